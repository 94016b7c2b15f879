"""`specstream bench structured`: structured outputs and tool calls, plain and speculative.

Workloads (greedy chat requests on the served pair): JSON extraction into a schema of four shapes
(flat, nested, array, enum), a tool call (the function's arguments; tool_choice "required" and
parallel_tool_calls false, as the HTTP front sends them: specstream/text/tools.py), classification by `choice`, and a regex field.
Rows, each on the same requests through the real processes:

- constrained plain: the constraint, no speculation (the reference every speculative row's tokens
  must equal);
- unconstrained plain: no constraint, no speculation, each answer as many tokens long as
  constrained plain's (``ignore_eos``): what the constraint costs is constrained plain's decode
  speed against this row's, on answers of the same length from the same prompts;
- + forced tokens only: no draft at all, the grammar's forced tokens proposed (γ 4);
- + draft cut at the first invalid token (vLLM's way): the draft service guessing unmasked, the
  target cutting its guesses where the grammar refuses them, no forced tokens;
- + grammar-aware draft (ours): forced tokens and the draft guessing from its masked distribution;
- constrained plain, sampled and + grammar-aware draft (ours), sampled: temperature 0.7, a seed per
  question, the second compared with the first (Leviathan's rule keeps the distribution, not the
  draws: only speed and validity are compared);
- the same with the draft in the target's process (`serve --colocate-draft`);
- peers: llama.cpp's JSON-schema mode (llama-cpp-python's `response_format` with the schema, its
  GBNF grammar) on the target's GGUF file and the same cores, for the JSON workloads, when
  `make peer` installed it; and transformers `generate()` on the same checkpoint (dense, the
  pair's dtype) with the same llguidance grammar as a logits processor, every workload.

The four stacks run side by side and each request's runs take turns across the rows (one run of
every row, then the next), each request timed on its fastest run: a slow moment of a shared
machine falls on every row alike rather than on the row that happened to run then.

Per row and workload: tokens/s, the share of forced tokens in the answers, α (draft guesses
accepted / proposed, forced tokens included), tokens per target pass, the share of answers valid
against their schema / regex / choices (`jsonschema` for JSON; an answer the token budget cut,
``finish_reason`` "length", is incomplete and counts as not valid: ``cut_by_budget`` in the JSON
says how many), and that the tokens equal
constrained plain's (a row whose tokens differ stops the run: tools/bench/checks.py). Prints a table, writes ``structured.json`` and ``structured.png``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from specstream.data.constraint import Constraint
from specstream.serving.compute import on_torch_thread
from specstream.text.grammar import GrammarCompiler
from specstream.text.tools import Tool, ToolCallParser, tool_constraint, tools_system_text
from tools.bench import report
from tools.bench.apart import run_apart
from tools.bench.checks import check_same_tokens
from tools.bench.latency import display, llama_cpp_available
from tools.bench.models import BenchModels
from tools.launcher import Stack, StackSpec
from tools.progress import Progress

__all__ = ["WORKLOADS", "Workload", "run"]

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "maxLength": 40}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                  "email": {"type": "string", "maxLength": 60}},
                 "required": ["name", "email"], "additionalProperties": False},
    "shipping": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                  "express": {"type": "boolean"}},
                 "required": ["city", "express"], "additionalProperties": False}},
    "required": ["customer", "shipping"], "additionalProperties": False}
ITEMS = {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                     "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
    "required": ["name", "quantity"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}
TICKET = {"type": "object", "properties": {
    "category": {"enum": ["billing", "shipping", "technical", "other"]},
    "priority": {"enum": ["low", "medium", "high"]},
    "sentiment": {"enum": ["positive", "neutral", "negative"]}},
    "required": ["category", "priority", "sentiment"], "additionalProperties": False}
WEATHER = Tool("get_weather", "The current weather in a city", json.dumps({
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}))
FLIGHTS = Tool("search_flights", "Flights between two cities on a date", json.dumps({
    "type": "object", "properties": {"origin": {"type": "string", "maxLength": 40},
                                     "destination": {"type": "string", "maxLength": 40},
                                     "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
    "required": ["origin", "destination", "date"], "additionalProperties": False}))


@dataclass(frozen=True)
class Workload:
    name: str
    constraint: Constraint
    questions: tuple[str, ...]
    schema_heavy: bool = False  # JSON whose structure the schema forces (the 2x goal is on these)
    schema: dict | None = None  # JSON workloads: what the answer validates against (and the peer's schema)
    tools: tuple[Tool, ...] = ()
    system: str = ""

    def messages(self, question: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": question}]

    def valid(self, text: str) -> bool:
        """Whether an answer matches its constraint (JSON: parsed and validated by jsonschema)."""
        import jsonschema

        try:
            if self.tools:
                parser = ToolCallParser()
                content, _ = parser.feed(text)
                schemas = {t.name: json.loads(t.parameters) for t in self.tools}
                for call in parser.calls:
                    jsonschema.validate(json.loads(call.arguments), schemas[call.name])
                return bool(parser.calls) and not (content + parser.finish()).strip()
            if self.schema is not None:
                jsonschema.validate(json.loads(text), self.schema)
                return True
            if self.constraint.kind == "choice":
                return text in self.constraint.choices
            return re.fullmatch(self.constraint.source, text) is not None
        except (ValueError, KeyError, jsonschema.ValidationError):
            return False


def _json(name: str, schema: dict, questions: tuple[str, ...]) -> Workload:
    return Workload(name, Constraint("json_schema", json.dumps(schema)), questions, True, schema)


WORKLOADS = [
    _json("json-flat", PERSON, ("Extract the person as JSON: Marie Curie, 66, lived in Paris.",
                                "Extract the person as JSON: Alan Turing was 41 and lived in Manchester.")),
    _json("json-nested", ORDER, ("Extract the order as JSON: Jane Doe (jane@example.com) wants express shipping "
                                 "to Berlin.",
                                 "Extract the order as JSON: Tom Lee, tom.lee@mail.com, standard delivery to Oslo.")),
    _json("json-array", ITEMS, ("List the shopping items as JSON: two apples, a loaf of bread and six eggs.",
                                "List the items as JSON: 3 notebooks, 1 stapler.")),
    _json("json-enum", TICKET, ("Classify this support ticket as JSON: 'I was charged twice this month, please fix "
                                "it now!'",
                                "Classify this support ticket as JSON: 'The app crashes when I open settings.'")),
    # One call (parallel_tool_calls false): SmolLM2-135M given the choice repeats its call until the budget ends.
    Workload("tool-call", tool_constraint([WEATHER, FLIGHTS], "required", parallel=False),
             ("What's the weather like in Rome right now?", "Find me a flight from Paris to Tokyo on 2026-03-14."),
             True, tools=(WEATHER, FLIGHTS), system=tools_system_text([WEATHER, FLIGHTS])),
    Workload("choice", Constraint("choice", json.dumps(["positive", "negative", "neutral"])),
             ("Sentiment of 'I love this phone, the battery lasts forever' (positive, negative or neutral)?",
              "Sentiment of 'The delivery was late and the box was damaged' (positive, negative or neutral)?")),
    Workload("regex-date", Constraint("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
             ("On what date did Apollo 11 land on the Moon? Answer as YYYY-MM-DD.",
              "When was the Berlin Wall opened? Answer as YYYY-MM-DD.")),
]

# (row, constraint on, speculation, stack, temperature): the stacks are "plain" (no draft), "cut"
# (the draft unmasked, no forced tokens), "ours" (the defaults) and "colocated" (the defaults, the
# draft in the target's process). Sampled rows (temperature > 0, a seed per question) are compared
# with constrained plain sampled at the same temperature: their tokens are other draws of the same
# distribution (Leviathan's rule; tests/test_structured_engine.py tests it), so only their speed and
# validity are reported.
SAMPLED_TEMPERATURE = 0.7
ROWS = [("constrained plain", True, "off", "plain", 0.0), ("unconstrained plain", False, "off", "plain", 0.0),
        ("+ forced tokens only", True, 4, "plain", 0.0),
        ("constrained plain, sampled", True, "off", "plain", SAMPLED_TEMPERATURE),
        ("+ draft cut at first invalid (vLLM's way)", True, "auto", "cut", 0.0),
        ("+ grammar-aware draft (ours)", True, "auto", "ours", 0.0),
        ("+ grammar-aware draft (ours), sampled", True, "auto", "ours", SAMPLED_TEMPERATURE),
        ("+ grammar-aware draft, colocated", True, "auto", "colocated", 0.0)]
HEADERS = ["workload", "row", "tok/s", "vs constrained plain", "decode tok/s", "forced share", "alpha", "tokens/pass",
           "valid", "= constrained plain"]


@dataclass
class _Measured:
    tokens: int = 0
    seconds: float = 0.0
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    valid: int = 0
    cut: int = 0  # answers the token budget ended ("length"): incomplete, so not counted valid
    decode_tokens: int = 0  # tokens after each answer's first
    decode_seconds: float = 0.0  # the server's time after each answer's first token
    answers: list[list[int]] = field(default_factory=list)


def run(models: BenchModels, out_dir: Path, max_new_tokens: int = 96, repeats: int = 2, quiet: bool = False,
        workloads: list[Workload] | None = None) -> dict:
    """``repeats``: each request is sent this many times and timed on the fastest (the first run
    of a request also pays its grammar's first compilation)."""
    workloads = workloads or WORKLOADS
    tokenizer = models.tokenizer()
    compiler = GrammarCompiler(tokenizer)
    for w in workloads:  # a workload's constraint must compile on this tokenizer before any stack starts
        compiler.compile(w.constraint)
    fields = models.stack_fields()
    stacks = {"plain": dict(models.stack_fields(speculative=False)),
              "cut": {**fields, "grammar_draft": False, "extra_target_args": ["--no-forced-tokens"]},
              "ours": fields, "colocated": {**fields, "colocate_draft": True}}
    measured = {(w.name, row[0]): _Measured() for w in workloads for row in ROWS}
    total = len(ROWS) * sum(len(w.questions) for w in workloads)
    with Progress(total, "answers", "structured", quiet=quiet) as progress, contextlib.ExitStack() as running:
        from specstream_client import Client

        clients = {}
        for stack_name, stack_fields in stacks.items():  # all four at once: the rows take turns (below)
            progress.phase(f"structured: stack '{stack_name}' starting")
            logs = running.enter_context(tempfile.TemporaryDirectory())
            stack = running.enter_context(Stack(StackSpec(**stack_fields, max_gamma=16, log_dir=logs)))
            client = clients[stack_name] = running.enter_context(Client(stack.gateway_address, timeout=600))
            for w in workloads:  # untimed: a fresh stack's first passes (and each grammar's compile) are slower
                for constrained in (True, False):
                    _ask(client, w, w.questions[0], constrained, "off", 8)
        # Each request's runs go round the rows (one run of every row, then the next run), so a slow
        # moment of this shared machine falls on every row alike, not on whichever row ran then.
        for w in workloads:
            progress.phase(f"structured: {w.name}")
            for seed, question in enumerate(w.questions):
                best: dict[str, tuple[float, object]] = {}
                for run in range(repeats):
                    for row, constrained, speculation, stack_name, temperature in ROWS:
                        # unconstrained plain: as many tokens as constrained plain's answer (ROWS has it first)
                        length = None if constrained else len(best["constrained plain"][1].token_ids)
                        seconds, result = _ask(clients[stack_name], w, question, constrained, speculation,
                                               max_new_tokens, length, temperature, seed, salt=f"{row} {run}")
                        if row not in best or seconds < best[row][0]:
                            best[row] = (seconds, result)
                for row, *_ in ROWS:
                    _record(measured[(w.name, row)], w, *best[row])
                    progress.update()
    peer = _llama_cpp(models, [w for w in workloads if w.schema is not None], max_new_tokens, repeats)
    hf = on_torch_thread(_hf_constrained, models, workloads, compiler, max_new_tokens)
    return _report(models, workloads, measured, peer, hf, compiler, out_dir, max_new_tokens)


def _ask(client, w: Workload, question: str, constrained: bool, speculation, max_new_tokens: int,
         length: int | None = None, temperature: float = 0.0, seed: int = 0, salt: str = "") -> tuple[float, object]:
    """One run of a request: (its seconds, the SDK's result). ``length``: the answer is exactly this
    many tokens (its end-of-turn ignored); ``temperature`` > 0: sampled with ``seed``. ``salt`` is
    its cache salt: each row and run has its own, so the target's prefix cache serves a request what
    it shares with the earlier requests of its row and run (the chat template's system prompt, a
    tool list), never its own earlier run."""
    kwargs = {"max_new_tokens": max_new_tokens, "speculation": speculation}
    if temperature:
        kwargs |= {"temperature": temperature, "seed": seed}
    if length is not None:
        kwargs |= {"max_new_tokens": length, "ignore_eos": True}
    if constrained:
        c = w.constraint
        kwargs |= ({"json_schema": c.source} if c.kind == "json_schema" else
                   {"choice": c.choices} if c.kind == "choice" else {c.kind: c.source})
    start = time.perf_counter()
    result = client.chat(w.messages(question), cache_salt=salt, **kwargs)
    return time.perf_counter() - start, result


def _record(m: _Measured, w: Workload, seconds: float, result) -> None:
    """Adds a request's fastest run to its row's measurements."""
    m.tokens += len(result.token_ids)
    m.seconds += seconds
    m.passes += result.stats.target_passes
    m.drafted += result.stats.draft_tokens
    m.accepted += result.stats.accepted_tokens
    m.valid += w.valid(result.text) and result.finish_reason in ("eos", "stop")
    m.cut += result.finish_reason == "length"
    m.decode_tokens += len(result.token_ids) - 1
    m.decode_seconds += result.timings.total_seconds - result.timings.time_to_first_token_seconds
    m.answers.append(result.token_ids)


def _forced_share(compiler: GrammarCompiler, w: Workload, answers: list[list[int]]) -> float:
    """Of the answers' tokens, the share the grammar allowed alone at their position."""
    forced = total = 0
    grammar = compiler.compile(w.constraint)
    for answer in answers:
        matcher = grammar.matcher()
        for token in answer:
            ahead = matcher.forced()
            forced += bool(ahead) and ahead[0] == token
            total += 1
            if matcher.consume([token]) != 1:
                break
    return forced / total if total else 0.0


def _llama_cpp(models: BenchModels, workloads: list[Workload], max_new_tokens: int, repeats: int) -> dict | None:
    if not workloads or not llama_cpp_available(models):
        print("llama.cpp: not installed (make peer)" if models.gguf is not None
              else "llama.cpp: the target has no GGUF file to run", flush=True)
        return None
    jobs = [{"name": w.name, "schema": w.schema, "messages": [w.messages(q) for q in w.questions]} for w in workloads]
    return run_apart(llama_cpp_json_runs, gguf=str(models.gguf), jobs=jobs, max_new_tokens=max_new_tokens,
                     repeats=repeats)


def llama_cpp_json_runs(gguf: str, jobs: list[dict], max_new_tokens: int, repeats: int) -> dict:
    """llama.cpp's JSON-schema mode, greedy, in a process of its own: per workload tokens/s (the
    fastest of ``repeats`` per request) and how many answers the schema validates. Each run starts
    from a context holding the request before it, as each of ours finds the prefix cache."""
    import jsonschema
    from llama_cpp import Llama  # optional: installed by `make peer`

    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=os.cpu_count(), verbose=False)
    out, previous = {}, None
    for job in jobs:
        tokens, seconds, valid = 0, 0.0, 0
        for messages in job["messages"]:
            best = None
            for _ in range(repeats):
                # As our runs: the context holds the request before this one (its prompt cache reuses
                # what they share: the system prompt), never this request's own earlier run.
                llm.reset()
                if previous is not None:
                    llm.create_chat_completion(messages=previous, max_tokens=1)
                start = time.perf_counter()
                reply = llm.create_chat_completion(messages=messages, temperature=0.0, top_k=1,
                                                   max_tokens=max_new_tokens,
                                                   response_format={"type": "json_object", "schema": job["schema"]})
                elapsed = time.perf_counter() - start
                if best is None or elapsed < best[0]:
                    best = (elapsed, reply)
            elapsed, reply = best
            previous = messages
            tokens += reply["usage"]["completion_tokens"]
            seconds += elapsed
            try:
                jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), job["schema"])
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        out[job["name"]] = {"tokens_per_s": tokens / seconds, "tokens": tokens, "valid": valid,
                            "answers": len(job["messages"])}
    return out


