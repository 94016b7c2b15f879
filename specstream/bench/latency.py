"""`specstream bench latency`: batch-1 greedy latency over the real three-process stack.

For each γ in the sweep it generates the same prompts through gateway → target → draft and
reports tokens/s, α (accepted / proposed), mean accepted length, the measured cost ratio c, the
theoretical speedup (1 − α^(γ+1)) / ((1 − α)(γc + 1)) for that α and c, and the measured speedup
over γ = 0. Then, on the same checkpoints and prompts, Hugging Face `generate()` plain and with
`assistant_model=`. Every γ's token ids must equal γ = 0's (and Hugging Face's): the run fails
loudly otherwise.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from specstream.bench import report
from specstream.bench.costs import measure_costs
from specstream.bench.theory import expected_speedup, expected_tokens_per_pass
from specstream.launcher import Stack, StackSpec
from specstream.tokenizer import TextTokenizer

DEFAULT_GAMMAS = [0, 1, 2, 3, 4, 6, 8]


def sweep(address: str, prompts: list[list[int]], gammas: list[int], max_new_tokens: int,
          temperature: float = 0.0) -> dict[int, dict]:
    """Generates every prompt at every γ, one request at a time (batch 1). Greedy by default; at
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


def run(target_dir: Path, draft_dir: Path, out_dir: Path, n_prompts: int = 8, max_new_tokens: int = 128,
        gammas: list[int] | None = None, with_hf: bool = True) -> dict:
    gammas = gammas or DEFAULT_GAMMAS
    tok = TextTokenizer.from_dir(target_dir)
    from specstream.bench.prompts import held_out_prompts

    prompts = held_out_prompts(tok, n_prompts)
    context = len(prompts[0]) + max_new_tokens // 2
    print(f"measuring the cost ratio c at context {context} ...", flush=True)
    costs = measure_costs(target_dir, draft_dir, context, [g for g in gammas if g])
    with tempfile.TemporaryDirectory() as logs, Stack(StackSpec(str(target_dir), str(draft_dir), max_gamma=16,
                                                                 log_dir=logs)) as stack:
        print(f"stack up at {stack.gateway_address}; sweeping gamma {gammas} over {len(prompts)} prompts x "
              f"{max_new_tokens} tokens ...", flush=True)
        ours = sweep(stack.gateway_address, prompts, gammas, max_new_tokens)
    baseline = ours[0]["token_ids"]
    mismatched = [g for g in gammas if ours[g]["token_ids"] != baseline]
    assert not mismatched, f"speculative output differs from plain decoding at gamma {mismatched}"
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
    result = {"target": display(target_dir), "draft": display(draft_dir), "prompts": len(prompts),
              "max_new_tokens": max_new_tokens, "costs": costs, "gammas": {g: public(ours[g]) for g in gammas}}
    print("\n" + report.table(headers, rows), flush=True)
    best = max((g for g in gammas if g), key=lambda g: ours[g]["tokens_per_s"])
    if with_hf:
        from specstream.bench.hf import hf_generate

        print("\nHugging Face transformers on the same checkpoints and prompts ...", flush=True)
        hf = hf_generate(target_dir, draft_dir, prompts, max_new_tokens)
        same = {mode: hf[mode]["token_ids"] == baseline for mode in hf}
        result["hf"] = {mode: {k: v for k, v in hf[mode].items() if k != "token_ids"} | {"same_tokens": same[mode]}
                        for mode in hf}
        hf_rows = [["specstream gamma=0", ours[0]["tokens_per_s"], 1.0],
                   [f"specstream gamma={best}", ours[best]["tokens_per_s"], ours[best]["tokens_per_s"] / ours[0]["tokens_per_s"]],
                   ["HF generate()", hf["plain"]["tokens_per_s"], hf["plain"]["tokens_per_s"] / ours[0]["tokens_per_s"]],
                   ["HF assisted (defaults)", hf["assisted"]["tokens_per_s"],
                    hf["assisted"]["tokens_per_s"] / ours[0]["tokens_per_s"]],
                   ["HF assisted (heuristic, start 5)", hf["assisted_heuristic"]["tokens_per_s"],
                    hf["assisted_heuristic"]["tokens_per_s"] / ours[0]["tokens_per_s"]]]
        best_hf = max(hf[m]["tokens_per_s"] for m in ("assisted", "assisted_heuristic"))
        print(report.table(["system", "tok/s", "x specstream gamma=0"], hf_rows))
        print(f"ours (gamma={best}) / best HF assisted: {ours[best]['tokens_per_s'] / best_hf:.2f}x; "
              f"HF outputs identical to ours: {same}", flush=True)
        result["ours_over_best_hf_assisted"] = ours[best]["tokens_per_s"] / best_hf
        report.plot_bars(out_dir / "latency_vs_hf.png", "Batch-1 greedy tokens/s, same checkpoints and prompts",
                         "tokens/s", {"specstream γ=0": ours[0]["tokens_per_s"],
                                      f"specstream γ={best}": ours[best]["tokens_per_s"],
                                      "HF generate": hf["plain"]["tokens_per_s"],
                                      "HF assisted": hf["assisted"]["tokens_per_s"],
                                      "HF assisted (heuristic)": hf["assisted_heuristic"]["tokens_per_s"]})
    result["best_gamma"] = best
    result["table_markdown"] = report.markdown_table(headers, rows)
    report.plot_lines(out_dir / "latency_speedup.png", "Speedup over γ=0: measured vs theory", "γ",
                      "speedup (x)", {"measured": (gammas, [ours[g]["speedup"] for g in gammas]),
                                      "theory (measured α, c)": (gammas, [ours[g]["theory"] for g in gammas])},
                      hline=1.0)
    report.write_json(out_dir / "latency.json", result)
    print(f"\nwrote {out_dir / 'latency.json'}, {out_dir / 'latency_speedup.png'}"
          + (f", {out_dir / 'latency_vs_hf.png'}" if with_hf else ""), flush=True)
    return result


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


def display(path: Path) -> str:
    """The path relative to the working directory when under it (results get committed)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return Path(path).name


def public(r: dict) -> dict:
    """A sweep result without its token ids (for JSON)."""
    return {k: v for k, v in r.items() if k != "token_ids"}
