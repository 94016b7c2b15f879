"""`specstream bench latency`: batch-1 greedy latency over the real three-process stack.

For each γ in the sweep it generates the same prompts through gateway → target → draft and
reports tokens/s, α (accepted / (accepted + rejections)), mean accepted length, the measured cost
ratio c, the theoretical speedup (1 − α^(γ+1)) / ((1 − α)(γc + 1)) for that α and c, and the
measured speedup over γ = 0. Then, on the same checkpoints and prompts, Hugging Face `generate()`
plain and with `assistant_model=`. Every γ's token ids must equal γ = 0's: the run fails loudly
otherwise (BenchmarkError, specstream.tools.bench.checks). Whether each peer's tokens equal ours is
recorded per peer (``same_tokens_as_ours``): in bfloat16 another implementation's arithmetic may
legitimately differ.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from specstream.tools.bench import report
from specstream.tools.bench.checks import check_runs_match
from specstream.tools.bench.costs import measure_costs
from specstream.tools.bench.models import BenchModels
from specstream.tools.bench.theory import expected_speedup, expected_tokens_per_pass
from specstream.tools.launcher import Stack, StackSpec

DEFAULT_GAMMAS = [0, 1, 2, 3, 4, 6, 8]


def sweep(address: str, prompts: list[list[int]], gammas: list[int | str], max_new_tokens: int,
          temperature: float = 0.0) -> dict[int | str, dict]:
    """Generates every prompt at every γ (or "auto": the γ controller), one request at a time
    (batch 1). Greedy by default; at
    temperature > 0 it samples from the full distribution (no top-k/top-p) with seed = the
    prompt's index, so every γ sees the same seeds."""
    from specstream_client import Client

    def seed(i: int) -> int | None:
        return i if temperature > 0 else None

    results: dict[int, dict] = {}
    with Client(address, timeout=600) as client:
        # warm-up
        client.generate(prompts[0], max_new_tokens=16, ignore_eos=True, temperature=temperature, seed=seed(0))
        for gamma in gammas:
            runs = [client.generate(p, max_new_tokens=max_new_tokens, speculation=gamma or "off", ignore_eos=True,
                                    temperature=temperature, seed=seed(i))
                    for i, p in enumerate(prompts)]
            tokens = sum(r.usage.completion_tokens for r in runs)
            seconds = sum(r.timings.total_seconds for r in runs)
            proposed = sum(r.stats.draft_tokens for r in runs)
            accepted = sum(r.stats.accepted_tokens for r in runs)
            rejections = sum(r.stats.rejections for r in runs)
            decode_passes = sum(r.stats.target_passes - 1 for r in runs)
            results[gamma] = {
                "tokens_per_s": tokens / seconds,
                # Leviathan's per-token alpha (i.i.d. estimate), and the plain fraction accepted.
                "alpha": accepted / (accepted + rejections) if proposed else None,
                "accepted_fraction": accepted / proposed if proposed else None,
                "mean_accepted_length": (tokens - len(runs)) / decode_passes if decode_passes else None,
                "ttft_ms": 1000 * sum(r.timings.time_to_first_token_seconds for r in runs) / len(runs),
                "tokens": tokens, "seconds": seconds, "proposed": proposed, "accepted": accepted,
                "rejections": rejections, "passes": decode_passes + len(runs),
                "token_ids": [r.token_ids for r in runs],
            }
    return results


