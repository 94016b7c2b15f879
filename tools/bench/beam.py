"""`specstream bench beam`: fixed- and variable-width beam search under the VAR-STREAM paper's
batching policies, like its Table 1, with transformers' beam search as the peer in the same run.

One stream of requests with varied prompts and budgets (end-of-turn/EOS ends hypotheses) runs
through an in-process engine once per method, at k = 5 and 10:

- FIXED: fixed width (transformers' beam search), static batches of n rows;
- VAR-BATCH: variable width (absolute threshold δ, at most M candidates per parent), static batches;
- VAR-STREAM(ε): variable width, refilled when at most ε·n rows run, only the shortest beams expanded;
- VAR-STR-FIFO: variable width, refilled at ε = 1/3, longest beams first.

n = rows expanded per step (4·k by default), with twice as many KV slots, so the streaming
policies can hold more beams than they expand. Per method: wall time, engine steps, candidate
expansions (hypothesis rows expanded) and expansions per step, the quality proxy (mean
log-probability of each request's best hypothesis, and how often its tokens equal FIXED's), and
wall-time ratios against FIXED and VAR-BATCH. VAR-STREAM and VAR-STR-FIFO must return VAR-BATCH's
hypotheses (streaming is an implementation detail); the run says whether they did. transformers'
`generate(num_beams=k)` runs the same prompts one at a time on the same checkpoint, dense.

Also measured: what sharing a beam's prefix costs against copying it (tools/bench/prefix_cost.py).
On a CPU a step's time grows with its rows, so wall time follows expansions; the expansion counts
and expansions per step are what would govern a GPU, where a step costs about the same at any
width up to the batch.
"""

from __future__ import annotations

import os
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specstream.serving.compute import on_torch_thread
from tools.bench import prefix_cost, report
from tools.bench.checks import require
from tools.bench.models import BenchModels
from tools.progress import Progress

TARGETS = {"stream_over_batch": 1.2, "stream_over_fixed": 2.0, "agreement": 0.95}  # at k = 10


@dataclass(frozen=True)
class Method:
    name: str
    variable: bool  # δ and M prune
    policy: str  # "static" or "topup"
    epsilon: float = 1.0
    selection: str = "all"


def methods(epsilons: tuple[float, ...]) -> list[Method]:
    return [Method("FIXED", False, "static"), Method("VAR-BATCH", True, "static"),
            *(Method(f"VAR-STREAM ε={_fraction(e)}", True, "topup", e, "min_length") for e in epsilons),
            Method("VAR-STR-FIFO ε=1/3", True, "topup", 1 / 3, "fifo")]


def _fraction(e: float) -> str:
    return f"1/{round(1 / e)}" if e and abs(1 / e - round(1 / e)) < 1e-9 else f"{e:g}"


