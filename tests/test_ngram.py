"""Prompt lookup (draft_service/ngram.py) and n-grams-then-model (draft_service/combined.py).

The lookup's rules on hand-made sequences; its incremental index against a brute-force reference
through random rollbacks; the protocol's refusals; the combination's routing and the draft
model's cache kept in sync behind the n-grams (checked against a fresh model given the whole
context); lossless greedy decoding through the engine; the config and the servicer's registry.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from tests.support.engine_harness import run_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from draft_service.build import PROPOSERS
from draft_service.combined import NgramPlusModelProposer
from draft_service.ngram import ANY_ID, NgramIndex, NgramProposer
from draft_service.proposer import DraftProposer
from specstream.data.propose_wire import proposal_to_pb
from specstream.data.config import DraftConfig, ModelSpec
from specstream.data.propose import ProposeItem
from specstream.data.sampling import GREEDY, SamplingParams
from specstream.models.loader import load_model
from tools.cli import build_parser

A, B, C, D, E, F = 11, 12, 13, 14, 15, 16


def reference(tokens: list[int], gamma: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """The lookup's definition, by brute force: longest n first, then the latest earlier start
    (never the suffix itself), then an overlapping copy."""
    size = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        for start in range(size - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[size - n:]:
                extended = list(tokens)
                for j in range(gamma):
                    extended.append(extended[start + n + j])
                return extended[size:]
    return []


def lookup(tokens: list[int], gamma: int, **kwargs) -> list[int]:
    """Guesses for `tokens` sent in one item; checks the reply's other fields on the way."""
    proposal = NgramProposer(1, 1000, **kwargs).propose([ProposeItem("s", 0, list(tokens), gamma)])[0]
    assert (proposal.length, proposal.source, proposal.q_width) == (len(tokens), "ngram", 0)
    assert proposal.tokens == reference(tokens, gamma, **kwargs)
    return proposal.tokens


# --- the lookup's rules ---------------------------------------------------------------------------

def test_copies_what_followed_the_match():
    assert lookup([A, B, C, D, A, B], 2) == [C, D]


def test_no_match_no_guesses():
    assert lookup([A, B, C, D], 4) == []
    assert lookup([A], 4) == []


def test_the_suffix_itself_is_not_a_match():
    # Every suffix of this history occurs only as itself, at the very end: nothing to copy.
    assert lookup([C, D, A, B], 4) == []
    # "A B" also ends the history, but its earlier occurrence counts (and has a continuation).
    assert lookup([A, B, C, A, B], 1) == [C]


def test_an_overlapping_match_extrapolates_the_repeat():
    # n = 2: suffix "B A" (positions 3-4) last occurred at 1, overlapping it; what follows is
    # "B A", and then the guesses themselves: the period goes on for all of gamma.
    assert lookup([A, B, A, B, A], 5, max_n=2) == [B, A, B, A, B]
    assert lookup([A, B, A, B, A], 5) == [B, A, B, A, B]  # n = 3 ("A B A" at 0) agrees
    assert lookup([A, A, A, A, A], 6) == [A] * 6


def test_the_longest_n_wins_over_a_later_shorter_match():
    # "B" last occurred at 4 (then E), but "A B" at 0 (then C) is longer.
    assert lookup([A, B, C, D, B, E, A, B], 1) == [C]
    assert lookup([A, B, C, D, B, E, A, B], 1, max_n=1) == [E]


def test_the_latest_occurrence_wins():
    assert lookup([A, B, C, A, B, D, A, B], 1) == [D]


def test_min_n_and_max_n_bound_the_lookup():
    assert lookup([A, B, C, B], 2, min_n=2) == []  # only the 1-gram "B" matches
    assert lookup([A, B, C, B], 2) == [C, B]
    assert lookup([A, B, C, D, E, F, B, C, D, A, B, C, D], 1, max_n=3) == [A]  # "B C D" latest at 6
    assert lookup([A, B, C, D, E, F, B, C, D, A, B, C, D], 1, max_n=4) == [E]  # "A B C D" at 0
    with pytest.raises(ValueError, match="min_n=3, max_n=2"):
        NgramProposer(1, 100, min_n=3, max_n=2)


def test_gamma_and_max_len_cap_the_guesses():
    assert lookup([A, A, A, A], 0) == []
    assert lookup([A, A, A, A], 3) == [A, A, A]
    proposer = NgramProposer(1, max_len=6)
    proposal = proposer.propose([ProposeItem("s", 0, [A, A, A, A, A], 4)])[0]
    assert (proposal.tokens, proposal.length) == ([A], 5)


