"""`specstream bench gamma`: choosing γ — fixed values, Hugging Face's heuristic, Leviathan's
batch-1 optimum and our goodput controller, with the draft model, prompt lookup (n-gram) and
n-gram+model proposers — on several workloads and batch sizes, in one run, as ratios.

Workloads (``WORKLOADS``): ``code`` (continue held-out standard-library source: predictable),
``chat`` (held-out chat prompts with the model's template, or free text for a model without one),
``repetitive`` (a passage, then its first half again: the continuation copies it, where n-gram
lookup shines), ``sampled`` (the chat prompts at temperature 1, seeded), and ``mix`` (all of them
interleaved, in the same batches). Batch size n: n requests at a time (n KV slots, top-up
batching), 2n requests per workload beyond batch 1.

Every setting runs on a fresh engine (in this process, the draft in-process too: no RPC), so each
controller starts knowing nothing and learns α and costs during the run, as a new server would.
Greedy workloads must give the same tokens under every setting (BenchmarkError otherwise).

What it does not know: how the engine or controller work; it only drives them.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

from specstream.data.sampling import GREEDY, SamplingParams
from specstream.serving.compute import on_torch_thread
from tools.bench import report
from tools.bench.checks import check_runs_match
from tools.bench.models import BenchModels
from tools.progress import Progress

WORKLOADS = ("code", "chat", "repetitive", "sampled", "mix")
FIXED_GAMMAS = (0, 1, 2, 4, 6, 8)
PROPOSERS = ("model", "ngram", "ngram+model")


@dataclass(frozen=True)
class Setting:
    name: str  # how tables show it
    mode: str  # "off", "fixed" or "auto"
    gamma: int = 0  # fixed mode
    policy: str = "goodput"  # the controller's policy for auto
    proposer: str = "model"


def settings(fixed: tuple[int, ...] = FIXED_GAMMAS, proposers: tuple[str, ...] = PROPOSERS) -> list[Setting]:
    out = [Setting("γ=0", "off")] if 0 in fixed else []
    out += [Setting(f"γ={g}", "fixed", g) for g in fixed if g]
    out += [Setting("HF heuristic", "auto", policy="hf"), Setting("Leviathan", "auto", policy="leviathan")]
    out += [Setting("ours" if p == "model" else f"ours {p}", "auto", proposer=p) for p in proposers]
    return out


@dataclass
class Job:
    prompt: list[int]
    sampling: SamplingParams
    kind: str  # the workload it came from


def workloads(models: BenchModels, n: int) -> dict[str, list[Job]]:
    """n prompts per workload; ``mix`` takes them all, interleaved."""
    from tools.bench.prompts import held_out_prompts

    tok = models.tokenizer()
    code = held_out_prompts(tok, 2 * n, 64)
    chat = models.prompts(n) if models.chat else code[n:]
    passages = held_out_prompts(tok, 3 * n, 96)[2 * n:]
    repetitive = [p + tok.encode("\n\n") + p[: len(p) // 2] for p in passages]
    out = {
        "code": [Job(p, GREEDY, "code") for p in code[:n]],
        "chat": [Job(p, GREEDY, "chat") for p in chat],
        "repetitive": [Job(p, GREEDY, "repetitive") for p in repetitive],
        "sampled": [Job(p, SamplingParams(temperature=1.0, seed=1000 + i), "sampled") for i, p in enumerate(chat)],
    }
    out["mix"] = [job for group in zip(*out.values()) for job in group]
    return out


class _Models:
    """The target and draft, loaded once for every setting."""

    def __init__(self, models: BenchModels) -> None:
        self.spec = models
        self.target = models.load("target")
        self.draft = models.load("draft")

    def proposer(self, kind: str, slots: int, max_len: int):
        from draft_service.combined import NgramPlusModelProposer
        from draft_service.feature import FeatureProposer
        from draft_service.ngram import NgramProposer
        from draft_service.proposer import DraftProposer

        if kind == "ngram":
            return NgramProposer(slots, max_len)
        kind_of_draft = FeatureProposer if self.spec.feature_draft else DraftProposer
        model = on_torch_thread(kind_of_draft, self.draft, slots, max_len)  # its cache: torch work
        return model if kind == "model" else NgramPlusModelProposer(model, slots)


def run_setting(loaded: _Models, setting: Setting, jobs: list[Job], batch: int, max_new_tokens: int,
                progress: Progress | None = None) -> dict:
    """``jobs`` on a fresh engine under ``setting``; ``progress`` counts each request as it finishes."""
    from specstream.data.config import ModelSpec, TargetConfig
    from specstream.data.engine import SequenceRequest, Speculation
    from target_service.engine import Engine
    from target_service.inprocess import run_requests
    from target_service.local_draft import LocalDraft

    max_len = max(len(j.prompt) for j in jobs) + max_new_tokens + 32
    config = TargetConfig(model=ModelSpec(str(loaded.spec.target)), max_slots=batch, max_seq_len=max_len,
                          max_gamma=16, gamma_policy=setting.policy)
    draft = None if setting.mode == "off" else LocalDraft(loaded.proposer(setting.proposer, batch, max_len))
    engine = Engine(loaded.target, config, draft)
    asyncio.run(engine.time_draft())  # as a new server does before it serves (not in the timed run)
    spec = Speculation(setting.mode, setting.gamma)
    requests = [SequenceRequest(str(i), job.prompt, max_new_tokens, speculation=spec, sampling=job.sampling)
                for i, job in enumerate(jobs)]
    started = time.perf_counter()
    results = run_requests(engine, requests, timeout_s=1200,
                           on_finished=None if progress is None else lambda finished: progress.update())
    seconds = time.perf_counter() - started
    stats = [r.final.stats for r in results]
    tokens = sum(len(r.token_ids) for r in results)
    accepted = sum(s.accepted_tokens for s in stats)
    rejections = sum(s.rejections for s in stats)
    passes = sum(s.target_passes - 1 for s in stats)
    histogram: dict[int, int] = {}
    for s in stats:
        for g, count in enumerate(s.gamma_histogram):
            histogram[g] = histogram.get(g, 0) + count
    return {
        "tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
        "proposed": sum(s.draft_tokens for s in stats), "accepted": accepted, "rejections": rejections,
        "alpha": accepted / (accepted + rejections) if accepted + rejections else None,
        "decode_passes": passes, "mean_gamma": sum(g * c for g, c in histogram.items()) / passes if passes else 0.0,
        "gamma_histogram": {str(g): c for g, c in sorted(histogram.items())},
        "token_ids": [r.token_ids for r in results],
        "greedy": [job.sampling.greedy for job in jobs],
    }


def run(models: BenchModels, out_dir: Path, batches: list[int], n_prompts: int = 4, max_new_tokens: int = 48,
        names: list[str] | None = None, fixed: tuple[int, ...] = FIXED_GAMMAS,
        proposers: tuple[str, ...] = PROPOSERS, repeats: int = 1, quiet: bool = False) -> dict:
    """``repeats`` > 1 runs every setting that many times, interleaved (all settings once, then all
    again, ...), and reports each setting's median tokens/s: on a shared machine whose speed drifts
    over minutes, interleaving keeps the drift from favouring whichever setting ran in a fast spell.
    Progress on stderr (tools.progress; ``quiet``: plain lines, never a bar), counted in
    requests."""
    models.require_draft()
    loaded = _Models(models)
    chosen = settings(fixed, proposers)
    data: dict = {"model": models.label, "dtype": models.dtype, "max_new_tokens": max_new_tokens,
                  "repeats": repeats, "settings": [s.name for s in chosen], "runs": {}}
    data["runs"] = _other_rows(out_dir / "gamma.json", data, {f"{b}/{n}" for b in batches for n in names or WORKLOADS})
    plan = {batch: batch_jobs(models, batch, n_prompts, names or WORKLOADS) for batch in batches}
    total = repeats * len(chosen) * sum(len(jobs) for by_name in plan.values() for jobs in by_name.values())
    with Progress(total, "requests", "gamma", quiet=quiet) as progress:
        for batch, by_name in plan.items():
            for name, jobs in by_name.items():
                progress.phase(f"gamma: batch {batch}, {name}")
                runs = _measure_workload(loaded, chosen, jobs, batch, name, max_new_tokens, repeats, progress)
                data["runs"][f"{batch}/{name}"] = _summary(runs) | {"target_weights": loaded.target.weights}
                # after every workload: a long run keeps what it measured
                report.write_json(out_dir / "gamma.json", data)
    _print_and_plot(data, out_dir)
    return data


def batch_jobs(models: BenchModels, batch: int, n_prompts: int,
               names: list[str] | tuple[str, ...]) -> dict[str, list[Job]]:
    """Each named workload's requests at batch size ``batch``: ``n_prompts`` of them at batch 1
    (``mix``: every workload's), 2n beyond (the batch refills once)."""
    per_workload = n_prompts if batch == 1 else max(n_prompts, 2 * batch // 4)
    all_jobs = workloads(models, per_workload)
    out = {}
    for name in names:
        jobs = all_jobs[name]
        out[name] = (jobs * (2 * batch // len(jobs) + 1))[: 2 * batch] if batch > 1 else jobs
    return out


def _measure_workload(loaded: _Models, chosen: list[Setting], jobs: list[Job], batch: int, name: str,
                      max_new_tokens: int, repeats: int, progress: Progress) -> dict[str, dict]:
    """Every setting on one workload, ``repeats`` times interleaved; each setting's median run,
    its greedy tokens checked against the other runs' and settings'."""
    repeated: dict[str, list[dict]] = {s.name: [] for s in chosen}
    for _ in range(repeats):
        for setting in chosen:
            result = run_setting(loaded, setting, jobs, batch, max_new_tokens, progress)
            repeated[setting.name].append(result)
            progress.print(f"batch {batch} {name:10s} {setting.name:18s} {result['tokens_per_s']:7.1f} tok/s "
                           f"mean γ {result['mean_gamma']:.2f}")
    for results in repeated.values():
        _check_greedy({f"run {i}": r for i, r in enumerate(results)}, batch, name)
    runs = {n: _median(results) for n, results in repeated.items()}
    _check_greedy(runs, batch, name)
    return runs


def _other_rows(path: Path, data: dict, measured: set[str]) -> dict:
    """The rows ("batch/workload") this run does not measure, kept from an earlier ``gamma.json`` of
    the same model, dtype, budget and settings (so ``--batch-sizes 1`` and ``--batch-sizes 8,32``, or
    one workload at one batch size, can be run apart); nothing when that file is absent or from
    another configuration."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    same = all(old.get(k) == data[k] for k in ("model", "dtype", "max_new_tokens", "settings"))
    return {key: run for key, run in old.get("runs", {}).items()
            if same and key not in measured}


def _median(results: list[dict]) -> dict:
    """The run with the median tokens/s, with every run's tokens/s beside it."""
    ranked = sorted(results, key=lambda r: r["tokens_per_s"])
    return {**ranked[len(ranked) // 2], "tokens_per_s_runs": [r["tokens_per_s"] for r in results]}


def _check_greedy(runs: dict[str, dict], batch: int, workload: str) -> None:
    """Greedy requests give the same tokens under every setting (sampled ones are checked for
    their distribution by the test suite, not here)."""
    reference = next(iter(runs.values()))
    keep = [i for i, greedy in enumerate(reference["greedy"]) if greedy]
    check_runs_match(f"batch {batch} {workload}: greedy output", "the first setting",
                     [reference["token_ids"][i] for i in keep],
                     {name: [r["token_ids"][i] for i in keep] for name, r in runs.items()})


def _summary(runs: dict[str, dict]) -> dict:
    plain = runs["γ=0"]["tokens_per_s"] if "γ=0" in runs else None
    fixed = {name: r["tokens_per_s"] for name, r in runs.items() if name.startswith("γ=")}
    best_fixed = max(fixed, key=fixed.get)
    out = {"best_fixed": best_fixed, "settings": {}}
    for name, r in runs.items():
        entry = {k: v for k, v in r.items() if k not in ("token_ids", "greedy")}
        entry["over_plain"] = r["tokens_per_s"] / plain if plain else None
        entry["over_best_fixed"] = r["tokens_per_s"] / fixed[best_fixed]
        out["settings"][name] = entry
    return out


def tables(data: dict, markdown: bool = False) -> str:
    """Per batch size, one row per workload: plain tok/s, the best fixed γ, and every other setting
    as a ratio to the best fixed γ; then ours against the targets (ratio to plain, mean γ chosen)."""
    fmt = report.markdown_table if markdown else report.table
    names = [n for n in data["settings"] if not n.startswith("γ=")]
    out = []
    for batch in sorted({int(key.split("/")[0]) for key in data["runs"]}):
        rows = []
        for key, summary in data["runs"].items():
            if int(key.split("/")[0]) != batch:
                continue
            s = summary["settings"]
            best = summary["best_fixed"]
            rows.append([key.split("/")[1], f"{s['γ=0']['tokens_per_s']:.1f}",
                         f"{best} ({s[best]['tokens_per_s']:.1f})",
                         *[f"{s[n]['over_best_fixed']:.2f}" for n in names],
                         f"{s['ours']['over_plain']:.2f}", f"{s['ours']['mean_gamma']:.1f}"])
        out.append(f"batch {batch}\n" + fmt(["workload", "γ=0 tok/s", "best fixed (tok/s)",
                                              *[f"{n} ÷ best fixed" for n in names], "ours ÷ γ=0", "ours mean γ"],
                                             rows))
    return "\n\n".join(out)


def _print_and_plot(data: dict, out_dir: Path) -> None:
    print(tables(data))
    report.plot_bars(out_dir / "gamma_vs_best_fixed.png", "ours / best fixed γ (1.0 = as fast as the best fixed γ)",
                     "ratio", {key: s["settings"]["ours"]["over_best_fixed"] for key, s in data["runs"].items()})
