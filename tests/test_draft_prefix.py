"""The draft's prefix cache (draft_service/prefix_state.py): a new sequence continues from the
state an earlier one left, bit for bit what a fresh prefill makes, only under the same salt and
tokens; a feature draft told the prefix is cached (ProposeItem.cached_prefix) reads no features
for it, and one that holds fewer says how much it holds; kept slots give way to new sequences.

The tests drive the proposers as the target does: each round sends the tokens the target
"committed" (here: the draft's first guess and a fixed token, so that rounds both accept and
reject) with, for a feature draft, the features of their positions (one fixed random row per
position: a prefix's features are the same in every sequence that has it, as the target's are)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_service.combined import NgramPlusModelProposer
from draft_service.feature import FeatureProposer
from draft_service.proposer import DraftProposer
from specstream.data.prefix import BLOCK
from specstream.data.propose import Proposal, ProposeItem, features_expected
from specstream.data.sampling import GREEDY, SamplingParams
from specstream.models.feature_draft import load_feature_draft
from specstream.models.loader import load_model
from target_service.engine import feature_bytes

SAMPLED = SamplingParams(temperature=0.8, top_k=50, seed=7)
PROMPT = [(37 * i + 11) % 250 + 2 for i in range(45)]


def _proposer(kind: str, model_zoo, feature_pair, slots: int = 8, kept: int = -1):
    if kind == "feature":
        return FeatureProposer(load_feature_draft(feature_pair["draft"], Path), slots, 256, prefix_slots=kept)
    return DraftProposer(load_model(model_zoo["partial"]), max_slots=slots, max_seq_len=256, prefix_slots=kept)


class _Target:
    """What the target's drafting sends one proposer for one sequence: rollbacks, appends, features."""

    def __init__(self, proposer, width: int, key: str, tokens: list[int], sampling: SamplingParams = GREEDY,
                 salt: str = "") -> None:
        self.proposer, self.width, self.key, self.salt = proposer, width, key, salt
        self.tokens, self.sampling, self.held = list(tokens), sampling, 0
        self.prompt_len = len(tokens)

    def features(self, start: int, count: int) -> bytes:
        if not self.width:
            return b""
        table = torch.randn(512, self.width, generator=torch.Generator().manual_seed(5))
        return feature_bytes(table[start:start + count])

    def item(self, gamma: int = 3, cached: int = 0) -> ProposeItem:
        first = self.held == 0
        assert first or not cached, "only a first item claims a cached prefix"
        start = self.held + cached
        count = features_expected(start, len(self.tokens) - start)
        extra = {"features": self.features(max(start - 1, 0), count), "feature_width": self.width} if self.width else {}
        if first:
            extra.update(output_start=self.prompt_len, cache_salt=self.salt, cached_prefix=cached)
        return ProposeItem(self.key, self.held, self.tokens[self.held:], gamma, self.sampling, **extra)

    def round(self, gamma: int = 3, cached: int = 0) -> Proposal:
        """One call; the target keeps the first guess and then a token of its own."""
        [reply] = self.proposer.propose([self.item(gamma, cached)])
        self.held = min(reply.length, len(self.tokens))
        if reply.tokens:
            self.tokens += [reply.tokens[0], 5 + len(self.tokens) % 7]
        return reply


def _run(proposer, width: int, history: list[tuple[str, list[int]]], rounds: int, sampling=GREEDY,
         salt: str = "") -> list[Proposal]:
    """Each sequence of ``history`` (key, prompt) for ``rounds`` rounds then released; every reply."""
    replies = []
    for key, prompt in history:
        target = _Target(proposer, width, key, prompt, sampling, salt)
        replies += [target.round() for _ in range(rounds)]
        proposer.release([key])
    return replies


def _same(a: list[Proposal], b: list[Proposal]) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x.tokens, x.length, x.parents, x.q_ids, x.q_probs, x.error) == \
               (y.tokens, y.length, y.parents, y.q_ids, y.q_probs, y.error)