def run(models: BenchModels, out_dir: Path, n_prompts: int = 8, max_new_tokens: int = 128,
        gammas: list[int] | None = None, with_hf: bool = True) -> dict:
    gammas = gammas or DEFAULT_GAMMAS
    draft = models.require_draft()
    prompts = models.prompts(n_prompts)
    context = sum(len(p) for p in prompts) // len(prompts) + max_new_tokens // 2
    print(f"{models.label} ({models.dtype}): measuring the cost ratio c at context {context} ...", flush=True)
    costs = measure_costs(models, context, [g for g in gammas if g])
    with tempfile.TemporaryDirectory() as logs, Stack(StackSpec(str(models.target), str(draft), max_gamma=16,
                                                                 weights=models.weights, **models.proposing,
                                                                 dtype=models.dtype, log_dir=logs)) as stack:
        print(f"stack up at {stack.gateway_address}; proposing with {models.proposer_label}; sweeping gamma "
              f"{gammas} and auto over {len(prompts)} prompts x {max_new_tokens} tokens ...", flush=True)
        ours = sweep(stack.gateway_address, prompts, gammas, max_new_tokens)
        auto = sweep(stack.gateway_address, prompts, ["auto"], max_new_tokens)["auto"]
    with tempfile.TemporaryDirectory() as logs, Stack(StackSpec(str(models.target), str(draft), max_gamma=16,
                                                                 weights=models.weights, colocate_draft=True,
                                                                 **models.proposing,
                                                                 dtype=models.dtype, log_dir=logs)) as stack:
        print(f"the same with the draft colocated in the target process (no draft service) ...", flush=True)
        colocated = sweep(stack.gateway_address, prompts, gammas, max_new_tokens)
    check_runs_match("speculative output", "plain decoding (gamma 0)", ours[0]["token_ids"],
                     {**{f"gamma {g}": ours[g]["token_ids"] for g in gammas if g}, "auto": auto["token_ids"],
                      **{f"gamma {g}, draft colocated": colocated[g]["token_ids"] for g in gammas}})
    rows = []
    for gamma in gammas:
        r = score(ours, gamma, costs)
        # Where a target pass's time goes: the models' own compute vs everything else (the gRPC
        # hops, the engine's and the gateway's Python, processes sharing the cores).
        r["ms_per_pass"] = 1000 * r["seconds"] / r["passes"]
        r["compute_ms_per_pass"] = (gamma * costs["draft_step_ms"] + costs["target_verify_ms"][gamma] if gamma
                                    else costs["target_step_ms"])
        r["overhead_ms_per_pass"] = r["ms_per_pass"] - r["compute_ms_per_pass"]
        rows.append([gamma, r["tokens_per_s"], r["alpha"] if gamma else "-", r["mean_accepted_length"] or 1.0,
                     costs["c"] if gamma else "-", r["theory"], r["theory_with_verify_cost"], r["speedup"],
                     r["of_theory"], r["ms_per_pass"], r["overhead_ms_per_pass"]])
    headers = ["gamma", "tok/s", "alpha", "mean acc len", "c", "theory x", "theory x (verify cost)", "measured x",
               "of theory", "ms/pass", "overhead ms/pass"]
    result = {"models": models.label, "target": display(models.target), "draft": display(models.draft),
              "dtype": models.dtype, "chat_prompts": models.chat, "prompts": len(prompts),
              "max_new_tokens": max_new_tokens, "costs": costs, "gammas": {g: public(ours[g]) for g in gammas}}
    auto["speedup"] = auto["tokens_per_s"] / ours[0]["tokens_per_s"]
    result["auto"] = public(auto)
    print("\n" + report.table(headers, rows), flush=True)
    print(f"speculation=auto (the default, γ chosen per step): {auto['tokens_per_s']:.1f} tok/s, "
          f"{auto['speedup']:.2f}x gamma 0, alpha {auto['alpha'] or 0.0:.3f}, mean accepted length "
          f"{auto['mean_accepted_length']:.2f}", flush=True)
    colocated_rows = []
    for gamma in gammas:
        r = colocated[gamma]
        r["speedup"] = r["tokens_per_s"] / colocated[0]["tokens_per_s"]
        r["ms_per_pass"] = 1000 * r["seconds"] / r["passes"]
        colocated_rows.append([gamma, r["tokens_per_s"], r["alpha"] if gamma else "-",
                               r["mean_accepted_length"] or 1.0, r["speedup"], r["ms_per_pass"]])
    colocated_headers = ["gamma", "tok/s", "alpha", "mean acc len", "measured x", "ms/pass"]
    print("\ndraft colocated in the target process:\n" + report.table(colocated_headers, colocated_rows), flush=True)
    result["colocated"] = {g: public(colocated[g]) for g in gammas}
    result["colocated_table_markdown"] = report.markdown_table(colocated_headers, colocated_rows)
    best_colocated = max((g for g in gammas if g), key=lambda g: colocated[g]["tokens_per_s"])
    result["best_colocated_gamma"] = best_colocated
    best = max((g for g in gammas if g), key=lambda g: ours[g]["tokens_per_s"])
    result["best_gamma"] = best
    result["proposer"] = models.proposing
    if models.proposer == "ngram+model":
        # What the prompt lookup adds: the draft model alone at the same γ, same layout.
        with tempfile.TemporaryDirectory() as logs, Stack(StackSpec(
                str(models.target), str(draft), max_gamma=16, weights=models.weights, dtype=models.dtype,
                log_dir=logs)) as stack:
            print(f"\nthe same with the draft model alone (no prompt lookup): gamma {best} ...", flush=True)
            alone = sweep(stack.gateway_address, prompts, [best], max_new_tokens)[best]
        check_runs_match("speculative output (draft model alone)", "plain decoding (gamma 0)", ours[0]["token_ids"],
                         {f"gamma {best}": alone["token_ids"]})
        result["model_alone"] = {"gamma": best, **public(alone)}
        print(f"gamma {best}: {alone['tokens_per_s']:.1f} tok/s, alpha {alone['alpha']:.3f}, mean accepted length "
              f"{alone['mean_accepted_length']:.2f} with the model alone; {ours[best]['tokens_per_s']:.1f} tok/s, "
              f"alpha {ours[best]['alpha']:.3f}, {ours[best]['mean_accepted_length']:.2f} with "
              f"{models.proposer_label}", flush=True)
    if with_hf:
        if costs["weights"] != "dense":
            # Our 4-bit serving beside our dense serving: the peers below dequantize, as dense does.
            with tempfile.TemporaryDirectory() as logs, Stack(StackSpec(
                    str(models.target), str(draft), max_gamma=16, weights="dense", dtype=models.dtype,
                    **models.proposing, log_dir=logs)) as stack:
                print(f"\nthe same with dense weights: gamma 0 and {best} ...", flush=True)
                dense = sweep(stack.gateway_address, prompts, [0, best], max_new_tokens)
            check_runs_match("speculative output (dense weights)", "plain decoding (dense weights)",
                             dense[0]["token_ids"], {f"gamma {best}": dense[best]["token_ids"]})
            result["dense"] = {g: public(r) for g, r in dense.items()}
        _compare_with_peers(result, ours, best, colocated, best_colocated, models, prompts, max_new_tokens, out_dir)
    result["table_markdown"] = report.markdown_table(headers, rows)
    report.plot_lines(out_dir / "latency_speedup.png", "Speedup over γ=0: measured vs theory", "γ",
                      "speedup (x)", {"measured": (gammas, [ours[g]["speedup"] for g in gammas]),
                                      "theory (measured α, c)": (gammas, [ours[g]["theory"] for g in gammas])},
                      hline=1.0)
    report.write_json(out_dir / "latency.json", result)
    print(f"\nwrote {out_dir / 'latency.json'}, {out_dir / 'latency_speedup.png'}"
          + (f", {out_dir / 'latency_vs_hf.png'}" if with_hf else ""), flush=True)
    return result