# --- the index through rollbacks ------------------------------------------------------------------

def _fresh_index(tokens: list[int], min_n: int, max_n: int) -> NgramIndex:
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    return index


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3), st.integers(0, 3),
       st.lists(st.tuples(st.integers(0, 1000), st.lists(st.integers(0, 3), min_size=1, max_size=8),
                          st.integers(0, 6)), min_size=1, max_size=30))
def test_index_equals_brute_force_through_rollbacks(min_n, extra, steps):
    """Random appends over a 4-token alphabet (many matches) with random rollbacks: every step's
    guesses are the brute-force ones, and the index is exactly the one built from scratch."""
    max_n = min_n + extra
    proposer = NgramProposer(1, 10_000, min_n, max_n)
    tokens: list[int] = []
    for cut, append, gamma in steps:
        rollback = cut % (len(tokens) + 1)
        tokens = tokens[:rollback] + append
        proposal = proposer.propose([ProposeItem("s", rollback, append, gamma)])[0]
        assert proposal.length == len(tokens)
        assert proposal.tokens == reference(tokens, gamma, min_n, max_n)
        index = proposer.sequences["s"]
        assert index.tokens == tokens
        assert index._latest == _fresh_index(tokens, min_n, max_n)._latest


def test_truncating_to_zero_empties_the_index():
    index = _fresh_index([A, B, A, B, C], 1, 4)
    index.truncate(0)
    assert index.tokens == [] and index._latest == {} and index._undo == []


def test_long_history_with_rollbacks_stays_exact():
    """A few thousand tokens with the target's own pattern: guesses, partial acceptance, rollback."""
    rng = random.Random(5)
    proposer = NgramProposer(1, 10_000)
    tokens, held = [rng.randrange(6) for _ in range(50)], 0
    while len(tokens) < 3000:
        proposal = proposer.propose([ProposeItem("s", held, tokens[held:], 6)])[0]
        assert proposal.tokens == reference(tokens, 6)
        accepted = rng.randint(0, len(proposal.tokens))
        context = len(tokens)
        tokens += proposal.tokens[:accepted] + [rng.randrange(6)]
        held = min(proposal.length, context + accepted)
        if rng.random() < 0.1:
            held = rng.randint(0, held)  # the target may resend more than it must
    assert proposer.sequences["s"]._latest == _fresh_index(proposer.sequences["s"].tokens, 1, 4)._latest


# --- the protocol ---------------------------------------------------------------------------------

def test_refusals_drop_the_state_and_report_length_zero():
    proposer = NgramProposer(max_slots=2, max_len=8)
    assert proposer.propose([ProposeItem("new", 3, [A], 2)])[0].length == 0  # unknown, rollback > 0
    assert proposer.held == 0
    assert proposer.propose([ProposeItem("a", 0, [A, B], 2)])[0].length == 2
    assert proposer.propose([ProposeItem("a", 3, [A], 2)])[0].length == 0  # beyond what it holds
    assert proposer.held == 0
    proposer.propose([ProposeItem("a", 0, [A, B], 2)])
    assert proposer.propose([ProposeItem("a", 2, [], 2)])[0].length == 0  # nothing appended
    proposer.propose([ProposeItem("a", 0, [A, B], 2)])
    assert proposer.propose([ProposeItem("a", 2, [A] * 7, 2)])[0].length == 0  # past max_len
    assert proposer.held == 0


def test_slots_and_release():
    proposer = NgramProposer(max_slots=2, max_len=100)
    out = proposer.propose([ProposeItem(k, 0, [A, B, A], 2) for k in "abc"])
    assert [p.length for p in out] == [3, 3, 0]  # no slot for "c"
    assert [p.tokens for p in out] == [[B, A], [B, A], []]
    assert (proposer.held, proposer.free_slots) == (2, 0)
    proposer.release(["a", "unknown"])
    assert (proposer.held, proposer.free_slots) == (1, 1)
    assert proposer.propose([ProposeItem("a", 3, [A], 2)])[0].length == 0  # released: holds nothing
    assert proposer.propose([ProposeItem("b", 3, [B], 2)])[0].tokens == [A, B]  # untouched


