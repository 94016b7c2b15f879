"""`bench overlap`'s served part: the draft service working ahead (draft_service/work_ahead.py), measured.

Stacks of the pair as served, side by side, differing only in where the draft runs (its own
service, or inside the target: ``--colocate-draft``, whose draft works ahead on the target's torch
thread during a pass's host work), in the draft's ``--work-ahead`` (off,
idle: at SCHED_IDLE, normal) and ``--work-ahead-outcomes`` (1: the whole chain kept; 3: also the
runner-up after the chain's first or second guess), in the target's threads (its default, one
per core: the two share the cores; 1: the draft has a core of its own), in whether the target
asks the draft for a pass as soon as the pass before is verified (``--draft-early``) or when it
starts (the default), and in where the draft computes (its event loop's thread, the default, or a
worker: ``--compute-thread``, as a draft working ahead does). Every request goes to each stack in
turn (the order alternating per request), so a slow stretch of the machine falls on all of them:
each row is a ratio to the stack with neither (the defaults) at the same threads and γ, in the
same run. Batch 1; greedy, or sampled at one temperature (seeded per prompt).

Per row: tokens/s, the draft's hit rate (items answered from a prepared round over the items
that had one) and the share of its hits on a runner-up's round, and the target engine's own
per-pass time (its compute, waiting for the draft, host work). Every row's token ids must equal
the defaults': greedy, every stack at every γ. Sampled, under Leviathan's rule the text depends on
the guesses (the distribution does not), so only the stacks that guess as the defaults do are
compared, at every fixed γ: not those working ahead (the feature draft drafts a prepared round from
its own predicted features, so its draws and q differ from a fresh round's; tests/test_work_ahead.py
checks that exactness holds), and not ``auto`` (its γ schedule decides which noise settles a
position). The JSON names what was compared.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from tools.bench import report
from tools.bench.checks import check_runs_match
from tools.bench.models import BenchModels
from tools.bench.passes import metric_samples, per_pass_ms, read_counters
from tools.launcher import Stack, StackSpec
from tools.progress import Progress

__all__ = ["SETTINGS", "Setting", "planned_generations", "served"]

class Setting(NamedTuple):
    work_ahead: str = "off"  # the draft's --work-ahead
    threads: int = 0  # the target's (0: one per core)
    early: bool = False  # the target's --draft-early
    worker: bool = False  # the draft's --compute-thread (working ahead implies it)
    outcomes: int = 1  # the draft's --work-ahead-outcomes
    colocated: bool = False  # the draft inside the target (--colocate-draft)

    @property
    def defaults(self) -> Setting:
        """The stack this one is compared with: the defaults at the same target threads and layout."""
        return Setting(threads=self.threads, colocated=self.colocated)


SETTINGS = [Setting(), Setting(early=True), Setting(worker=True), Setting("idle"), Setting("normal"),
            Setting("normal", outcomes=3), Setting(threads=1), Setting("idle", threads=1),
            Setting("idle", threads=1, outcomes=3), Setting(colocated=True), Setting("normal", colocated=True),
            Setting("normal", outcomes=3, colocated=True)]
HEADERS = ["gamma", "layout", "target threads", "asks early", "draft computes on", "work ahead", "outcomes", "tok/s", "x defaults",
           "hit rate", "of them runner-up", "prepared per pass", "target ms", "draft ms", "host ms"]
_COUNTER = "specstream:draft_work_ahead_total"


def planned_generations(n_prompts: int, gammas: list, settings: list[Setting] = SETTINGS) -> int:
    return len(settings) * len(gammas) * n_prompts


def served(models: BenchModels, gammas: list[int | str], n_prompts: int, max_new_tokens: int,
           progress: Progress, settings: list[Setting] = SETTINGS, temperature: float = 0.0) -> tuple[dict, list[list]]:
    """Runs every γ ("auto": the controller; 0: plain) on every setting (each one's defaults among
    them), greedy or sampled at ``temperature`` (seed: the prompt's index); returns the JSON entry
    and the table's rows."""
    prompts = models.prompts(n_prompts)
    with contextlib.ExitStack() as stacks:
        running = {}
        for setting in settings:
            progress.phase(f"overlap: starting the stack with {_name(setting)}")
            logs = stacks.enter_context(tempfile.TemporaryDirectory())
            running[setting] = stacks.enter_context(Stack(_spec(models, logs, setting)))
        progress.phase(f"overlap: served, {len(settings)} stacks interleaved")
        runs = _interleaved(running, prompts, gammas, max_new_tokens, progress, temperature)
    rows, entries = [], {}
    checked = [g for g in gammas if temperature == 0 or g != "auto"]
    compared = [s for s in settings[1:] if temperature == 0 or s.work_ahead == "off"]
    for gamma in checked:
        check_runs_match(f"gamma {gamma}", "the defaults",
                         runs[(gamma, settings[0])]["token_ids"],
                         {_name(s): runs[(gamma, s)]["token_ids"] for s in compared})
    for gamma in gammas:
        for setting in settings:
            r = runs[(gamma, setting)]
            r["x_without"] = r["tokens_per_s"] / runs[(gamma, setting.defaults)]["tokens_per_s"]
            parts = r["pass_ms"] or {}
            draft_on = "target's thread" if setting.colocated else \
                "worker" if setting.worker or setting.work_ahead != "off" else "loop"
            rows.append([gamma, "colocated" if setting.colocated else "service", setting.threads or "default",
                         "yes" if setting.early else "no", draft_on, setting.work_ahead,
                         setting.outcomes if setting.work_ahead != "off" else "-", r["tokens_per_s"], r["x_without"],
                         r["hit_rate"], r["runner_up_hits"] / r["hits"] if r["hits"] else "-", r["prepared_per_pass"], parts.get("target", "-"), parts.get("draft", "-"),
                         parts.get("host", "-")])
            entries[f"gamma {gamma}, {_name(setting)}"] = {k: v for k, v in r.items() if k != "token_ids"}
    return {"settings": [_name(s) for s in settings], "compared": [_name(s) for s in settings if s != s.defaults],
            "gammas": gammas, "prompts": len(prompts), "temperature": temperature,
            "tokens_checked": {"gammas": checked, "stacks": [_name(s) for s in compared]},
            "max_new_tokens": max_new_tokens, "rows": entries,
            "table_markdown": report.markdown_table(HEADERS, rows)}, rows


def _name(setting: Setting) -> str:
    return (("colocated, " if setting.colocated else "")
            + f"work ahead {setting.work_ahead}" + (f" ({setting.outcomes} outcomes)" if setting.outcomes != 1 else "")
            + f", target threads {setting.threads or 'default'}"
            + (", asking early" if setting.early else "") + (", draft on a worker thread" if setting.worker else ""))


def _spec(models: BenchModels, logs: str, setting: Setting) -> StackSpec:
    return StackSpec(str(models.target), str(models.require_draft()), max_gamma=16, dtype=models.dtype,
                     log_dir=logs, metrics=True, work_ahead=setting.work_ahead, work_ahead_outcomes=setting.outcomes,
                     colocate_draft=setting.colocated,
                     target_threads=setting.threads,
                     extra_target_args=["--draft-early"] if setting.early else [],
                     extra_draft_args=["--compute-thread"] if setting.worker else [],
                     **({"weights": models.weights, **models.proposing}))


def _interleaved(running: dict, prompts: list[list[int]], gammas: list, max_new_tokens: int,
                 progress: Progress, temperature: float) -> dict:
    from specstream_client import Client

    settings = list(running)
    with contextlib.ExitStack() as opened:
        clients = {s: opened.enter_context(Client(stack.gateway_address, timeout=600)) for s, stack in running.items()}
        for client in clients.values():  # warm-up
            client.generate(prompts[0], max_new_tokens=16, ignore_eos=True)
        target = {s: stack.metrics_addresses["target"] for s, stack in running.items()}
        # The work's counter: the draft service's, or the target's where the draft runs inside it.
        draft = {s: stack.metrics_addresses["target" if s.colocated else "draft"] for s, stack in running.items()}
        totals = {(g, s): {"seconds": 0.0, "tokens": 0, "token_ids": [], "passes": None, "ahead": {}}
                  for g in gammas for s in settings}
        for i, prompt in enumerate(prompts):
            for j, gamma in enumerate(gammas):
                for s in settings if (i + j) % 2 == 0 else settings[::-1]:
                    t = totals[(gamma, s)]
                    before, ahead = read_counters(target[s]), _ahead(draft[s])
                    began = time.perf_counter()
                    reply = clients[s].generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True,
                                                speculation=gamma or "off",
                                                **({"temperature": temperature, "seed": i} if temperature else {}))
                    t["seconds"] += time.perf_counter() - began
                    t["tokens"] += len(reply.token_ids)
                    t["token_ids"].append(list(reply.token_ids))
                    _add(t, "passes", _difference(before, read_counters(target[s])))
                    _add(t, "ahead", _difference(ahead, _ahead(draft[s])))
                    progress.update()
    return {key: _summary(t) for key, t in totals.items()}


