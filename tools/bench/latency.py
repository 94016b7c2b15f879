"""`specstream bench latency`: batch-1 greedy latency over the real three-process stack.

For each γ in the sweep it generates the same prompts through gateway → target → draft and
reports tokens/s, α (accepted / (accepted + rejections)), mean accepted length, the measured cost
ratio c, the theoretical speedup (1 − α^(γ+1)) / ((1 − α)(γc + 1)) for that α and c, and the
measured speedup over γ = 0. With llama.cpp installed (`make peer`), our plain decoding and the
default against llama.cpp's plain decoding in turns (``head_to_head``: the fair ratio on a machine
whose speed drifts). Then, on the same checkpoints and prompts, Hugging Face `generate()` plain and
with `assistant_model=`, and llama.cpp once more beside them. Every γ's token ids must equal γ = 0's:
the run fails loudly otherwise (BenchmarkError, tools.bench.checks). Whether each peer's tokens equal ours is
recorded per peer (``same_tokens_as_ours``): in bfloat16 another implementation's arithmetic may
legitimately differ.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

from tools.bench import report, trees
from tools.bench.apart import run_apart
from tools.bench.checks import check_runs_match
from tools.bench.costs import measure_costs, measure_feature_costs
from tools.bench.hf import hf_generate, runnable_modes
from tools.bench.models import BenchModels
from tools.bench.passes import per_pass_ms, read_counters
from tools.bench.theory import expected_speedup, expected_tokens_per_pass
from tools.launcher import Stack, StackSpec
from tools.progress import Progress

DEFAULT_GAMMAS = [0, 1, 2, 3, 4, 6, 8]
# Rounds of the head-to-head: our plain decoding, the default and llama.cpp's plain decoding in turns.
HEAD_TO_HEAD_ROUNDS = 5


def sweep(address: str, prompts: list[list[int]], gammas: list[int | str], max_new_tokens: int,
          temperature: float = 0.0, progress: Progress | None = None,
          metrics: str | None = None, rounds: int = 1,
          routes: dict[int | str, tuple[str, str | None, int | str]] | None = None) -> dict[int | str, dict]:
    """Generates every prompt at every γ (or "auto": the γ controller), one request at a time
    (batch 1). Greedy by default; at
    temperature > 0 it samples from the full distribution (no top-k/top-p) with seed = the
    prompt's index, so every γ sees the same seeds. ``rounds`` > 1: the whole sweep again, the γ
    order reversed every other round, each γ's figures pooled over its rounds (a slow stretch of
    the machine then falls on every γ alike; later rounds repeat the first round's seeds).
    ``progress`` counts each generation as it finishes (the warm-up is not one). With ``metrics``
    (the target's /metrics address) each γ's figures get the engine's own per-pass breakdown,
    ``pass_ms`` (tools/bench/passes.py). ``routes``: settings sent elsewhere, by key:
    (gateway address, its target's /metrics or None, the speculation to ask for), so another
    stack's settings take their turns in the same sweep."""
    from specstream_client import Client

    def seed(i: int) -> int | None:
        return i if temperature > 0 else None

    routes = {gamma: (routes or {}).get(gamma, (address, metrics, gamma or "off")) for gamma in gammas}
    runs: dict[int | str, list] = {gamma: [] for gamma in gammas}
    counted: dict[int | str, dict[str, float]] = {}  # per γ: the metrics' growth over its generations
    with contextlib.ExitStack() as opened:
        clients = {where: opened.enter_context(Client(where, timeout=600)) for where in {r[0] for r in routes.values()}}
        for client in clients.values():  # warm-up
            client.generate(prompts[0], max_new_tokens=16, ignore_eos=True, temperature=temperature, seed=seed(0))
        for round_ in range(rounds):
            for gamma in gammas if round_ % 2 == 0 else gammas[::-1]:
                where, watched, speculation = routes[gamma]
                before = read_counters(watched) if watched else None
                for i, p in enumerate(prompts):
                    runs[gamma].append(clients[where].generate(p, max_new_tokens=max_new_tokens, speculation=speculation,
                                                               ignore_eos=True, temperature=temperature, seed=seed(i)))
                    if progress is not None:
                        progress.update()
                if before is not None:
                    grown = {k: v - before[k] for k, v in read_counters(watched).items()}
                    counted[gamma] = {k: counted.get(gamma, {}).get(k, 0.0) + v for k, v in grown.items()}
    results: dict[int | str, dict] = {}
    for gamma in gammas:
        results[gamma] = _summary(runs[gamma])
        if gamma in counted:
            results[gamma]["pass_ms"] = per_pass_ms(dict.fromkeys(counted[gamma], 0.0), counted[gamma])
    return results


def _summary(runs: list) -> dict:
    """One γ's figures over its generations (the SDK's results)."""
    tokens = sum(r.usage.completion_tokens for r in runs)
    seconds = sum(r.timings.total_seconds for r in runs)
    proposed = sum(r.stats.draft_tokens for r in runs)
    accepted = sum(r.stats.accepted_tokens for r in runs)
    rejections = sum(r.stats.rejections for r in runs)
    decode_passes = sum(r.stats.target_passes - 1 for r in runs)
    tree_passes = sum(sum(r.stats.branch_histogram[1:]) for r in runs)
    return {
        "tokens_per_s": tokens / seconds,
        # Leviathan's per-token alpha (i.i.d. estimate), and the plain fraction accepted.
        "alpha": accepted / (accepted + rejections) if proposed else None,
        "accepted_fraction": accepted / proposed if proposed else None,
        "mean_accepted_length": (tokens - len(runs)) / decode_passes if decode_passes else None,
        "ttft_ms": 1000 * sum(r.timings.time_to_first_token_seconds for r in runs) / len(runs),
        "tokens": tokens, "seconds": seconds, "proposed": proposed, "accepted": accepted,
        "rejections": rejections, "passes": decode_passes + len(runs),
        # Trees: passes that verified one, and kept tokens that were branches, not the chain.
        "tree_passes": tree_passes, "branch_tokens": sum(r.stats.branch_tokens for r in runs),
        # Decode passes that proposed anything (under speculation=auto, those the controller drafted in).
        "drafting_passes": sum(sum(r.stats.gamma_histogram[1:]) for r in runs),
        "token_ids": [r.token_ids for r in runs],
    }


# A pass's ms as the client sees it, then by the engine's own clock (pass_ms): its compute call
# (target), waiting for the draft, and its host work; what the client sees beyond them is the
# gateway, the client and the hops between the processes.
PASS_HEADERS = ["ms/pass", "target ms", "draft ms", "host ms"]
HEADERS = ["gamma", "tok/s", "alpha", "mean acc len", "c", "theory x", "theory x (verify cost)", "measured x",
           "of theory", *PASS_HEADERS, "overhead ms/pass"]
COLOCATED_HEADERS = ["gamma", "tok/s", "alpha", "mean acc len", "measured x", *PASS_HEADERS]


def run(models: BenchModels, out_dir: Path, n_prompts: int = 8, max_new_tokens: int = 128,
        gammas: list[int] | None = None, with_hf: bool = True, quiet: bool = False,
        compare_draft: Path | None = None, with_trees: bool = True) -> dict:
    """The γ sweep through the draft service and with the draft colocated, speculation=auto, the
    draft model alone (behind prompt lookup), trees (``with_trees``: tools/bench/trees.py,
    at γ 1..3), ours against llama.cpp in turns (``head_to_head``, with the peers), dense weights
    and the peers; with ``compare_draft``
    (another draft of the same target: a feature draft), the same sweeps with it, side by side;
    tables on stdout, ``latency.json`` and plots in ``out_dir``. Progress on stderr
    (tools.progress; ``quiet``: plain lines, never a bar), counted in generations."""
    gammas = gammas or DEFAULT_GAMMAS
    draft = models.require_draft()
    prompts = models.prompts(n_prompts)
    costs = _measure_costs(models, prompts, max_new_tokens, gammas)
    total = planned_generations(models, len(prompts), gammas, with_hf, costs["weights"])
    total += (2 * len(gammas) + 2) * len(prompts) if compare_draft is not None else 0
    with_trees = with_trees and all(g in gammas for g in trees.TREE_GAMMAS)  # beside the chains of the same γ
    total += trees.planned_generations(len(prompts)) if with_trees else 0
    with Progress(total, "generations", "latency", quiet=quiet) as progress:
        ours, auto, colocated = _sweeps(models, draft, prompts, gammas, max_new_tokens, progress)
        check_runs_match("speculative output", "plain decoding (gamma 0)", ours[0]["token_ids"],
                         {**{f"gamma {g}": ours[g]["token_ids"] for g in gammas if g}, "auto": auto["token_ids"],
                          **{f"gamma {g}, draft colocated": colocated[g]["token_ids"] for g in gammas}})
        rows = [_row(ours, gamma, costs) for gamma in gammas]
        result = _result(models, prompts, max_new_tokens, costs, ours, auto, gammas)
        _report_sweeps(result, rows, colocated, gammas, progress)
        best = max((g for g in gammas if g), key=lambda g: ours[g]["tokens_per_s"])
        result["best_gamma"] = best
        result["proposer"] = models.proposing
        if models.proposer == "ngram+model":
            _model_alone(result, models, draft, prompts, ours, best, max_new_tokens, progress)
        if with_trees:
            def swept(tree_gammas: list[int], **fields) -> dict:
                with tempfile.TemporaryDirectory() as logs, Stack(_spec(models, draft, logs, **fields)) as stack:
                    return sweep(stack.gateway_address, prompts, tree_gammas, max_new_tokens, progress=progress,
                                 metrics=stack.metrics_addresses["target"])

            result["trees"] = trees.tree_rows(swept, ours[0]["token_ids"],
                                              {"service": ours, "colocated": colocated}, progress)
        if compare_draft is not None:
            _compare_draft(result, models, compare_draft, prompts, gammas, max_new_tokens, ours, colocated, auto,
                           progress)
        if with_hf and llama_cpp_available(models):
            result["head_to_head"] = head_to_head(models, draft, prompts, max_new_tokens, progress)
        if with_hf:
            if costs["weights"] != "dense":
                _dense(result, models, draft, prompts, best, max_new_tokens, progress)
            _compare_with_peers(result, ours, best, colocated, result["best_colocated_gamma"], models, prompts,
                                max_new_tokens, out_dir, progress)
    result["table_markdown"] = report.markdown_table(HEADERS, rows)
    _write(result, ours, gammas, out_dir, with_hf)
    return result


def planned_generations(models: BenchModels, n_prompts: int, gammas: list[int], with_hf: bool, weights: str) -> int:
    """The generations `run` makes, warm-ups aside (its progress total); ``weights``: the target's
    as served (measure_costs)."""
    sweeps = 2 * len(gammas) + 1  # through the draft service, speculation=auto, the draft colocated
    sweeps += models.proposer == "ngram+model"  # the draft model alone at the best γ
    if with_hf:
        sweeps += 2 * (weights != "dense")  # our dense weights at γ = 0 and the best γ
        sweeps += len(runnable_modes(models)) + (models.dtype != "float32")  # HF, and HF plain in float32
        sweeps += 2 * llama_cpp_available(models)  # llama.cpp plain and with prompt lookup
        sweeps += 3 * HEAD_TO_HEAD_ROUNDS * llama_cpp_available(models)  # head_to_head
    return sweeps * n_prompts


def _measure_costs(models: BenchModels, prompts: list[list[int]], max_new_tokens: int, gammas: list[int]) -> dict:
    """The cost ratio c and the verify costs at the sweep's mean context (tools.bench.costs)."""
    context = sum(len(p) for p in prompts) // len(prompts) + max_new_tokens // 2
    print(f"{models.label} ({models.dtype}): measuring the cost ratio c at context {context} ...", flush=True)
    return measure_costs(models, context, [g for g in gammas if g])


def _spec(models: BenchModels, draft: Path, logs: str, **fields) -> StackSpec:
    """The stack the sweeps run on: our draft as the pair proposes with it, up to γ = 16."""
    return StackSpec(str(models.target), str(draft), max_gamma=16, dtype=models.dtype, log_dir=logs, metrics=True,
                     **({"weights": models.weights, **models.proposing} | fields))


def _sweeps(models: BenchModels, draft: Path, prompts: list[list[int]], gammas: list[int], max_new_tokens: int,
            progress: Progress) -> tuple[dict, dict, dict]:
    """Every γ and speculation=auto through the draft service, then every γ with the draft
    colocated in the target process: (ours, auto, colocated)."""
    with tempfile.TemporaryDirectory() as logs, Stack(_spec(models, draft, logs)) as stack:
        progress.print(f"stack up at {stack.gateway_address}; proposing with {models.proposer_label}; sweeping gamma "
                       f"{gammas} and auto over {len(prompts)} prompts x {max_new_tokens} tokens ...")
        progress.phase(f"latency: gamma {_listed(gammas)}, draft service")
        engine = stack.metrics_addresses["target"]
        ours = sweep(stack.gateway_address, prompts, gammas, max_new_tokens, progress=progress, metrics=engine)
        progress.phase("latency: speculation=auto")
        auto = sweep(stack.gateway_address, prompts, ["auto"], max_new_tokens, progress=progress,
                     metrics=engine)["auto"]
    with tempfile.TemporaryDirectory() as logs, Stack(_spec(models, draft, logs, colocate_draft=True)) as stack:
        progress.print("the same with the draft colocated in the target process (no draft service) ...")
        progress.phase(f"latency: gamma {_listed(gammas)}, draft colocated")
        colocated = sweep(stack.gateway_address, prompts, gammas, max_new_tokens, progress=progress,
                          metrics=stack.metrics_addresses["target"])
    return ours, auto, colocated


def _listed(gammas: list) -> str:
    return ",".join(str(g) for g in gammas)


def _row(ours: dict[int, dict], gamma: int, costs: dict) -> list:
    """Scores one γ (score) and returns its row of the main table (HEADERS)."""
    r = score(ours, gamma, costs)
    # Where a target pass's time goes: the models' own compute vs everything else (the gRPC
    # hops, the engine's and the gateway's Python, processes sharing the cores).
    r["ms_per_pass"] = 1000 * r["seconds"] / r["passes"]
    r["compute_ms_per_pass"] = (gamma * costs["draft_step_ms"] + costs["target_verify_ms"][gamma] if gamma
                                else costs["target_step_ms"])
    r["overhead_ms_per_pass"] = r["ms_per_pass"] - r["compute_ms_per_pass"]
    return [gamma, r["tokens_per_s"], r["alpha"] if gamma else "-", r["mean_accepted_length"] or 1.0,
            costs["c"] if gamma else "-", r["theory"], r["theory_with_verify_cost"], r["speedup"],
            r["of_theory"], *_pass_columns(r), r["overhead_ms_per_pass"]]


def _pass_columns(r: dict) -> list:
    """PASS_HEADERS' columns of a sweep result: ms per pass as the client saw it, then the engine's parts."""
    parts = r.get("pass_ms")
    return [1000 * r["seconds"] / r["passes"],
            *([parts["target"], parts["draft"], parts["host"]] if parts else ["-", "-", "-"])]


def _result(models: BenchModels, prompts: list[list[int]], max_new_tokens: int, costs: dict, ours: dict[int, dict],
            auto: dict, gammas: list[int]) -> dict:
    """The JSON's first fields: the pair, the run, the costs, every γ's figures and auto's."""
    result = {"models": models.label, "target": display(models.target), "draft": display(models.draft),
              "dtype": models.dtype, "chat_prompts": models.chat, "prompts": len(prompts),
              "max_new_tokens": max_new_tokens, "costs": costs, "gammas": {g: public(ours[g]) for g in gammas}}
    auto["speedup"] = auto["tokens_per_s"] / ours[0]["tokens_per_s"]
    result["auto"] = public(auto)
    return result


def _report_sweeps(result: dict, rows: list[list], colocated: dict[int, dict], gammas: list[int],
                   progress: Progress) -> None:
    """Prints the main table, auto's figures and the colocated table; adds the colocated sweep's
    figures and its best γ to ``result``."""
    auto = result["auto"]
    progress.print("\n" + report.table(HEADERS, rows))
    progress.print(f"speculation=auto (the default, γ chosen per step): {auto['tokens_per_s']:.1f} tok/s, "
                   f"{auto['speedup']:.2f}x gamma 0, alpha {auto['alpha'] or 0.0:.3f}, mean accepted length "
                   f"{auto['mean_accepted_length']:.2f}")
    colocated_rows = []
    for gamma in gammas:
        r = colocated[gamma]
        r["speedup"] = r["tokens_per_s"] / colocated[0]["tokens_per_s"]
        r["ms_per_pass"] = 1000 * r["seconds"] / r["passes"]
        colocated_rows.append([gamma, r["tokens_per_s"], r["alpha"] if gamma else "-",
                               r["mean_accepted_length"] or 1.0, r["speedup"], *_pass_columns(r)])
    progress.print("\ndraft colocated in the target process:\n" + report.table(COLOCATED_HEADERS, colocated_rows))
    result["colocated"] = {g: public(colocated[g]) for g in gammas}
    result["colocated_table_markdown"] = report.markdown_table(COLOCATED_HEADERS, colocated_rows)
    result["best_colocated_gamma"] = max((g for g in gammas if g), key=lambda g: colocated[g]["tokens_per_s"])


def _model_alone(result: dict, models: BenchModels, draft: Path, prompts: list[list[int]], ours: dict[int, dict],
                 best: int, max_new_tokens: int, progress: Progress) -> None:
    """What the prompt lookup adds: the draft model alone at the best γ, same layout."""
    with tempfile.TemporaryDirectory() as logs, Stack(StackSpec(
            str(models.target), str(draft), max_gamma=16, weights=models.weights, dtype=models.dtype,
            log_dir=logs)) as stack:
        progress.print(f"\nthe same with the draft model alone (no prompt lookup): gamma {best} ...")
        progress.phase(f"latency: draft model alone, gamma {best}")
        alone = sweep(stack.gateway_address, prompts, [best], max_new_tokens, progress=progress)[best]
    check_runs_match("speculative output (draft model alone)", "plain decoding (gamma 0)", ours[0]["token_ids"],
                     {f"gamma {best}": alone["token_ids"]})
    result["model_alone"] = {"gamma": best, **public(alone)}
    progress.print(f"gamma {best}: {alone['tokens_per_s']:.1f} tok/s, alpha {alone['alpha']:.3f}, mean accepted "
                   f"length {alone['mean_accepted_length']:.2f} with the model alone; "
                   f"{ours[best]['tokens_per_s']:.1f} tok/s, alpha {ours[best]['alpha']:.3f}, "
                   f"{ours[best]['mean_accepted_length']:.2f} with {models.proposer_label}")


COMPARE_HEADERS = ["draft", "layout", "gamma", "tok/s", "x plain", "alpha", "mean acc len", *PASS_HEADERS,
                   "feature KB/pass"]


def _compare_draft(result: dict, models: BenchModels, other: Path, prompts: list[list[int]], gammas: list[int],
                   max_new_tokens: int, ours: dict, colocated: dict, auto: dict, progress: Progress) -> None:
    """The same sweeps (draft service, auto, colocated, and alone at its best γ) with another
    draft of the target, each row beside the pair's draft's, as ratios to the same plain decoding
    (γ = 0 through the draft service). A feature draft's rows say how many kilobytes of features
    crossed to the draft per target pass (every committed position's feature once, bfloat16) and
    what encoding, the wire and decoding them cost (``feature_transport_us``)."""
    from specstream.models.feature_draft import feature_draft_layers, is_feature_draft
    from specstream.models.loader import read_config

    with tempfile.TemporaryDirectory() as logs, Stack(_spec(models, other, logs)) as stack:
        progress.print(f"\nthe same with {display(other)}: gamma {gammas} and auto, draft service ...")
        progress.phase(f"latency: {Path(other).name}, draft service")
        engine = stack.metrics_addresses["target"]
        theirs = sweep(stack.gateway_address, prompts, gammas, max_new_tokens, progress=progress, metrics=engine)
        theirs["auto"] = sweep(stack.gateway_address, prompts, ["auto"], max_new_tokens, progress=progress,
                               metrics=engine)["auto"]
    with tempfile.TemporaryDirectory() as logs, Stack(_spec(models, other, logs, colocate_draft=True)) as stack:
        progress.phase(f"latency: {Path(other).name}, draft colocated")
        theirs_colocated = sweep(stack.gateway_address, prompts, gammas, max_new_tokens, progress=progress,
                                 metrics=stack.metrics_addresses["target"])
    best = max((g for g in gammas if g), key=lambda g: theirs[g]["tokens_per_s"])
    with tempfile.TemporaryDirectory() as logs, Stack(StackSpec(
            str(models.target), str(other), max_gamma=16, weights=models.weights, dtype=models.dtype,
            log_dir=logs)) as stack:
        progress.phase(f"latency: {Path(other).name} alone, gamma {best}")
        alone = sweep(stack.gateway_address, prompts, [best], max_new_tokens, progress=progress)[best]
    plain_ids = ours[0]["token_ids"]
    check_runs_match(f"speculative output ({Path(other).name})", "plain decoding (gamma 0)", plain_ids,
                     {**{f"gamma {g}": theirs[g]["token_ids"] for g in gammas if g}, "auto": theirs["auto"]["token_ids"],
                      **{f"gamma {g}, colocated": theirs_colocated[g]["token_ids"] for g in gammas if g},
                      f"gamma {best}, alone": alone["token_ids"]})
    hidden = read_config(models.target).hidden_size
    widths = {name: hidden * len(feature_draft_layers(path)) if is_feature_draft(path) else 0
              for name, path in ((Path(models.require_draft()).name, models.draft), (Path(other).name, other))}
    feature_tokens = sum(len(p) - 1 + max_new_tokens for p in prompts)  # every committed position, once
    plain = ours[0]["tokens_per_s"]
    rows, entries = [], {}
    pair, named = Path(models.require_draft()).name, Path(other).name
    for label, runs, layout, keys in ((pair, ours, "service", gammas), (named, theirs, "service", gammas),
                                      (pair, {"auto": auto}, "service", ["auto"]),
                                      (named, theirs, "service", ["auto"]),
                                      (pair, colocated, "colocated", gammas),
                                      (named, theirs_colocated, "colocated", gammas),
                                      (f"{named} alone", {best: alone}, "service", [best])):
        for g in keys:
            if g == 0 and label != pair or g == 0 and layout == "colocated":
                continue
            r = runs[g]
            width = widths[named if label.startswith(named) else pair] if g else 0  # γ 0 asks the draft nothing
            kb = width * 2 * feature_tokens / r["passes"] / 1024
            rows.append([label, layout, g, r["tokens_per_s"], r["tokens_per_s"] / plain, r["alpha"] if g else "-",
                         r["mean_accepted_length"] or 1.0, *_pass_columns(r), kb if kb else "-"])
            entries[f"{label}, {layout}, gamma {g}"] = {**public(r), "speedup": r["tokens_per_s"] / plain,
                                                        "feature_kb_per_pass": kb}
    progress.print(f"\n{pair} beside {named} (x plain: gamma 0 through the draft service):\n"
                   + report.table(COMPARE_HEADERS, rows))
    compare = {"draft": display(other), "rows": entries, "best_gamma": best,
               "table_markdown": report.markdown_table(COMPARE_HEADERS, rows)}
    # The feature draft's transport and cost as it serves: the named draft's, or else the pair's.
    featured = next(((name, runs) for name, runs in ((named, theirs), (pair, ours)) if widths[name]), None)
    if featured is not None:
        name, runs = featured
        best_of = max((g for g in gammas if g), key=lambda g: runs[g]["tokens_per_s"])
        per_pass = max(1, round(feature_tokens / runs[best_of]["passes"]))  # features a pass sends, at its best γ
        compare["feature_transport_us"] = feature_transport_us(widths[name], per_pass)
        compare["costs"] = measure_feature_costs(models.target, other if name == named else models.draft,
                                                 models.dtype, result["costs"]["context"])
        progress.print(f"feature draft: c = {compare['costs']['c']:.3f} per guess "
                       f"({compare['costs']['draft_ms_per_guess']:.2f} ms, one thread); features: encoding, the "
                       f"wire format and decoding one pass's take {compare['feature_transport_us']:.0f} us")
    result["compare"] = compare


def feature_transport_us(width: int, count: int, repeats: int = 200) -> float:
    """Microseconds to turn ``count`` features of ``width`` (a pass's) from the target's tensor into
    the propose item's bytes, through the protobuf wire format, and back into the draft's tensor."""
    import torch

    from specstream_pb import draft_pb2
    from target_service.engine import feature_bytes

    hidden = torch.randn(count, width)
    begin = time.perf_counter()
    for _ in range(repeats):
        wire = draft_pb2.ProposeItem(seq_id=1, features=feature_bytes(hidden), feature_width=width).SerializeToString()
        got = draft_pb2.ProposeItem.FromString(wire).features
        torch.frombuffer(bytearray(got), dtype=torch.bfloat16).view(count, width)  # as the draft reads them
    return (time.perf_counter() - begin) / repeats * 1e6


def _dense(result: dict, models: BenchModels, draft: Path, prompts: list[list[int]], best: int, max_new_tokens: int,
           progress: Progress) -> None:
    """Our 4-bit serving beside our dense serving: the peers dequantize, as dense does."""
    with tempfile.TemporaryDirectory() as logs, Stack(_spec(models, draft, logs, weights="dense")) as stack:
        progress.print(f"\nthe same with dense weights: gamma 0 and {best} ...")
        progress.phase(f"latency: dense weights, gamma 0,{best}")
        dense = sweep(stack.gateway_address, prompts, [0, best], max_new_tokens, progress=progress)
    check_runs_match("speculative output (dense weights)", "plain decoding (dense weights)",
                     dense[0]["token_ids"], {f"gamma {best}": dense[best]["token_ids"]})
    result["dense"] = {g: public(r) for g, r in dense.items()}


def _write(result: dict, ours: dict[int, dict], gammas: list[int], out_dir: Path, with_hf: bool) -> None:
    """The speedup plot and ``latency.json`` (the peers' plot is drawn beside their table)."""
    report.plot_lines(out_dir / "latency_speedup.png", "Speedup over γ=0: measured vs theory", "γ",
                      "speedup (x)", {"measured": (gammas, [ours[g]["speedup"] for g in gammas]),
                                      "theory (measured α, c)": (gammas, [ours[g]["theory"] for g in gammas])},
                      hline=1.0)
    report.write_json(out_dir / "latency.json", result)
    print(f"\nwrote {out_dir / 'latency.json'}, {out_dir / 'latency_speedup.png'}"
          + (f", {out_dir / 'latency_vs_hf.png'}" if with_hf else ""), flush=True)


def _compare_with_peers(result: dict, ours: dict[int, dict], best: int, colocated: dict[int, dict],
                        best_colocated: int, models: BenchModels, prompts: list[list[int]], max_new_tokens: int,
                        out_dir: Path, progress: Progress) -> None:
    """transformers (plain in the serving dtype and in float32, assisted with our draft's layers,
    prompt lookup) and, when installed, llama.cpp on the same GGUF file; the stack is down by now."""
    progress.print("\nHugging Face transformers on the same checkpoints and prompts ...")
    progress.phase("latency: Hugging Face transformers")
    baseline = ours[0]["token_ids"]
    hf = hf_generate(models, prompts, max_new_tokens, progress=progress)
    if models.dtype != "float32":
        hf["plain_float32"] = hf_generate(models, prompts, max_new_tokens, dtype="float32", modes=("plain",),
                                          progress=progress)["plain"]
    peers = {f"HF {mode}": hf[mode] for mode in hf}
    llama = llama_cpp_generate(models, prompts, max_new_tokens, progress)
    if llama is not None:
        peers.update({f"llama.cpp {mode}": r for mode, r in llama.items()})
    result["peers"] = {name: {k: v for k, v in r.items() if k != "token_ids"}
                       | {"same_tokens_as_ours": r["token_ids"] == baseline} for name, r in peers.items()}
    plain = ours[0]["tokens_per_s"]
    weights = result["costs"]["weights"]  # e.g. "int4-a8 (210 matrices), 8-bit output layer"
    served = models.dtype + ("" if weights == "dense" else f", {weights.split(' (')[0]} weights")
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
    progress.print(report.table(["system", "dtype", "tok/s", "x specstream gamma=0", "draft"], rows))
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
    progress.print(f"ours plain / HF plain ({models.dtype}): {result['ours_plain_over_hf_plain']:.2f}x; ours best "
                   f"speculative / best HF assisted ({best_hf}): "
                   f"{result.get('ours_over_best_hf_assisted', float('nan')):.2f}x; identical outputs: "
                   f"{ {n: v['same_tokens_as_ours'] for n, v in result['peers'].items()} }")
    result["peers_table_markdown"] = report.markdown_table(["system", "dtype", "tok/s", "x specstream gamma=0", "draft"],
                                                           rows)
    report.plot_bars(out_dir / "latency_vs_hf.png", f"Batch-1 greedy tokens/s, {models.label}, same prompts",
                     "tokens/s", {"specstream γ=0": plain, f"specstream γ={best}": ours[best]["tokens_per_s"],
                                  f"specstream γ={best_colocated}, colocated": colocated[best_colocated]["tokens_per_s"],
                                  **({f"specstream γ={result['model_alone']['gamma']}, draft alone":
                                      result["model_alone"]["tokens_per_s"]} if "model_alone" in result else {}),
                                  **{f"specstream γ={g}, dense": r["tokens_per_s"] for g, r in dense.items()},
                                  **{name: r["tokens_per_s"] for name, r in peers.items()}})


def head_to_head(models: BenchModels, draft: Path, prompts: list[list[int]], max_new_tokens: int,
                 progress: Progress, rounds: int = HEAD_TO_HEAD_ROUNDS) -> dict:
    """Our served plain decoding and the default (``speculation=auto``, the draft service), on one
    stack as `specstream serve` runs it, against llama.cpp's plain decoding of the same prompts in
    a process of its own, in turns: ``rounds`` rounds, each system once a round, the order
    reversed every other round, so a slow spell of a shared machine falls on all three alike
    (the sweeps above run llama.cpp minutes after ours, and this VM's speed moves by a third
    between such minutes). Per round, each of ours ÷ llama.cpp's; overall, the tokens over the
    seconds of all rounds, and each ratio's median over the rounds."""
    progress.print(f"\nours and llama.cpp in turns, {rounds} rounds ...")
    progress.phase("latency: ours and llama.cpp in turns")
    runs: dict[str, list[dict]] = {"plain": [], "auto": [], "llama.cpp": []}
    with tempfile.TemporaryDirectory() as logs, Stack(_spec(models, draft, logs)) as stack:
        def ours() -> None:
            done = sweep(stack.gateway_address, prompts, [0, "auto"], max_new_tokens, progress=progress)
            runs["plain"].append(done[0])
            runs["auto"].append(done["auto"])

        def peer() -> None:
            done = run_apart(llama_cpp_runs, gguf=str(models.gguf), prompts=prompts, max_new_tokens=max_new_tokens,
                             modes=("plain",))["plain"]
            runs["llama.cpp"].append(done)
            for _ in prompts:
                progress.update()

        for round_ in range(rounds):
            for turn in (ours, peer) if round_ % 2 == 0 else (peer, ours):
                turn()
    check_runs_match("the head-to-head's output", "plain decoding", runs["plain"][0]["token_ids"],
                     {f"{name}, round {i + 1}": r["token_ids"] for name in ("plain", "auto")
                      for i, r in enumerate(runs[name])})
    speed = {name: [r["tokens_per_s"] for r in rs] for name, rs in runs.items()}
    pooled = {name: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for name, rs in runs.items()}
    out = {"rounds": rounds, "tokens_per_s": pooled, "runs_tokens_per_s": speed}
    for name in ("plain", "auto"):
        per_round = [ours_ / peer_ for ours_, peer_ in zip(speed[name], speed["llama.cpp"])]
        out[f"{name}_over_llama_cpp"] = pooled[name] / pooled["llama.cpp"]
        out[f"{name}_over_llama_cpp_runs"] = per_round
        out[f"{name}_over_llama_cpp_median"] = statistics.median(per_round)
    rows = [[f"round {i + 1}", speed["plain"][i], speed["auto"][i], speed["llama.cpp"][i],
             out["plain_over_llama_cpp_runs"][i], out["auto_over_llama_cpp_runs"][i]] for i in range(rounds)]
    rows.append(["all rounds", pooled["plain"], pooled["auto"], pooled["llama.cpp"], out["plain_over_llama_cpp"],
                 out["auto_over_llama_cpp"]])
    headers = ["", "ours plain tok/s", "ours default (auto) tok/s", "llama.cpp plain tok/s", "plain ÷ llama.cpp",
               "default ÷ llama.cpp"]
    progress.print(report.table(headers, rows))
    out["table_markdown"] = report.markdown_table(headers, rows)
    return out


def llama_cpp_available(models: BenchModels) -> bool:
    """Whether llama_cpp_generate runs: llama-cpp-python installed, and a GGUF file to run."""
    return models.gguf is not None and importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_generate(models: BenchModels, prompts: list[list[int]], max_new_tokens: int,
                       progress: Progress | None = None) -> dict | None:
    """llama.cpp (llama-cpp-python) greedy on the target's original GGUF file, plain and with its
    prompt-lookup draft, in a process of its own as a user runs it (inside this one its thread
    pool shared the cores with torch's and ran up to twice as slow); None (and a note) when the
    package or the file is not there. ``progress`` counts each generation."""
    say = progress.print if progress is not None else lambda text: print(text, flush=True)
    if not llama_cpp_available(models):
        say("llama.cpp: not installed (make peer)" if models.gguf is not None
            else "llama.cpp: the target has no GGUF file to run")
        return None
    if progress is not None:
        progress.phase("latency: llama.cpp")
    out = run_apart(llama_cpp_runs, gguf=str(models.gguf), prompts=prompts, max_new_tokens=max_new_tokens)
    if progress is not None:
        for _ in range(2 * len(prompts)):
            progress.update()
    return out


def llama_cpp_runs(gguf: str, prompts: list[list[int]], max_new_tokens: int,
                   modes: tuple[str, ...] = ("plain", "prompt_lookup")) -> dict:
    """What ``llama_cpp_generate`` runs in its own process: each prompt greedy, plain and with
    llama.cpp's prompt lookup (10 tokens), or only the ``modes`` asked for."""
    from llama_cpp import Llama  # optional: installed by `make peer`
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    results = {}
    for mode, draft in (("plain", None), ("prompt_lookup", LlamaPromptLookupDecoding(num_pred_tokens=10))):
        if mode not in modes:
            continue
        llm = Llama(model_path=gguf, n_ctx=2048, n_threads=os.cpu_count(), draft_model=draft, verbose=False)
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
