"""A draft's reply is untrusted input (target_service/drafting.py, ``malformed``): a reply that names
another sequence, carries more tokens than asked, an id outside the target's vocabulary, a held
length past what the draft was sent and guessed, a tree that was not asked for or is not one, or
(a sampled row) a q table that is not one distribution per token with the drawn token in its
support, or a tree whose siblings are not distinct draws from one q, is refused for its row: that row
decodes plainly that pass, the refusal is counted per cause in the target's metrics, and no other
row is touched. Through the real engine: the output stays the target's plain output, token for token.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
from tests.support.engine_harness import naive_greedy, speculation

from draft_service.proposer import DraftProposer
from specstream.data.config import ModelSpec, TargetConfig
from specstream.data.engine import SequenceRequest
from specstream.data.propose import Proposal, ProposeItem
from specstream.data.sampling import SamplingParams
from specstream.models.loader import load_model
from specstream.serving.metrics import MALFORMED_CAUSES
from target_service.drafting import malformed
from target_service.engine import Engine
from target_service.inprocess import run_requests
from target_service.local_draft import LocalDraft

VOCAB = 100
SAMPLED = SamplingParams(temperature=1.0, seed=3)


def _item(gamma: int = 3, sampling: SamplingParams = SamplingParams()) -> ProposeItem:
    return ProposeItem(7, 4, [11, 12], gamma, sampling)  # the draft held 4 tokens, is sent 2 more


def _good(sampled: bool = False) -> Proposal:
    """Three guesses; sampled: each drawn from a q of width 2 that gives it probability."""
    if not sampled:
        return Proposal([5, 6, 7], 8, key=7)
    return Proposal([5, 6, 7], 8, q_width=2, q_ids=[5, 9, 6, 9, 7, 9], q_probs=[0.75, 0.25, 0.5, 0.5, 1.0, 0.0], key=7)


CORRUPTIONS = {
    "seq_id": (False, lambda p: dataclasses.replace(p, key=8), r"Proposal.seq_id=8 answers ProposeItem.seq_id=7"),
    "tokens": (False, lambda p: dataclasses.replace(p, tokens=[5, 6, 7, 8]), r"4 tokens for gamma=3"),
    "token_id": (False, lambda p: dataclasses.replace(p, tokens=[5, VOCAB, 7]), r"holds 100, outside"),
    "token_id negative": (False, lambda p: dataclasses.replace(p, tokens=[-1]), r"holds -1, outside"),
    "length": (False, lambda p: dataclasses.replace(p, length=10), r"Proposal.length=10: more than the 9"),
    "q sizes": (True, lambda p: dataclasses.replace(p, q_probs=p.q_probs[:-1]), r"q_probs 5 entries for 3"),
    "q id": (True, lambda p: dataclasses.replace(p, q_ids=[5, VOCAB, 6, 9, 7, 9]), r"q_ids holds an id outside"),
    "q negative": (True, lambda p: dataclasses.replace(p, q_probs=[1.25, -0.25, 0.5, 0.5, 1.0, 0.0]),
                   r"q_probs holds a probability outside \[0, 1\]"),
    "q nan": (True, lambda p: dataclasses.replace(p, q_probs=[0.75, 0.25, math.nan, 0.5, 1.0, 0.0]),
              r"row 1 sums to nan, not 1 \(or holds NaN\)"),
    "q sum": (True, lambda p: dataclasses.replace(p, q_probs=[0.75, 0.25, 0.5, 0.4, 1.0, 0.0]),
              r"row 1 sums to 0.9"),
    "q support": (True, lambda p: dataclasses.replace(p, q_probs=[0.75, 0.25, 0.5, 0.5, 0.0, 1.0]),
                  r"row 2 gives no probability to the token it drew \(7\)"),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_each_malformed_reply_is_refused_naming_its_cause(name) -> None:
    sampled, corrupt, why = CORRUPTIONS[name]
    item = _item(sampling=SAMPLED if sampled else SamplingParams())
    assert malformed(_good(sampled), item, 3, VOCAB, greedy=not sampled) == ("", "")
    cause, message = malformed(corrupt(_good(sampled)), item, 3, VOCAB, greedy=not sampled)
    assert cause == name.split()[0] and cause in MALFORMED_CAUSES
    assert re.search(why, message), message


def test_what_a_well_formed_reply_may_do() -> None:
    """Fewer guesses than asked (even none), a q row summing to 1 within float32 rounding, no key (an
    in-process proposer), no q for a greedy row or from a model-free proposer: all verified as sent."""
    item = _item()
    assert malformed(Proposal([], 6), item, 3, VOCAB, greedy=True) == ("", "")
    assert malformed(Proposal([5], 7, key=None), item, 3, VOCAB, greedy=True) == ("", "")
    rounding = dataclasses.replace(_good(True), q_probs=[0.7500001, 0.25, 0.5, 0.5, 1.0, 0.0])
    assert malformed(rounding, _item(sampling=SAMPLED), 3, VOCAB, greedy=False) == ("", "")
    assert malformed(Proposal([5, 6, 7], 8), _item(sampling=SAMPLED), 3, VOCAB, greedy=False) == ("", "")
    # A greedy row's q is not read: whatever it holds, nothing is refused for it.
    assert malformed(CORRUPTIONS["q sum"][1](_good(True)), item, 3, VOCAB, greedy=True) == ("", "")


TREE_ITEM = dataclasses.replace(_item(), branches=2)  # gamma 3, two branches allowed
GOOD_TREE = Proposal([5, 6, 7, 8, 9], 8, key=7, parents=[0, 1, 2, 0, 1])  # a chain of 3, two branches
TREE_CORRUPTIONS = {
    "parent out of range": ("tree", [0, 1, 2, 0, 9], r"Proposal.parents\[4\]=9: a parent is node 0..4"),
    "parent not before child": ("tree", [0, 2, 2, 0, 1], r"Proposal.parents\[1\]=2"),
    "deeper than gamma": ("tree", [0, 1, 2, 3, 0], r"token 3 is 4 deep, past gamma=3"),
    "entries": ("tree", [0, 1, 2, 0], r"4 entries for 5 tokens"),
}


@pytest.mark.parametrize("name", TREE_CORRUPTIONS)
def test_a_malformed_tree_is_refused_naming_its_cause(name) -> None:
    cause, parents, why = TREE_CORRUPTIONS[name]
    assert malformed(GOOD_TREE, TREE_ITEM, 3, VOCAB, greedy=True) == ("", "")
    got, message = malformed(dataclasses.replace(GOOD_TREE, parents=parents), TREE_ITEM, 3, VOCAB, greedy=True)
    assert got == cause and re.search(why, message), message


def test_a_tree_beyond_its_budget_or_not_asked_for_is_refused() -> None:
    bigger = dataclasses.replace(GOOD_TREE, tokens=[5, 6, 7, 8, 9, 10], parents=[0, 1, 2, 0, 1, 2])
    assert malformed(bigger, TREE_ITEM, 3, VOCAB, greedy=True)[0] == "tokens"  # 6 > gamma 3 + 2 branches
    small = Proposal([5, 6, 7], 8, key=7, parents=[0, 1, 0])  # within gamma, but a tree
    cause, message = malformed(small, _item(), 3, VOCAB, greedy=True)  # no branches allowed
    assert cause == "tree" and "allowed none (branches=0)" in message


# A sampled tree: a chain of 3, then two runner-ups of the first guess's race, each row of q the
# one its token was drawn from (siblings share theirs).
SAMPLED_TREE = Proposal([5, 6, 7, 9, 4], 8, key=7, parents=[0, 1, 2, 0, 0], q_width=3,
                        q_ids=[5, 9, 4, 6, 9, 2, 7, 1, 2, 5, 9, 4, 5, 9, 4],
                        q_probs=[0.5, 0.3, 0.2, 0.6, 0.4, 0.0, 0.9, 0.1, 0.0, 0.5, 0.3, 0.2, 0.5, 0.3, 0.2])
SAMPLED_TREE_CORRUPTIONS = {
    "without q": ({"q_width": 0, "q_ids": [], "q_probs": []}, r"a sampled row's tree comes with q"),
    "siblings' q differ": ({"q_probs": [*SAMPLED_TREE.q_probs[:9], 0.4, 0.4, 0.2, 0.5, 0.3, 0.2]},
                           r"q row 3 differs from its first sibling's \(row 0\)"),
    "a sibling drawn twice": ({"tokens": [5, 6, 7, 9, 9]}, r"token 4 \(9\) repeats a sibling's token under node 0"),
}


@pytest.mark.parametrize("name", SAMPLED_TREE_CORRUPTIONS)
def test_a_sampled_tree_whose_siblings_are_not_draws_from_one_q_is_refused(name) -> None:
    item = dataclasses.replace(TREE_ITEM, sampling=SAMPLED)
    assert malformed(SAMPLED_TREE, item, 3, VOCAB, greedy=False) == ("", "")
    fields, why = SAMPLED_TREE_CORRUPTIONS[name]
    cause, message = malformed(dataclasses.replace(SAMPLED_TREE, **fields), item, 3, VOCAB, greedy=False)
    assert cause == "tree" and re.search(why, message), message


class _Corrupting:
    """The real draft's proposer with every reply for sequence ``victim`` corrupted one way."""

    def __init__(self, inner: DraftProposer, victim: int, corrupt) -> None:
        self.inner, self.victim, self.corrupt = inner, victim, corrupt
        self.corrupted = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        replies = self.inner.propose(items)
        for i, (item, reply) in enumerate(zip(items, replies)):
            if item.key == self.victim and reply.tokens:
                replies[i] = self.corrupt(reply, item)
                self.corrupted += 1
        return replies


