"""`make demo`: start the three services on the default models and ask them real questions.

With the default pair (SmolLM2-135M-Instruct and its distilled draft) the demo chats: each
question goes through the model's chat template, once with speculation off and once with automatic
speculation (the γ controller picks γ per step; a fixed ``--gamma N`` instead if asked), greedy (the
answers must be token-identical) and then sampled with a seed; it prints the answers, the draft's
acceptance α, the γ the controller chose and the measured speedups; then one JSON-schema question and one tool call, constrained (the answer is
checked against its schema) and compared the same way. A sampled seed reproduces its
text when the γ schedule is the same (off, or a fixed γ); under ``auto`` the schedule follows the
measured costs, so only the distribution is guaranteed, and the demo reports whether repeats matched. A pair without a
chat template (``--models demo-small``) gets code-completion prompts instead. Then the greedy
questions again on a second stack whose target runs the draft in its own process
(``serve --colocate-draft``: no draft service, no gRPC hop per step), the faster layout on one
machine.
"""

from __future__ import annotations

import tempfile

from tools.launcher import Stack, StackSpec

SAMPLING = dict(temperature=0.7, top_p=0.95)  # the sampled half of the demo; seed = the question's index

QUESTIONS = [
    "Write a Python function that reverses a string.",
    "What is the capital of France, and what is it famous for?",
    "Explain what a hash table is in two sentences.",
    "What does the `grep` command do on Linux? Give one example.",
]

# Structured outputs (chat models): a JSON-schema answer and a tool call (specstream/text/tools.py's format).
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "maxLength": 40}},
          "required": ["name", "age", "city"], "additionalProperties": False}
JSON_QUESTION = "Extract the person as JSON: Marie Curie was 66 and lived in Paris."
WEATHER = {"name": "get_weather", "description": "The current weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
TOOL_QUESTION = "What's the weather like in Rome right now?"

CODE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "    for i, line in enumerate(lines):\n",
]


def run_demo(pair: str = "smollm2", max_new_tokens: int = 160, gamma: int | str = "auto", repeats: int = 3) -> int:
    """Each prompt runs `repeats` times per setting; tokens/s is taken from the median run."""
    from specstream.models.registry import PAIRS, pair_refs, resolve_model
    from specstream.text.tokenizer import TextTokenizer
    from specstream_client import Client

    target_ref, draft, dtype = pair_refs(pair)
    target = resolve_model(target_ref)  # a GGUF model is converted once, here, with a message
    chat = TextTokenizer.from_dir(target).chat_template is not None
    prompts = QUESTIONS if chat else CODE_PROMPTS
    proposing = PAIRS[pair].proposing if draft else {}
    with tempfile.TemporaryDirectory() as logs:
        with Stack(StackSpec(str(target), draft, dtype=dtype, **proposing, log_dir=logs + "/service")) as stack:
            print(f"stack up: gateway {stack.gateway_address}, target {stack.addresses['target']}, "
                  f"draft {stack.addresses['draft']}\n")
            with Client(stack.gateway_address, timeout=300) as client:
                info = client.model_info()
                print(f"model: {info.target_model}, draft: {info.draft_model}, {dtype}; "
                      f"chat template: {'yes' if info.has_chat_template else 'no'}\n")
                call = _chat(client) if chat else _complete(client)
                call(prompts[0], 8, "off", {})  # warm-up
                greedy = [_compare(call, p, max_new_tokens, gamma, repeats, {}) for p in prompts]
                print(f"--- sampling: {_settings()}, seed = question number, gamma={gamma} ---\n")
                sampled = [_compare(call, p, max_new_tokens, gamma, repeats, {**SAMPLING, "seed": i},
                                    show=i == 0) for i, p in enumerate(prompts[:2])]
                structured = _structured(client, max_new_tokens, gamma, repeats) if chat else []
        colocated = []
        if draft is not None:
            with Stack(StackSpec(str(target), draft, dtype=dtype, colocate_draft=True, **proposing,
                                 log_dir=logs + "/colocated")) as stack, \
                    Client(stack.gateway_address, timeout=300) as client:
                print(f"--- the draft inside the target process (serve --colocate-draft): gateway "
                      f"{stack.gateway_address}, target {stack.addresses['target']}, no draft service; greedy ---\n")
                call = _chat(client) if chat else _complete(client)
                call(prompts[0], 8, "off", {})  # warm-up
                colocated = [_compare(call, p, max_new_tokens, gamma, repeats, {}, show=False) for p in prompts]
    identical = all(same for _, same in greedy + colocated + structured)
    print(f"greedy, draft service: mean speedup over speculation=off {_mean(greedy):.2f}x")
    if structured:
        print(f"structured (a JSON schema, a tool call), draft service: speedups "
              f"{', '.join(f'{s:.2f}x' for s, _ in structured)}")
    if colocated:
        print(f"greedy, draft colocated in the target: mean speedup over speculation=off {_mean(colocated):.2f}x")
    print(f"all greedy answers token-identical to plain decoding: {identical}")
    print(f"sampled ({_settings()}), draft service: mean speedup {_mean(sampled):.2f}x")
    return 0 if identical else 1


