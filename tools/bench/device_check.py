"""The whole stack on one device at small scale: exactness, a γ sweep and batching, with no checkpoint.

`make gpu-check` runs this on CUDA (tools/gpu_check.py); on a CPU it runs the same code on a tiny
model (the rehearsal its test makes). The target is a random-init Llama built where it runs (on a GPU
~1B parameters in bfloat16: `GPU_SHAPE`), sharing the demo pair's tokenizer; the draft is the
synthetic proposer (draft_service/synthetic.py), which replays the target's own greedy continuation
with each token corrupted with probability 1 − α, so any acceptance rate can be had without a trained
draft. In order:

1. plain decoding (no draft) of `n_prompts` random prompts: the reference and the baseline;
2. the same prompts through gateway → target → synthetic draft at each fixed γ and at
   `speculation=auto`: how many prompts' tokens equal plain decoding's in each run (recorded, not
   raised: the check goes on measuring, and its summary says so first), and tokens/s, α and the
   speedup over plain beside Leviathan's c = 0 theory;
3. closed-loop throughput at `batch` slots, static against top-up batching (γ = 4), on requests that
   reuse those prompts (the oracle knows only their continuations) with lognormal budgets.

Writes ``device_check.json`` and ``device_check.png`` into the output directory.
What it does not know: the kernels (`bench kernels`) and how the check is packed (tools/gpu_check.py).
"""

from __future__ import annotations

import json
import math
import random
import tempfile
import time
from pathlib import Path

from tools.bench import report
from tools.bench.checks import token_difference
from tools.bench.latency import sweep
from tools.bench.models import BenchModels
from tools.bench.synthetic import build_target
from tools.bench.theory import expected_speedup
from tools.bench.throughput import Setting, measure
from tools.launcher import Stack, StackSpec

# ~1B parameters (TinyLlama's layers): 22 x (4.2M q + 1M k, v + 4.2M o + 34.6M MLP) = 0.97B + embeddings.
GPU_SHAPE = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "max_position_embeddings": 2048, "tie_word_embeddings": False}
# The rehearsal on a CPU: the same code path in seconds.
TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 1024, "tie_word_embeddings": False}
PROMPT_TOKENS = 32


def parameters(shape: dict, vocab: int) -> int:
    """Parameters of a Llama of `shape` (no biases) with a `vocab`-token embedding and head."""
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head_dim = hidden // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden
    heads = 1 if shape.get("tie_word_embeddings") else 2
    return layers * per_layer + heads * vocab * hidden + hidden


