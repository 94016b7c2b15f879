"""`specstream bench agent`: what each proposer gains on agent traffic, which repeats itself.

Three workloads, each under a cache salt of its own (so suffix drafting draws on each one's outputs only):

- **transcript**: an agent framework's loop replaying a tool-using transcript. One system prompt
  (the instructions and the descriptions of the travel tools of tools/bench/prefix.py), one task,
  then ``CALLS`` calls; each call re-sends the whole transcript so far (every earlier answer of the
  model, and after it the tool's JSON result) and the model writes its next step;
- **calls**: independent calls with that system prompt and one request each (prefix.py's
  ``AGENT_REQUESTS``): nothing of an earlier answer is in the next prompt, so prompt lookup has
  only the prompt to copy from, and suffix drafting has the earlier answers too;
- **rerun**: the transcript's loop run again by the same tenant after it ran once (a retried or
  scheduled workflow, the same job for the next item): the best case for suffix drafting, whose
  corpus holds the first run's answers, while prompt lookup sees only this run's transcript.

The answers are the model's own greedy ones (speculation is lossless: every row answers the
same, checked; a difference stops the run), so every row sends the same prompts.

Rows, each a stack of its own on the default pair (greedy, speculation auto, the prefix cache on
unless the row says so, the three processes, gRPC streams timed by the client): plain decoding;
prompt lookup (``--proposer ngram``); suffix drafting (``suffix``), also with the prefix cache
off; suffix drafting before the draft model (``suffix+model``); and the pair's own proposer. Per
row and workload: generated tokens per second over all calls (their tokens over their whole time,
time to first token included), the ratio to plain decoding and to prompt lookup; the same for
decoding alone (the tokens after each call's first over the time after it: what a proposer can
change, the prefill left out); the mean time to first token, and the guesses the target accepted
per pass. Prints a table, writes ``agent.json``
and ``agent.png`` (each call's tokens per second, per row).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

from specstream.data.config import DraftConfig
from tools.bench import report
from tools.bench.latency import display
from tools.bench.models import BenchModels
from tools.bench.prefix import AGENT_REQUESTS, AGENT_SYSTEM, timed_chat
from tools.launcher import Stack, StackSpec
from tools.progress import Progress

__all__ = ["run"]

CALLS = 8
MAX_NEW_TOKENS = 64
MAX_SEQ_LEN = 4096  # the transcript grows to ~3,000 tokens
TASK = ("Plan a three-day trip for two people from Paris to Rome, leaving on 2026-04-12: find a flight, book a "
        "hotel for three nights, check the weather each day, and find restaurants near the hotel. Call one tool "
        "at a time.")
# The tools' answers, in turn: JSON as a travel API returns it.
RESULTS = [
    {"flights": [{"flight": "AZ 317", "departs": "2026-04-12T07:25", "arrives": "2026-04-12T09:30",
                  "price_eur": 148}, {"flight": "AF 1404", "departs": "2026-04-12T10:05",
                                      "arrives": "2026-04-12T12:10", "price_eur": 172}]},
    {"hotel": "Albergo del Senato", "city": "Rome", "check_in": "2026-04-12", "nights": 3, "guests": 2,
     "confirmation": "RSV-20931", "price_eur": 612},
    {"city": "Rome", "day": "2026-04-12", "forecast": "sunny", "high_c": 21, "low_c": 11},
    {"city": "Rome", "day": "2026-04-13", "forecast": "cloudy", "high_c": 19, "low_c": 10},
    {"city": "Rome", "day": "2026-04-14", "forecast": "rain", "high_c": 16, "low_c": 9},
    {"restaurants": [{"name": "Armando al Pantheon", "cuisine": "roman", "price": "moderate"},
                     {"name": "Da Francesco", "cuisine": "pizza", "price": "cheap"}]},
]
ROWS = [  # (label, proposer: None for plain decoding, prefix cache slots)
    ("plain decoding", None, -1),
    ("prompt lookup", "ngram", -1),
    ("suffix drafting", "suffix", -1),
    ("suffix drafting, prefix cache off", "suffix", 0),
    ("suffix drafting + model", "suffix+model", -1),
    ("the pair's proposer", "", -1),  # "": the pair's own (its draft model)
]
WORKLOADS = ("transcript", "calls", "rerun")
HEADERS = ["workload", "row", "tok/s", "vs plain", "vs prompt lookup", "decode tok/s", "decode vs plain",
           "decode vs lookup", "ttft ms", "accepted / pass", "= plain"]


def _transcript(answers: list[str]) -> list[dict]:
    """The messages of the next call: the task, then each earlier answer and its tool's result."""
    messages = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": TASK}]
    for i, answer in enumerate(answers):
        messages += [{"role": "assistant", "content": answer},
                     {"role": "tool", "content": json.dumps(RESULTS[i % len(RESULTS)])}]
    return messages