def _ahead(address: str) -> dict[str, float]:
    counts = dict.fromkeys(("prepared", "hit", "miss", "hit_runner_up"), 0.0)
    counts.update({labels["outcome"]: value for labels, value in metric_samples(address, _COUNTER)})
    return counts


def _difference(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def _add(t: dict, field: str, difference: dict[str, float]) -> None:
    t[field] = {k: (t[field] or {}).get(k, 0.0) + v for k, v in difference.items()}


def _summary(t: dict) -> dict:
    passes, ahead = t["passes"], t["ahead"]
    had = ahead["hit"] + ahead["miss"]
    return {"tokens_per_s": t["tokens"] / t["seconds"], "token_ids": t["token_ids"],
            "pass_ms": per_pass_ms(dict.fromkeys(passes, 0.0), passes),
            "hit_rate": ahead["hit"] / had if had else "-", "hits": ahead["hit"], "misses": ahead["miss"],
            "runner_up_hits": ahead["hit_runner_up"],
            "prepared_per_pass": ahead["prepared"] / passes["passes"] if passes["passes"] else "-"}


def plot(path: Path, label: str, entry: dict) -> None:
    """Each setting's tokens/s over the defaults' at the same threads, per γ."""
    gammas = [str(g) for g in entry["gammas"]]
    series = {name: (gammas, [entry["rows"][f"gamma {g}, {name}"]["x_without"] for g in entry["gammas"]])
              for name in entry["compared"]}
    kind = f"sampled at T={entry['temperature']:g}" if entry.get("temperature") else "greedy"
    report.plot_lines(path, f"Working ahead / asking early, served, batch 1, {kind}, {label}", "gamma",
                      "tokens/s over the defaults", series, hline=1.0)
