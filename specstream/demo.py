"""`make demo`: start the three services on the default models, generate for a few prompts with
and without speculation, greedy and then sampled (seeded), and print the text, the speculation
stats and the measured speedup."""

from __future__ import annotations

import tempfile

from specstream.default_models import RANDOM_INIT_NOTICE, default_model_dirs
from specstream.launcher import Stack, StackSpec

SAMPLING = dict(temperature=0.8, top_p=0.95)  # the sampled half of the demo; seed = the prompt's index
SAMPLING_GAMMA = 3  # sampled acceptance is lower than greedy; `bench sampling` finds 2-4 best on this pair

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    "    for i, line in enumerate(lines):\n",
]


def run_demo(max_new_tokens: int = 96, gamma: int = 6, repeats: int = 3) -> int:
    """Each prompt runs `repeats` times per setting; tokens/s is taken from the median run."""
    from specstream.tokenizer import TextTokenizer
    from specstream_client import Client

    target, draft, random_init = default_model_dirs()
    if random_init:
        print(RANDOM_INIT_NOTICE)
        prompts: list = PROMPTS
    else:
        # The openings of standard-library files the pair never saw in training.
        from specstream.bench.prompts import held_out_prompts

        tok = TextTokenizer.from_dir(target)
        prompts = [tok.decode(ids) for ids in held_out_prompts(tok, 4, length=40)]
    with tempfile.TemporaryDirectory() as logs:
        with Stack(StackSpec(str(target), str(draft), gamma=gamma, log_dir=logs)) as stack:
            print(f"stack up: gateway {stack.gateway_address}, target {stack.addresses['target']}, "
                  f"draft {stack.addresses['draft']}\n")
            with Client(stack.gateway_address, timeout=120) as client:
                client.generate(prompts[0], max_new_tokens=8)  # warm-up
                rows = []
                for prompt in prompts:
                    plain = _median_run(client, prompt, max_new_tokens, "off", repeats)
                    spec = _median_run(client, prompt, max_new_tokens, gamma, repeats)
                    same = "identical" if spec.token_ids == plain.token_ids else "DIFFERENT (bug!)"
                    plain_tps = _tps(plain)
                    spec_tps = _tps(spec)
                    print("prompt:\n  " + "\n  ".join(prompt.splitlines()[-4:]))
                    print("completion:\n  " + "\n  ".join(spec.text[:400].splitlines()[:8]))
                    print(f"  gamma={gamma}: {spec_tps:7.1f} tok/s, accepted {spec.stats.accepted_tokens}/"
                          f"{spec.stats.draft_tokens} (alpha {spec.stats.alpha:.2f}), mean accepted "
                          f"length {spec.stats.mean_accepted_length:.2f}; off: {plain_tps:7.1f} tok/s; "
                          f"speedup {spec_tps / plain_tps:.2f}x; tokens {same}\n")
                    rows.append((spec_tps / plain_tps, spec.token_ids == plain.token_ids))
                sampled = _sampling_demo(client, prompts, max_new_tokens, SAMPLING_GAMMA, repeats)
    mean = sum(r[0] for r in rows) / len(rows)
    print(f"greedy: mean speedup over speculation=off: {mean:.2f}x; all outputs identical: {all(r[1] for r in rows)}")
    print(f"sampled ({_settings()}): mean speedup over speculation=off: {sum(sampled) / len(sampled):.2f}x; "
          f"every seed gave the same text in each of its {repeats} runs")
    return 0 if all(r[1] for r in rows) else 1


def _sampling_demo(client, prompts: list, max_new_tokens: int, gamma: int, repeats: int) -> list[float]:
    """Seeded sampling: speculative output has the target's distribution (not plain's exact
    tokens), and one seed always reproduces the same text."""
    print(f"--- sampling: {_settings()}, seed = prompt number ---\n")
    speedups = []
    for i, prompt in enumerate(prompts):
        plain = _median_run(client, prompt, max_new_tokens, "off", repeats, seed=i, **SAMPLING)
        spec = _median_run(client, prompt, max_new_tokens, gamma, repeats, seed=i, **SAMPLING)
        speedups.append(_tps(spec) / _tps(plain))
        if i == 0:
            print("completion (sampled):\n  " + "\n  ".join(spec.text[:400].splitlines()[:8]))
        print(f"  prompt {i}: gamma={gamma}: {_tps(spec):7.1f} tok/s, alpha {spec.stats.alpha:.2f}, mean accepted "
              f"length {spec.stats.mean_accepted_length:.2f}; off: {_tps(plain):7.1f} tok/s; "
              f"speedup {speedups[-1]:.2f}x")
    print()
    return speedups


def _settings() -> str:
    return ", ".join(f"{k}={v}" for k, v in SAMPLING.items())


def _median_run(client, prompt: str, max_new_tokens: int, speculation, repeats: int, **sampling):
    runs = [client.generate(prompt, max_new_tokens=max_new_tokens, speculation=speculation, ignore_eos=True,
                            **sampling) for _ in range(repeats)]
    assert all(r.token_ids == runs[0].token_ids for r in runs), "a seeded or greedy output must not vary between runs"
    return sorted(runs, key=_tps)[len(runs) // 2]


def _tps(result) -> float:
    return result.usage.completion_tokens / max(result.timings.total_seconds, 1e-9)
