"""`specstream bench throughput`: batching policies under a closed-loop, long-tailed workload.

For each configuration (batch size n, policy static / topup ε, row selection, γ) it starts the
real three-process stack with `--max-slots n`, then `clients` concurrent callers (2n: enough that
requests always wait for a slot) send the same ≥ 200 requests back to back: held-out prompts of
8-64 tokens, `max_new_tokens` drawn from a lognormal (the "short" workload: median 12, a long
tail to 256, like subtitle-style text; "long": median 96). It reports tokens/s, request latency
p50/p99, and the target's own batch counters over the run (`Load.batch`): steps, expansions per
step, mean occupancy (overall, and while requests were waiting), padding fraction, and the
occupancy histogram (Marian's "actual batch size during decoding" figure).
"""

from __future__ import annotations

import asyncio
import math
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from specstream.bench import report
from specstream.bench.latency import display
from specstream.bench.models import BenchModels
from specstream.launcher import Stack, StackSpec

WORKLOADS = {"short": (12.0, 1.0, 256), "long": (96.0, 0.6, 512)}  # lognormal median, sigma, cap


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


async def _closed_loop(address: str, requests: list[tuple[list[int], int]], clients: int) -> list[tuple[int, float]]:
    """`clients` callers, each sending the next request as soon as its last one finished;
    returns (completion tokens, latency seconds) per request."""
    from specstream_client import AsyncClient

    pending = list(reversed(requests))
    results: list[tuple[int, float]] = []
    async with AsyncClient(address, timeout=600) as client:
        async def caller() -> None:
            while pending:
                prompt, budget = pending.pop()
                start = time.monotonic()
                result = await client.generate(prompt, max_new_tokens=budget, ignore_eos=True)
                results.append((result.usage.completion_tokens, time.monotonic() - start))

        await asyncio.gather(*(caller() for _ in range(clients)))
    return results


def _batch_counters(address: str):
    import grpc

    from specstream_pb import target_pb2, target_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return target_pb2_grpc.TargetStub(channel).GetInfo(target_pb2.TargetInfoRequest(), timeout=30).load.batch


def measure(models: BenchModels, setting: Setting, requests: list[tuple[list[int], int]]) -> dict:
    clients = 2 * setting.n
    with tempfile.TemporaryDirectory() as logs, Stack(StackSpec(
            str(models.target), str(models.require_draft()) if setting.gamma else None, gamma=setting.gamma or 4,
            max_slots=setting.n, dtype=models.dtype, weights=models.weights,
            **(models.proposing if setting.gamma else {}), extra_target_args=setting.target_args(),
            extra_gateway_args=["--max-in-flight", str(4 * clients)],
            log_dir=logs)) as stack:
        asyncio.run(_closed_loop(stack.gateway_address, requests[:clients], clients))  # warm-up
        before = _batch_counters(stack.addresses["target"])
        start = time.monotonic()
        results = asyncio.run(_closed_loop(stack.gateway_address, requests, clients))
        wall = time.monotonic() - start
        after = _batch_counters(stack.addresses["target"])
    latencies = sorted(r[1] for r in results)
    steps = after.steps - before.steps
    queued_steps = after.queued_steps - before.queued_steps
    expansions = after.row_expansions - before.row_expansions
    real = after.tokens_processed - before.tokens_processed
    padded = after.padded_tokens - before.padded_tokens
    histogram = [a - b for a, b in zip(after.occupancy, before.occupancy)]
    return {
        "setting": setting.__dict__ | {"name": setting.name}, "requests": len(results), "clients": clients,
        "tokens": sum(r[0] for r in results), "seconds": wall,
        "tokens_per_s": sum(r[0] for r in results) / wall,
        "p50_s": latencies[len(latencies) // 2], "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "steps": steps, "expansions_per_step": expansions / steps if steps else 0.0,
        "mean_occupancy": expansions / steps / setting.n if steps else 0.0,
        "occupancy_while_queued": ((after.queued_rows - before.queued_rows) / queued_steps / setting.n
                                   if queued_steps else None),
        "padding_fraction": padded / (real + padded) if real + padded else 0.0,
        "occupancy_histogram": histogram,
    }


def run(models: BenchModels, out_dir: Path, kinds: list[str], settings: list[Setting], count: int = 200) -> dict:
    headers = ["workload", "setting", "tok/s", "x static", "p50 s", "p99 s", "occupancy", "occupancy (queue>0)",
               "steps", "rows/step", "padding"]
    rows, results = [], {}
    for kind in kinds:
        requests = workload(models, kind, count)
        print(f"{kind}: {count} requests, max_new_tokens median {sorted(b for _, b in requests)[count // 2]}, "
              f"max {max(b for _, b in requests)}", flush=True)
        for setting in settings:
            print(f"  {setting.name} ...", flush=True)
            results[(kind, setting)] = measure(models, setting, requests)
        for setting in settings:
            r = results[(kind, setting)]
            static = results.get((kind, Setting(setting.n, "static", 1.0, setting.selection, setting.gamma)))
            r["over_static"] = r["tokens_per_s"] / static["tokens_per_s"] if static else None
            rows.append([kind, setting.name, r["tokens_per_s"], r["over_static"] or "-", r["p50_s"], r["p99_s"],
                         r["mean_occupancy"], r["occupancy_while_queued"] or "-", r["steps"],
                         r["expansions_per_step"], r["padding_fraction"]])
    print("\n" + report.table(headers, rows), flush=True)
    data = {"models": models.label, "target": display(models.target), "draft": display(models.draft),
            "dtype": models.dtype, "requests": count, "proposer": models.proposing,
            "workloads": {k: WORKLOADS[k] for k in kinds}, "table_markdown": report.markdown_table(headers, rows),
            "runs": [results[key] | {"workload": key[0]} for key in results]}
    _plot_occupancy(out_dir / "throughput_occupancy.png", results, kinds[0])
    report.write_json(out_dir / "throughput.json", data)
    print(f"\nwrote {out_dir / 'throughput.json'}, {out_dir / 'throughput_occupancy.png'}", flush=True)
    return data


def _plot_occupancy(path: Path, results: dict, kind: str) -> None:
    """Steps by number of rows expanded, static against topup at the largest n (Marian Fig. 2/8)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [(s, r) for (k, s), r in results.items() if k == kind and s.selection == "all"]
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
    fig.savefig(path, dpi=120)
    plt.close(fig)
