"""`specstream soak`: a bounded closed-loop load on a running stack for a set time, watching what
slowly goes wrong: each process's resident memory (its slope in MB/min after a warm-up, by least
squares; the issue's target is < 1 MB/min per process over 10 minutes), errors by code, and
latency drift (per-token latency in the last third against the first).

Callers send greedy and sampled requests, text and chat (when the model has a chat template),
streamed and unary, with automatic γ, in a seeded mix, as many at once as `concurrency`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from tools.bench.report import save_figure
from tools.progress import Progress

PROMPTS = [
    "Explain how a hash table handles collisions.", "Write a Python function that merges two sorted lists.",
    "What causes the seasons on Earth?", "Summarize the plot of a detective story in three sentences.",
    "List five uses of the grep command.", "def quicksort(items):\n", "The history of the printing press",
    "Translate to French: the weather is nice today.",
]


@dataclass
class ProcessMemory:
    name: str
    pid: int
    samples: list[tuple[float, float]]  # (seconds since start, RSS MB)
    slope_mb_per_min: float  # after the warm-up
    start_mb: float
    end_mb: float


@dataclass
class SoakReport:
    seconds: float
    concurrency: int
    requests: int
    tokens: int
    errors: dict[str, int]  # status code name -> count
    processes: list[ProcessMemory]
    latency_first_ms_per_token: float  # median per-token latency of requests finishing in the first third
    latency_last_ms_per_token: float  # ... in the last third
    latency_drift: float  # last / first
    warmup_s: float
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (finished at, ms per token)

    def to_dict(self) -> dict:
        return asdict(self)


def slope_per_minute(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) samples, in value per minute (0 for < 2 samples)."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_v = sum(v for _, v in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    return 60.0 * sum((t - mean_t) * (v - mean_v) for t, v in samples) / var


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


async def soak(address: str, pids: dict[str, int], seconds: float, concurrency: int = 8, seed: int = 0,
               sample_s: float = 1.0, warmup_s: float | None = None, max_new_tokens: int = 96,
               quiet: bool = False) -> SoakReport:
    """Load the gateway at `address` for `seconds`; sample the RSS of `pids` every `sample_s`.
    Progress on stderr (tools.progress; ``quiet``: plain lines, never a bar), counted in
    whole seconds of the soak, at each sample."""
    import psutil

    from specstream_client import AsyncClient
    from specstream_client.errors import SpecstreamError

    warmup = seconds / 5 if warmup_s is None else warmup_s
    procs = {name: psutil.Process(pid) for name, pid in pids.items()}
    memory: dict[str, list[tuple[float, float]]] = {name: [] for name in pids}
    errors: Counter[str] = Counter()
    finished: list[tuple[float, float]] = []  # (seconds since start, ms per token)
    counts = {"requests": 0, "tokens": 0}
    start = time.monotonic()
    stop_at = start + seconds

    async def sampler(progress: Progress) -> None:
        while time.monotonic() < stop_at:
            now = time.monotonic() - start
            for name, proc in procs.items():
                try:
                    memory[name].append((now, proc.memory_info().rss / 2**20))
                except psutil.Error:
                    errors[f"{name} process gone"] += 1
            progress.advance_to(min(int(now), seconds))
            await asyncio.sleep(sample_s)
        progress.advance_to(seconds)

    async def caller(client: AsyncClient, chat: bool, k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        while time.monotonic() < stop_at:
            prompt = rng.choice(PROMPTS)
            options = {"max_new_tokens": rng.randint(8, max_new_tokens)}
            if rng.random() < 0.3:
                options |= {"temperature": 0.8, "top_p": 0.95, "seed": rng.getrandbits(32)}
            began = time.monotonic()
            try:
                if rng.random() < 0.5:
                    tokens = 0
                    stream = (client.chat_stream([{"role": "user", "content": prompt}], **options)
                              if chat and rng.random() < 0.5 else client.generate_stream(prompt, **options))
                    async for chunk in stream:
                        tokens += len(chunk.token_ids)
                else:
                    result = (await client.chat([{"role": "user", "content": prompt}], **options)
                              if chat and rng.random() < 0.5 else await client.generate(prompt, **options))
                    tokens = result.usage.completion_tokens
            except SpecstreamError as exc:
                errors[exc.code.name] += 1
                continue
            done = time.monotonic()
            counts["requests"] += 1
            counts["tokens"] += tokens
            finished.append((done - start, 1000 * (done - began) / max(tokens, 1)))

    with Progress(seconds, "seconds", "soak", quiet=quiet) as progress:
        async with AsyncClient(address, timeout=300) as client:
            chat = (await client.model_info()).has_chat_template  # else text prompts only
            await asyncio.gather(sampler(progress), *(caller(client, chat, k) for k in range(concurrency)))
    return _report(time.monotonic() - start, concurrency, warmup, pids, memory, errors, finished, counts)


def _report(elapsed: float, concurrency: int, warmup: float, pids: dict[str, int],
            memory: dict[str, list[tuple[float, float]]], errors: Counter[str], finished: list[tuple[float, float]],
            counts: dict[str, int]) -> SoakReport:
    """The soak's figures from what it recorded: each process's RSS slope after ``warmup``, and
    per-token latency in the first third of the run against the last."""
    processes = []
    for name, raw in memory.items():
        samples = [(round(t, 2), round(v, 3)) for t, v in raw]
        after = [s for s in samples if s[0] >= warmup] or samples
        processes.append(ProcessMemory(name, pids[name], samples, slope_per_minute(after),
                                       samples[0][1] if samples else 0.0, samples[-1][1] if samples else 0.0))
    third = elapsed / 3
    first = _median([ms for t, ms in finished if t <= third])
    last = _median([ms for t, ms in finished if t >= 2 * third])
    return SoakReport(seconds=elapsed, concurrency=concurrency, requests=counts["requests"], tokens=counts["tokens"],
                      errors=dict(errors), processes=processes, latency_first_ms_per_token=first,
                      latency_last_ms_per_token=last, latency_drift=last / first if first else 0.0, warmup_s=warmup,
                      timeline=[(round(t, 2), round(ms, 3)) for t, ms in finished])


def plot(path, report: SoakReport) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, lat) = plt.subplots(1, 2, figsize=(12, 4.2))
    for proc in report.processes:
        xs = [t / 60 for t, _ in proc.samples]
        mem.plot(xs, [v for _, v in proc.samples], label=f"{proc.name} ({proc.slope_mb_per_min:+.2f} MB/min)")
    mem.axvline(report.warmup_s / 60, color="grey", linestyle=":", label="end of warm-up")
    mem.set(title="Resident memory", xlabel="minutes", ylabel="MB")
    mem.legend(fontsize=8)
    lat.scatter([t / 60 for t, _ in report.timeline], [ms for _, ms in report.timeline], s=3, alpha=0.5)
    lat.set(title=f"Latency per token (drift {report.latency_drift:.2f}x)", xlabel="minutes (request end)",
            ylabel="ms / token", yscale="log")
    for ax in (mem, lat):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