def _structured(client, max_new_tokens: int, gamma, repeats: int) -> list[tuple[float, bool]]:
    """A JSON-schema question and a required tool call, off against ``gamma``, greedy; each answer
    parsed and checked against its schema (a wrong one fails the demo)."""
    import json

    import jsonschema

    print("--- structured outputs: a JSON schema and a tool call (greedy) ---\n")
    results = [_compare(_chat(client), JSON_QUESTION, max_new_tokens, gamma, repeats, {"json_schema": PERSON})]
    answer = client.chat([{"role": "user", "content": JSON_QUESTION}], max_new_tokens=max_new_tokens,
                         json_schema=PERSON)
    jsonschema.validate(json.loads(answer.text), PERSON)

    def call_tool(prompt: str, max_new: int, speculation, sampling: dict):
        return client.chat([{"role": "user", "content": prompt}], max_new_tokens=max_new, speculation=speculation,
                           tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, **sampling)

    results.append(_compare(call_tool, TOOL_QUESTION, max_new_tokens, gamma, repeats, {}))
    calls = call_tool(TOOL_QUESTION, max_new_tokens, "off", {}).tool_calls
    if not calls:
        raise SystemExit("demo: the tool call came back with no call")
    for made in calls:
        jsonschema.validate(made.parsed_arguments(), WEATHER["parameters"])
    print(f"  the call: {[(c.name, c.arguments) for c in calls]} (its arguments valid against the schema)\n")
    return results


def _mean(results: list[tuple[float, bool]]) -> float:
    return sum(speedup for speedup, _ in results) / len(results)


def _chat(client):
    def call(prompt: str, max_new_tokens: int, speculation, sampling: dict):
        return client.chat([{"role": "user", "content": prompt}], max_new_tokens=max_new_tokens,
                           speculation=speculation, **sampling)

    return call


def _complete(client):
    def call(prompt: str, max_new_tokens: int, speculation, sampling: dict):
        return client.generate(prompt, max_new_tokens=max_new_tokens, speculation=speculation, ignore_eos=True,
                               **sampling)

    return call


def _compare(call, prompt: str, max_new_tokens: int, gamma: int, repeats: int, sampling: dict,
             show: bool = True) -> tuple[float, bool]:
    """(speedup of γ over off, whether the token ids are identical), after printing the answer."""
    plain, spec = _median_runs(call, prompt, max_new_tokens, ("off", gamma), repeats, sampling)
    same = spec.token_ids == plain.token_ids
    sampled = bool(sampling.get("temperature"))  # `sampling` may also hold a constraint
    speedup = _tps(spec) / _tps(plain)
    if show:
        print("> " + "\n> ".join(prompt.splitlines()))
        print("  " + "\n  ".join(spec.text.strip()[:600].splitlines()[:12]))
        for made in spec.tool_calls:  # with tools: the calls, outside the text
            print(f"  {made.name}({made.arguments})")
    verdict = ("tokens identical" if same else "DIFFERENT (bug!)") if not sampled else (
        "same text as plain sampling" if same else "a different sample (the γ schedule differs)")
    print(f"  [gamma={gamma}{_chosen(spec)}: {_tps(spec):6.1f} tok/s, alpha {spec.stats.alpha:.2f}, mean accepted "
          f"length {spec.stats.mean_accepted_length:.2f} | off: {_tps(plain):6.1f} tok/s | speedup {speedup:.2f}x | "
          f"{len(spec.token_ids)} tokens, {verdict}]\n")
    return speedup, same or sampled


def _chosen(result) -> str:
    """The γ per decode step as the controller chose it, e.g. " (chose γ 0×3, 2×10, 3×25)"."""
    chosen = [f"{g}×{n}" for g, n in enumerate(result.stats.gamma_histogram) if n]
    return f" (chose γ {', '.join(chosen)})" if chosen else ""


def _settings() -> str:
    return ", ".join(f"{k}={v}" for k, v in SAMPLING.items())


def _median_runs(call, prompt: str, max_new_tokens: int, settings: tuple, repeats: int, sampling: dict) -> list:
    """Each setting's median run (by tokens/s) of `repeats`, the settings taking turns (off, auto,
    off, auto, ...): a shared machine's speed drifts over seconds, and runs of one setting back to
    back would each see a different part of the drift. Each run has a cache salt of its own, so
    none starts from the prefix cache an earlier one filled: they compare decoding, cold."""
    runs: list[list] = [[] for _ in settings]
    for r in range(repeats):
        for i, speculation in enumerate(settings):
            runs[i].append(call(prompt, max_new_tokens, speculation,
                                {**sampling, "cache_salt": f"demo {prompt[:32]} {speculation} {r}"}))
    for speculation, each in zip(settings, runs):
        # Greedy output never varies; a seed's text varies only with the γ schedule (auto).
        if any(r.token_ids != each[0].token_ids for r in each) and (not sampling.get("temperature")
                                                                    or speculation != "auto"):
            raise RuntimeError("a seeded or greedy output varied between runs")
    return [sorted(each, key=_tps)[len(each) // 2] for each in runs]


def _tps(result) -> float:
    return result.usage.completion_tokens / max(result.timings.total_seconds, 1e-9)