def test_the_source_goes_on_the_wire():
    proposal = NgramProposer(1, 100).propose([ProposeItem("s", 0, [A, B, A], 2)])[0]
    message = proposal_to_pb(7, proposal)
    assert (message.proposer, list(message.token_ids), message.length) == ("ngram", [B, A], 3)


def test_info_of_the_ngram_proposer():
    proposer = NgramProposer(4, 512)
    assert (proposer.name, proposer.vocab_size, proposer.max_len, proposer.free_slots) == ("ngram", ANY_ID, 512, 4)


# --- n-grams, then the model ----------------------------------------------------------------------

def _fresh_model_proposal(model, context: list[int], gamma: int, sampling: SamplingParams = GREEDY):
    """What a draft that never saw the sequence before proposes after the whole context."""
    return DraftProposer(model, 1, 512).propose([ProposeItem("fresh", 0, list(context), gamma, sampling)])[0]


class _CountingDraft(DraftProposer):
    """The real draft proposer, remembering each item it was asked (key, rollback_to, append)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[tuple[object, int, list[int]]] = []

    def propose(self, items):
        self.asked += [(it.key, it.rollback_to, list(it.append)) for it in items]
        return super().propose(items)


def test_each_item_goes_to_the_ngrams_or_to_the_model(model_zoo):
    model = load_model(model_zoo["partial"])
    draft = _CountingDraft(model, 4, 512)
    combined = NgramPlusModelProposer(draft, 4)
    repeating, new = [0, 5, 6, 7, 5, 6], [0, 20, 21, 22]
    out = combined.propose([ProposeItem("r", 0, repeating, 4), ProposeItem("n", 0, new, 4)])
    assert (out[0].source, out[0].tokens, out[0].length) == ("ngram", [7, 5, 6, 7], 6)
    assert out[1].source == "model"
    assert out[1].tokens == _fresh_model_proposal(model, new, 4).tokens
    assert out[1].length == len(new) + 3  # the model holds its guesses but the last; so does the history
    assert draft.asked == [("n", 0, new)]  # one model call, only for the item without a match
    assert (combined.name, combined.vocab_size, combined.max_len) == (f"ngram+{model.config.name}", 300, draft.max_len)


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, seed=7)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("seed", [1, 2])
def test_the_models_cache_stays_in_sync_behind_the_ngrams(model_zoo, sampling, seed):
    """A simulated target: each step it accepts some guesses and adds a token of its own, either
    one seen before (the n-grams usually match next) or a new one (only the model can guess).
    Every model answer equals a fresh model's given the whole context, however many n-gram steps
    it sat out and however many of its own guesses were rolled back."""
    rng = random.Random(seed)
    model = load_model(model_zoo["partial"])
    draft = _CountingDraft(model, 2, 512)
    combined = NgramPlusModelProposer(draft, 2)
    tokens, held, unused = [0, *range(100, 110)], 0, iter(range(110, 300))
    sources: Counter[str] = Counter()
    for _ in range(40):
        gamma = rng.randint(1, 5)
        reply = combined.propose([ProposeItem("s", held, tokens[held:], gamma, sampling)])[0]
        if reply.source == "model":
            fresh = _fresh_model_proposal(model, tokens, gamma, sampling)
            assert (reply.tokens, reply.q_width, reply.q_ids) == (fresh.tokens, fresh.q_width, fresh.q_ids)
            assert reply.q_probs == pytest.approx(fresh.q_probs, abs=1e-6)
            assert reply.length == len(tokens) + len(reply.tokens) - 1
        else:
            assert reply.tokens == reference(tokens, gamma) != []
            assert (reply.length, reply.q_width) == (len(tokens), 0)
        sources[reply.source] += 1
        accepted = rng.randint(0, len(reply.tokens))
        context = len(tokens)
        tokens += reply.tokens[:accepted] + [rng.choice(tokens) if rng.random() < 0.5 else next(unused)]
        held = min(reply.length, context + accepted)
    assert sources["model"] >= 5 and sources["ngram"] >= 5, sources
    assert any(len(append) > 2 for _, _, append in draft.asked)  # the model caught up after n-gram steps
    combined.release(["s"])
    assert (combined.held, draft.held, combined.model_len) == (0, 0, {})


def test_a_model_without_a_free_slot_leaves_the_ngrams_working(model_zoo):
    model = load_model(model_zoo["partial"])
    combined = NgramPlusModelProposer(DraftProposer(model, 1, 512), 4)
    first, second = [0, 20, 21], [0, 30, 31]
    out = combined.propose([ProposeItem("a", 0, first, 3), ProposeItem("b", 0, second, 3)])
    assert out[0].tokens and out[1].tokens == []  # one model slot: "b" gets no guesses...
    assert out[1].length == 3 and combined.model_len["b"] == 0  # ...but its history is held
    combined.release(["a"])
    second += [40]
    reply = combined.propose([ProposeItem("b", 3, [40], 3)])[0]
    assert reply.source == "model" and reply.tokens == _fresh_model_proposal(model, second, 3).tokens


def test_an_out_of_sync_item_drops_both_sides(model_zoo):
    draft = DraftProposer(load_model(model_zoo["partial"]), 2, 512)
    combined = NgramPlusModelProposer(draft, 2)
    held = combined.propose([ProposeItem("s", 0, [0, 20, 21], 3)])[0].length
    assert draft.held == 1
    assert combined.propose([ProposeItem("s", held + 1, [5], 3)])[0].length == 0
    assert (combined.held, draft.held) == (0, 0)


# --- through the engine ---------------------------------------------------------------------------

PROMPTS = [[0, 5, 6, 7, 5, 6, 7, 5], [0, 9], [0, 40, 41, 42, 43, 44, 40, 41]]


class _SourceCounting:
    """Wraps a proposer, counting the proposals with tokens by source."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.sources: Counter[str] = Counter()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, items):
        proposals = self.inner.propose(items)
        self.sources.update(p.source for p in proposals if p.tokens)
        return proposals


