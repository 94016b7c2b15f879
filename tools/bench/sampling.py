"""`specstream bench sampling`: batch-1 speculative sampling over the real three-process stack.

One stack, then for each temperature T a γ sweep (latency's `sweep`): the same held-out prompts,
one request at a time, seed = the prompt's index, full distribution (no top-k/top-p). Per (T, γ):
tokens/s, α, accepted fraction, mean accepted length, speedup over γ = 0 at the same T, and
Leviathan's theoretical speedup for that α and the measured cost ratio c; and the same figures
for ``speculation=auto`` (the default: the γ controller chooses per pass), its row "auto", with
no theory (its γ varies). Each entry carries the engine's own per-pass breakdown, ``pass_ms``
(tools/bench/passes.py: the target's compute, waiting for the draft, host work), and
auto's line says how long it waited for the draft against γ = 0. ``auto_stack`` "own" (the
default) sends auto's requests to a second stack of their own, as a user who never asks for a
fixed γ runs it, with that stack's plain decoding (row "auto plain") taking its turns beside them
as its baseline: in the shared stack fixed-γ traffic feeds the controller's acceptance pools and
cost model (in one mixed sweep auto drafted 327 passes where its own stack drafted ~60); "shared"
asks the sweep's own stack (one stack fewer). Both stacks take turns in one sweep. ``repeats`` > 1 runs each
temperature's sweep that many rounds, the γ order reversed every other round, and pools them
(latency's ``sweep``). Then, at each T > 0,
Hugging Face `generate(do_sample=True, top_k=0)` plain and assisted on the same checkpoints and
prompts.

Tree rows (unless ``with_trees`` is off): at each T > 0, a stack whose targets run
``--gamma-policy fixed --tree-branches B`` (every pass a tree: the chain of γ and up to B of the
draft's next draws beside it, verified by recursive rejection) sweeps γ = 0 and the tree γs;
each row is a ratio to that stack's own γ = 0 and to the chain's row at the same T and γ.

Speculative sampling preserves the target's distribution, not the token sequence a seed gives at
γ = 0, so only T = 0 checks that every γ's token ids equal γ = 0's. Nothing here checks the
distribution: the sampling tests do that.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from tools.bench import report
from tools.bench.checks import check_runs_match
from tools.bench.costs import measure_costs
from tools.bench.hf import MODES as HF_MODES
from tools.bench.hf import hf_generate, runnable_modes
from tools.bench.latency import display, public, score, sweep
from tools.bench.models import BenchModels
from tools.launcher import Stack, StackSpec
from tools.progress import Progress

DEFAULT_TEMPERATURES = [0.0, 0.7, 1.0]
DEFAULT_GAMMAS = [0, 2, 4, 6]
TREE_BRANCHES = [1, 3]
AUTO_STACKS = ("own", "shared")  # where speculation=auto's requests go (run's auto_stack)
AUTO_PLAIN = "auto plain"  # the plain decoding of auto's own stack, its baseline
TREE_HEADERS = ["T", "gamma", "branches", "tok/s", "x plain", "x chain", "mean acc len", "chain mean acc len",
                "branch tokens"]
HEADERS = ["T", "gamma", "tok/s", "alpha", "accepted frac", "mean acc len", "theory x", "theory x (verify cost)",
           "measured x", "of theory"]


def run(models: BenchModels, out_dir: Path, n_prompts: int = 8, max_new_tokens: int = 128,
        temperatures: list[float] | None = None, gammas: list[int] | None = None, with_hf: bool = True,
        quiet: bool = False, with_trees: bool = True, repeats: int = 1, auto_stack: str = "own") -> dict:
    """A γ sweep at each temperature, then the peers at each T > 0; the table on stdout,
    ``sampling.json`` and a plot in ``out_dir``. Progress on stderr (tools.progress;
    ``quiet``: plain lines, never a bar), counted in generations."""
    temperatures = DEFAULT_TEMPERATURES if temperatures is None else temperatures
    gammas = DEFAULT_GAMMAS if gammas is None else gammas
    _check(temperatures, gammas, repeats, auto_stack)
    draft = models.require_draft()
    prompts = models.prompts(n_prompts)
    context = sum(len(p) for p in prompts) // len(prompts) + max_new_tokens // 2
    print(f"{models.label} ({models.dtype}): measuring the cost ratio c at context {context} ...", flush=True)
    costs = measure_costs(models, context, [g for g in gammas if g])
    total = planned_generations(models, len(prompts), temperatures, gammas, with_hf, with_trees, repeats, auto_stack)
    with Progress(total, "generations", "sampling", quiet=quiet) as progress:
        ours = _sweeps(models, draft, prompts, temperatures, gammas, max_new_tokens, progress, repeats, auto_stack)
        if 0.0 in ours:
            check_runs_match("greedy (T=0) speculative output", "plain decoding (gamma 0)", ours[0.0][0]["token_ids"],
                             {**{f"gamma {g}": ours[0.0][g]["token_ids"] for g in gammas if g},
                              "auto": ours[0.0]["auto"]["token_ids"],
                              **({"auto's own stack's plain decoding": ours[0.0][AUTO_PLAIN]["token_ids"]}
                                 if AUTO_PLAIN in ours[0.0] else {})})
        rows = [_score(ours[t], gamma, costs, t) for t in temperatures for gamma in [*gammas, "auto"]]
        rows += [_score(ours[t], AUTO_PLAIN, costs, t) for t in temperatures if AUTO_PLAIN in ours[t]]
        result = {"models": models.label, "target": display(models.target), "draft": display(models.draft),
                  "dtype": models.dtype, "chat_prompts": models.chat, "prompts": len(prompts),
                  "proposer": models.proposing, "repeats": repeats, "auto_stack": auto_stack,
                  "prompt_set": models.prompt_set if models.chat or models.prompt_set == "nonsense" else "-",
                  "max_new_tokens": max_new_tokens, "seeds": "prompt index", "costs": costs,
                  "temperatures": {t: {"gammas": {g: public(ours[t][g]) for g in gammas},
                                       "auto": public(ours[t]["auto"]),
                                       **({"auto_plain": public(ours[t][AUTO_PLAIN])} if AUTO_PLAIN in ours[t] else {}),
                                       "best_gamma": _best(ours[t])} for t in temperatures}}
        progress.print("\n" + report.table(HEADERS, rows))
        for t in temperatures:
            auto, plain = ours[t]["auto"], ours[t].get(AUTO_PLAIN, ours[t][0])
            waits = (f"; waiting for the draft {auto['pass_ms']['draft']:.2f} ms a pass against "
                     f"{plain['pass_ms']['draft']:.2f} for plain decoding (the target's clock)"
                     if auto.get("pass_ms") and plain.get("pass_ms") else "")
            where = " in its own stack" if AUTO_PLAIN in ours[t] else ""
            progress.print(f"speculation=auto at T={t:g}{where}: {auto['speedup']:.2f}x plain decoding, drafted in "
                           f"{auto['drafting_passes']} of {auto['passes'] - len(prompts) * repeats} decode passes"
                           + waits)
        if with_trees and any(t > 0 for t in temperatures):
            result["trees"] = _tree_rows(models, draft, prompts, temperatures, gammas, max_new_tokens, ours, progress)
        if with_hf:
            _compare_with_hf(result, ours, models, prompts, max_new_tokens, progress)
    result["table_markdown"] = report.markdown_table(HEADERS, rows)
    report.plot_lines(out_dir / "sampling_speedup.png", "Speculative sampling: speedup over γ=0 at each T", "γ",
                      "speedup (x)", {f"T={t}": (gammas, [ours[t][g]["speedup"] for g in gammas])
                                      for t in temperatures}, hline=1.0)
    report.write_json(out_dir / "sampling.json", result)
    print(f"\nwrote {out_dir / 'sampling.json'}, {out_dir / 'sampling_speedup.png'}", flush=True)
    return result


def planned_generations(models: BenchModels, n_prompts: int, temperatures: list[float], gammas: list[int],
                        with_hf: bool, with_trees: bool = False, repeats: int = 1, auto_stack: str = "own") -> int:
    """The generations `run` makes, warm-ups aside: its progress total."""
    settings = len(gammas) + (2 if auto_stack == "own" else 1)  # every γ and auto (and auto's plain)
    sweeps = len(temperatures) * settings * repeats  # each round
    if with_trees:
        sweeps += len(TREE_BRANCHES) * len(gammas) * sum(t > 0 for t in temperatures)
    if with_hf:
        sweeps += len(runnable_modes(models, HF_MODES)) * sum(t > 0 for t in temperatures)
    return sweeps * n_prompts


def _sweeps(models: BenchModels, draft: Path, prompts: list[list[int]], temperatures: list[float], gammas: list[int],
            max_new_tokens: int, progress: Progress, repeats: int = 1, auto_stack: str = "own"
            ) -> dict[float, dict[int | str, dict]]:
    """Every temperature's γ sweep and speculation=auto: in one stack, or auto (and its own plain
    baseline) in a second stack whose turns come in the same sweep."""
    ours: dict[float, dict[int | str, dict]] = {}
    with contextlib.ExitStack() as stacks:
        stack = stacks.enter_context(Stack(_spec(models, draft, stacks.enter_context(tempfile.TemporaryDirectory()))))
        settings: list[int | str] = [*gammas, "auto"]
        routes = {}
        if auto_stack == "own":
            own = stacks.enter_context(Stack(_spec(models, draft, stacks.enter_context(tempfile.TemporaryDirectory()))))
            watched = own.metrics_addresses["target"]
            routes = {"auto": (own.gateway_address, watched, "auto"), AUTO_PLAIN: (own.gateway_address, watched, "off")}
            settings.append(AUTO_PLAIN)
        for t in temperatures:
            rounds = f", {repeats} rounds" if repeats > 1 else ""
            progress.print(f"T={t}: sweeping gamma {gammas} and auto over {len(prompts)} prompts x "
                           f"{max_new_tokens} tokens{rounds} ...")
            progress.phase(f"sampling: T={t:g}, gamma {','.join(str(g) for g in gammas)},auto")
            ours[t] = sweep(stack.gateway_address, prompts, settings, max_new_tokens, temperature=t,
                            progress=progress, metrics=stack.metrics_addresses["target"], rounds=repeats, routes=routes)
    return ours


def _spec(models: BenchModels, draft: Path, logs: str, **fields) -> StackSpec:
    """The stack every sweep here runs on (``fields``: a tree stack's policy and flags)."""
    return StackSpec(str(models.target), str(draft), max_gamma=16, weights=models.weights, **models.proposing,
                     dtype=models.dtype, log_dir=logs, metrics=True, **fields)


def _tree_rows(models: BenchModels, draft: Path, prompts: list[list[int]], temperatures: list[float],
               gammas: list[int], max_new_tokens: int, chains: dict[float, dict[int, dict]],
               progress: Progress) -> dict:
    """Per branch budget, one stack whose every pass is a tree, swept at each T > 0 like the chains;
    returns the JSON's "trees" entry (rows and a markdown table) and prints the table."""
    rows, entries = [], {}
    for branches in TREE_BRANCHES:
        with tempfile.TemporaryDirectory() as logs, Stack(_spec(
                models, draft, logs, gamma_policy="fixed", extra_target_args=["--tree-branches", str(branches)])) as stack:
            for t in (t for t in temperatures if t > 0):
                progress.phase(f"sampling: trees of {branches} branches, T={t:g}")
                runs = sweep(stack.gateway_address, prompts, gammas, max_new_tokens, temperature=t, progress=progress)
                for gamma in (g for g in gammas if g):
                    r, chain = runs[gamma], chains[t][gamma]
                    r["speedup"] = r["tokens_per_s"] / runs[0]["tokens_per_s"]
                    r["over_chain"] = r["speedup"] / chain["speedup"]
                    rows.append([f"{t:g}", gamma, branches, r["tokens_per_s"], r["speedup"], r["over_chain"],
                                 r["mean_accepted_length"], chain["mean_accepted_length"], r.get("branch_tokens", 0)])
                    entries[f"T={t:g}, gamma {gamma}, {branches} branches"] = public(r)
    progress.print("\nsampled trees: the chain of gamma and up to B of the draft's next draws as branches, every "
                   "pass (x plain: the same stack's gamma 0; x chain: over the chain's own x plain)\n"
                   + report.table(TREE_HEADERS, rows))
    return {"branches": TREE_BRANCHES, "rows": entries, "table_markdown": report.markdown_table(TREE_HEADERS, rows)}


def _check(temperatures: list[float], gammas: list[int], repeats: int = 1, auto_stack: str = "own") -> None:
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: need at least 1")
    if auto_stack not in AUTO_STACKS:
        raise ValueError(f"auto_stack={auto_stack!r}: must be one of {', '.join(AUTO_STACKS)}")
    if not temperatures or any(t < 0 for t in temperatures):
        raise ValueError(f"temperatures={temperatures}: need at least one, all >= 0")
    if 0 not in gammas or not any(g > 0 for g in gammas) or any(g < 0 for g in gammas):
        raise ValueError(f"gammas={gammas}: need 0 (the baseline) and at least one gamma > 0, none negative")


def _score(by_gamma: dict[int | str, dict], gamma: int | str, costs: dict, t: float) -> list:
    """Scores one sweep entry (latency.score; "auto": its speedup over its own stack's plain
    decoding (the sweep's γ = 0 in a shared stack) only; "auto plain": over the sweep's γ = 0, the
    gap between the two stacks) and returns its table row."""
    if gamma in ("auto", AUTO_PLAIN):  # auto over its own stack's plain; that over the sweep's (their gap)
        r = by_gamma[gamma]
        r["speedup"] = r["tokens_per_s"] / by_gamma[AUTO_PLAIN if gamma == "auto" and AUTO_PLAIN in by_gamma
                                                    else 0]["tokens_per_s"]
        return [f"{t:g}", gamma, r["tokens_per_s"], r["alpha"] if r["proposed"] else "-",
                r["accepted_fraction"] if r["proposed"] else "-", r["mean_accepted_length"] or 1.0, "-", "-",
                r["speedup"], "-"]
    r = score(by_gamma, gamma, costs)
    return [f"{t:g}", gamma, r["tokens_per_s"], r["alpha"] if gamma else "-", r["accepted_fraction"] if gamma else "-",
            r["mean_accepted_length"] or 1.0, r["theory"], r["theory_with_verify_cost"], r["speedup"],
            r["of_theory"]]


def _best(by_gamma: dict[int | str, dict]) -> int:
    """The fastest fixed γ > 0 (auto is not one)."""
    return max((g for g in by_gamma if isinstance(g, int) and g), key=lambda g: by_gamma[g]["tokens_per_s"])


def _compare_with_hf(result: dict, ours: dict[float, dict[int, dict]], models: BenchModels,
                     prompts: list[list[int]], max_new_tokens: int, progress: Progress) -> None:
    """Hugging Face plain and assisted sampling at each T > 0 (the stack is down by now)."""
    sampled = [t for t in ours if t > 0]
    if not sampled:
        return
    progress.print("\nHugging Face transformers, do_sample=True, top_k=0, same checkpoints, prompts and seeds ...")
    rows = []
    for t in sampled:
        progress.phase(f"sampling: Hugging Face transformers, T={t:g}")
        hf = hf_generate(models, prompts, max_new_tokens, temperature=t, modes=HF_MODES, progress=progress)
        best = _best(ours[t])
        best_hf = max((m for m in hf if m != "plain"), key=lambda m: hf[m]["tokens_per_s"])
        entry = result["temperatures"][t]
        entry["hf"] = {mode: {k: v for k, v in hf[mode].items() if k != "token_ids"} for mode in hf}
        entry["best_hf_assisted"] = best_hf
        entry["ours_over_best_hf_assisted"] = ours[t][best]["tokens_per_s"] / hf[best_hf]["tokens_per_s"]
        rows.append([f"{t:g}", ours[t][0]["tokens_per_s"], f"{ours[t][best]['tokens_per_s']:.1f} (gamma={best})",
                     *(hf[m]["tokens_per_s"] if m in hf else "-" for m in HF_MODES),
                     entry["ours_over_best_hf_assisted"]])
    headers = ["T", "ours gamma=0", "ours best", "HF generate()", "HF assisted (defaults)",
               "HF assisted (heuristic, start 5)", "HF prompt lookup", "ours best / best HF assisted"]
    progress.print(report.table(headers, rows))
    result["hf_table_markdown"] = report.markdown_table(headers, rows)