def jobs(models: BenchModels, n: int, min_new: int, max_new: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, max_new_tokens) per request: the pair's held-out prompts, budgets drawn from
    [min_new, max_new] with a fixed seed."""
    rng = random.Random(seed)
    prompts = models.prompts(n)
    return [(p, rng.randint(min_new, max_new)) for p in prompts]


def stop_ids(models: BenchModels) -> list[int]:
    tok = models.tokenizer()
    ends = set(tok.eos_token_ids)
    if tok.chat_template is not None and tok.end_of_turn_id is not None:
        ends.add(tok.end_of_turn_id)
    return sorted(ends)


def run_method(model, method: Method, k: int, work: list[tuple[list[int], int]], stops: list[int], rows: int,
               threshold: float, limit: int, progress: Progress | None = None) -> dict:
    """``work`` through an in-process engine under ``method`` at width k; ``progress`` counts each
    request as its search ends."""
    from specstream.data.config import ModelSpec, TargetConfig
    from specstream.data.engine import BeamOptions, SequenceRequest, Speculation
    from target_service.engine import Engine
    from target_service.inprocess import run_requests

    beam = BeamOptions(k, 1, beam_threshold=threshold, max_candidates_per_parent=limit) if method.variable \
        else BeamOptions(k, 1)
    max_len = max(len(p) for p, _ in work) + max(n for _, n in work) + 16
    # Every prompt prefilled whole (no chunks), whatever else is admitted with it: the methods differ
    # in their batching policy only.
    config = TargetConfig(model=ModelSpec("bench-beam"), max_slots=2 * rows, max_batch=rows, max_seq_len=max_len,
                          prefill_chunk=sum(len(p) for p, _ in work),
                          max_gamma=1, default_gamma=0, calibrate=False, policy=method.policy, refill_threshold=method.epsilon,
                          row_selection=method.selection)
    engine = Engine(model, config, None)
    requests = [SequenceRequest(str(i), prompt, budget, frozenset(stops), frozenset(stops), Speculation("off"),
                                beam=beam) for i, (prompt, budget) in enumerate(work)]
    started = time.perf_counter()
    results = run_requests(engine, requests, timeout_s=1800,
                           on_finished=None if progress is None else lambda finished: progress.update())
    seconds = time.perf_counter() - started
    failed = [(r.request_id, r.finish_reason) for r in results if not r.final.sequences]
    require(not failed, f"{method.name} k={k}: requests ended without hypotheses: {failed[:4]}")
    best = [r.final.sequences[0] for r in results]
    expansions = sum(r.final.stats.beam_expansions for r in results)
    steps, decode_rows = engine.stats.steps, engine.stats.row_expansions
    # A beam's first expansion rides on its prompt's prefill forward; every later one is a row of a
    # decode step. Two counters kept apart (the search's, the batch's) must agree.
    require(expansions == decode_rows + len(results),
            f"{method.name} k={k}: {expansions} beam expansions, but {decode_rows} decode rows + "
            f"{len(results)} first expansions")
    return {"seconds": seconds, "steps": steps, "engine_steps": engine.step_count, "expansions": expansions,
            "expansions_per_step": decode_rows / steps if steps else 0.0,
            "mean_best_logprob": sum(b.logprob for b in best) / len(best),
            "tokens": sum(len(b.token_ids) for b in best), "best": [b.token_ids for b in best]}


def hf_beams(models: BenchModels, work: list[tuple[list[int], int]], stops: list[int], k: int,
             progress: Progress | None = None) -> dict:
    """transformers' `generate(num_beams=k)` on each request, one at a time (on the torch thread);
    ``progress`` counts each."""
    return on_torch_thread(_hf_beams, models, work, stops, k, progress)


def _hf_beams(models: BenchModels, work: list[tuple[list[int], int]], stops: list[int], k: int,
              progress: Progress | None) -> dict:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(models.target, dtype=getattr(torch, models.dtype)).eval()
    best, seconds = [], 0.0
    with torch.inference_mode():
        warm = torch.tensor([work[0][0]])
        target.generate(warm, attention_mask=torch.ones_like(warm), num_beams=k, do_sample=False, max_new_tokens=4,
                        eos_token_id=stops, pad_token_id=stops[0])
        for prompt, budget in work:
            ids = torch.tensor([prompt])
            started = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), num_beams=k, num_return_sequences=1,
                                  do_sample=False, max_new_tokens=budget, eos_token_id=stops, pad_token_id=stops[0])
            seconds += time.perf_counter() - started
            tokens = out[0, len(prompt):].tolist()
            ends = [i for i, t in enumerate(tokens) if t in stops]
            best.append(tokens[: ends[0] + 1] if ends else tokens)
            if progress is not None:
                progress.update()
    return {"seconds": seconds, "best": best, "dtype": models.dtype, "weights": "dense"}


def device() -> str:
    """Where the engine's forwards ran: the CPU's model, cores and the torch thread's thread count
    (BenchModels.load puts the model on the CPU)."""
    return on_torch_thread(_device)


def _device() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), model)
    except OSError:
        pass
    return f"CPU ({model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def _median_run(results: list[dict]) -> dict:
    """The run with the median wall time, every run's beside it; all runs must agree on the outputs."""
    for other in results[1:]:
        require(other["best"] == results[0]["best"], "a repeated run returned other best hypotheses")
    ranked = sorted(results, key=lambda r: r["seconds"])
    return {**ranked[len(ranked) // 2], "seconds_runs": [r["seconds"] for r in results]}


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def run(models: BenchModels, out_dir: Path, ks: tuple[int, ...] = (5, 10), n_requests: int = 24, min_new: int = 8,
        max_new: int = 48, threshold: float = 1.5, limits: dict[int, int] | None = None,
        epsilons: tuple[float, ...] = (1 / 6, 1 / 3, 1 / 2), rows_per_beam: int = 4, peer: bool = True,
        seed: int = 0, repeats: int = 1, sweep: tuple[float, ...] = (3.0, 5.0, 8.0), quiet: bool = False) -> dict:
    """The table, `beam.json` and plots in `out_dir`. `limits`: M per k (default 3 at k = 5,
    5 at k = 10: the paper's §A.3 values, below k). ``repeats`` > 1 runs every method that many
    times, interleaved (all methods once, then all again), and reports each one's median wall time:
    on a shared machine whose speed drifts over minutes, interleaving keeps the drift from favouring
    whichever method ran in a fast spell (as bench gamma does). Progress on stderr
    (tools.progress; ``quiet``: plain lines, never a bar), counted in requests."""
    limits = limits or {k: max(1, min(k - 1, 3 if k <= 5 else 5)) for k in ks}
    out_dir.mkdir(parents=True, exist_ok=True)
    model = models.load("target")
    work = jobs(models, n_requests, min_new, max_new, seed)
    stops = stop_ids(models)
    chosen = methods(epsilons)
    data: dict = {"model": models.label, "dtype": models.dtype, "target_weights": model.weights,
                  "device": device(), "requests": len(work), "repeats": repeats,
                  "max_new_tokens": [n for _, n in work], "prompt_tokens": [len(p) for p, _ in work],
                  "stop_ids": stops, "beam_threshold": threshold, "max_candidates_per_parent": limits,
                  "targets": TARGETS, "runs": {}}
    total = planned_requests(len(work), ks, len(chosen), repeats, peer, sweep)
    with Progress(total, "requests", "beam", quiet=quiet) as progress:
        for k in ks:
            rows = rows_per_beam * k
            data["runs"][str(k)] = _run_k(model, models, chosen, k, work, stops, rows, threshold, limits[k], repeats,
                                          peer, progress)
            report.write_json(out_dir / "beam.json", data)
        if sweep:  # the paper's Table 5: δ trades expansions for agreement with FIXED (VAR-BATCH, largest k)
            k = max(ks)
            data["threshold_sweep"] = _threshold_sweep(model, chosen[1], data["runs"][str(k)]["methods"]["FIXED"], k,
                                                       work, stops, rows_per_beam * k, (threshold, *sweep),
                                                       limits[k], progress)
            report.write_json(out_dir / "beam.json", data)
        progress.phase("beam: prefix sharing against copying")
        data["prefix_sharing"] = prefix_cost.measure(model, ks=tuple(ks))
    report.write_json(out_dir / "beam.json", data)
    print(tables(data))
    _plot(data, out_dir)
    return data


def planned_requests(n_requests: int, ks: tuple[int, ...], n_methods: int, repeats: int, peer: bool,
                     sweep: tuple[float, ...]) -> int:
    """The requests `run` decodes (its progress total): per k an untimed warm-up of up to 2, every
    method ``repeats`` times and transformers once; then the threshold sweep's runs."""
    per_k = min(2, n_requests) + (repeats * n_methods + peer) * n_requests
    return len(ks) * per_k + ((1 + len(sweep)) * n_requests if sweep else 0)


def _run_k(model, models: BenchModels, chosen: list[Method], k: int, work: list[tuple[list[int], int]],
           stops: list[int], rows: int, threshold: float, limit: int, repeats: int, peer: bool,
           progress: Progress) -> dict:
    """Every method at beam width k (``rows`` expanded per step), and transformers beside it with
    ``peer``: the JSON's row for k."""
    progress.phase(f"beam: k={k}")
    # Untimed: the first forwards at this k's shapes pay one-time costs that would otherwise
    # land on whichever method runs first (FIXED).
    run_method(model, chosen[0], k, [(p, min(4, n)) for p, n in work[:2]], stops, rows, threshold, limit, progress)
    repeated: dict[str, list[dict]] = {m.name: [] for m in chosen}
    for _ in range(repeats):
        for method in chosen:
            r = run_method(model, method, k, work, stops, rows, threshold, limit, progress)
            repeated[method.name].append(r)
            progress.print(f"k={k:2d} {method.name:18s} {r['seconds']:7.1f} s  {r['steps']:5d} steps  "
                           f"{r['expansions']:6d} expansions  {r['expansions_per_step']:5.1f}/step")
    runs = {name: _median_run(results) for name, results in repeated.items()}
    fixed, batch = runs["FIXED"], runs["VAR-BATCH"]
    for name, r in runs.items():
        r["speedup_vs_fixed"] = fixed["seconds"] / r["seconds"]
        r["speedup_vs_var_batch"] = batch["seconds"] / r["seconds"]
        r["top1_agreement_with_fixed"] = _agreement(r["best"], fixed["best"])
        r["steps_vs_fixed"] = fixed["steps"] / r["steps"]
        r["steps_vs_var_batch"] = batch["steps"] / r["steps"]
        r["same_as_var_batch"] = r["best"] == batch["best"] if name.startswith("VAR-STR") else None
    row: dict = {"rows_per_step": rows, "max_slots": 2 * rows, "methods": runs}
    if peer:
        progress.phase(f"beam: k={k}, transformers")
        hf = hf_beams(models, work, stops, k, progress)
        hf["top1_agreement_with_fixed"] = _agreement(hf["best"], fixed["best"])
        hf["fixed_speedup_over_hf"] = hf["seconds"] / fixed["seconds"]
        row["transformers"] = hf
        progress.print(f"k={k:2d} {'transformers':18s} {hf['seconds']:7.1f} s  top-1 = our FIXED on "
                       f"{hf['top1_agreement_with_fixed']:.0%}")
    return row


def _threshold_sweep(model, method: Method, fixed: dict, k: int, work: list[tuple[list[int], int]], stops: list[int],
                     rows: int, deltas: tuple[float, ...], limit: int, progress: Progress) -> dict:
    """``method`` (VAR-BATCH) at each threshold δ of ``deltas``, against FIXED's run ``fixed``."""
    progress.phase(f"beam: k={k}, threshold sweep")
    out = {"k": k, "max_candidates_per_parent": limit, "rows": []}
    for delta in deltas:
        r = run_method(model, method, k, work, stops, rows, delta, limit, progress)
        entry = {"beam_threshold": delta, "seconds": r["seconds"], "expansions": r["expansions"],
                 "expansions_vs_fixed": r["expansions"] / fixed["expansions"],
                 "top1_agreement_with_fixed": _agreement(r["best"], fixed["best"]),
                 "mean_best_logprob": r["mean_best_logprob"]}
        out["rows"].append(entry)
        progress.print(f"k={k} VAR-BATCH δ={delta:g}: {r['expansions']} expansions "
                       f"({entry['expansions_vs_fixed']:.0%} of FIXED's), top-1 = FIXED on "
                       f"{entry['top1_agreement_with_fixed']:.0%}")
    return out


def verdicts(data: dict) -> list[str]:
    """The issue's targets at k = 10 (or the largest k run), met or not, and VAR-STREAM = VAR-BATCH."""
    lines = []
    for k, row in data["runs"].items():
        for name, r in row["methods"].items():
            if r.get("same_as_var_batch") is False:
                lines.append(f"k={k}: {name} returned different best hypotheses from VAR-BATCH")
    k = max(data["runs"], key=int)
    runs = data["runs"][k]["methods"]
    streams = {n: r for n, r in runs.items() if n.startswith("VAR-STREAM")}
    for name, r in streams.items():
        checks = [("≥ 1.2× VAR-BATCH", r["speedup_vs_var_batch"], TARGETS["stream_over_batch"]),
                  ("≥ 2× FIXED", r["speedup_vs_fixed"], TARGETS["stream_over_fixed"]),
                  ("top-1 = FIXED ≥ 95%", r["top1_agreement_with_fixed"], TARGETS["agreement"])]
        lines.append(f"k={k} {name}: " + "; ".join(f"{label} {'met' if value >= goal else 'missed'} ({value:.2f})"
                                                  for label, value, goal in checks))
        # Wall time here is a CPU's, where a step costs in proportion to its rows. Where a step costs
        # about the same at any width up to n (a GPU below saturation), steps govern instead:
        lines.append(f"    where steps govern (a GPU below saturation): {r['steps_vs_var_batch']:.2f}x VAR-BATCH's "
                     f"steps, {r['steps_vs_fixed']:.2f}x FIXED's (targets 1.2x, 2x)")
    return lines


def tables(data: dict, markdown: bool = False) -> str:
    table = report.markdown_table if markdown else report.table
    out = []
    for k, row in data["runs"].items():
        rows = []
        for name, r in row["methods"].items():
            rows.append([name, f"{r['seconds']:.1f}", f"{r['speedup_vs_fixed']:.2f}×", f"{r['speedup_vs_var_batch']:.2f}×",
                         r["steps"], r["expansions"], f"{r['expansions_per_step']:.1f}",
                         f"{r['mean_best_logprob']:.3f}", f"{r['top1_agreement_with_fixed']:.0%}",
                         "—" if r["same_as_var_batch"] is None else "yes" if r["same_as_var_batch"] else "NO"])
        hf = row.get("transformers")
        if hf is not None:
            rows.append([f"transformers generate(num_beams={k})", f"{hf['seconds']:.1f}",
                         f"{1 / hf['fixed_speedup_over_hf']:.2f}×", "", "", "", "", "",
                         f"{hf['top1_agreement_with_fixed']:.0%}", ""])
        out.append(f"k = {k}, n = {row['rows_per_step']} rows per step, {row['max_slots']} KV slots, "
                   f"{data['requests']} requests ({data['model']}, {data['target_weights']}, {data['device']})")
        out.append(table(["method", "wall s", "vs FIXED", "vs VAR-BATCH", "steps", "expansions", "exp/step",
                          "mean best logprob", "top-1 = FIXED", "= VAR-BATCH"], rows))
    sweep = data.get("threshold_sweep")
    if sweep:
        out.append(f"VAR-BATCH at k = {sweep['k']}, M = {sweep['max_candidates_per_parent']}: the threshold δ against "
                   "FIXED")
        out.append(table(["δ", "wall s", "expansions", "of FIXED's", "mean best logprob", "top-1 = FIXED"],
                         [[f"{r['beam_threshold']:g}", f"{r['seconds']:.1f}", r["expansions"],
                           f"{r['expansions_vs_fixed']:.0%}", f"{r['mean_best_logprob']:.3f}",
                           f"{r['top1_agreement_with_fixed']:.0%}"] for r in sweep["rows"]]))
    sharing = data.get("prefix_sharing")
    if sharing:
        out.append("sharing a beam's prefix (k - 1 forks per step) against copying it")
        out.append(table(["k", "context", "fork ms", "copy ms", "K/V copied", "forward gathered ms",
                          "forward contiguous ms"],
                         [[s["k"], s["context"], f"{s['fork_ms']:.3f}", f"{s['copy_ms']:.2f}",
                           f"{s['copy_bytes'] / 2**20:.1f} MiB vs 0", f"{s['forward_gathered_ms']:.1f}",
                           f"{s['forward_contiguous_ms']:.1f}"] for s in sharing]))
    out.extend(verdicts(data))
    return "\n".join(out)


def _plot(data: dict, out_dir: Path) -> None:
    for key, label, file in (("seconds", "wall time (s)", "beam_wall_time.png"),
                             ("expansions_per_step", "candidate expansions per step", "beam_expansions_per_step.png"),
                             ("expansions", "candidate expansions", "beam_expansions.png")):
        bars = {f"k={k} {name}": r[key] for k, row in data["runs"].items() for name, r in row["methods"].items()}
        report.plot_bars(out_dir / file, f"beam search, {data['model']} ({data['device']})", label, bars)