def _compare_with_peers(result: dict, ours: dict[int, dict], best: int, colocated: dict[int, dict],
                        best_colocated: int, models: BenchModels, prompts: list[list[int]], max_new_tokens: int,
                        out_dir: Path) -> None:
    """transformers (plain in the serving dtype and in float32, assisted with our draft's layers,
    prompt lookup) and, when installed, llama.cpp on the same GGUF file; the stack is down by now."""
    from specstream.tools.bench.hf import hf_generate

    print("\nHugging Face transformers on the same checkpoints and prompts ...", flush=True)
    baseline = ours[0]["token_ids"]
    hf = hf_generate(models, prompts, max_new_tokens)
    if models.dtype != "float32":
        hf["plain_float32"] = hf_generate(models, prompts, max_new_tokens, dtype="float32", modes=("plain",))["plain"]
    peers = {f"HF {mode}": hf[mode] for mode in hf}
    llama = llama_cpp_generate(models, prompts, max_new_tokens)
    if llama is not None:
        peers.update({f"llama.cpp {mode}": r for mode, r in llama.items()})
    result["peers"] = {name: {k: v for k, v in r.items() if k != "token_ids"}
                       | {"same_tokens_as_ours": r["token_ids"] == baseline} for name, r in peers.items()}
    plain = ours[0]["tokens_per_s"]
    served = models.dtype + ("" if result["costs"]["weights"] == "dense" else ", int4 weights")
    label = models.proposer_label
    rows = [["specstream gamma=0", served, plain, 1.0, "-"],
            [f"specstream gamma={best}", served, ours[best]["tokens_per_s"], ours[best]["tokens_per_s"] / plain,
             f"{label}, draft service"],
            [f"specstream gamma={best_colocated}", served, colocated[best_colocated]["tokens_per_s"],
             colocated[best_colocated]["tokens_per_s"] / plain, f"{label}, colocated in the target"]]
    rows.append(["specstream speculation=auto", served, result["auto"]["tokens_per_s"],
                 result["auto"]["tokens_per_s"] / plain, f"{label}, draft service (the default)"])
    if "model_alone" in result:
        alone = result["model_alone"]
        rows.append([f"specstream gamma={alone['gamma']}", served, alone["tokens_per_s"],
                     alone["tokens_per_s"] / plain, "our draft alone, draft service"])
    dense = result.get("dense", {})
    rows += [[f"specstream gamma={g}", f"{models.dtype}, dense weights", r["tokens_per_s"],
              r["tokens_per_s"] / plain, label if g else "-"] for g, r in dense.items()]
    rows += [[name, r.get("dtype", "-"), r["tokens_per_s"], r["tokens_per_s"] / plain, r.get("assistant") or "-"]
             for name, r in peers.items()]
    print(report.table(["system", "dtype", "tok/s", "x specstream gamma=0", "draft"], rows))
    assisted = {n: r["tokens_per_s"] for n, r in peers.items() if n.startswith("HF ") and r.get("assistant")}
    best_hf = max(assisted, key=assisted.get) if assisted else None
    ours_best = max(ours[best]["tokens_per_s"], colocated[best_colocated]["tokens_per_s"],
                    result["auto"]["tokens_per_s"])
    result["ours_best_speculative_over_plain"] = ours_best / plain
    if best_hf is not None:
        result["best_hf_assisted"] = best_hf
        result["ours_over_best_hf_assisted"] = ours_best / assisted[best_hf]
    result["ours_plain_over_hf_plain"] = plain / hf["plain"]["tokens_per_s"]
    if dense:
        result["ours_dense_plain_over_hf_plain"] = dense[0]["tokens_per_s"] / hf["plain"]["tokens_per_s"]
    print(f"ours plain / HF plain ({models.dtype}): {result['ours_plain_over_hf_plain']:.2f}x; ours best speculative / "
          f"best HF assisted ({best_hf}): {result.get('ours_over_best_hf_assisted', float('nan')):.2f}x; "
          f"identical outputs: { {n: v['same_tokens_as_ours'] for n, v in result['peers'].items()} }", flush=True)
    result["peers_table_markdown"] = report.markdown_table(["system", "dtype", "tok/s", "x specstream gamma=0", "draft"],
                                                           rows)
    report.plot_bars(out_dir / "latency_vs_hf.png", f"Batch-1 greedy tokens/s, {models.label}, same prompts",
                     "tokens/s", {"specstream γ=0": plain, f"specstream γ={best}": ours[best]["tokens_per_s"],
                                  f"specstream γ={best_colocated}, colocated": colocated[best_colocated]["tokens_per_s"],
                                  **({f"specstream γ={result['model_alone']['gamma']}, draft alone":
                                      result["model_alone"]["tokens_per_s"]} if "model_alone" in result else {}),
                                  **{f"specstream γ={g}, dense": r["tokens_per_s"] for g, r in dense.items()},
                                  **{name: r["tokens_per_s"] for name, r in peers.items()}})