def _longer(p: Proposal, count: int) -> Proposal:
    """``p`` padded to ``count`` tokens (a tree's extra ones hang under the root)."""
    extra = count - len(p.tokens)
    return dataclasses.replace(p, tokens=p.tokens + [1] * extra, parents=p.parents and p.parents + [0] * extra)


ENGINE_CORRUPTIONS = {
    "seq_id": lambda p, item: dataclasses.replace(p, key=item.key + 1000),
    "tokens": lambda p, item: _longer(p, item.gamma + item.branches + 1),  # past what a tree may hold
    "token_id": lambda p, item: dataclasses.replace(p, tokens=[*p.tokens[:-1], 10**6]),
    "length": lambda p, item: dataclasses.replace(p, length=item.rollback_to + len(item.append) + len(p.tokens) + 1),
    "tree": lambda p, item: dataclasses.replace(p, parents=[len(p.tokens)] * len(p.tokens)),  # each its own parent
}


@pytest.mark.parametrize("cause", ENGINE_CORRUPTIONS)
def test_a_malformed_reply_costs_its_row_one_plain_pass_and_nothing_else(model_zoo, cause) -> None:
    """Two sequences, one whose every reply is corrupted: both decode to the target's plain greedy
    output, the other keeps its accepted guesses, the victim gets none, and the target counts every
    corrupted reply under its cause (and nothing under the others)."""
    target = model_zoo["target"]
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    # The engine numbers sequences from 1 in the order they come: the second request is sequence 2.
    proposer = _Corrupting(DraftProposer(load_model(model_zoo["partial"]), 8, 256), victim=2,
                           corrupt=ENGINE_CORRUPTIONS[cause])
    config = TargetConfig(model=ModelSpec(str(target)), max_slots=2, max_seq_len=256, max_gamma=8)
    engine = Engine(load_model(target), config, LocalDraft(proposer))
    requests = [SequenceRequest(str(i), p, 24, speculation=speculation(3)) for i, p in enumerate(prompts)]
    results = sorted(run_requests(engine, requests, timeout_s=60), key=lambda r: r.request_id)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == naive_greedy(target, prompt, 24), result.request_id
    fine, victim = (r.final.stats for r in results)
    assert fine.accepted_tokens > 0 and victim.draft_tokens == 0 and proposer.corrupted > 0
    registry = engine.metrics.registry
    counts = {c: registry.get_sample_value("specstream:draft_replies_malformed_total", {"cause": c})
              for c in MALFORMED_CAUSES}
    assert counts == {c: float(proposer.corrupted if c == cause else 0) for c in MALFORMED_CAUSES}
