"""`specstream bench throughput`: batching policies under a closed-loop, long-tailed workload.

For each configuration (batch size n, policy static / topup ε, row selection, γ) it starts the
real three-process stack with `--max-slots n`, then `clients` concurrent callers (2n: enough that
requests always wait for a slot) send the same ≥ 200 requests back to back: held-out prompts of
8-64 tokens, `max_new_tokens` drawn from a lognormal (the "short" workload: median 12, a long
tail to 256, like subtitle-style text; "long": median 96). It reports tokens/s, request latency
p50/p99, and the target's own batch counters over the run (`Load.batch`): steps, expansions per
step, mean occupancy (overall, and while requests were waiting), padding fraction, and the
occupancy histogram (Marian's "actual batch size during decoding" figure).

Fronts (`fronts`, `--fronts grpc,http`): with "http" the stack also serves the OpenAI-compatible
API, and each setting sends the identical request list through the gRPC client and through the
`openai` client (`/v1/completions`, the prompt as token ids, temperature 0 and `ignore_eos` as the
gRPC calls use, `max_tokens` = the budget), in the same stack, in rounds of A B B A (grpc, http,
http, grpc; `repeats` rounds), so that a machine getting steadily faster or slower weighs on both
fronts alike. Each front's figures pool its passes: tokens/s is its tokens over its wall time,
p50/p99 over all its requests. Both fronts must return the same completion tokens for every
request, token for token (BenchmarkError otherwise). The HTTP front's overhead: http tok/s ÷ grpc tok/s, the
difference in request latency (p50, p99), and per token, the difference in latency ÷ completion
tokens per request (p50, p99).
"""

from __future__ import annotations

import asyncio
import math
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.bench import report
from tools.bench.checks import require
from tools.bench.latency import display
from tools.bench.models import BenchModels
from tools.launcher import Stack, StackSpec
from tools.progress import Progress

WORKLOADS = {"short": (12.0, 1.0, 256), "long": (96.0, 0.6, 512)}  # lognormal median, sigma, cap
FRONTS = ("grpc", "http")  # the gateway's gRPC API; its OpenAI-compatible HTTP API
HTTP_TARGET = 0.95  # the HTTP front serves at least this share of the gRPC front's tokens/s


@dataclass(frozen=True)
class Setting:
    n: int
    policy: str  # "static" or "topup"
    refill: float  # ε (topup)
    selection: str
    gamma: int

    @property
    def policy_name(self) -> str:
        """The batching policy and row selection, as `--policies` names them: "topup ε=1 all"."""
        policy = self.policy if self.policy == "static" else f"topup ε={self.refill:g}"
        return f"{policy} {self.selection}"

    @property
    def name(self) -> str:
        return f"n={self.n} {self.policy_name} γ={self.gamma}"

    def target_args(self) -> list[str]:
        return ["--policy", self.policy, "--refill-threshold", str(self.refill), "--row-selection", self.selection]


def default_settings() -> list[Setting]:
    settings = [Setting(n, policy, refill, "all", gamma) for n in (8, 32) for gamma in (0, 4)
                for policy, refill in (("static", 1.0), ("topup", 0.5), ("topup", 1.0))]
    settings += [Setting(32, "topup", 1.0, selection, 4) for selection in ("min_length", "fifo")]
    return settings