def _hf_constrained(models: BenchModels, workloads: list[Workload], compiler: GrammarCompiler,
                    max_new_tokens: int) -> dict:
    """transformers `generate()`, greedy, with each workload's grammar masking its logits at every
    step (llguidance, through our matcher: the same grammar text and tokenizer), on the torch thread."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    class GrammarMask(LogitsProcessor):
        def __init__(self, matcher, prompt_len: int) -> None:
            self.matcher, self.prompt_len, self.fed = matcher, prompt_len, 0

        def __call__(self, input_ids, scores):
            new = input_ids[0, self.prompt_len:].tolist()
            self.matcher.consume(new[self.fed:])
            self.fed = len(new)
            allowed = torch.from_numpy(self.matcher.allowed())
            scores[0, : len(allowed)].masked_fill_(~allowed, float("-inf"))
            scores[0, len(allowed):] = float("-inf")
            return scores

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its weight-loading bar would land in the table's output
    tokenizer = models.tokenizer()
    ends = list(dict.fromkeys([*tokenizer.eos_token_ids, *([tokenizer.end_of_turn_id]
                                                         if tokenizer.end_of_turn_id is not None else [])]))
    model = AutoModelForCausalLM.from_pretrained(models.target, dtype=getattr(torch, models.dtype)).eval()
    out = {}
    with torch.inference_mode():
        for w in workloads:
            grammar = compiler.compile(w.constraint)
            tokens, seconds, valid = 0, 0.0, 0
            for question in w.questions:
                prompt = tokenizer.encode_chat(w.messages(question))
                ids = torch.tensor([prompt])
                start = time.perf_counter()
                generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                           do_sample=False, eos_token_id=ends, pad_token_id=ends[0],
                                           logits_processor=LogitsProcessorList([GrammarMask(grammar.matcher(),
                                                                                             len(prompt))]))
                seconds += time.perf_counter() - start
                new = generated[0, len(prompt):].tolist()
                ended = bool(new) and new[-1] in ends
                tokens += len(new)
                valid += ended and w.valid(tokenizer.decode(new[:-1]))
            out[w.name] = {"tokens_per_s": tokens / seconds, "tokens": tokens, "valid": valid,
                           "answers": len(w.questions), "dtype": models.dtype}
    return out


def _report(models: BenchModels, workloads: list[Workload], measured: dict[tuple[str, str], _Measured],
            peer: dict | None, hf: dict, compiler: GrammarCompiler, out_dir: Path, max_new_tokens: int) -> dict:
    rows, data = [], {"models": models.label, "target": display(models.target), "draft": display(models.draft),
                      "cpu": report.cpu_name(), "max_new_tokens": max_new_tokens, "workloads": {}}
    for w in workloads:
        plain = measured[(w.name, "constrained plain")]
        plain_rate = plain.tokens / plain.seconds
        entry = data["workloads"][w.name] = {"constraint": w.constraint.kind, "schema_heavy": w.schema_heavy,
                                             "forced_share": _forced_share(compiler, w, plain.answers), "rows": {}}
        sampled_plain = measured[(w.name, "constrained plain, sampled")]
        for row, constrained, _, _, temperature in ROWS:
            m = measured[(w.name, row)]
            greedy = constrained and not temperature
            if greedy:  # every greedy constrained row's tokens are constrained plain's, or the run stops
                check_same_tokens(f"{w.name}, {row}", plain.answers, m.answers)
            rate = m.tokens / m.seconds
            # a sampled row against constrained plain sampled at its temperature
            base = sampled_plain.tokens / sampled_plain.seconds if temperature else plain_rate
            r = entry["rows"][row] = {
                "tokens_per_s": rate, "vs_constrained_plain": rate / base, "tokens": m.tokens,
                "decode_tokens_per_s": m.decode_tokens / m.decode_seconds if m.decode_seconds > 0 else None,
                "alpha": m.accepted / m.drafted if m.drafted else None,
                "tokens_per_pass": m.tokens / m.passes if m.passes else None,
                "valid": m.valid / len(m.answers) if constrained else None,
                "cut_by_budget": m.cut if constrained else None,
                "equals_constrained_plain": m.answers == plain.answers if greedy else None}
            rows.append([w.name, row, rate, r["vs_constrained_plain"], r["decode_tokens_per_s"],
                         entry["forced_share"] if constrained else None, r["alpha"], r["tokens_per_pass"], r["valid"],
                         r["equals_constrained_plain"]])
        if peer and w.name in peer:
            p = peer[w.name]
            entry["rows"]["llama.cpp JSON-schema mode"] = {**p, "vs_constrained_plain": p["tokens_per_s"] / plain_rate}
            ours = entry["rows"]["+ grammar-aware draft (ours)"]["tokens_per_s"]
            entry["ours_vs_llama_cpp"] = ours / p["tokens_per_s"]
            rows.append([w.name, "peer: llama.cpp JSON-schema mode", p["tokens_per_s"],
                         p["tokens_per_s"] / plain_rate, None, None, None, None, p["valid"] / p["answers"], None])
        h = hf[w.name]
        entry["rows"]["transformers + llguidance"] = {**h, "vs_constrained_plain": h["tokens_per_s"] / plain_rate}
        entry["ours_vs_transformers"] = entry["rows"]["+ grammar-aware draft (ours)"]["tokens_per_s"] / h["tokens_per_s"]
        rows.append([w.name, f"peer: transformers + llguidance ({h['dtype']})", h["tokens_per_s"],
                     h["tokens_per_s"] / plain_rate, None, None, None, None, h["valid"] / h["answers"], None])
    heavy = [w.name for w in workloads if w.schema_heavy]

    def mean(key: str, row: str, names: list[str]) -> float | None:
        values = [data["workloads"][n]["rows"][row][key] for n in names if row in data["workloads"][n]["rows"]]
        return sum(values) / len(values) if values else None

    data["schema_heavy_speedup"] = mean("vs_constrained_plain", "+ grammar-aware draft (ours)", heavy)
    data["schema_heavy_speedup_sampled"] = mean("vs_constrained_plain", "+ grammar-aware draft (ours), sampled", heavy)
    # The constraint's own cost, like for like: decode speed (tokens after the first, per second of
    # the server's time after it) of constrained plain against unconstrained plain, whose answers
    # are other texts of the same lengths.
    decode = [data["workloads"][n]["rows"]["constrained plain"]["decode_tokens_per_s"]
              / data["workloads"][n]["rows"]["unconstrained plain"]["decode_tokens_per_s"] for n in heavy
              if data["workloads"][n]["rows"]["unconstrained plain"]["decode_tokens_per_s"]
              and data["workloads"][n]["rows"]["constrained plain"]["decode_tokens_per_s"]]
    data["constrained_vs_unconstrained_decode"] = sum(decode) / len(decode) if decode else None
    data["ours_vs_transformers"] = [data["workloads"][n]["ours_vs_transformers"] for n in heavy]
    if peer:
        data["ours_vs_llama_cpp"] = [data["workloads"][n].get("ours_vs_llama_cpp") for n in heavy
                                     if "ours_vs_llama_cpp" in data["workloads"][n]]
    print(f"structured outputs, {models.label} on {data['cpu']} (greedy, {max_new_tokens} new tokens at most)")
    print(report.table(HEADERS, rows), flush=True)
    print(f"schema-heavy workloads, ours vs constrained plain: {data['schema_heavy_speedup']:.2f}x (mean); "
          f"sampled (T {SAMPLED_TEMPERATURE}): {data['schema_heavy_speedup_sampled']:.2f}x")
    if data["constrained_vs_unconstrained_decode"] is not None:
        print(f"schema-heavy workloads, constrained plain's decode speed vs unconstrained plain's: "
              f"{data['constrained_vs_unconstrained_decode']:.3f}x (mean)")
    data["table_markdown"] = report.markdown_table(HEADERS, rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write_json(out_dir / "structured.json", data)
    bars = {f"{w.name}: {row.split(' (')[0]}": data["workloads"][w.name]["rows"][row]["tokens_per_s"]
            for w in workloads for row in ("constrained plain", "+ grammar-aware draft (ours)")}
    report.plot_bars(out_dir / "structured.png", f"structured outputs, {models.label} ({data['cpu']})",
                     "tokens/s", bars)
    return data