@pytest.mark.parametrize("kind", ["token", "feature"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_restored_state_proposes_bit_for_bit_what_a_fresh_prefill_does(kind, sampling, model_zoo, feature_pair):
    """A conversation's next turn (take-over) and another request sharing its start (a copy)
    propose with the cache exactly what they propose without it: the same guesses, and for
    sampled rows the same q, to the last bit."""
    on, off = (_proposer(kind, model_zoo, feature_pair, kept=k) for k in (-1, 0))
    width = on.feature_width
    first = _Target(on, width, "turn1", PROMPT, sampling)
    for _ in range(6):
        first.round()
    turn1 = first.tokens[:first.held]
    history = [("turn1", PROMPT), ("turn2", turn1 + [9, 8, 7, 6]), ("shared", PROMPT[:40] + [3, 4])]
    on.release(["turn1"])
    with_cache = _run(on, width, history[1:], 5, sampling)
    _run(off, width, history[:1], 6, sampling)
    without = _run(off, width, history[1:], 5, sampling)
    assert on.prefixes.cache.hits == 2 and off.prefixes.cache is None
    assert on.prefixes.cache.hit_tokens >= (len(turn1) // BLOCK - 1) * BLOCK + 32
    _same(with_cache, without)
    assert any(reply.tokens for reply in with_cache)


def test_a_claimed_prefix_is_read_without_its_features_and_one_held_in_part_says_how_much(model_zoo, feature_pair):
    on, off = (_proposer("feature", model_zoo, feature_pair, kept=k) for k in (-1, 0))
    width = on.feature_width
    first = _Target(on, width, "turn1", PROMPT)
    for _ in range(4):
        first.round()
    held = first.held  # the draft's state is good for these tokens
    on.release(["turn1"])
    turn2 = first.tokens[:held] + [9, 8, 7, 6, 5]

    # The claim the draft can meet: no features sent for it, the proposals of a full resend.
    claim = held // BLOCK * BLOCK
    claimed = _Target(on, width, "turn2", turn2)
    full = _Target(off, width, "turn2", turn2)
    item = claimed.item(cached=claim)
    assert len(item.features) == (len(turn2) - claim) * width * 2
    _same([claimed.round(cached=claim), claimed.round(), claimed.round()], [full.round() for _ in range(3)])

    # A claim past what it holds (a block the last pass never sent it): it keeps what it has,
    # guesses nothing and says so; the rest, with its features, goes next time.
    on.release(["turn2"])
    longer = claimed.tokens[:claimed.held] + [4] * 20
    kept = claimed.held // BLOCK * BLOCK
    over = _Target(on, width, "turn3", longer)
    reply = over.round(cached=kept + BLOCK)
    assert (reply.tokens, reply.length, reply.error) == ([], kept, "")
    assert over.item().rollback_to == kept and len(over.item().features) == (len(longer) - kept) * width * 2
    fresh = _Target(off, width, "turn3", longer)
    _same([over.round() for _ in range(2)], [fresh.round() for _ in range(2)])

    # Nothing held under this salt: length 0, and the target resends it whole.
    other = _Target(on, width, "tenant", longer, salt="another tenant")
    reply = other.round(cached=kept)
    assert (reply.tokens, reply.length, reply.error) == ([], 0, "") and other.held == 0
    assert other.round().length > 0


@pytest.mark.parametrize("kind", ["token", "feature"])
def test_only_the_same_salt_and_tokens_restore(kind, model_zoo, feature_pair):
    proposer = _proposer(kind, model_zoo, feature_pair)
    width = proposer.feature_width
    _run(proposer, width, [("a", PROMPT)], 3, salt="tenant a")
    cache = proposer.prefixes.cache
    _run(proposer, width, [("b", PROMPT + [1, 2])], 1, salt="tenant b")
    _run(proposer, width, [("c", [PROMPT[0] + 1, *PROMPT[1:]])], 1, salt="tenant a")  # its first token differs
    assert cache.hits == 0
    _run(proposer, width, [("d", PROMPT + [1, 2])], 1, salt="tenant a")
    assert cache.hits == 1 and cache.hit_tokens == len(PROMPT) // BLOCK * BLOCK


@pytest.mark.parametrize("kind", ["token", "feature"])
def test_kept_slots_give_way_to_new_sequences_least_recently_used_first(kind, model_zoo, feature_pair):
    proposer = _proposer(kind, model_zoo, feature_pair, slots=2)
    width = proposer.feature_width
    prompts = [[p + i for p in PROMPT] for i in range(3)]
    _run(proposer, width, [("a", prompts[0]), ("b", prompts[1])], 2)
    assert proposer.prefixes.retained == 2 and proposer.free_slots == 2 and proposer.held == 0
    # Two new sequences at once: both get a slot, each evicting a kept one, a's (the older) first.
    running = [_Target(proposer, width, key, prompt) for key, prompt in (("c", prompts[2]), ("d", prompts[2][:20]))]
    running[0].round()
    assert proposer.prefixes.retained == 1
    _run(proposer, width, [("e", prompts[0] + [1])], 1)  # a's state is gone: no hit
    assert proposer.prefixes.cache.hits == 0
    assert running[1].round().length > 0 and proposer.prefixes.retained == 0
    proposer.release(["c", "d"])
    assert proposer.prefixes.retained == 2 and proposer.free_slots == 2


@pytest.mark.parametrize("kind", ["token", "feature"])
def test_samples_of_one_prompt_copy_the_first_ones_state(kind, model_zoo, feature_pair):
    """``n`` samples, or requests sharing a system prompt, while the first still runs: the others
    copy its prompt's state (a running sequence's positions are never taken over)."""
    on, off = (_proposer(kind, model_zoo, feature_pair, kept=k) for k in (-1, 0))
    width = on.feature_width
    replies = {}
    for proposer in (on, off):
        first = _Target(proposer, width, "s0", PROMPT, SAMPLED)
        second = _Target(proposer, width, "s1", PROMPT, SamplingParams(temperature=0.8, top_k=50, seed=8))
        replies[proposer is on] = [first.round(), second.round(), first.round(), second.round()]
    assert on.prefixes.cache.hits == 1 and on.prefixes.cache.hit_tokens == len(PROMPT) // BLOCK * BLOCK
    _same(replies[True], replies[False])


def test_behind_prompt_lookup_a_claimed_prefix_is_restored_and_one_held_in_part_is_sent_again(model_zoo, feature_pair):
    """The pair's default (prompt lookup, then the feature draft): the lookup keeps the target's
    features only from the claimed prefix on; the model restores the prefix and proposes what it
    proposes without the cache; a claim the model meets only in part is answered with what it
    holds, and the features sent next let it draft on."""
    def combined(kept: int) -> NgramPlusModelProposer:
        return NgramPlusModelProposer(_proposer("feature", model_zoo, feature_pair, kept=kept), 8, min_n=3)

    on, off = combined(-1), combined(0)
    width = on.feature_width
    first = _Target(on, width, "turn1", PROMPT)
    for _ in range(4):
        first.round()
    on.release(["turn1"])
    turn2 = first.tokens[:first.held] + [9, 8, 7, 6, 5]
    claim = first.held // BLOCK * BLOCK
    claimed, full = _Target(on, width, "turn2", turn2), _Target(off, width, "turn2", turn2)
    replies = [claimed.round(cached=claim), claimed.round(), claimed.round()]
    _same(replies, [full.round() for _ in range(3)])
    assert on.model.prefixes.cache.hits == 1 and any(r.source == "model" and r.tokens for r in replies)

    on.release(["turn2"])
    longer = claimed.tokens[:claimed.held] + [200 - i for i in range(20)]  # nothing for the lookup to copy
    kept = claimed.held // BLOCK * BLOCK
    over = _Target(on, width, "turn3", longer)
    reply = over.round(cached=kept + BLOCK)
    assert (reply.tokens, reply.length, reply.error) == ([], kept, "")
    reply = over.round()
    assert reply.error == "" and reply.source == "model" and reply.tokens and over.held == len(longer)


def test_the_claim_and_the_capability_cross_the_wire():
    from specstream.data.propose import DraftInfo
    from specstream.data.propose_wire import info_from_pb, info_to_pb, item_from_pb, item_to_pb
    from specstream_pb import draft_pb2

    item = ProposeItem(3, 0, list(range(40)), 4, features=bytes(2 * 8 * 8), feature_width=8, cached_prefix=32,
                       cache_salt="s", output_start=40)
    back = item_from_pb(3, draft_pb2.ProposeItem.FromString(item_to_pb(item).SerializeToString()))
    assert back == item and back.feature_count == 8
    info = DraftInfo(model_name="d", vocab_size=10, prefix_cache=True)
    assert info_from_pb(draft_pb2.DraftInfo.FromString(info_to_pb(info).SerializeToString())) == info


@pytest.mark.parametrize("kind", ["token", "feature"])
def test_a_claim_that_cannot_be_met_drops_the_sequence_and_others_are_unaffected(kind, model_zoo, feature_pair):
    """A claim on an item that rolls back to a held position, or covering every appended token, is
    no valid claim: that sequence gets length 0 (the target resends it whole); the item beside it
    is answered as ever."""
    proposer = _proposer(kind, model_zoo, feature_pair)
    width = proposer.feature_width
    good = _Target(proposer, width, "good", PROMPT)
    good.round()
    held = _Target(proposer, width, "held", PROMPT)
    held.round()
    bad_rollback = held.item()
    bad_rollback.cached_prefix = BLOCK
    whole = _Target(proposer, width, "whole", PROMPT[:32]).item()
    whole.cached_prefix, whole.features = 32, b""
    replies = proposer.propose([bad_rollback, whole, good.item()])
    assert [r.length for r in replies[:2]] == [0, 0] and not replies[0].tokens and not replies[1].tokens
    assert replies[2].length > 0 and replies[2].error == ""


def test_a_token_drafts_kept_state_includes_the_guesses_the_target_accepted(model_zoo, feature_pair):
    """The target rolls a token draft back to what it agreed, accepted guesses included (they are
    never sent again): the kept slot's tokens are what its cache holds, so the next turn restores
    the whole first turn, and proposes bit for bit what a fresh prefill does."""
    on, off = (_proposer("token", model_zoo, feature_pair, kept=k) for k in (-1, 0))

    def turn(proposer, key: str, prompt: list[int], rounds: int) -> tuple[list[int], list[Proposal]]:
        tokens, held, replies = list(prompt), 0, []
        for r in range(rounds):
            first_item = {"output_start": len(prompt)} if held == 0 else {}
            [reply] = proposer.propose([ProposeItem(key, held, tokens[held:], 4, GREEDY, **first_item)])
            replies.append(reply)
            kept = reply.tokens[:2] if r % 2 else reply.tokens[:1]  # the target accepts some guesses
            held = min(reply.length, len(tokens) + len(kept))  # agreed: what was sent and the accepted guesses
            tokens += [*kept, 7 + r % 5]
        return tokens, replies

    first, _ = turn(on, "turn1", PROMPT, 8)
    on.release(["turn1"])
    second = first + [9, 8, 7]
    cached = on.prefixes.cache.hit_tokens
    _, with_cache = turn(on, "turn2", second, 4)
    restored = on.prefixes.cache.hit_tokens - cached
    assert restored >= (len(first) - 8) // BLOCK * BLOCK > len(PROMPT) // BLOCK * BLOCK, (restored, len(first))
    turn(off, "turn1", PROMPT, 8)
    off.release(["turn1"])
    _, without = turn(off, "turn2", second, 4)
    _same(with_cache, without)


def test_a_prompt_sent_in_parts_is_offered_once_its_state_is_complete(model_zoo, feature_pair):
    """A long prompt reaches a feature draft over several calls (the target's byte budget per
    call): it is offered to other sequences when its last part is in, not before."""
    proposer = _proposer("feature", model_zoo, feature_pair)
    width = proposer.feature_width
    first = _Target(proposer, width, "first", PROMPT)
    part = first.item(gamma=0)
    part.append = PROMPT[:20]
    part.features = first.features(0, 19) if width else b""
    assert proposer.propose([part])[0].length == 20 and not proposer.prefixes.cache.entries
    first.held = 20
    first.round()
    assert [len(e.tokens) for e in proposer.prefixes.cache.entries.values()] == [len(PROMPT) // BLOCK * BLOCK]
    _run(proposer, width, [("second", PROMPT + [3])], 1)
    assert proposer.prefixes.cache.hits == 1