@pytest.mark.parametrize("kind", ["ngram", "ngram+model"])
def test_greedy_speculation_equals_plain_decoding(model_zoo, kind):
    plain, _ = run_engine(model_zoo["target"], None, PROMPTS, 0, 48)
    if kind == "ngram":
        proposer = _SourceCounting(NgramProposer(16, 512))
    else:
        proposer = _SourceCounting(NgramPlusModelProposer(DraftProposer(load_model(model_zoo["partial"]), 16, 512), 16))
    spec, finals = run_engine(model_zoo["target"], None, PROMPTS, 4, 48, proposer=proposer)
    assert spec == plain
    assert sum(f.stats.accepted_tokens for f in finals) > 0  # the guesses really took part
    assert proposer.sources["ngram"] > 0
    assert (proposer.sources["model"] > 0) == (kind == "ngram+model")
    assert proposer.held == 0  # released when the sequences finished


def test_branches_are_the_shorter_suffixes_other_next_tokens():
    """The suffix "A B" last occurred at the start (then C: the chain); the shorter suffix "B" last
    occurred before D: D is a branch beside C, a child of the root."""
    X, Y, W = 21, 22, 24
    tokens = [A, B, C, W, B, D, X, Y, A, B]  # suffix "A B": latest "A B" at 0 -> C; "B" latest at 4 -> D
    proposal = NgramProposer(1, 1000).propose([ProposeItem("s", 0, tokens, 3, branches=2)])[0]
    assert proposal.tokens[:3] == reference(tokens, 3) == [C, W, B]
    assert proposal.tokens[3:] == [D] and proposal.parents == [0, 1, 2, 0]  # D: a child of the root
    # Sampled items, items that allow none, and a first guess every shorter suffix agrees with: chains.
    sampled = ProposeItem("t", 0, tokens, 3, SamplingParams(temperature=1.0, seed=1), branches=2)
    assert NgramProposer(1, 1000).propose([sampled])[0].parents == []
    assert NgramProposer(1, 1000).propose([ProposeItem("u", 0, tokens, 3)])[0].tokens == [C, W, B]
    agree = [A, B, C, X, A, B]
    assert NgramProposer(1, 1000).propose([ProposeItem("v", 0, agree, 3, branches=2)])[0].parents == []


def test_ngram_trees_equal_plain_decoding(model_zoo):
    plain, _ = run_engine(model_zoo["target"], None, PROMPTS, 0, 48)
    proposer = NgramPlusModelProposer(DraftProposer(load_model(model_zoo["partial"]), 16, 512), 16)
    spec, finals = run_engine(model_zoo["target"], None, PROMPTS, 4, 48, proposer=proposer,
                              config={"tree_branches": 2, "gamma_policy": "fixed"})
    assert spec == plain and sum(sum(f.stats.branch_histogram[1:]) for f in finals) > 0


# --- config and servicer --------------------------------------------------------------------------

