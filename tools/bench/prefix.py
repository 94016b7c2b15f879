"""`specstream bench prefix`: what the target's prefix cache saves on requests that repeat themselves.

Two workloads, on the default pair (greedy, speculation auto, the three processes, gRPC streams
timed by the client):

- **conversation**: a chat of ``TURNS`` turns; each turn sends the whole history (the system
  prompt, every earlier question and answer) and a new question, as chat applications do;
- **agent**: one long system prompt (instructions and the descriptions of ``len(AGENT_TOOLS)``
  tools, as an agent framework writes them) with a different request each call.

Rows: our stack with the prefix cache off (``--prefix-cache-slots 0``) and on (the default), the
same prompts in the same order; and llama.cpp (llama-cpp-python on the same GGUF file, both cores,
in a process of its own) given the same prompt tokens, once as its server runs with
``cache_prompt`` (one context kept across calls: each prompt reuses the previous one's common
prefix, its own answer included) and once reset before every prompt. The conversation's history
is our cache-off run's answers, so every row sends the same prompts; ours with the cache must
answer exactly as without it (checked: a difference stops the run).

Per row: time to first token (the mean over the calls after the first: the first is a miss for
everyone), the whole time of the calls, and for ours the prompt tokens the cache served. Prints a
table, writes ``prefix.json`` and ``prefix.png`` (time to first token per call).

**Pressure** (ours, cache off and on): ``PRESSURE_PROMPTS`` distinct prompts sent one after another
(none shares more than the chat template's opening with another: each is a miss past it, and with
the cache on every finished one is kept until evicted), while streams of ``STREAM_TOKENS`` tokens run beside them, one after
another. Per row: the running streams' gaps between tokens (median, 99th percentile, max), the
prompts' time to first token, and the target's resident memory before and after. The cache must
add no latency cliff and keep memory bounded.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from specstream.text.tools import Tool, tools_system_text
from tools.bench import report
from tools.bench.apart import run_apart
from tools.bench.latency import display, llama_cpp_available
from tools.bench.models import BenchModels
from tools.launcher import Stack, StackSpec
from tools.progress import Progress

__all__ = ["run"]

TURNS = 8
SYSTEM = "You are a friendly assistant for a travel agency. Answer in two or three sentences."
QUESTIONS = ["I want to visit Italy in spring. Which cities should I see?", "How many days should I stay in Rome?",
             "What food should I try there?", "Is it easy to get from Rome to Florence?",
             "What should I pack for the trip?", "Do I need to book museums in advance?",
             "What is a good day trip from Florence?", "Can you sum up my plan in one sentence?"]


def _tool(name: str, description: str, properties: dict, required: list[str]) -> Tool:
    return Tool(name, description, json.dumps({"type": "object", "properties": properties, "required": required,
                                               "additionalProperties": False}))


_TEXT = {"type": "string", "maxLength": 80}
AGENT_TOOLS = [
    _tool("search_flights", "Flights between two cities on a date", {"origin": _TEXT, "destination": _TEXT,
          "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}, ["origin", "destination", "date"]),
    _tool("book_hotel", "Books a hotel room in a city for some nights", {"city": _TEXT, "check_in": _TEXT,
          "nights": {"type": "integer", "minimum": 1, "maximum": 30}, "guests": {"type": "integer"}},
          ["city", "check_in", "nights"]),
    _tool("get_weather", "The weather forecast in a city for a day", {"city": _TEXT, "day": _TEXT,
          "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _tool("convert_currency", "Converts an amount between currencies", {"amount": {"type": "number"},
          "from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"}},
          ["amount", "from", "to"]),
    _tool("find_restaurants", "Restaurants near a place, by cuisine and price", {"near": _TEXT, "cuisine": _TEXT,
          "price": {"enum": ["cheap", "moderate", "expensive"]}}, ["near"]),
    _tool("train_times", "Train departures between two stations", {"from": _TEXT, "to": _TEXT, "after": _TEXT},
          ["from", "to"]),
    _tool("museum_tickets", "Ticket availability at a museum on a day", {"museum": _TEXT, "day": _TEXT,
          "people": {"type": "integer", "minimum": 1}}, ["museum", "day"]),
    _tool("translate", "Translates a short text", {"text": {"type": "string", "maxLength": 400},
          "language": _TEXT}, ["text", "language"]),
]
AGENT_SYSTEM = ("You are a travel agent's assistant. Use the tools when they help; otherwise answer briefly.\n\n"
                + tools_system_text(AGENT_TOOLS))
AGENT_REQUESTS = ["Find me a flight from Paris to Rome on 2026-04-12.", "What's the weather in Florence tomorrow?",
                  "Book a hotel in Venice for three nights from May 2.", "How much is 250 EUR in USD?",
                  "Any cheap pizza places near the Pantheon?", "Trains from Rome to Naples after 9am?",
                  "Are there Uffizi tickets for two on Friday?", "Translate 'where is the station' into Italian."]
MAX_NEW_TOKENS = 48
PRESSURE_PROMPTS = 1000  # distinct prompts of the pressure run
STREAM_TOKENS = 256  # each running stream's tokens in the pressure run
HEADERS = ["workload", "row", "ttft ms (mean after the 1st)", "vs cache off", "2nd token ms", "total s",
           "cached tokens / prompt", "draft features not sent / call", "= cache off"]


PRESSURE_HEADERS = ["row", "stream gap ms p50", "p99", "max", "prompt ttft ms (median)", "target RSS MiB before",
                    "after"]


def _conversation_messages(answers: list[str]) -> list[list[dict]]:
    """Each turn's messages, the earlier turns answered with ``answers``."""
    out, history = [], [{"role": "system", "content": SYSTEM}]
    for i, question in enumerate(QUESTIONS[:TURNS]):
        history = [*history, {"role": "user", "content": question}]
        out.append(list(history))
        if i < len(answers):
            history = [*history, {"role": "assistant", "content": answers[i]}]
    return out