def llama_cpp_generate(models: BenchModels, prompts: list[list[int]], max_new_tokens: int) -> dict | None:
    """llama.cpp (llama-cpp-python) greedy on the target's original GGUF file, plain and with its
    prompt-lookup draft; None (and a note) when the package or the file is not there."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        print("llama.cpp: not installed (pip install llama-cpp-python to include it)", flush=True)
        return None
    gguf = models.gguf
    if gguf is None:
        print("llama.cpp: the target has no GGUF file to run", flush=True)
        return None
    import os
    import time

    results = {}
    for mode, draft in (("plain", None), ("prompt_lookup", LlamaPromptLookupDecoding(num_pred_tokens=10))):
        llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=os.cpu_count(), draft_model=draft, verbose=False)
        tokens, seconds, outputs = 0, 0.0, []
        for prompt in prompts:
            llm.reset()
            start = time.perf_counter()
            out = []
            for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                out.append(int(token))
                if len(out) == max_new_tokens:
                    break
            seconds += time.perf_counter() - start
            tokens += len(out)
            outputs.append(out)
        results[mode] = {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds, "token_ids": outputs,
                         "dtype": "GGUF as stored", "assistant": "prompt lookup, 10 tokens" if draft else None}
    return results


def score(by_gamma: dict[int, dict], gamma: int, costs: dict) -> dict:
    """Adds to a sweep entry its speedup over γ = 0 and Leviathan's theory for its α and the
    measured c, with and without the verify forward's real cost; returns the entry."""
    r = by_gamma[gamma]
    r["speedup"] = r["tokens_per_s"] / by_gamma[0]["tokens_per_s"]
    r["theory"] = expected_speedup(r["alpha"], gamma, costs["c"]) if gamma else 1.0
    # The theory prices a (γ+1)-token verify like a 1-token step; on a CPU it is not free.
    verify = costs["target_verify_ms"][gamma] / costs["target_step_ms"] if gamma else 1.0
    r["theory_with_verify_cost"] = (expected_tokens_per_pass(r["alpha"], gamma) / (gamma * costs["c"] + verify)
                                    if gamma else 1.0)
    r["of_theory"] = r["speedup"] / r["theory"]
    return r


def display(path: Path | None) -> str:
    """The path relative to the working directory when under it (results get committed)."""
    if path is None:
        return "-"
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return Path(path).name


def public(r: dict) -> dict:
    """A sweep result without its token ids (for JSON)."""
    return {k: v for k, v in r.items() if k != "token_ids"}
