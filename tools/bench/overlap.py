"""`specstream bench overlap`: can the draft work while the target verifies, on this machine?

Drafting that works ahead (the draft guesses round k+1 while the target verifies round k) hides
the draft's time only if the two computations really run side by side. On a machine whose cores
the target's forward already fills, they do not: the draft takes a core the target's thread team
needs, and the whole team waits for it. This benchmark measures that directly, with the served
models as they serve (the target's threads as a target service takes them, the draft on one
thread in a process of its own, as the draft service runs it):

- V(γ): the target's forward over γ + 1 positions after 200 cached ones, alone, and V_b(γ) while
  the draft process runs propose calls back to back;
- D(γ): one propose call of the pair's draft for γ guesses (appending one token, with its feature
  for a feature draft), alone, and D_b(γ) while the target runs forwards back to back.

From them, per γ: a sequential pass S = V + D (what the engine does today, RPC aside); a pass with
the draft overlapped from the verify's start, O = D_b + (1 − D_b / V_b) · V when the draft finishes
first (the target runs at V / V_b of its speed meanwhile; else symmetric), the best case of work-ahead
(every guess right); and what a wrong work-ahead guess costs the target, O − V, on top of the
sequential pass it still needs. Work-ahead pays when its hit rate exceeds h* = (O − V) / (S − O + O − V)
= (O − V) / D. Prints a table, writes ``overlap.json`` and ``overlap.png``.

Then the served part (tools/bench/ahead.py): the pair's stacks with the draft service
working ahead (off / idle / normal, the target on all cores or on one, asking early or not), side by side on the same
requests: what working ahead gives as built, RPC and acceptance included. Its rows go to
``overlap.json`` ("served") and ``ahead.png``.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from pathlib import Path

from specstream.data.sampling import SamplingParams
from tools.bench import ahead, report
from tools.bench.latency import display
from tools.bench.models import BenchModels
from tools.progress import Progress

__all__ = ["overlapped_pass_ms", "run"]

CONTEXT = 200
HEADERS = ["gamma", "verify ms", "verify, draft busy", "draft call ms", "draft call, target busy",
           "sequential pass", "overlapped pass", "saving", "a wrong guess costs", "break-even hit rate"]


def overlapped_pass_ms(v: float, v_busy: float, d: float, d_busy: float) -> float:
    """ms of a pass whose verify (v alone, v_busy beside the draft) and draft call (d, d_busy) start
    together: both run at their side-by-side speed until the first finishes, the other then alone."""
    if d_busy <= v_busy:
        return d_busy + (1.0 - d_busy / v_busy) * v
    return v_busy + (1.0 - v_busy / d_busy) * d


def run(models: BenchModels, out_dir: Path, gammas: list[int] | None = None, seconds: float = 2.0,
        quiet: bool = False, served_prompts: int = 4, max_new_tokens: int = 96,
        served_settings: list[ahead.Setting] = ahead.SETTINGS, temperature: float = 0.0) -> dict:
    """``temperature``: the served part's requests, greedy (0) or sampled (the alone and
    side-by-side timings are of greedy calls either way)."""
    SamplingParams(temperature=temperature)  # a bad one is refused now, naming it, not after the stacks start
    gammas = gammas or [1, 2, 4]
    ctx = mp.get_context("spawn")
    to_target, to_draft, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    spec = {"target": str(models.target), "draft": str(models.require_draft()), "dtype": models.dtype,
            "weights": models.weights, "seconds": seconds, "gammas": gammas}
    with Progress(4 * len(gammas), "timings", "overlap", quiet=quiet) as progress:
        procs = [ctx.Process(target=_target_side, args=(spec, to_target, results), daemon=True),
                 ctx.Process(target=_draft_side, args=(spec, to_draft, results), daemon=True)]
        for p in procs:
            p.start()
        try:
            measured: dict[tuple[str, str, int], float] = {}

            def ask(queue, *command) -> None:
                queue.put(command)
                side, what, gamma, value = results.get(timeout=900)
                if isinstance(value, str):
                    raise RuntimeError(f"the {side} process failed: {value}")
                measured[(side, what, gamma)] = value
                progress.update()

            for gamma in gammas:  # each alone, the other side idle
                progress.phase(f"overlap: gamma {gamma}, alone")
                ask(to_target, "alone", gamma)
                ask(to_draft, "alone", gamma)
            for gamma in gammas:  # each timed while the other runs back to back
                progress.phase(f"overlap: gamma {gamma}, side by side")
                to_draft.put(("busy", gamma))
                ask(to_target, "timed", gamma)
                to_draft.put(("stop", gamma))
                measured[("draft", "busy", gamma)] = results.get(timeout=900)[3]
                to_target.put(("busy", gamma))
                ask(to_draft, "timed", gamma)
                to_target.put(("stop", gamma))
                measured[("target", "busy", gamma)] = results.get(timeout=900)[3]
        finally:
            for queue in (to_target, to_draft):
                queue.put(("quit", 0))
            for p in procs:
                p.join(30)
    rows, data = [], {"models": models.label, "target": display(models.target), "draft": display(models.draft),
                      "dtype": models.dtype, "context": CONTEXT, "gammas": {}}
    for gamma in gammas:
        v, v_b = measured[("target", "alone", gamma)], measured[("target", "timed", gamma)]
        d, d_b = measured[("draft", "alone", gamma)], measured[("draft", "timed", gamma)]
        sequential, overlapped = v + d, overlapped_pass_ms(v, v_b, d, d_b)
        wrong = max(overlapped - v, 0.0)
        entry = {"verify_ms": v, "verify_draft_busy_ms": v_b, "draft_ms": d, "draft_target_busy_ms": d_b,
                 "sequential_ms": sequential, "overlapped_ms": overlapped, "saving": 1.0 - overlapped / sequential,
                 "wrong_guess_ms": wrong, "break_even_hit_rate": min(wrong / d, 1.0) if d > 0 else None}
        data["gammas"][gamma] = entry
        rows.append([gamma, v, v_b, d, d_b, sequential, overlapped, entry["saving"], wrong,
                     entry["break_even_hit_rate"]])
    print(report.table(HEADERS, rows), flush=True)
    data["table_markdown"] = report.markdown_table(HEADERS, rows)
    served_gammas = [0, *gammas, "auto"]  # γ 0 shows the stacks' spread: nothing drafts there
    with Progress(ahead.planned_generations(served_prompts, served_gammas, served_settings), "generations",
                  "overlap, served", quiet=quiet) as progress:
        data["served"], served_rows = ahead.served(models, served_gammas, served_prompts, max_new_tokens, progress,
                                                   served_settings, temperature)
    print(f"\nserved, batch 1, {'greedy' if not temperature else f'sampled at T={temperature:g}'}: the target asking "
          "early, the draft working ahead (x defaults: over the stack with neither at the same target threads and "
          "gamma, requests interleaved)\n" + report.table(ahead.HEADERS, served_rows), flush=True)
    ahead.plot(out_dir / "ahead.png", models.label, data["served"])
    report.write_json(out_dir / "overlap.json", data)
    report.plot_stacked(out_dir / "overlap.png", f"A pass, sequential and overlapped, {models.label}", "ms",
                        [f"γ={g} {kind}" for g in gammas for kind in ("seq", "overlap")],
                        {"pass": [data["gammas"][g][k] for g in gammas for k in ("sequential_ms", "overlapped_ms")]})
    print(f"\nwrote {out_dir / 'overlap.json'}, {out_dir / 'overlap.png'}, {out_dir / 'ahead.png'}", flush=True)
    return data


# ----- the two processes ------------------------------------------------------------------------
def _serve_commands(side: str, commands, results, once) -> None:
    """Answers (command, γ): "alone"/"timed" -> the median ms of ``once(γ)`` over the spec's seconds;
    "busy" -> ``once(γ)`` back to back until "stop", then the mean ms of its calls."""
    try:
        while True:
            command, gamma = commands.get()
            if command == "quit":
                return
            if command in ("alone", "timed"):
                results.put((side, command, gamma, _median_ms(lambda: once(gamma), _SECONDS[0])))
            elif command == "busy":
                calls, spent = 0, 0.0
                while commands.empty():
                    began = time.perf_counter()
                    once(gamma)
                    spent += time.perf_counter() - began
                    calls += 1
                commands.get()  # "stop"
                results.put((side, "busy", gamma, 1000 * spent / max(calls, 1)))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((side, "error", 0, f"{type(exc).__name__}: {exc}"))


_SECONDS = [2.0]


def _median_ms(fn, seconds: float) -> float:
    for _ in range(5):
        fn()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 10:
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def _target_side(spec: dict, commands, results) -> None:
    import torch

    from specstream.models.loader import load_model
    from specstream.models.registry import resolve_model
    from specstream.serving.compute import cpu_share

    _SECONDS[0] = spec["seconds"]
    torch.set_num_threads(cpu_share())  # as a target service takes them (--threads 0)
    model = load_model(Path(spec["target"]), dtype=spec["dtype"], resolve=resolve_model, weights=spec["weights"])
    width = max(spec["gammas"]) + 1
    cache = model.new_cache(1, CONTEXT + width + 1)
    slot, start = torch.tensor([0]), torch.tensor([CONTEXT])
    with torch.inference_mode():
        model(torch.zeros(1, CONTEXT, dtype=torch.int64), cache, slot, torch.tensor([0]))

        def verify(gamma: int) -> None:
            with torch.inference_mode():
                model(torch.zeros(1, gamma + 1, dtype=torch.int64), cache, slot, start)  # [1, γ+1] positions

        _serve_commands("target", commands, results, verify)


def _draft_side(spec: dict, commands, results) -> None:
    import torch

    from draft_service.build import build_proposer
    from specstream.data.config import DraftConfig, ModelSpec
    from specstream.data.propose import ProposeItem

    _SECONDS[0] = spec["seconds"]
    torch.set_num_threads(1)  # as the draft service runs it
    proposer = build_proposer(DraftConfig(ModelSpec(spec["draft"], spec["dtype"]), max_slots=2,
                                          max_seq_len=CONTEXT + 64))
    width = proposer.feature_width

    def item(rollback: int, count: int, gamma: int) -> ProposeItem:
        features = {"features": bytes(2 * width * (count - (rollback == 0))), "feature_width": width} if width else {}
        return ProposeItem(0, rollback, [1] * count, gamma, **features)  # zeros: the compute does not depend on them

    proposer.propose([item(0, CONTEXT, 1)])

    def call(gamma: int) -> None:  # one new token after the context, γ guesses; the state rolls back each time
        proposer.propose([item(CONTEXT, 1, gamma)])

    _serve_commands("draft", commands, results, call)