def _agent_messages() -> list[list[dict]]:
    return [[{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": r}] for r in AGENT_REQUESTS]


def timed_chat(client, messages: list[dict], max_new_tokens: int = MAX_NEW_TOKENS, **options) -> dict:
    """One streamed chat call (the SDK's ``chat_stream``), timed by the client: time to the first
    token and in all, the tokens and text, usage, and the speculation counts."""
    started = time.perf_counter()
    first, second, tokens, text, last = None, None, [], "", None
    for chunk in client.chat_stream(messages, max_new_tokens=max_new_tokens, **options):
        if chunk.token_ids and first is not None and second is None:
            second = time.perf_counter() - started
        if first is None and chunk.token_ids:
            first = time.perf_counter() - started
        tokens += chunk.token_ids
        text += chunk.text
        last = chunk
    stats = last.stats
    return {"ttft_s": first, "second_s": second, "total_s": time.perf_counter() - started, "token_ids": tokens,
            "text": text,
            "prompt_tokens": last.usage.prompt_tokens, "cached_tokens": last.usage.cached_tokens,
            "accepted": stats.accepted_tokens if stats else 0, "passes": stats.target_passes if stats else 0}


def _serve(models: BenchModels, kept: int, workloads: dict, progress: Progress) -> dict:
    """Every workload's calls on one stack with ``--prefix-cache-slots kept`` (the target's and the
    draft's); the conversation takes ``workloads["conversation"]`` as its messages, or builds them
    from its own answers. Each call also gets the feature bytes the draft's cache saved it (the
    target's metrics)."""
    spec = StackSpec(**models.stack_fields(), extra_target_args=["--prefix-cache-slots", str(kept)],
                     extra_draft_args=["--prefix-cache-slots", str(kept)], metrics=True)
    out = {}
    from specstream_client import Client

    with tempfile.TemporaryDirectory() as logs, Stack(replace(spec, log_dir=logs)) as stack, \
            Client(stack.gateway_address, timeout=600) as client:
        client.chat([{"role": "user", "content": "Hi"}], max_new_tokens=2, cache_salt="warm-up")  # not timed
        for name, calls in workloads.items():
            results = []
            for i in range(len(calls) if calls is not None else TURNS):
                messages = calls[i] if calls is not None else \
                    _conversation_messages([r["text"] for r in results])[i]
                saved = _bytes_saved(stack)
                results.append({**timed_chat(client, messages), "messages": messages})
                results[-1]["feature_bytes_saved"] = _bytes_saved(stack) - saved
                progress.update()
            out[name] = results
    return out


def _bytes_saved(stack: Stack) -> float:
    """The target's specstream:draft_prefix_feature_bytes_saved_total."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://{stack.metrics_addresses['target']}/metrics", timeout=30) as reply:
        body = reply.read()
    return float(re.search(rb"^specstream:draft_prefix_feature_bytes_saved_total (\S+)$", body, re.M).group(1))


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _pressure(models: BenchModels, kept: int, progress: Progress) -> dict:
    """The pressure run on a stack with ``--prefix-cache-slots kept`` (target and draft)."""
    import threading

    from specstream_client import Client

    spec = StackSpec(**models.stack_fields(), extra_target_args=["--prefix-cache-slots", str(kept)],
                     extra_draft_args=["--prefix-cache-slots", str(kept)])
    gaps: list[float] = []
    done = threading.Event()
    with tempfile.TemporaryDirectory() as logs, Stack(replace(spec, log_dir=logs)) as stack, \
            Client(stack.gateway_address, timeout=600) as client:
        client.chat([{"role": "user", "content": "Hi"}], max_new_tokens=2, cache_salt="warm-up")  # not timed
        pid = stack.procs["target"].pid
        before = _rss_mib(pid)

        def streams() -> None:  # one running stream after another until the prompts are all sent
            k = 0
            while not done.is_set():
                k += 1
                last = None
                for chunk in client.chat_stream([{"role": "user", "content": f"Tell me a long story, number {k}."}],
                                                max_new_tokens=STREAM_TOKENS, ignore_eos=True):
                    now = time.perf_counter()
                    if last is not None and chunk.token_ids:
                        gaps.append((now - last) / len(chunk.token_ids))
                    last = now if chunk.token_ids else last

        runner = threading.Thread(target=streams, daemon=True)
        runner.start()
        ttfts = []
        for i in range(PRESSURE_PROMPTS):
            words = " ".join(f"item-{i}-{j}" for j in range(12))  # distinct from the template's opening on
            started = time.perf_counter()
            for chunk in client.chat_stream([{"role": "user", "content": f"{i}: {words}"}], max_new_tokens=1):
                if chunk.token_ids:
                    ttfts.append(time.perf_counter() - started)
                    break
            if i % 100 == 99:
                progress.update(100)
        done.set()
        runner.join()
        after = _rss_mib(pid)
    gaps.sort()
    return {"gap_ms_p50": 1e3 * gaps[len(gaps) // 2], "gap_ms_p99": 1e3 * gaps[int(0.99 * (len(gaps) - 1))],
            "gap_ms_max": 1e3 * gaps[-1], "gaps": len(gaps), "ttft_ms_median": 1e3 * statistics.median(ttfts),
            "rss_mib_before": before, "rss_mib_after": after}


def _llama_cpp(gguf: str, prompts: dict[str, list[list[int]]], max_new_tokens: int) -> dict:
    """What llama.cpp runs in its own process: each workload's prompts in order, with one context
    kept across them (its prompt cache: the common prefix with the previous prompt is reused) and
    reset before each; greedy, time to its first token and in all."""
    from llama_cpp import Llama  # optional: installed by `make peer`

    llm = Llama(model_path=gguf, n_ctx=4096, n_threads=os.cpu_count(), verbose=False)
    out = {}
    for mode in ("kept", "reset"):
        for name, calls in prompts.items():
            llm.reset()
            rows = []
            for prompt in calls:
                if mode == "reset":
                    llm.reset()
                started, first, n = time.perf_counter(), None, 0
                for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                    first = first if first is not None else time.perf_counter() - started
                    n += 1
                    if n == max_new_tokens:
                        break
                rows.append({"ttft_s": first, "total_s": time.perf_counter() - started})
            out[f"{name}/{mode}"] = rows
    return out


def _mean_after_first(rows: list[dict]) -> float:
    return statistics.mean(r["ttft_s"] for r in rows[1:]) if len(rows) > 1 else rows[0]["ttft_s"]


def run(models: BenchModels, out_dir: Path, quiet: bool = False) -> dict:
    tokenizer = models.tokenizer()
    with Progress(4 * TURNS + 2 * PRESSURE_PROMPTS, "calls", "prefix", quiet=quiet) as progress:
        off = _serve(models, 0, {"conversation": None, "agent": _agent_messages()}, progress)
        messages = {name: [r["messages"] for r in rows] for name, rows in off.items()}
        on = _serve(models, -1, messages, progress)
        pressure = {"ours, cache off": _pressure(models, 0, progress), "ours, prefix cache": _pressure(models, -1, progress)}
    for name in off:
        for i, (a, b) in enumerate(zip(off[name], on[name])):
            if a["token_ids"] != b["token_ids"]:
                raise AssertionError(f"{name} call {i}: the cached run answered differently from cache off")
    prompts = {name: [tokenizer.encode_chat(m) for m in calls] for name, calls in messages.items()}
    llama = run_apart(_llama_cpp, gguf=str(models.gguf), prompts=prompts, max_new_tokens=MAX_NEW_TOKENS) \
        if llama_cpp_available(models) else None
    if llama is None:
        print("llama.cpp: not installed (make peer)", flush=True)
    rows, data = [], {"models": models.label, "target": display(models.target), "cpu": report.cpu_name(),
                      "max_new_tokens": MAX_NEW_TOKENS, "workloads": {}}
    series = {}
    for name in off:
        base = _mean_after_first(off[name])
        entry = {}
        for row, calls in (("ours, cache off", off[name]), ("ours, prefix cache", on[name])):
            prompt_tokens = sum(c["prompt_tokens"] for c in calls)
            cached = sum(c["cached_tokens"] for c in calls)
            ttft = _mean_after_first(calls)
            second = statistics.mean(c["second_s"] - c["ttft_s"] for c in calls[1:] if c["second_s"] is not None)
            saved = statistics.mean(c["feature_bytes_saved"] for c in calls[1:])
            entry[row] = {"ttft_ms": 1e3 * ttft, "total_s": sum(c["total_s"] for c in calls), "cached_tokens": cached,
                          "prompt_tokens": prompt_tokens, "per_call_ttft_ms": [1e3 * c["ttft_s"] for c in calls],
                          "second_token_ms": 1e3 * second, "feature_bytes_saved_per_call": saved,
                          "per_call_feature_bytes_saved": [c["feature_bytes_saved"] for c in calls]}
            rows.append([name, row, 1e3 * ttft, base / ttft, 1e3 * second, entry[row]["total_s"],
                         f"{cached} / {prompt_tokens}", f"{saved / 1e6:.2f} MB",
                         row == "ours, cache off" or calls == on[name]])
            series[f"{name}: {row}"] = (list(range(1, len(calls) + 1)), entry[row]["per_call_ttft_ms"])
        for mode, label in (("kept", "llama.cpp, prompt cache"), ("reset", "llama.cpp, reset")):
            if llama is None:
                continue
            calls = llama[f"{name}/{mode}"]
            ttft = _mean_after_first(calls)
            entry[label] = {"ttft_ms": 1e3 * ttft, "total_s": sum(c["total_s"] for c in calls),
                            "per_call_ttft_ms": [1e3 * c["ttft_s"] for c in calls]}
            rows.append([name, label, 1e3 * ttft, base / ttft, None, entry[label]["total_s"], None, None, None])
            series[f"{name}: {label}"] = (list(range(1, len(calls) + 1)), entry[label]["per_call_ttft_ms"])
        entry["prompt_tokens_per_call"] = [len(p) for p in prompts[name]]
        data["workloads"][name] = entry
    print(f"prefix cache, {models.label} on {data['cpu']}: {TURNS} calls a workload, {MAX_NEW_TOKENS} new tokens "
          f"at most; prompts of {min(min(v) for v in (e['prompt_tokens_per_call'] for e in data['workloads'].values()))}"
          f"-{max(max(v) for v in (e['prompt_tokens_per_call'] for e in data['workloads'].values()))} tokens")
    print(report.table(HEADERS, rows))
    data["table_markdown"] = report.markdown_table(HEADERS, rows)
    pressure_rows = [[row, p["gap_ms_p50"], p["gap_ms_p99"], p["gap_ms_max"], p["ttft_ms_median"], p["rss_mib_before"],
                      p["rss_mib_after"]] for row, p in pressure.items()]
    print(f"pressure: {PRESSURE_PROMPTS} distinct prompts one after another, streams of {STREAM_TOKENS} tokens beside them")
    print(report.table(PRESSURE_HEADERS, pressure_rows))
    data["pressure"] = {"prompts": PRESSURE_PROMPTS, "stream_tokens": STREAM_TOKENS, "rows": pressure,
                        "table_markdown": report.markdown_table(PRESSURE_HEADERS, pressure_rows)}
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write_json(out_dir / "prefix.json", data)
    report.plot_lines(out_dir / "prefix.png", f"time to first token per call, {models.label} ({data['cpu']})",
                      "call", "ms", series)
    return data
