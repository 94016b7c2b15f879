"""`specstream experiment`: a traced latency experiment. Starts the three services with tracing to a
file, drives a named workload through them, then turns the spans into a latency breakdown per
request (docs/observability.md explains the spans):

- queue: request receipt at the gateway → admitted to a slot on the target (gateway queue, the hop,
  the target's queue);
- prefill: admitted → first token computed;
- draft: the draft's propose batches this sequence was in;
- verify: the verify forwards of the steps that advanced it;
- engine other: the rest of its decode phase (accept/commit/emit, steps of other rows it waited for);
- gateway + network: the target finishing the sequence → the gateway's last chunk (event hop,
  detokenization, response).

Prints a table of p50/p99 per component, writes `experiment_<workload>.json` and `.png` (mean per
component as stacked bars, next to the median request's components laid end to end).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections import defaultdict
from pathlib import Path

from tools.bench import report
from tools.bench.models import BenchModels
from tools.bench.throughput import workload as lengths
from tools.launcher import Stack, StackSpec
from tools.progress import Progress

COMPONENTS = ["queue", "prefill", "draft", "verify", "engine other", "gateway + network"]
WORKLOADS = {  # name: (requests, concurrent callers, speculation, throughput workload for lengths)
    "single": (16, 1, 4, "short"),
    "busy": (64, 16, 4, "short"),
}


def run(models: BenchModels, out_dir: Path, workload: str = "single", max_slots: int = 8, quiet: bool = False) -> dict:
    """Drives ``workload`` through a traced stack and reports where each request's time went (the
    table on stdout, JSON and a plot in ``out_dir``). Progress on stderr (tools.progress;
    ``quiet``: plain lines, never a bar), counted in requests."""
    count, clients, gamma, kind = WORKLOADS[workload]
    requests = lengths(models, kind, count)
    with tempfile.TemporaryDirectory() as tmp:
        trace_file = Path(tmp) / "spans.jsonl"
        with Progress(len(requests), "requests", f"experiment: {workload}", quiet=quiet) as progress, \
                Stack(StackSpec(str(models.target), str(models.require_draft()), gamma=gamma, max_slots=max_slots,
                                log_dir=tmp, dtype=models.dtype, weights=models.weights, **models.proposing,
                                trace_file=str(trace_file))) as stack:
            asyncio.run(_drive(stack.gateway_address, requests, clients, progress))
        spans = [json.loads(line) for line in trace_file.read_text().splitlines()]  # flushed at shutdown
    breakdown = breakdown_from_spans(spans)
    return _report(breakdown, out_dir, workload, {"models": models.label, "dtype": models.dtype,
                                                  "proposer": models.proposing})


async def _drive(address: str, requests: list[tuple[list[int], int]], clients: int, progress: Progress) -> None:
    """``clients`` callers sending the requests back to back; ``progress`` counts each answered one."""
    from specstream_client import AsyncClient

    pending = list(reversed(requests))
    async with AsyncClient(address, timeout=600) as client:
        async def caller() -> None:
            while pending:
                prompt, budget = pending.pop()
                await client.generate(prompt, max_new_tokens=budget, ignore_eos=True)
                progress.update()

        await asyncio.gather(*(caller() for _ in range(clients)))


def breakdown_from_spans(spans: list[dict]) -> list[dict]:
    """One dict per request: seconds per component, the total, and the request id."""
    by_parent = defaultdict(list)
    for span in spans:
        by_parent[span["parent_span_id"]].append(span)
    steps_of = defaultdict(list)  # sequence span id -> the step spans that advanced it
    for span in spans:
        if span["name"] == "specstream.engine_step":
            for link in span["links"]:
                steps_of[link["span_id"]].append(span)
    out = []
    for request in (s for s in spans if s["name"] == "gen_ai.generate"):
        sequences = [s for s in by_parent[request["span_id"]] if s["name"] == "specstream.sequence"]
        if len(sequences) != 1:
            continue  # refused, failed or moved between replicas: no single sequence to break down
        seq = sequences[0]
        events = {e["name"]: e["time_ns"] for e in seq["events"]}
        if "admitted" not in events or "prefilled" not in events:
            continue
        draft = sum(s["end_ns"] - s["start_ns"] for s in by_parent[seq["span_id"]]
                    if s["name"] == "specstream.draft_propose_sequence") / 1e9
        verify = sum(s["attributes"].get("specstream.verify_s", 0.0) for s in steps_of[seq["span_id"]])
        decode = (seq["end_ns"] - events["prefilled"]) / 1e9
        parts = {
            "queue": (events["admitted"] - request["start_ns"]) / 1e9,
            "prefill": (events["prefilled"] - events["admitted"]) / 1e9,
            "draft": draft,
            "verify": verify,
            "engine other": max(decode - draft - verify, 0.0),
            "gateway + network": max((request["end_ns"] - seq["end_ns"]) / 1e9, 0.0),
        }
        out.append({"request_id": request["attributes"].get("specstream.request_id", ""),
                    "total": (request["end_ns"] - request["start_ns"]) / 1e9,
                    "tokens": request["attributes"].get("gen_ai.usage.output_tokens", 0), **parts})
    return out


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _report(rows: list[dict], out_dir: Path, workload: str, about: dict) -> dict:
    assert rows, "no request could be broken down: is tracing writing spans?"
    headers = ["component", "mean ms", "p50 ms", "p99 ms", "share of total"]
    total = sum(r["total"] for r in rows)
    table = []
    for name in [*COMPONENTS, "total"]:
        values = [r[name] for r in rows]
        table.append([name, 1000 * sum(values) / len(values), 1000 * _percentile(values, 0.5),
                      1000 * _percentile(values, 0.99), sum(values) / total if total else 0.0])
    print(report.table(headers, table), flush=True)
    data = {**about, "workload": workload, "requests": len(rows), "table_markdown": report.markdown_table(headers, table),
            "per_request": rows}
    _plot(out_dir / f"experiment_{workload}.png", rows)
    report.write_json(out_dir / f"experiment_{workload}.json", data)
    print(f"\n{len(rows)} requests; wrote {out_dir / f'experiment_{workload}.json'}, "
          f"{out_dir / f'experiment_{workload}.png'}", flush=True)
    return data


def _plot(path: Path, rows: list[dict]) -> None:
    plt = report.pyplot(path)
    if plt is None:
        return

    fig, (bars, waterfall) = plt.subplots(1, 2, figsize=(11, 4.2))
    means = [1000 * sum(r[c] for r in rows) / len(rows) for c in COMPONENTS]
    bottom = 0.0
    for name, value in zip(COMPONENTS, means):
        bars.bar(["mean request"], [value], bottom=bottom, label=name)
        bottom += value
    bars.set(title=f"Where a request's time goes ({len(rows)} requests)", ylabel="ms")
    bars.legend(fontsize=8)
    median = sorted(rows, key=lambda r: r["total"])[len(rows) // 2]
    start = 0.0
    for i, name in enumerate(COMPONENTS):
        waterfall.barh(i, 1000 * median[name], left=start)
        start += 1000 * median[name]
    waterfall.set(title=f"Median request ({median['tokens']} tokens), components in sequence", xlabel="ms",
                  yticks=range(len(COMPONENTS)), yticklabels=COMPONENTS)
    waterfall.invert_yaxis()
    fig.tight_layout()
    report.save_figure(fig, path)
    plt.close(fig)