def workload(models: BenchModels, kind: str, count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """`count` (prompt ids, max_new_tokens) pairs; the same for every setting. Chat models get
    whole held-out chat prompts; others a random 8..64-token prefix of a held-out file."""
    median, sigma, cap = WORKLOADS[kind]
    rng = random.Random(seed)
    texts = models.prompts(32, length=64)
    out = []
    for i in range(count):
        text = texts[i % len(texts)]
        prompt = text if models.chat else text[: rng.randint(8, 64)]
        budget = int(min(cap, max(1, round(math.exp(rng.gauss(math.log(median), sigma))))))
        out.append((prompt, budget))
    return out


@dataclass
class Pass:
    """One measured closed-loop pass over the request list through one front."""

    front: str
    results: list[tuple[int, float]]  # (completion tokens, latency seconds), in request order
    seconds: float  # wall time from the first request sent to the last answered
    counters: dict = field(default_factory=dict)  # the target's batch counters over the pass (_delta)
    outputs: list[list[int]] = field(default_factory=list)  # the completion token ids, in request order


def schedule(fronts: tuple[str, ...], repeats: int = 1) -> list[str]:
    """The order of a setting's measured passes: one front, `repeats` passes; several, `repeats`
    rounds of A B B A (each front twice per round, first and last in turn)."""
    if len(fronts) == 1:
        return list(fronts) * max(1, repeats)
    return (list(fronts) + list(reversed(fronts))) * max(1, repeats)


async def _closed_loop(front: str, address: str, requests: list[tuple[list[int], int]], clients: int,
                       progress: Progress | None = None) -> tuple[list[tuple[int, float]], float, list[list[int]]]:
    """`clients` callers, each sending the next request as soon as its last one finished, through
    `front`; returns (completion tokens, latency seconds) per request, in request order, the wall
    time from the first request to the last answer, and each request's completion token ids.
    `progress` counts each request as it is answered."""
    pending = list(reversed(list(enumerate(requests))))
    results: list[tuple[int, float]] = [(0, 0.0)] * len(requests)
    outputs: list[list[int]] = [[] for _ in requests]

    async def loop(call) -> float:
        async def caller() -> None:
            while pending:
                i, (prompt, budget) = pending.pop()
                start = time.monotonic()
                outputs[i] = await call(prompt, budget)
                results[i] = (len(outputs[i]), time.monotonic() - start)
                if progress is not None:
                    progress.update(1)

        start = time.monotonic()
        await asyncio.gather(*(caller() for _ in range(clients)))
        return time.monotonic() - start

    if front == "grpc":
        from specstream_client import AsyncClient

        async with AsyncClient(address, timeout=600) as client:
            async def call(prompt: list[int], budget: int) -> list[int]:
                result = await client.generate(prompt, max_new_tokens=budget, ignore_eos=True)
                return list(result.token_ids)

            wall = await loop(call)
    elif front == "http":
        import openai

        async with openai.AsyncOpenAI(base_url=f"http://{address}/v1", api_key="none", max_retries=0,
                                      timeout=600) as client:
            model = (await client.models.list()).data[0].id

            async def call(prompt: list[int], budget: int) -> list[int]:
                # temperature 0 and ignore_eos, as the gRPC calls (whose default temperature is 0)
                completion = await client.completions.create(model=model, prompt=prompt, max_tokens=budget,
                                                             temperature=0, extra_body={"ignore_eos": True,
                                                                                        "return_token_ids": True})
                return list(completion.choices[0].model_extra["token_ids"])

            wall = await loop(call)
    else:
        raise ValueError(f"front {front!r}: expected one of {', '.join(FRONTS)}")
    return results, wall, outputs


def _batch_counters(stack):
    """The target's batch counters (its `Load.batch`), asked as the gateway would (the stack's credentials)."""
    from specstream_pb import target_pb2, target_pb2_grpc

    with stack.channel("target") as channel:
        return target_pb2_grpc.TargetStub(channel).GetInfo(target_pb2.TargetInfoRequest(), timeout=30).load.batch


COUNTERS = ("steps", "queued_steps", "queued_rows", "row_expansions", "tokens_processed", "padded_tokens")


def _delta(before, after) -> dict:
    """The target's batch counters over a pass: `after` less `before` (`Load.batch` messages)."""
    delta = {name: getattr(after, name) - getattr(before, name) for name in COUNTERS}
    delta["occupancy"] = [a - b for a, b in zip(after.occupancy, before.occupancy)]
    return delta


def _percentile(ordered: list[float], q: float) -> float:
    """The q-quantile of a sorted list: the value at index ⌊q·len⌋ (p50: the upper middle)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(setting: Setting, clients: int, passes: list[Pass]) -> dict:
    """One front's figures for a setting, pooled over its passes."""
    results = [r for p in passes for r in p.results]
    wall = sum(p.seconds for p in passes)
    tokens = sum(r[0] for r in results)
    counts = {name: sum(p.counters.get(name, 0) for p in passes) for name in COUNTERS}
    histogram = [sum(column) for column in zip(*(p.counters.get("occupancy", []) for p in passes))]
    latencies = sorted(r[1] for r in results)
    per_token = sorted(r[1] / max(r[0], 1) for r in results)
    steps, queued_steps, expansions = counts["steps"], counts["queued_steps"], counts["row_expansions"]
    real, padded = counts["tokens_processed"], counts["padded_tokens"]
    return {
        "setting": setting.__dict__ | {"name": setting.name}, "front": passes[0].front if passes else None,
        "passes": len(passes), "requests": len(results), "clients": clients,
        "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall if wall else 0.0,
        "pass_tokens_per_s": [sum(r[0] for r in p.results) / p.seconds if p.seconds else 0.0 for p in passes],
        "p50_s": _percentile(latencies, 0.5), "p99_s": _percentile(latencies, 0.99),
        "mean_latency_s": sum(latencies) / len(latencies), "mean_tokens": tokens / len(results),
        "per_token_p50_s": _percentile(per_token, 0.5), "per_token_p99_s": _percentile(per_token, 0.99),
        "steps": steps, "expansions_per_step": expansions / steps if steps else 0.0,
        "mean_occupancy": expansions / steps / setting.n if steps else 0.0,
        "occupancy_while_queued": counts["queued_rows"] / queued_steps / setting.n if queued_steps else None,
        "padding_fraction": padded / (real + padded) if real + padded else 0.0,
        "occupancy_histogram": histogram,
    }


def check_fronts_agree(name: str, requests: list[tuple[list[int], int]], passes: list[Pass]) -> None:
    """Every pass (every front, every repeat) returned the same completion tokens for each request
    as the first (greedy: token for token; a pass without `outputs`: the same counts);
    BenchmarkError naming the first requests that differ otherwise."""
    if not passes:
        return
    reference = [tokens for tokens, _ in passes[0].results]
    for k, p in enumerate(passes[1:], start=1):
        counts = [tokens for tokens, _ in p.results]
        require(len(counts) == len(reference) == len(requests),
                f"{name}: pass {k} ({p.front}) answered {len(counts)} requests, pass 0 ({passes[0].front}) "
                f"{len(reference)}, of {len(requests)}")
        differ = [i for i, (a, b) in enumerate(zip(reference, counts)) if a != b]
        require(not differ, f"{name}: {len(differ)} requests got different completion token counts through "
                            f"{p.front} (pass {k}) and {passes[0].front} (pass 0): " + ", ".join(
                                f"request {i} (max_new_tokens {requests[i][1]}): {counts[i]} against {reference[i]}"
                                for i in differ[:5]))
        if p.outputs and passes[0].outputs:
            differ = [i for i, (a, b) in enumerate(zip(passes[0].outputs, p.outputs)) if a != b]
            require(not differ, f"{name}: {len(differ)} requests got other completion tokens through {p.front} "
                                f"(pass {k}) than through {passes[0].front} (pass 0), greedy: requests " +
                                ", ".join(str(i) for i in differ[:10]))


def front_overhead(grpc: dict, http: dict, grpc_passes: list[float] | None = None,
                   http_passes: list[float] | None = None) -> dict:
    """The HTTP front's cost against gRPC, from two `summarize` results of the same setting:
    the tokens/s ratio (and per round of A B B A when the per-pass figures are given), request
    latency differences and latency-per-token differences (milliseconds; positive: HTTP slower)."""
    ratio = http["tokens_per_s"] / grpc["tokens_per_s"] if grpc["tokens_per_s"] else 0.0
    rounds = []
    if grpc_passes and http_passes:
        pairs = list(zip(grpc_passes[0::2], grpc_passes[1::2], http_passes[0::2], http_passes[1::2]))
        # per round: the harmonic mean of its two passes' rates (the pooled rate when they ran as long)
        harmonic = lambda a, b: 2 / (1 / a + 1 / b) if a and b else 0.0  # noqa: E731
        rounds = [harmonic(h1, h2) / harmonic(g1, g2) if harmonic(g1, g2) else 0.0 for g1, g2, h1, h2 in pairs]
    return {
        "tokens_per_s_ratio": ratio, "round_ratios": rounds, "meets_target": ratio >= HTTP_TARGET,
        "request_p50_ms": 1000 * (http["p50_s"] - grpc["p50_s"]),
        "request_p99_ms": 1000 * (http["p99_s"] - grpc["p99_s"]),
        "token_p50_ms": 1000 * (http["per_token_p50_s"] - grpc["per_token_p50_s"]),
        "token_p99_ms": 1000 * (http["per_token_p99_s"] - grpc["per_token_p99_s"]),
        "mean_ms_per_token": 1000 * (http["mean_latency_s"] - grpc["mean_latency_s"]) / grpc["mean_tokens"],
    }


FRONT_HEADERS = ["workload", "setting", "grpc tok/s", "http tok/s", "http ÷ grpc", f"≥ {HTTP_TARGET}",
                 "Δ p50 ms", "Δ p99 ms", "Δ p50 ms/token", "Δ p99 ms/token", "Δ mean ms/token"]


def front_row(kind: str, setting: Setting, grpc: dict, http: dict, overhead: dict) -> list:
    """A row of the fronts table (FRONT_HEADERS)."""
    return [kind, setting.name, grpc["tokens_per_s"], http["tokens_per_s"], overhead["tokens_per_s_ratio"],
            "yes" if overhead["meets_target"] else "no", overhead["request_p50_ms"], overhead["request_p99_ms"],
            overhead["token_p50_ms"], overhead["token_p99_ms"], overhead["mean_ms_per_token"]]


def row_name(setting: Setting, front: str, fronts: tuple[str, ...]) -> str:
    """How the main table names a run: the setting, and its front unless only gRPC ran."""
    return setting.name if fronts == ("grpc",) else f"{setting.name} {front}"


def measure(models: BenchModels, setting: Setting, requests: list[tuple[list[int], int]],
            fronts: tuple[str, ...] = ("grpc",), repeats: int = 1, progress: Progress | None = None
            ) -> dict[str, dict]:
    """Each front's figures (`summarize`) for one setting, all in one stack; `progress` counts
    every request sent (`requests_sent` of them), warm-ups included."""
    clients = 2 * setting.n
    with tempfile.TemporaryDirectory() as logs, Stack(StackSpec(
            **models.stack_fields(speculative=bool(setting.gamma)), gamma=setting.gamma or 4,
            max_slots=setting.n, http_port=0 if "http" in fronts else None, extra_target_args=setting.target_args(),
            extra_gateway_args=["--max-in-flight", str(4 * clients)],
            log_dir=logs)) as stack:
        addresses = {"grpc": stack.gateway_address, "http": stack.http_address}
        for front in fronts:  # warm-up
            asyncio.run(_closed_loop(front, addresses[front], requests[:clients], clients, progress))
        passes = []
        for front in schedule(fronts, repeats):
            before = _batch_counters(stack)
            results, wall, outputs = asyncio.run(_closed_loop(front, addresses[front], requests, clients, progress))
            passes.append(Pass(front, results, wall, _delta(before, _batch_counters(stack)),
                               outputs))
    check_fronts_agree(setting.name, requests, passes)
    out = {front: summarize(setting, clients, [p for p in passes if p.front == front]) for front in fronts}
    if len(fronts) > 1:
        for front in fronts:
            out[front]["latencies_s"] = [round(r[1], 5) for p in passes if p.front == front for r in p.results]
            out[front]["tokens_per_request"] = [r[0] for r in next(p for p in passes if p.front == front).results]
    return out


def requests_sent(setting: Setting, count: int, fronts: tuple[str, ...] = ("grpc",), repeats: int = 1) -> int:
    """The requests `measure` sends for one setting: each front's warm-up, then every pass."""
    return len(fronts) * min(2 * setting.n, count) + len(schedule(fronts, repeats)) * count


def run(models: BenchModels, out_dir: Path, kinds: list[str], settings: list[Setting], count: int = 200,
        fronts: tuple[str, ...] = ("grpc",), repeats: int = 1, quiet: bool = False) -> dict:
    """Every setting on every workload through every front; tables on stdout, ``throughput.json``
    and plots in ``out_dir``. Progress on stderr (tools.progress; ``quiet``: plain lines,
    never a bar), counted in requests as they are answered."""
    headers = ["workload", "setting", "tok/s", "x static", "p50 s", "p99 s", "occupancy", "occupancy (queue>0)",
               "steps", "rows/step", "padding"]
    rows, results, comparisons, front_rows = [], {}, [], []
    total = len(kinds) * sum(requests_sent(s, count, fronts, repeats) for s in settings)
    with Progress(total, "requests", "throughput", quiet=quiet) as progress:
        for kind in kinds:
            _measure_workload(models, kind, settings, count, fronts, repeats, results, progress)
    for kind in kinds:
        for setting in settings:
            for front in fronts:
                r = results[(kind, setting, front)]
                static = results.get((kind, Setting(setting.n, "static", 1.0, setting.selection, setting.gamma),
                                      front))
                r["over_static"] = r["tokens_per_s"] / static["tokens_per_s"] if static else None
                rows.append([kind, row_name(setting, front, fronts), r["tokens_per_s"], r["over_static"] or "-",
                             r["p50_s"], r["p99_s"], r["mean_occupancy"], r["occupancy_while_queued"] or "-",
                             r["steps"], r["expansions_per_step"], r["padding_fraction"]])
            if set(FRONTS) <= set(fronts):
                grpc, http = results[(kind, setting, "grpc")], results[(kind, setting, "http")]
                overhead = front_overhead(grpc, http, grpc["pass_tokens_per_s"], http["pass_tokens_per_s"])
                comparisons.append({"workload": kind, "setting": setting.name} | overhead)
                front_rows.append(front_row(kind, setting, grpc, http, overhead))
    print("\n" + report.table(headers, rows), flush=True)
    data = {"models": models.label, "target": display(models.target), "draft": display(models.draft),
            "dtype": models.dtype, "requests": count, "proposer": models.proposing,
            "workloads": {k: WORKLOADS[k] for k in kinds}, "table_markdown": report.markdown_table(headers, rows),
            "runs": [results[key] | {"workload": key[0]} for key in results]}
    written = [out_dir / "throughput.json", out_dir / "throughput_occupancy.png"]
    if len(fronts) > 1:
        data |= {"fronts": list(fronts), "repeats": repeats, "pass_order": schedule(fronts, repeats)}
    if comparisons:
        print(f"\nHTTP front against gRPC (the same requests, the same stack; {repeats} round(s) of "
              f"grpc, http, http, grpc, pooled; Δ: http − grpc):\n" + report.table(FRONT_HEADERS, front_rows),
              flush=True)
        data |= {"front_table_markdown": report.markdown_table(FRONT_HEADERS, front_rows),
                 "front_overhead": comparisons, "http_target": HTTP_TARGET}
        written.append(out_dir / "throughput_fronts.png")
        _plot_fronts(written[-1], results, kinds[0])
    _plot_occupancy(written[1], results, kinds[0], fronts[0])
    report.write_json(written[0], data)
    print(f"\nwrote {', '.join(str(p) for p in written)}", flush=True)
    return data


def _measure_workload(models: BenchModels, kind: str, settings: list[Setting], count: int, fronts: tuple[str, ...],
                      repeats: int, results: dict, progress: Progress) -> None:
    """Every setting on one workload (`measure`), into ``results`` by (workload, setting, front)."""
    requests = workload(models, kind, count)
    progress.print(f"{kind}: {count} requests, max_new_tokens median {sorted(b for _, b in requests)[count // 2]}, "
                   f"max {max(b for _, b in requests)}")
    for setting in settings:
        progress.print(f"  {setting.name} ...")
        progress.phase(f"throughput: {kind}, {setting.name}")
        for front, r in measure(models, setting, requests, fronts, repeats, progress).items():
            results[(kind, setting, front)] = r


def _plot_occupancy(path: Path, results: dict, kind: str, front: str = "grpc") -> None:
    """Steps by number of rows expanded, static against topup at the largest n (Marian Fig. 2/8)."""
    plt = report.pyplot(path)
    if plt is None:
        return

    chosen = [(s, r) for (k, s, f), r in results.items() if k == kind and f == front and s.selection == "all"]
    chosen = chosen or [(s, r) for (k, s, f), r in results.items() if k == kind and f == front]
    n = max(s.n for s, _ in chosen)
    chosen = [(s, r) for s, r in chosen if s.n == n and s.gamma == max(x.gamma for x, _ in chosen)]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for setting, r in chosen:
        hist = r["occupancy_histogram"]
        total = sum(hist) or 1
        ax.plot(range(len(hist)), [100 * h / total for h in hist], marker=".", label=setting.name)
    ax.set(title=f"Rows expanded per step ({kind} workload, n={n})", xlabel="rows in the step",
           ylabel="% of steps")
    ax.legend()
    fig.tight_layout()
    report.save_figure(fig, path)
    plt.close(fig)


def _plot_fronts(path: Path, results: dict, kind: str) -> None:
    """Request latency and latency per completion token, CDFs per setting: gRPC solid, HTTP dashed."""
    plt = report.pyplot(path)
    if plt is None:
        return

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    settings = [s for (k, s, f) in results if k == kind and f == "grpc" and (k, s, "http") in results]
    for i, setting in enumerate(settings):
        for front, style in (("grpc", "-"), ("http", "--")):
            r = results[(kind, setting, front)]
            tokens = r["tokens_per_request"] * r["passes"]
            for ax, values in ((axes[0], r["latencies_s"]),
                               (axes[1], [1000 * lat / max(t, 1) for lat, t in zip(r["latencies_s"], tokens)])):
                ordered = sorted(values)
                ax.plot(ordered, [(j + 1) / len(ordered) for j in range(len(ordered))], style,
                        color=colors[i % len(colors)], label=f"{setting.name} {front} ({r['tokens_per_s']:.0f} tok/s)")
    axes[0].set(title=f"Request latency ({kind} workload)", xlabel="seconds", ylabel="share of requests")
    axes[1].set(title="Latency per completion token", xlabel="ms / token", xscale="log")
    from matplotlib.ticker import NullFormatter

    axes[1].xaxis.set_minor_formatter(NullFormatter())
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    report.save_figure(fig, path)
    plt.close(fig)