def test_config_names_the_proposer():
    assert DraftConfig(None, proposer="ngram").proposer == "ngram"
    assert DraftConfig(ModelSpec("m"), proposer="ngram+model").model == ModelSpec("m")
    for kwargs, message in [
        (dict(model=None), "model=None"),
        (dict(model=None, proposer="ngram+model"), "model=None"),
        (dict(model=ModelSpec("m"), proposer="ngram"), "model=ModelSpec"),
        (dict(model=ModelSpec("m"), proposer="lookup"), r"proposer='lookup': must be one of model, ngram, "),
        (dict(model=None, proposer="ngram", synthetic_oracle="o.json"), "proposer='ngram'"),
        (dict(model=None, proposer="ngram", ngram_min=0), "ngram_min=\\(0, 4\\)"),
        (dict(model=None, proposer="ngram", ngram_min=3, ngram_max=2), "ngram_min=\\(3, 2\\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            DraftConfig(**kwargs)


def test_every_configurable_proposer_is_built_and_offered_on_the_command_line():
    assert tuple(PROPOSERS) == DraftConfig.PROPOSERS
    args = build_parser().parse_args(["draft", "--proposer", "ngram", "--ngram-min", "2"])
    assert (args.proposer, args.ngram_min, args.ngram_max, args.model) == ("ngram", 2, 4, None)
    for name in DraftConfig.PROPOSERS:
        assert build_parser().parse_args(["draft", "--proposer", name]).proposer == name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["draft", "--proposer", "lookup"])
    proposer = PROPOSERS["ngram"](DraftConfig(None, proposer="ngram", max_slots=3, max_seq_len=99, ngram_min=2))
    assert (proposer.name, proposer.free_slots, proposer.max_len, proposer.min_n, proposer.max_n) == \
        ("ngram", 3, 99, 2, 4)


def test_get_info_names_the_proposers(model_zoo):
    import asyncio

    from draft_service.server import DraftServicer
    from specstream.serving.metrics import DraftMetrics

    def info(proposer):
        return asyncio.run(DraftServicer(proposer, None, DraftMetrics()).GetInfo(None, None))

    ngram = info(NgramProposer(4, 512))
    assert (ngram.model_name, ngram.vocab_size, ngram.max_context_length, ngram.free_slots) == ("ngram", ANY_ID, 512, 4)
    draft = DraftProposer(load_model(model_zoo["partial"]), 4, 512)
    both = info(NgramPlusModelProposer(draft, 4))
    assert (both.model_name, both.vocab_size) == (f"ngram+{draft.name}", draft.vocab_size)


class _ItemRecording:
    """Combined proposals, remembering each call's items and how many the model was asked in it."""

    def __init__(self, inner: NgramPlusModelProposer, model: _CountingDraft) -> None:
        self.inner, self.model, self.calls = inner, model, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, items):
        before = len(self.model.asked)
        out = self.inner.propose(items)
        self.calls.append((items, len(self.model.asked) - before))
        return out


def test_a_row_the_model_is_priced_out_of_still_gets_its_lookup_asked(model_zoo, monkeypatch):
    """Behind prompt lookup, a row the controller gives γ 0 (here every row, every step: the
    pricing itself, which follows measured times, is tests/test_gamma.py's) gets its lookup asked
    alone (ProposeItem.lookup_only, at the γ ``lookup_gamma`` gives), which never asks the model.
    Greedy output stays plain decoding's, and the lookup's guesses are accepted where the text
    repeats itself."""
    from target_service.gamma import GammaController

    monkeypatch.setattr(GammaController, "choose", lambda self, rows, caps: [0] * len(rows))
    monkeypatch.setattr(GammaController, "lookup_gamma", lambda self, rows, gammas, i, source, cap: min(cap, 4))
    plain, _ = run_engine(model_zoo["target"], None, PROMPTS, 0, 48)
    model = _CountingDraft(load_model(model_zoo["unrelated"]), 16, 512)
    proposer = _ItemRecording(NgramPlusModelProposer(model, 16), model)
    assert proposer.lookup == "ngram"
    spec, finals = run_engine(model_zoo["target"], None, PROMPTS, None, 48, proposer=proposer)
    assert spec == plain
    lookup_only = [asked for items, asked in proposer.calls if all(item.lookup_only for item in items)]
    assert lookup_only, "no call asked the lookup alone"
    assert not any(lookup_only), "the model was asked in a lookup-only call"
    assert sum(f.stats.accepted_tokens for f in finals) > 0
