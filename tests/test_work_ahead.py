"""Working ahead (draft_service/work_ahead.py): after a reply, the draft drafts the round that
follows if the target keeps the whole chain and emits the draft's own bonus guess, and, with more
outcomes, the rounds that follow a shorter kept part of the chain and the draft's runner-up.

- Greedy output with a draft that works ahead after every call (token draft, feature draft, prompt
  lookup in front) is the target's plain greedy output, with rounds answered from work ahead and
  rounds that missed.
- A prepared round answers only the item it assumed: any other rollback, token, sampling settings
  or another stream's key drafts afresh, with the very reply a draft that never worked ahead gives.
- Sampling rows work ahead on the whole chain: with a token draft the output is token for token
  what it is without working ahead, with a feature draft under coupled verification plain
  sampling's; a prepared round's q is sent with its guesses, cut to the item's γ.
- A hit of the token draft is what it would have drafted afresh; a stop ends the work at its next
  forward, and what was drafted before it still answers.
- The other outcomes: each is answered only to its own item, a token draft's hit is what it would
  draft afresh, and a miss after their work (which wrote over the chain's positions) is answered
  as a draft that never worked ahead answers it.
- The work runs at SCHED_IDLE when asked, and the thread's policy is back after it, failed or not.
- tests/integration/test_work_ahead_stack.py: a draft service working ahead serves the stack.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from pathlib import Path

import pytest
from tests.support.engine_harness import naive_greedy, run_engine
from tests.support.feature_pair import PROMPTS

from draft_service.combined import NgramPlusModelProposer
from draft_service.feature import FeatureProposer
from draft_service.proposer import DraftProposer
from specstream.data.propose import ProposeItem, Proposer, features_expected
from specstream.data.sampling import SamplingParams
from specstream.models.feature_draft import load_feature_draft
from specstream.models.loader import load_model
from specstream.serving.compute import run_at_idle_priority
from specstream.serving.metrics import MALFORMED_CAUSES


class _AheadAfterEveryCall:
    """A proposer that works ahead after every reply, as the draft service does between requests."""

    def __init__(self, proposer, replies: list | None = None) -> None:
        self.proposer = proposer
        self.replies = replies if replies is not None else []  # every reply sent

    def __getattr__(self, name):
        return getattr(self.proposer, name)

    def propose(self, items):
        out = self.proposer.propose(items)
        self.replies.extend(out)
        self.proposer.work_ahead()
        return out


def _token_draft(model_zoo) -> DraftProposer:
    return DraftProposer(load_model(model_zoo["partial"]), max_slots=16, max_seq_len=512)


def _feature_draft(feature_pair) -> FeatureProposer:
    return FeatureProposer(load_feature_draft(feature_pair["draft"], Path), 16, 512)


@pytest.mark.parametrize(("kind", "gamma", "outcomes"), [
    *[(kind, gamma, 1) for kind in ("token", "feature", "ngram+feature") for gamma in (3, None)],
    ("token", 3, 4), ("feature", 3, 4), ("ngram+feature", None, 3)])
def test_greedy_with_a_draft_working_ahead_is_plain_greedy(model_zoo, feature_pair, kind, gamma, outcomes) -> None:
    draft = _token_draft(model_zoo) if kind == "token" else _feature_draft(feature_pair)
    draft.ahead.outcomes = outcomes
    if kind == "ngram+feature":
        draft = NgramPlusModelProposer(draft, 16, min_n=2)
    budgets = [30, 41, 25, 36]
    got, finals = run_engine(model_zoo["target"], None, PROMPTS, gamma=gamma, max_new_tokens=budgets,
                             proposer=_AheadAfterEveryCall(draft), config={"calibrate": False})
    for prompt, tokens, budget in zip(PROMPTS, got, budgets):
        assert tokens == naive_greedy(model_zoo["target"], prompt, budget)
    counts = draft.ahead.counts
    if gamma:  # a fixed γ drafts every step: rounds were prepared, and some answered, some missed
        assert counts["prepared"] > 0 and counts["hit"] > 0 and counts["miss"] > 0, counts
    if gamma and outcomes > 1:  # and some answered the runner-up after a refused guess
        assert counts["hit_runner_up"] > 0, counts
    assert sum(f.stats.rejections for f in finals) > 0


SAMPLING = [SamplingParams.from_settings(0.8, seed=11 + i) for i in range(4)]


def test_sampling_with_a_token_draft_working_ahead_is_sampling_without_it(model_zoo) -> None:
    """A token draft's prepared round of a sampling row holds the very draws and q a fresh round
    makes (the same keys, the same cache), so the target samples exactly what it samples when the
    draft never works ahead (itself tested against plain sampling in tests/test_sampling_exact.py),
    token for token, with rounds answered from the work and rounds that missed."""
    budgets = [30, 41, 25, 36]
    runs, steps = {}, {}
    for ahead in (False, True):
        draft = _token_draft(model_zoo)
        proposer = _AheadAfterEveryCall(draft) if ahead else draft
        runs[ahead], _ = run_engine(model_zoo["target"], None, PROMPTS, gamma=2, max_new_tokens=budgets,
                                    sampling=SAMPLING, proposer=proposer, config={"calibrate": False}, steps=steps)
    assert runs[True] == runs[False]
    counts = draft.ahead.counts
    assert counts["prepared"] > 0 and counts["hit"] > 0 and counts["miss"] > 0, counts
    assert _refused(steps) == 0  # every answer from the work was verified, none refused as malformed


def test_coupled_sampling_with_a_feature_draft_working_ahead_is_plain_sampling(model_zoo, feature_pair) -> None:
    """The feature draft drafts a sampling row's next round from its own predicted features, so its
    draws and q differ from a fresh round's; coupled verification keeps plain sampling's output
    token for token whatever is proposed, and Leviathan's rule is exact for any q the guesses were
    drawn from, which the prepared round sends with them."""
    budgets = [30, 41, 25, 36]
    draft = _feature_draft(feature_pair)
    coupled = {"calibrate": False, "speculative_sampling": "coupled"}
    steps: dict = {}
    got, _ = run_engine(model_zoo["target"], None, PROMPTS, gamma=2, max_new_tokens=budgets, sampling=SAMPLING,
                        proposer=_AheadAfterEveryCall(draft), config=coupled, steps=steps)
    plain, _ = run_engine(model_zoo["target"], None, PROMPTS, gamma=0, max_new_tokens=budgets, sampling=SAMPLING,
                          config=coupled)
    assert got == plain
    counts = draft.ahead.counts
    assert counts["prepared"] > 0 and counts["hit"] > 0, counts
    assert _refused(steps) == 0  # a refused reply decodes plainly, which coupled output would not show
    # Under Leviathan's rule a hit's guesses need the q they were drawn from (a sampling reply
    # without one is verified as a deterministic draft's, q one-hot): every reply carries a q row
    # per guess, and none is refused (a row that is no distribution or misses its guess: cause "q").
    draft, steps = _feature_draft(feature_pair), {}
    replies: list = []
    run_engine(model_zoo["target"], None, PROMPTS, gamma=2, max_new_tokens=budgets, sampling=SAMPLING,
               proposer=_AheadAfterEveryCall(draft, replies), config={"calibrate": False}, steps=steps)
    assert draft.ahead.counts["hit"] > 0 and _refused(steps) == 0, draft.ahead.counts
    assert all(r.q_width > 0 and len(r.q_probs) == len(r.tokens) * r.q_width for r in replies if r.tokens)


def _refused(steps: dict) -> float:
    """Draft replies the engine refused as malformed, every cause (its TargetMetrics, from run_engine)."""
    registry = steps["metrics"].registry
    return sum(registry.get_sample_value("specstream:draft_replies_malformed_total", {"cause": cause}) or 0.0
               for cause in MALFORMED_CAUSES)


def test_a_sampling_rows_prepared_round_answers_only_its_own_settings_with_the_q_it_drew_from(model_zoo) -> None:
    prompt, params = [5, 6, 7, 8, 9], SAMPLING[0]
    draft = _token_draft(model_zoo)
    draft.ahead.outcomes = 3  # a sampling row prepares the whole chain's round only
    reply = draft.propose([ProposeItem("s", 0, prompt, 3, params)])[0]
    draft.work_ahead()
    ready, = draft.ahead.prepared["s"]
    assert ready.whole and ready.sampling == params and len(ready.q[1]) == len(ready.tail) * ready.q[0]
    assumed = ProposeItem("s", reply.length, [reply.tokens[-1], ready.append[-1]], 2, params)
    for variant in (dataclasses.replace(assumed, sampling=SamplingParams.from_settings(0.8, seed=99)),
                    dataclasses.replace(assumed, sampling=SamplingParams.from_settings(0.9, seed=params.seed)),
                    dataclasses.replace(assumed, sampling=SamplingParams())):
        fresh, worked = _token_draft(model_zoo), _token_draft(model_zoo)
        for d in (fresh, worked):
            d.propose([ProposeItem("s", 0, prompt, 3, params)])
        worked.work_ahead()
        expected, got = fresh.propose([variant])[0], worked.propose([variant])[0]
        assert (got.tokens, got.q_ids, got.q_probs) == (expected.tokens, expected.q_ids, expected.q_probs)
        assert worked.ahead.counts["miss"] == 1 and worked.ahead.counts["hit"] == 0
    fresh = _token_draft(model_zoo)
    fresh.propose([ProposeItem("s", 0, prompt, 3, params)])
    expected, got = fresh.propose([assumed])[0], draft.propose([assumed])[0]
    assert draft.ahead.counts["hit"] == 1  # cut to the item's γ of 2, with its q rows
    assert (got.tokens, got.q_width, got.q_ids, got.q_probs) == \
        (expected.tokens, expected.q_width, expected.q_ids, expected.q_probs)


@pytest.mark.parametrize(("kind", "outcomes"), [("token", 1), ("feature", 3)])
def test_a_draft_in_the_targets_process_works_ahead_between_passes_and_stays_exact(model_zoo, feature_pair, kind,
                                                                                   outcomes) -> None:
    """LocalDraft with work_ahead: the engine's torch thread drafts the next round while the engine
    does a pass's host work (no wrapper calls the work here: the engine's after_verify does). The
    tiny models' host work is over before the thread starts the work, whose first check then stops
    it; here it ignores the check, so it runs whole and the next call waits for it."""
    draft = _token_draft(model_zoo) if kind == "token" else _feature_draft(feature_pair)
    draft.ahead.outcomes = outcomes
    budgets = [30, 41, 25, 36]
    steps: dict = {}
    got, _ = run_engine(model_zoo["target"], None, PROMPTS, gamma=3, max_new_tokens=budgets,
                        proposer=_WholeWork(draft), config={"calibrate": False}, work_ahead="normal", steps=steps)
    for prompt, tokens, budget in zip(PROMPTS, got, budgets):
        assert tokens == naive_greedy(model_zoo["target"], prompt, budget)
    counts = draft.ahead.counts
    assert counts["prepared"] > 0 and counts["hit"] + counts["miss"] > 0, counts
    # The target's /metrics count the work (up to the pass before the last, observed before each work).
    # Hits and misses are counted when a proposal is asked for, before the pass's verify: all of them.
    registry = steps["metrics"].registry
    for outcome in ("hit", "miss"):
        value = registry.get_sample_value("specstream:draft_work_ahead_total", {"outcome": outcome}) or 0.0
        assert value == counts[outcome], (outcome, value, counts)
    assert 0 < registry.get_sample_value("specstream:draft_work_ahead_total", {"outcome": "prepared"}) \
        <= counts["prepared"]  # all but the last pass's work


class _WholeWork:
    """A proposer whose work ahead runs whole, whatever waits for the thread."""

    def __init__(self, proposer) -> None:
        self.proposer = proposer

    def __getattr__(self, name):
        return getattr(self.proposer, name)

    def work_ahead(self, stop) -> None:
        self.proposer.work_ahead()


class _Work(Proposer):
    """A proposer stand-in whose work drafts until told to stop (at most 200 forwards), counting."""

    name, max_len, vocab_size, held, works_ahead = "work", 64, 32, 0, True

    def __init__(self) -> None:
        self.forwards = 0
        self.started = threading.Event()

    def propose(self, items):
        return [None for _ in items]

    def work_ahead(self, stop) -> None:
        self.started.set()
        for _ in range(200):
            if stop():
                return
            self.forwards += 1
            time.sleep(0.002)


def test_a_colocated_drafts_work_runs_after_a_verify_and_stops_when_the_thread_is_wanted() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from target_service.local_draft import LocalDraft

    compute = ThreadPoolExecutor(1)
    work = _Work()
    local = LocalDraft(work, compute, work_ahead="normal")
    local.after_verify(lambda: False)  # no reply yet: nothing to work on
    compute.submit(lambda: None).result()
    assert not work.started.is_set()
    asyncio.run(local.propose(0, [ProposeItem("s", 0, [1], 2)]))
    wanted = threading.Event()
    local.after_verify(wanted.is_set)
    assert work.started.wait(5)
    time.sleep(0.02)
    wanted.set()  # the engine wants the thread: the work stops before its next forward
    began = time.perf_counter()
    compute.submit(lambda: None).result()
    assert time.perf_counter() - began < 0.2 and 0 < work.forwards < 200
    local.after_verify(lambda: False)  # the reply was worked on once already
    compute.submit(lambda: None).result()
    assert work.forwards < 200
    off = LocalDraft(_Work(), compute)  # work_ahead off, the default: never
    asyncio.run(off.propose(0, [ProposeItem("s", 0, [1], 2)]))
    off.after_verify(lambda: False)
    compute.submit(lambda: None).result()
    assert not off.proposer.started.is_set()
    compute.shutdown()


def _first_round(draft, key="s", prompt=(5, 6, 7, 8, 9), gamma=3) -> tuple[ProposeItem, list[int], int]:
    item = ProposeItem(key, 0, list(prompt), gamma)
    reply = draft.propose([item])[0]
    return item, reply.tokens, reply.length


def test_a_prepared_round_answers_only_the_item_it_assumed(model_zoo) -> None:
    """Each variant of the assumed next item is a miss, answered bit for bit as by a draft that never
    worked ahead; the assumed item itself is a hit."""
    prompt = [5, 6, 7, 8, 9]
    ahead = _token_draft(model_zoo)
    _, chain, length = _first_round(ahead, prompt=prompt)
    ahead.work_ahead()
    bonus = ahead.ahead.prepared["s"][0].append[-1]
    assumed = ProposeItem("s", length, [chain[-1], bonus], 3)
    other = (bonus + 1) % 300
    variants = {
        "another bonus": ProposeItem("s", length, [chain[-1], other], 3),
        "a refused guess": ProposeItem("s", length - 1, [other], 3),
        "sampling": ProposeItem("s", length, [chain[-1], bonus], 3, SamplingParams.from_settings(0.8, seed=1)),
    }
    for why, variant in variants.items():
        fresh = _token_draft(model_zoo)
        _first_round(fresh, prompt=prompt)
        expected = fresh.propose([variant])[0]
        draft = _token_draft(model_zoo)
        _first_round(draft, prompt=prompt)
        draft.work_ahead()
        reply = draft.propose([variant])[0]
        assert (reply.tokens, reply.length, reply.q_probs) == (expected.tokens, expected.length, expected.q_probs), why
        assert draft.ahead.counts["miss"] == 1 and draft.ahead.counts["hit"] == 0, why
    # Another stream's sequence (another key) with the same tokens was never worked ahead on.
    fresh = _token_draft(model_zoo)
    _first_round(fresh, key="t", prompt=prompt)
    draft = _token_draft(model_zoo)
    _first_round(draft, prompt=prompt)
    _first_round(draft, key="t", prompt=prompt)
    draft.work_ahead()
    assert "t" in draft.ahead.prepared and "s" not in draft.ahead.prepared  # only the latest call's chains
    reply = ahead.propose([assumed])[0]
    assert ahead.ahead.counts["hit"] == 1 and len(reply.tokens) == 3


def test_a_token_drafts_hit_is_what_it_would_draft_afresh(model_zoo) -> None:
    prompt = [5, 6, 7, 8, 9]
    hits = 0
    for gamma in (1, 2, 4):
        draft = _token_draft(model_zoo)
        _, chain, length = _first_round(draft, prompt=prompt, gamma=gamma)
        draft.work_ahead()
        assumed = ProposeItem("s", length, [chain[-1], draft.ahead.prepared["s"][0].append[-1]], gamma)
        fresh = _token_draft(model_zoo)
        _first_round(fresh, prompt=prompt, gamma=gamma)
        expected, reply = fresh.propose([assumed])[0], draft.propose([assumed])[0]
        assert (reply.tokens, reply.length) == (expected.tokens, expected.length)
        hits += draft.ahead.counts["hit"]
    assert hits == 3


def test_a_stop_ends_the_work_and_what_was_drafted_still_answers(model_zoo, feature_pair) -> None:
    # stop() is read before the work's forwards: the token draft's 1 + 4 guesses after its first,
    # the feature draft's after each row's check (its chain of 4 is fed before its bonus guess).
    for draft, allowed in ((_token_draft(model_zoo), 3), (_feature_draft(feature_pair), 6)):
        features = _zero_features(draft, 4)
        reply = draft.propose([ProposeItem("s", 0, [5, 6, 7, 8, 9], 4, **features)])[0]
        assert len(reply.tokens) == 4
        asked = []

        def stop(asked: list = asked, allowed: int = allowed) -> bool:
            asked.append(1)
            return len(asked) > allowed

        draft.work_ahead(stop=stop)
        ready, = draft.ahead.prepared["s"]
        assert 0 < len(ready.tail) < 4  # stopped before the round was whole
        features = _zero_features(draft, len(ready.append))  # the target's, of the chain and the bonus
        reply = draft.propose([ProposeItem("s", ready.rollback_to, ready.append, 4, **features)])[0]
        assert reply.tokens == ready.tail and draft.ahead.counts["hit"] == 1


def _after_one_round(model_zoo, prompt: list[int], outcomes: int) -> tuple[DraftProposer, DraftProposer]:
    """Two token drafts after the same first round: one that never worked ahead, and one that then
    worked ahead on ``outcomes`` outcomes."""
    fresh, worked = _token_draft(model_zoo), _token_draft(model_zoo)
    worked.ahead.outcomes = outcomes
    for draft in (fresh, worked):
        _first_round(draft, prompt=prompt)
    worked.work_ahead()
    return fresh, worked


def test_each_outcome_answers_its_own_item_and_a_token_drafts_hit_is_what_it_would_draft_afresh(model_zoo) -> None:
    prompt = [5, 6, 7, 8, 9]
    draft = _token_draft(model_zoo)
    draft.ahead.outcomes = 4  # the whole chain of 3, then the runner-up at each of its guesses
    _, chain, length = _first_round(draft, prompt=prompt)
    draft.work_ahead()
    rounds = draft.ahead.prepared["s"]
    start = length - 2  # where the chain's first guess sits (the draft held all guesses but the last)
    assert [(r.whole, r.rollback_to) for r in rounds] == [(True, length), (False, start + 2), (False, start + 1),
                                                        (False, start)]
    assert [r.cached for r in rounds] == [False, False, False, True]  # the last one's work is what the cache holds
    for k in [*range(3), "whole"]:
        if k == "whole":  # the whole chain kept, the draft's bonus guess right
            item, kept = ProposeItem("s", length, rounds[0].append, 3), chain[:2]
        else:
            refused = next(r for r in rounds if r.rollback_to == start + k and not r.whole)
            assert refused.append[0] != chain[k]  # the runner-up, not the guess the chain made
            item, kept = ProposeItem("s", start + k, refused.append, 3), chain[:k]
        fresh, worked = _after_one_round(model_zoo, prompt, outcomes=4)
        expected, reply = fresh.propose([item])[0], worked.propose([item])[0]
        assert (reply.tokens, reply.length) == (expected.tokens, expected.length), k
        assert worked.ahead.counts["hit"] == 1 and worked.ahead.counts["hit_runner_up"] == (k != "whole"), k
        assert worked.plans["s"].length == reply.length, k  # held whole again: the next round can be worked on
        # The round after it (the target kept every guess, then emitted 7): the same reply as a
        # draft that never worked ahead, and worked on (rounds another outcome's work wrote over
        # had their tokens fed again).
        committed = [*prompt, *kept, *item.append, *reply.tokens, 7]
        follow = ProposeItem("s", reply.length, committed[reply.length:], 3)
        assert worked.propose([follow])[0].tokens == fresh.propose([follow])[0].tokens, k


def test_a_token_draft_prepares_the_runner_ups_its_chain_reaches(model_zoo) -> None:
    """Three outcomes asked, a chain of one guess: the whole chain's round and the runner-up's."""
    draft = _token_draft(model_zoo)
    draft.ahead.outcomes = 3
    _first_round(draft, prompt=[5, 6, 7, 8, 9], gamma=1)
    draft.work_ahead()
    assert [r.whole for r in draft.ahead.prepared["s"]] == [True, False]


@pytest.mark.parametrize("why", ["another bonus", "a refused guess", "a refused first guess"])
def test_a_miss_after_the_other_outcomes_work_is_answered_as_without_it(model_zoo, why) -> None:
    """The other outcomes' work writes over the chain's positions; an item none of them assumed
    has those tokens fed again, and gets the very reply a draft that never worked ahead gives."""
    prompt = [5, 6, 7, 8, 9]
    probe = _token_draft(model_zoo)
    probe.ahead.outcomes = 4
    _, chain, length = _first_round(probe, prompt=prompt)
    probe.work_ahead()
    bonus = probe.ahead.prepared["s"][0].append[-1]
    runner_ups = {r.rollback_to: r.append[0] for r in probe.ahead.prepared["s"] if not r.whole}
    other = next(t for t in range(300) if t not in (bonus, runner_ups[length - 1]) and t != chain[-1])
    item = {"another bonus": ProposeItem("s", length, [chain[-1], (bonus + 1) % 300], 3),
            "a refused guess": ProposeItem("s", length - 1, [other], 3),  # the chain's second guess kept
            "a refused first guess": ProposeItem("s", length - 2, [(runner_ups[length - 2] + 1) % 300], 3)}[why]
    fresh, draft = _after_one_round(model_zoo, prompt, outcomes=4)
    expected, reply = fresh.propose([item])[0], draft.propose([item])[0]
    assert (reply.tokens, reply.length) == (expected.tokens, expected.length)
    assert draft.ahead.counts["miss"] == 1 and draft.ahead.counts["hit"] == 0


def test_a_feature_draft_prepares_each_outcome_from_its_runner_up(feature_pair) -> None:
    draft = _feature_draft(feature_pair)
    draft.ahead.outcomes = 3
    reply = draft.propose([ProposeItem("s", 0, [5, 6, 7, 8, 9], 3, **_zero_features(draft, 4))])[0]
    draft.work_ahead()
    rounds = draft.ahead.prepared["s"]
    assert [(r.whole, r.rollback_to, len(r.append), len(r.tail)) for r in rounds] == \
        [(True, reply.length, 4, 3), (False, reply.length, 1, 3), (False, reply.length, 2, 3)]
    assert rounds[1].append[0] != reply.tokens[0] and rounds[2].append == [reply.tokens[0], rounds[2].append[1]]
    assert rounds[2].append[1] != reply.tokens[1]
    item = ProposeItem("s", reply.length, rounds[2].append, 3,
                       **_zero_features(draft, features_expected(reply.length, 2)))
    assert draft.propose([item])[0].tokens == rounds[2].tail
    assert draft.ahead.counts["hit_runner_up"] == 1


def _zero_features(draft, count: int) -> dict:
    if not isinstance(draft, FeatureProposer):
        return {}
    return {"features": bytes(2 * draft.feature_width * count), "feature_width": draft.feature_width}


@pytest.mark.parametrize("proposer", ["model", "ngram+model"])
def test_the_config_sets_how_many_outcomes_the_draft_prepares(model_zoo, proposer) -> None:
    from draft_service.build import build_proposer
    from specstream.data.config import DraftConfig, ModelSpec

    spec = ModelSpec(str(model_zoo["partial"]))
    built = build_proposer(DraftConfig(spec, proposer=proposer, max_seq_len=256, work_ahead="idle",
                                       work_ahead_outcomes=3))
    assert built.ahead.outcomes == 3
    # Not working ahead: one outcome (no runner-ups kept for it on the way); more is refused.
    assert build_proposer(DraftConfig(spec, proposer=proposer, max_seq_len=256)).ahead.outcomes == 1


def test_an_unprivileged_process_that_could_not_leave_sched_idle_works_at_its_own_priority(monkeypatch, caplog):
    """Without root, a thread at SCHED_IDLE goes back only where RLIMIT_NICE allows its nice value
    (the default limit, 0, allows none): the work then runs at the thread's own policy, said once."""
    import resource

    from specstream.serving import compute

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (0, 0))
    monkeypatch.setattr(compute, "_idle_checked", None)
    assert not compute.may_leave_idle()
    seen = []
    before = os.sched_getscheduler(0)
    compute.run_at_idle_priority(lambda: seen.append(os.sched_getscheduler(0)), idle=True)
    compute.run_at_idle_priority(lambda: seen.append(os.sched_getscheduler(0)), idle=True)
    assert seen == [before, before]
    assert sum("could not leave SCHED_IDLE" in r.message for r in caplog.records) == 1
    monkeypatch.setattr(resource, "getrlimit", lambda which: (20, 20))  # nice 0 allowed: 20 - 20 <= 0
    assert compute.may_leave_idle()


def test_the_work_runs_at_idle_priority_and_the_thread_gets_its_own_back() -> None:
    seen = []
    before = os.sched_getscheduler(0)
    run_at_idle_priority(lambda: seen.append(os.sched_getscheduler(0)), idle=True)
    run_at_idle_priority(lambda: seen.append(os.sched_getscheduler(0)), idle=False)

    def fails() -> None:
        seen.append(os.sched_getscheduler(0))
        raise RuntimeError("the work failed")

    run_at_idle_priority(fails, idle=True)  # logged, not raised
    assert seen == [os.SCHED_IDLE, before, os.SCHED_IDLE] and os.sched_getscheduler(0) == before
