"""`specstream bench routing`: cache-aware routing against load-only routing, with two target replicas.

The workload: ``CONVERSATIONS`` chats of ``TURNS`` turns, each with a system prompt of its own (a
customer's record, as a support application writes one), interleaved: every round sends each
conversation's next turn, the conversations in a shuffled order (the same for both rows), one
request at a time. Each turn re-sends the whole conversation so far.

Rows, each a stack of its own (the default pair, greedy, speculation auto, two target replicas
with their prefix caches on, one gateway): the gateway's cache-aware routing (the default: the
replica that holds the longest prefix of the prompt, unless it is busier than the other by more
than 4 requests) and load-only routing (``--prefix-routing-imbalance -1``: the least loaded, ties
to the one sent the fewest requests, which alternates a trickle like round robin). Per row: the
hit rate (of the turns after each conversation's first, those whose prompt came in part from a
replica's cache), the prompt tokens served from cache, the mean time to first token of those
turns, and how the prompt tokens split between the replicas. Both rows must answer token for token
the same (checked: a difference stops the run). Prints a table, writes ``routing.json`` and
``routing.png`` (time to first token per round).
"""

from __future__ import annotations

import random
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from tools.bench import report
from tools.bench.latency import display
from tools.bench.models import BenchModels
from tools.bench.prefix import timed_chat
from tools.launcher import Stack, StackSpec
from tools.progress import Progress

__all__ = ["run"]

CONVERSATIONS = 16
TURNS = 4
MAX_NEW_TOKENS = 24
CITIES = ["Lisbon", "Oslo", "Vienna", "Prague", "Dublin", "Madrid", "Athens", "Warsaw", "Zurich", "Berlin",
          "Helsinki", "Budapest", "Brussels", "Copenhagen", "Rome", "Paris"]
QUESTIONS = ["Where am I flying to, and when?", "Can I take a second bag?", "What should I see there first?",
             "Sum up my booking in one sentence."]
ROWS = [("cache-aware routing", 4), ("load-only routing", -1)]  # (label, --prefix-routing-imbalance)
HEADERS = ["row", "hit rate", "cached / prompt tokens", "ttft ms (turns 2+)", "prompt tokens per replica", "= first row"]


def _system(i: int) -> str:
    city = CITIES[i % len(CITIES)]
    return (f"You are the booking assistant of customer {1000 + i}. Their booking: a return flight from London "
            f"to {city}, leaving on day {3 + i} of May at {7 + i % 10}:30 and returning a week later, one checked "
            f"bag, seat {10 + i}{'ABCDEF'[i % 6]}, a hotel near the centre of {city} for six nights with breakfast. "
            f"They prefer short answers and trains to taxis. Answer in one or two sentences.")


def _row(models: BenchModels, imbalance: int, order: list[list[int]], progress: Progress) -> dict:
    spec = StackSpec(**models.stack_fields(), target_replicas=2, metrics=True,
                     extra_gateway_args=["--prefix-routing-imbalance", str(imbalance)])
    from specstream_client import Client

    history = {c: [{"role": "system", "content": _system(c)}] for c in range(CONVERSATIONS)}
    calls: list[dict] = []
    with tempfile.TemporaryDirectory() as logs, Stack(replace(spec, log_dir=logs)) as stack, \
            Client(stack.gateway_address, timeout=600) as client:
        client.chat([{"role": "user", "content": "Hi"}], max_new_tokens=2, cache_salt="warm-up")  # not timed
        before = _per_replica(stack)
        for turn, conversations in enumerate(order):
            for c in conversations:
                messages = [*history[c], {"role": "user", "content": QUESTIONS[turn]}]
                call = timed_chat(client, messages, MAX_NEW_TOKENS)
                history[c] = [*messages, {"role": "assistant", "content": call["text"]}]
                calls.append({"conversation": c, "turn": turn, **call})
                progress.update()
        after = _per_replica(stack)
    return {"calls": calls, "per_replica": {name: after[name] - before.get(name, 0) for name in after}}


def _per_replica(stack: Stack) -> dict[str, float]:
    """The gateway's count of prompt tokens sent to each replica (its Prometheus metrics)."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://{stack.metrics_addresses['gateway']}/metrics", timeout=30) as reply:
        body = reply.read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^specstream:replica_prompt_tokens_total\{replica="([^"]+)"\} (\S+)$', body, re.M)}


def run(models: BenchModels, out_dir: Path, quiet: bool = False) -> dict:
    rng = random.Random(7)
    order = []
    for _ in range(TURNS):
        conversations = list(range(CONVERSATIONS))
        rng.shuffle(conversations)
        order.append(conversations)
    results = {}
    with Progress(len(ROWS) * CONVERSATIONS * TURNS, "calls", "routing", quiet=quiet) as progress:
        for label, imbalance in ROWS:
            results[label] = _row(models, imbalance, order, progress)
    first = results[ROWS[0][0]]["calls"]
    for label, result in results.items():
        for a, b in zip(first, result["calls"]):
            if a["token_ids"] != b["token_ids"]:
                raise AssertionError(f"{label}: conversation {b['conversation']} turn {b['turn']} answered "
                                     f"differently from {ROWS[0][0]}")
    rows, series = [], {}
    data = {"models": models.label, "target": display(models.target), "cpu": report.cpu_name(),
            "conversations": CONVERSATIONS, "turns": TURNS, "max_new_tokens": MAX_NEW_TOKENS, "rows": {}}
    for label, result in results.items():
        later = [c for c in result["calls"] if c["turn"] > 0]
        hits = sum(c["cached_tokens"] > 0 for c in later) / len(later)
        cached = sum(c["cached_tokens"] for c in later)
        prompt = sum(c["prompt_tokens"] for c in later)
        ttft = statistics.mean(c["ttft_s"] for c in later)
        split = " / ".join(f"{v:.0f}" for _, v in sorted(result["per_replica"].items()))
        rows.append([label, hits, f"{cached} / {prompt}", 1e3 * ttft, split,
                     all(a["token_ids"] == b["token_ids"] for a, b in zip(first, result["calls"]))])
        data["rows"][label] = {"hit_rate": hits, "cached_tokens": cached, "prompt_tokens": prompt,
                               "ttft_ms": 1e3 * ttft, "prompt_tokens_per_replica": result["per_replica"],
                               "per_call": [{k: c[k] for k in ("conversation", "turn", "ttft_s", "cached_tokens",
                                                               "prompt_tokens")} for c in result["calls"]]}
        per_round = [1e3 * statistics.mean(c["ttft_s"] for c in result["calls"] if c["turn"] == t)
                     for t in range(TURNS)]
        series[label] = (list(range(1, TURNS + 1)), per_round)
    print(f"routing, {models.label} on {data['cpu']}: two target replicas, {CONVERSATIONS} conversations of "
          f"{TURNS} turns interleaved, {MAX_NEW_TOKENS} new tokens at most; greedy, speculation auto")
    print(report.table(HEADERS, rows))
    data["table_markdown"] = report.markdown_table(HEADERS, rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write_json(out_dir / "routing.json", data)
    report.plot_lines(out_dir / "routing.png", f"time to first token per turn, two replicas, {models.label} "
                      f"({data['cpu']})", "turn", "ms", series)
    return data