def requests_for(prompts: list[list[int]], count: int, cap: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """`count` (prompt, budget) pairs cycling through `prompts`, budgets lognormal (median cap/4) up to `cap`."""
    rng = random.Random(seed)
    return [(prompts[i % len(prompts)], int(min(cap, max(1, round(math.exp(rng.gauss(math.log(cap / 4), 0.8)))))))
            for i in range(count)]


def run(out_dir: Path, device: str = "cuda", shape: dict | None = None, n_prompts: int = 8, max_new_tokens: int = 64,
        gammas: tuple[int, ...] = (1, 2, 4), alpha: float = 0.8, batch: int = 32, requests: int = 96,
        tokenizer_dir: Path | None = None) -> dict:
    from specstream.models.registry import pair_refs

    shape = shape or (GPU_SHAPE if device.startswith("cuda") else TINY_SHAPE)
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = tokenizer_dir or Path(pair_refs("demo-small")[0])
    result: dict = {"device": device_name(device), "dtype": dtype, "shape": shape, "alpha_set": alpha,
                    "prompts": n_prompts, "max_new_tokens": max_new_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        target = build_target(Path(tmp) / "target", tokenizer_dir, shape=shape, dtype=dtype)
        vocab = json.loads((target / "config.json").read_text())["vocab_size"]
        result |= {"parameters": parameters(shape, vocab), "vocab": vocab,
                   "build_seconds": time.monotonic() - started}
        print(f"random Llama target: {result['parameters'] / 1e9:.2f}B parameters, {dtype}, on {result['device']} "
              f"(built in {result['build_seconds']:.0f} s)", flush=True)
        rng = random.Random(0)
        prompts = [[0] + [rng.randrange(2, vocab) for _ in range(PROMPT_TOKENS - 1)] for _ in range(n_prompts)]
        models = BenchModels("random-llama", target, None, dtype, device=device)
        plain = plain_runs(models, prompts, max_new_tokens, out_dir)
        oracle = Path(tmp) / "oracle.json"
        oracle.write_text(json.dumps({"vocab_size": vocab,
                                      "sequences": [p + t for p, t in zip(prompts, plain["token_ids"])]}))
        models.synthetic = (str(oracle), alpha)
        result["latency"] = speculative_runs(models, prompts, max_new_tokens, gammas, plain, out_dir)
        result["exact"], result["exactness"] = all_exact(result["latency"]), exactness_line(result["latency"])
        report.write_json(out_dir / "device_check.json", result)  # what is known, should batching not finish
        work = requests_for(prompts, requests, max_new_tokens)
        result["throughput"] = {}
        for setting in (Setting(batch, "static", 1.0, "all", 4), Setting(batch, "topup", 1.0, "all", 4)):
            print(f"throughput: {setting.name}, {len(work)} requests ...", flush=True)
            summary = measure(models, setting, work)["grpc"]
            result["throughput"][setting.name] = {k: summary[k] for k in (
                "tokens_per_s", "p50_s", "p99_s", "mean_occupancy", "steps", "expansions_per_step")}
    _report(result, out_dir)
    return result


def plain_runs(models: BenchModels, prompts: list[list[int]], max_new_tokens: int, logs: Path) -> dict:
    """Plain greedy decoding of every prompt through the stack: the reference and the baseline.
    The services log into logs/logs-plain/."""
    with Stack(StackSpec(**models.stack_fields(speculative=False), log_dir=f"{logs}/logs-plain")) as stack:
        return sweep(stack.gateway_address, prompts, [0], max_new_tokens)[0]


def speculative_runs(models: BenchModels, prompts: list[list[int]], max_new_tokens: int, gammas: tuple[int, ...],
                     plain: dict, logs: Path) -> dict:
    """Every fixed γ and `auto` through gateway → target → draft. Returns the latency figures
    (`_latency`), each run's with its exactness against plain decoding (`exactness`): a check on a
    device's ten minutes records a difference and goes on measuring, where a benchmark would stop."""
    with Stack(StackSpec(**models.stack_fields(), max_gamma=16, log_dir=f"{logs}/logs-spec")) as stack:
        runs = sweep(stack.gateway_address, prompts, [*gammas, "auto"], max_new_tokens)
    latency = _latency(plain, runs)
    for gamma, r in runs.items():
        latency[str(gamma)]["exactness"] = exactness(plain["token_ids"], r["token_ids"])
    return latency


def exactness(expected: list[list[int]], actual: list[list[int]]) -> dict:
    """How many prompts' outputs (one list per prompt) equal plain decoding's, and the first
    difference in words (None when all do)."""
    identical = sum(list(want) == list(got) for want, got in zip(expected, actual))
    return {"identical": identical, "prompts": len(expected), "first_difference": token_difference(expected, actual)}


def all_exact(latency: dict) -> bool:
    """Every speculative run's output equalled plain decoding's on every prompt."""
    return all(r["exactness"]["first_difference"] is None for g, r in latency.items() if g != "plain")


def exactness_line(latency: dict) -> str:
    """One line for a summary: exact everywhere, or which runs differed and where first."""
    runs = {g: r["exactness"] for g, r in latency.items() if g != "plain"}
    if all_exact(latency):
        return (f"speculative greedy = plain greedy: identical on every prompt ({next(iter(runs.values()))['prompts']}) "
                f"in every run ({', '.join(runs)})")
    return "speculative greedy = plain greedy: NOT identical: " + "; ".join(
        f"{g}: {e['identical']}/{e['prompts']} identical, {e['first_difference']}" for g, e in runs.items()
        if e["first_difference"] is not None)


def real_pair(out_dir: Path, models: BenchModels, n_prompts: int = 4, max_new_tokens: int = 64,
              gammas: tuple[int, ...] = (2, 4)) -> dict:
    """The same exactness check and γ sweep on a real pair (its own draft and prompts)."""
    prompts = models.prompts(n_prompts)
    plain = plain_runs(models, prompts, max_new_tokens, out_dir)
    latency = speculative_runs(models, prompts, max_new_tokens, gammas, plain, out_dir)
    headers, rows = _latency_table(latency)
    result = {"device": device_name(models.device), "models": models.label, "dtype": models.dtype,
              "prompts": n_prompts, "max_new_tokens": max_new_tokens, "latency": latency,
              "title": f"{models.label}, {models.dtype}, {device_name(models.device)}, {n_prompts} prompts",
              "exact": all_exact(latency), "exactness": exactness_line(latency),
              "latency_table_markdown": report.markdown_table(headers, rows)}
    print(f"\n{result['title']}\n{result['exactness']}\n" + report.table(headers, rows), flush=True)
    report.write_json(out_dir / "real_pair.json", result)
    return result


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"CPU ({platform.processor() or platform.machine()})"


def _latency(plain: dict, runs: dict) -> dict:
    out = {"plain": {"tokens_per_s": plain["tokens_per_s"], "ttft_ms": plain["ttft_ms"]}}
    for gamma, r in runs.items():
        theory = expected_speedup(r["alpha"], gamma, 0.0) if gamma != "auto" and r["alpha"] is not None else None
        out[str(gamma)] = {"tokens_per_s": r["tokens_per_s"], "speedup": r["tokens_per_s"] / plain["tokens_per_s"],
                           "alpha": r["alpha"], "mean_accepted_length": r["mean_accepted_length"],
                           "theory_c0": theory, "ms_per_pass": 1000 * r["seconds"] / r["passes"]}
    return out


def _latency_table(latency: dict) -> tuple[list[str], list[list]]:
    rows = [["plain", latency["plain"]["tokens_per_s"], 1.0, "-", "-", "-"]]
    for gamma, r in latency.items():
        if gamma != "plain":
            rows.append([f"γ={gamma}" if gamma != "auto" else "auto", r["tokens_per_s"], r["speedup"],
                         r["alpha"] if r["alpha"] is not None else "-", r["mean_accepted_length"] or "-",
                         r["theory_c0"] if r["theory_c0"] is not None else "-"])
    return ["speculation", "tok/s", "x plain", "alpha", "mean acc len", "theory x (c=0)"], rows


def _report(result: dict, out_dir: Path) -> None:
    latency_headers, rows = _latency_table(result["latency"])
    static, topup = (result["throughput"][name]["tokens_per_s"] for name in result["throughput"])
    through_rows = [[name, r["tokens_per_s"], r["tokens_per_s"] / static, r["p50_s"], r["p99_s"], r["mean_occupancy"]]
                    for name, r in result["throughput"].items()]
    through_headers = ["setting", "tok/s", "x static", "p50 s", "p99 s", "occupancy"]
    title = (f"{result['parameters'] / 1e9:.2f}B random Llama, {result['dtype']}, {result['device']}, synthetic draft "
             f"α={result['alpha_set']}, {result['prompts']} prompts")
    print(f"\n{title}\n{result['exactness']}\n" + report.table(latency_headers, rows) + "\n\n" + report.table(through_headers, through_rows),
          flush=True)
    result["title"] = title
    result["latency_table_markdown"] = report.markdown_table(latency_headers, rows)
    result["throughput_table_markdown"] = report.markdown_table(through_headers, through_rows)
    result["topup_over_static"] = topup / static
    gammas = [g for g in result["latency"] if g not in ("plain", "auto")]
    report.plot_lines(out_dir / "device_check.png", f"Speedup over plain ({result['device']})", "γ", "speedup (x)",
                      {"measured": ([int(g) for g in gammas], [result["latency"][g]["speedup"] for g in gammas]),
                       "theory (c = 0)": ([int(g) for g in gammas], [result["latency"][g]["theory_c0"] for g in gammas])},
                      hline=1.0)
    report.write_json(out_dir / "device_check.json", result)
