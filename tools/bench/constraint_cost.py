"""`specstream bench constraint-cost`: what a costly or hostile constraint costs, and whether it
stalls anyone else.

Cases: constraints a careless or hostile client can send within the request limits (a source of at
most 64 KiB, 128 tools): deeply nested schemas, huge repetitions and alternations, big enums and
Lark grammars, a large real schema, tool sets up to the largest; and a free-text request as the
reference for what admitting any request costs the running streams. Two parts:

- **offline**, on the served model's tokenizer: each case compiled with the server's compiler and
  its limits (specstream/text/grammar.py ``LIMITS``): refused (with the compiler's reason) or
  compiled, the time either took, the first mask's time, and the mean mask time over a short
  masked random walk (what each constrained token costs the server);
- **served**: a stack with no draft runs greedy streams while every case is sent, one after the
  other, as a request of its own (a tool set as a chat with those tools); each case's answer
  (served, or INVALID_ARGUMENT) and time, and the worst gap between the running streams' chunks
  while the cases were in against before (tools/bench/stream_gaps.py), once with the target's
  default prefill chunk and once with 512-token chunks. Compiling happens off the gateway's and
  the target's event loops, so the streams should not notice a constraint; a long prompt's
  prefill they do, a chunk at a time.

Prints a table, writes ``constraint_cost.json`` and ``constraint_cost.png``.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from specstream.data.constraint import Constraint
from specstream.data.errors import InvalidArgumentError
from specstream.text.grammar import GrammarCompiler, GrammarError
from specstream.text.tools import Tool, tool_constraint
from tools.bench import report
from tools.bench.latency import display
from tools.bench.models import BenchModels
from tools.launcher import Stack, StackSpec
from tools.progress import Progress
from tools.bench.stream_gaps import answer_of, stream_gaps

__all__ = ["CASES", "run"]

WALK = 32  # tokens of the masked random walk that times each mask


@dataclass(frozen=True)
class Case:
    name: str
    constraint: Constraint | None = None  # or a tool set
    tools: tuple[Tool, ...] = ()


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema, "b": {"anyOf": [
            {"type": "string"}, {"type": "integer"}, {"type": "array", "items": {"type": "number"}}]}},
            "required": ["a"]}
    return schema


def _wide() -> dict:
    """A large real-world shape: 200 properties with patterns and formats, 50 of them required."""
    props = {f"field_{i}": {"type": "string", "pattern": "^[a-z]{3,9}(-[0-9]{2,5}){0,3}$"} if i % 3 else
             {"type": "integer", "minimum": 0, "maximum": 10 ** 6} for i in range(200)}
    return {"type": "object", "properties": props, "required": list(props)[:50], "additionalProperties": False}


def _tools(n: int) -> tuple[Tool, ...]:
    return tuple(Tool(f"tool_{i}", f"does thing {i}", json.dumps({
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 64}, "n": {"type": "integer"},
                                         "mode": {"enum": ["fast", "slow", f"m{i}"]}},
        "required": ["q"], "additionalProperties": False})) for i in range(n))


CASES = [
    Case("none (free text)"),  # the reference: what admitting any short request costs the streams
    Case("schema: nested 40 deep", Constraint("json_schema", json.dumps(_nested(40)))),
    Case("schema: 200 properties", Constraint("json_schema", json.dumps(_wide()))),
    Case("schema: enum of 3,000", Constraint("json_schema", json.dumps({"enum": [f"value-{i}" for i in range(3000)]}))),
    Case("schema: nested repeats", Constraint("json_schema", json.dumps(
        {"type": "string", "pattern": "^([a-z]{1,50}){1,50}$"}))),
    Case("regex: 10,000 repeats of 3 letters", Constraint("regex", "(a|b|c){10000}")),
    Case("regex: nested repeats", Constraint("regex", "((a{1,100}){1,100}){1,100}")),
    Case("regex: 3,000 words", Constraint("regex", "|".join(f"word{i}x" for i in range(3000)))),
    Case("grammar: 1,500 rules", Constraint("grammar", "start: " + " | ".join(f'"t{i}" r{i}' for i in range(1500))
                                             + "\n" + "\n".join(f"r{i}: /[a-z]{{1,{i % 50 + 1}}}/"
                                                                for i in range(1500)))),
    Case("grammar: left recursion",
         Constraint("grammar", 'start: e\ne: e "+" e | e "*" e | "(" e ")" | /[0-9]+/')),
    Case("tools: 12 functions", tools=_tools(12)),
    Case("tools: 128 functions", tools=_tools(128)),  # their description alone outgrows a 2k context
]
HEADERS = ["case", "source KiB", "compiled", "compile ms", "first mask ms", "mask ms/token", "served as",
           "why refused"]  # and, per prefill chunk, the served ms and the streams' worst gap


def _constraint(case: Case) -> Constraint | None:
    if case.tools:
        return tool_constraint(list(case.tools), "auto")
    return case.constraint


def offline(compiler: GrammarCompiler, case: Case, seed: int = 0) -> dict:
    """Compiles ``case`` on the server's compiler: refused or compiled, its time, the first mask's,
    and the mean mask time over a masked random walk of up to ``WALK`` tokens."""
    constraint = _constraint(case)
    if constraint is None:
        return {"source_kib": 0.0, "compiled": None, "compile_ms": None}
    out = {"source_kib": len(constraint.source.encode()) / 1024}
    began = time.perf_counter()
    try:
        grammar = compiler.compile(constraint)
    except InvalidArgumentError as err:
        return out | {"compiled": False, "compile_ms": 1e3 * (time.perf_counter() - began), "reason": err.reason}
    out |= {"compiled": True, "compile_ms": 1e3 * (time.perf_counter() - began)}
    matcher = grammar.matcher()
    rng = random.Random(seed)
    seconds, masks = [], 0
    try:
        for _ in range(WALK):
            began = time.perf_counter()
            allowed = matcher.allowed()
            seconds.append(time.perf_counter() - began)
            masks += 1
            ids = allowed.nonzero()[0]
            if matcher.stopped or not len(ids):
                break
            matcher.consume([int(ids[rng.randrange(len(ids))])])
    except GrammarError as err:  # the parser's limits reached mid-output: that sequence would end with an error
        out["reason"] = f"after {masks} tokens: {err}"
    out |= {"first_mask_ms": 1e3 * seconds[0] if seconds else None,
            "mask_ms": 1e3 * sum(seconds[1:]) / len(seconds[1:]) if len(seconds) > 1 else None}
    return out


def _request(case: Case):
    """The case as a request of its own: ``async (client) -> outcome``."""
    async def send(client) -> str:
        messages = [{"role": "user", "content": "Answer."}]
        if case.tools:
            tools = [{"name": t.name, "description": t.description, "parameters": json.loads(t.parameters)}
                     for t in case.tools]
            return await answer_of(client.chat(messages, max_new_tokens=4, tools=tools, speculation="off"), field=True)
        c = case.constraint
        option = {} if c is None else {"json_schema": c.source} if c.kind == "json_schema" else \
            {"choice": c.choices} if c.kind == "choice" else {c.kind: c.source}
        return await answer_of(client.chat(messages, max_new_tokens=4, speculation="off", **option), field=True)
    return send


def run(models: BenchModels, out_dir: Path, streams: int = 4, quiet: bool = False,
        prefill_chunks: tuple[int, ...] = (0, 512)) -> dict:
    """``prefill_chunks``: the served part once per target ``--prefill-chunk`` (0: the device's
    default), so a long prompt's stall is seen beside the chunk that causes it."""
    tokenizer = models.tokenizer()
    compiler = GrammarCompiler(tokenizer)
    cases = {case.name: offline(compiler, case) for case in CASES}
    served = {}
    with Progress(len(prefill_chunks) * streams * 400, "tokens", "constraint-cost", quiet=quiet) as progress:
        for chunk in prefill_chunks:
            spec = StackSpec(**models.stack_fields(speculative=False), extra_target_args=["--prefill-chunk", str(chunk)])
            with tempfile.TemporaryDirectory() as logs, Stack(replace(spec, log_dir=logs)) as stack:
                served[chunk] = asyncio.run(stream_gaps(stack.gateway_address, [_request(c) for c in CASES],
                                                        streams=streams, max_new_tokens=400, timeout=600,
                                                        progress=progress))
    rows = []
    for i, case in enumerate(CASES):
        entry = cases[case.name]
        entry["served"] = {str(chunk): {"as": gaps.outcomes[i], "ms": 1e3 * gaps.seconds[i],
                                        "worst_gap_ms": gaps.worst_gap_ms_each[i]} for chunk, gaps in served.items()}
        first = entry["served"][str(prefill_chunks[0])]
        rows.append([case.name, entry["source_kib"], entry["compiled"], entry["compile_ms"], entry.get("first_mask_ms"),
                     entry.get("mask_ms"), first["as"],
                     *[x for chunk in prefill_chunks for x in (entry["served"][str(chunk)]["ms"],
                                                              entry["served"][str(chunk)]["worst_gap_ms"])],
                     (entry.get("reason") or "")[:60]])
    headers = [*HEADERS[:7], *[f"{what} (chunk {chunk or 'default'})" for chunk in prefill_chunks
                              for what in ("served ms", "worst gap ms")], HEADERS[-1]]
    data = {"models": models.label, "target": display(models.target), "cpu": report.cpu_name(), "cases": cases,
            "streams": streams, "prefill_chunks": list(prefill_chunks),
            "baseline_worst_gap_ms": {str(c): g.baseline_worst_gap_ms for c, g in served.items()}}
    print(f"costly constraints, {models.label} on {data['cpu']}")
    print(report.table(headers, rows))
    for chunk, gaps in served.items():
        print(f"prefill chunk {chunk or 'default'}: {streams} greedy streams meanwhile, worst gap between chunks "
              f"{gaps.worst_gap_ms:.1f} ms while the cases were in, {gaps.baseline_worst_gap_ms:.1f} ms before",
              flush=True)
    data["table_markdown"] = report.markdown_table(headers, rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write_json(out_dir / "constraint_cost.json", data)
    report.plot_bars(out_dir / "constraint_cost.png", f"compile (or refuse) time, {models.label} ({data['cpu']})",
                     "ms", {name: e["compile_ms"] for name, e in cases.items() if e["compile_ms"] is not None})
    return data