def _messages(workload: str, answers: list[str]) -> list[dict]:
    if workload in ("transcript", "rerun"):
        return _transcript(answers)
    request = AGENT_REQUESTS[len(answers) % len(AGENT_REQUESTS)]
    return [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": request}]


def _row(models: BenchModels, proposer: str | None, kept: int, progress: Progress) -> dict[str, list[dict]]:
    """Each workload's calls on one stack: ``proposer`` (None: plain decoding), ``kept`` prefix cache slots."""
    fields = models.stack_fields(speculative=proposer is not None)
    if proposer:
        fields = {**fields, "proposer": proposer,
                  "draft_model": None if proposer in DraftConfig.MODEL_FREE else str(models.require_draft())}
    spec = StackSpec(**fields, max_seq_len=MAX_SEQ_LEN, extra_target_args=["--prefix-cache-slots", str(kept)])
    from specstream_client import Client

    out: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as logs, Stack(replace(spec, log_dir=logs)) as stack, \
            Client(stack.gateway_address, timeout=600) as client:
        client.chat([{"role": "user", "content": "Hi"}], max_new_tokens=2, cache_salt="warm-up")  # not timed
        for workload in WORKLOADS:
            calls: list[dict] = out.setdefault(workload, [])
            salt = "transcript" if workload == "rerun" else workload  # the same tenant runs it again
            for _ in range(CALLS):
                calls.append(timed_chat(client, _messages(workload, [c["text"] for c in calls]), MAX_NEW_TOKENS,
                                        cache_salt=salt))
                progress.update()
    return out


def _speed(calls: list[dict]) -> float:
    return sum(len(c["token_ids"]) for c in calls) / sum(c["total_s"] for c in calls)


def _decode_speed(calls: list[dict]) -> float:
    """The tokens after each call's first over the time after it: decoding alone, the prefill left out."""
    return sum(len(c["token_ids"]) - 1 for c in calls) / sum(c["total_s"] - c["ttft_s"] for c in calls)


def run(models: BenchModels, out_dir: Path, quiet: bool = False) -> dict:
    results: dict[str, dict[str, list[dict]]] = {}
    with Progress(len(ROWS) * len(WORKLOADS) * CALLS, "calls", "agent", quiet=quiet) as progress:
        for label, proposer, kept in ROWS:
            results[label] = _row(models, proposer if proposer != "" else models.proposer, kept, progress)
    plain = results["plain decoding"]
    for label, workloads in results.items():
        for workload, calls in workloads.items():
            for i, (a, b) in enumerate(zip(plain[workload], calls)):
                if a["token_ids"] != b["token_ids"]:
                    raise AssertionError(f"{label}, {workload} call {i}: answered differently from plain decoding")
    rows, series = [], {}
    data = {"models": models.label, "target": display(models.target), "cpu": report.cpu_name(), "calls": CALLS,
            "max_new_tokens": MAX_NEW_TOKENS, "pair_proposer": models.proposer, "workloads": {}}
    for workload in WORKLOADS:
        base, lookup = _speed(plain[workload]), _speed(results["prompt lookup"][workload])
        decode_base, decode_lookup = _decode_speed(plain[workload]), _decode_speed(results["prompt lookup"][workload])
        entry = data["workloads"][workload] = {"rows": {}, "answers": [c["text"] for c in plain[workload]],
                                               "prompt_tokens": [c["prompt_tokens"] for c in plain[workload]]}
        for label, workloads in results.items():
            calls = workloads[workload]
            tps = _speed(calls)
            passes = sum(c["passes"] for c in calls)
            accepted = sum(c["accepted"] for c in calls) / passes if passes else 0.0
            ttft = sum(c["ttft_s"] for c in calls) / len(calls)
            decode = _decode_speed(calls)
            rows.append([workload, label, tps, tps / base, tps / lookup, decode, decode / decode_base,
                         decode / decode_lookup, 1e3 * ttft, accepted,
                         all(a["token_ids"] == b["token_ids"] for a, b in zip(plain[workload], calls))])
            entry["rows"][label] = {"tokens_per_s": tps, "vs_plain": tps / base, "vs_prompt_lookup": tps / lookup,
                                    "decode_tokens_per_s": decode, "decode_vs_plain": decode / decode_base,
                                    "decode_vs_prompt_lookup": decode / decode_lookup,
                                    "ttft_ms": 1e3 * ttft, "accepted_per_pass": accepted,
                                    "per_call_tokens_per_s": [len(c["token_ids"]) / c["total_s"] for c in calls],
                                    "cached_tokens": [c["cached_tokens"] for c in calls],
                                    "generated_tokens": [len(c["token_ids"]) for c in calls]}
            series[f"{workload}: {label}"] = (list(range(1, len(calls) + 1)),
                                              entry["rows"][label]["per_call_tokens_per_s"])
    sizes = [n for entry in data["workloads"].values() for n in entry["prompt_tokens"]]
    print(f"agent traffic, {models.label} on {data['cpu']}: {CALLS} calls a workload, prompts of {min(sizes)}-"
          f"{max(sizes)} tokens, {MAX_NEW_TOKENS} new tokens at most; greedy, speculation auto; the pair's "
          f"proposer: {models.proposer}")
    print(report.table(HEADERS, rows))
    data["table_markdown"] = report.markdown_table(HEADERS, rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write_json(out_dir / "agent.json", data)
    report.plot_lines(out_dir / "agent.png", f"agent traffic: tokens per second per call, {models.label} "
                      f"({data['cpu']})", "call", "tok/s", series)
    return data
