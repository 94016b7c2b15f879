"""Suffix drafting (draft_service/suffix.py), alone and before the draft model ("suffix+model").

Its rules on hand-made sequences: the longest matching suffix, candidates from the sequence and
from earlier outputs of the same salt only, a chain as long as its weights trust; its indexes
against brute force through rollbacks and evictions; the protocol's refusals; the corpus bounded;
lossless greedy decoding through the engine (sampling: tests/test_sampling_exact.py); the config,
the command line and the item's salt on the wire.
"""

from __future__ import annotations

import random

import pytest
from tests.support.engine_harness import run_engine

from draft_service.build import PROPOSERS
from draft_service.combined import NgramPlusModelProposer
from draft_service.proposer import DraftProposer
from draft_service.suffix import MAX_MATCH, Corpus, SuffixProposer, _Occurrences
from specstream.data.config import DraftConfig, ModelSpec
from specstream.data.propose import ProposeItem
from specstream.data.propose_wire import item_from_pb, item_to_pb
from specstream.data.sampling import SamplingParams
from specstream.models.loader import load_model
from tools.cli import build_parser

A, B, C, D, E, F, G = 11, 12, 13, 14, 15, 16, 17


def _first(tokens: list[int], gamma: int = 8, salt: str = "", output_start: int = 0, key="s",
           **kwargs) -> ProposeItem:
    return ProposeItem(key, 0, list(tokens), gamma, cache_salt=salt, output_start=output_start, **kwargs)


def _answered(proposer: SuffixProposer, key, prompt: list[int], output: list[int], salt: str = "") -> None:
    """A finished sequence: its prompt and output held, then released into the corpus."""
    proposer.propose([_first(prompt + output, salt=salt, output_start=len(prompt), key=key)])
    proposer.release([key])


# ----- rules ------------------------------------------------------------------------------------

def test_a_long_match_in_the_sequence_is_trusted_further_than_a_short_one():
    """One earlier occurrence: matched over 1 token, a guess is worth 1/2; over 4, 4/5 each
    (the chain stops below MIN_CONFIDENCE 0.3): the longer the match, the longer the chain."""
    short = SuffixProposer(1, 1000).propose([_first([A, B, C, D, E, A])])[0]
    assert short.tokens == [B]  # 1/2, then 1/4 < 0.3
    long = SuffixProposer(1, 1000).propose([_first([A, B, C, D, E, F, G, 30, 31, A, B, C, D])])[0]
    assert long.tokens == [E, F, G, 30, 31]  # 0.8 ** 5 = 0.33, 0.8 ** 6 = 0.26
    assert long.length == 13 and long.source == "suffix" and long.q_width == 0


def test_earlier_outputs_are_drafted_from_under_the_same_salt_only():
    proposer = SuffixProposer(4, 1000)
    _answered(proposer, "a", [40, 41], [A, B, C, D, E, F, G], salt="tenant 1")
    asked = [30, 31, A, B, C]
    assert proposer.propose([_first(asked, salt="tenant 1", key="b")])[0].tokens == [D, E, F, G]  # (3/4)^4 = 0.32
    assert proposer.propose([_first(asked, salt="tenant 2", key="c")])[0].tokens == []
    assert proposer.propose([_first(asked, key="d")])[0].tokens == []  # no salt is a salt of its own
    assert proposer.held == 3  # the prompt was not added: only outputs are
    assert proposer.corpus.tokens == 7


def test_repeated_outputs_weigh_more_and_disagreement_shortens_the_chain():
    output = [A, B, C, D, E, F, G, 30, 31]
    one, agree, split = SuffixProposer(8, 1000), SuffixProposer(8, 1000), SuffixProposer(8, 1000)
    _answered(one, 0, [], output)
    for i in range(3):
        _answered(agree, i, [], output)
    for i, third in enumerate([C, C, 40]):
        _answered(split, i, [], [A, B, third, *output[3:]])
    asked = [50, A, B]  # matches each output over 2 tokens: weight 2
    assert one.propose([_first(asked)])[0].tokens == [C, D]  # 2/3, 4/9, then 8/27 < 0.3
    assert agree.propose([_first(asked)])[0].tokens == output[2:]  # (6/7)^7 = 0.34
    # C weighs 4 against 40's 2: 4/7; then the two outputs with C agree: x 4/5 each while >= 0.3.
    assert split.propose([_first(asked)])[0].tokens == [C, D, E]
    # The lighter first token is a branch beside the chain where the item allows branches.
    branched = split.propose([_first(asked, branches=2, key="t")])[0]
    assert branched.tokens == [C, D, E, 40] and branched.parents == [0, 1, 2, 0]


def test_gamma_caps_the_chain_and_masked_ids_cut_it():
    tokens = [A, B, C, D, E, F, G, 30, 31, A, B, C, D]
    assert SuffixProposer(1, 1000).propose([_first(tokens, gamma=2)])[0].tokens == [E, F]
    masked = SuffixProposer(1, 1000).propose([_first(tokens, masked_ids=frozenset({F}), masked_until=100)])[0]
    assert masked.tokens == [E]  # F may not be guessed there: it and what follows it are cut
    sampled = _first(tokens, branches=2, sampling=SamplingParams(temperature=1.0, seed=1))
    assert SuffixProposer(1, 1000).propose([sampled])[0].parents == []  # branches are for greedy items


def _brute_index(tokens: list[int], min_n: int, max_n: int) -> dict:
    index: dict = {}
    for end in range(1, len(tokens)):
        for n in range(min_n, min(max_n, end) + 1):
            index.setdefault(tuple(tokens[end - n:end]), []).append(end)
    return index


@pytest.mark.parametrize("seed", range(3))
def test_the_sequence_index_equals_brute_force_through_rollbacks(seed):
    rng = random.Random(seed)
    index = _Occurrences(1, 4)
    for _ in range(200):
        if rng.random() < 0.3 and len(index):
            index.truncate(rng.randrange(len(index) + 1))
        else:
            index.extend([rng.randrange(4) for _ in range(rng.randrange(1, 6))])
        assert index.after == _brute_index(index.tokens, 1, 4)
    index.truncate(0)
    assert index.after == {} and index.tokens == []


def test_the_corpus_is_bounded_and_evicts_its_oldest_outputs_exactly():
    rng = random.Random(7)
    corpus = Corpus(100, 1, 4)
    added = []
    for i in range(60):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(2, 30))]
        salt = f"salt {i % 3}"
        corpus.add(salt, tokens)
        added.append((salt, tokens))
        assert corpus.tokens <= 100
        kept = list(corpus.outputs.values())
        assert kept == added[len(added) - len(kept):]  # the newest, in order
        for s in {salt for salt, _ in kept}:  # each salt's index is exactly that of its kept outputs
            brute: dict = {}
            for doc, (owner, toks) in corpus.outputs.items():
                if owner == s:
                    for gram, ends in _brute_index(toks, 1, 4).items():
                        brute.setdefault(gram, []).extend((doc, end) for end in ends)
            assert {gram: list(found) for gram, found in corpus.after[s].items()} == brute
    while corpus.outputs:
        corpus._evict()
    assert corpus.after == {} and corpus.tokens == 0


def test_a_match_is_weighed_up_to_max_match():
    proposer = SuffixProposer(1, 10_000)
    run = [random.Random(1).randrange(100, 200) for _ in range(MAX_MATCH + 10)]
    sequence = proposer.sync(_first(run + [A] + run))
    assert sequence._match(sequence.tokens, len(run)) == MAX_MATCH


# ----- protocol -----------------------------------------------------------------------------------

def test_refusals_drop_the_state_and_report_length_zero():
    proposer = SuffixProposer(1, 10)
    assert proposer.propose([ProposeItem("x", 3, [A], 2)])[0].length == 0  # unknown, rollback_to > 0
    assert proposer.propose([_first([A, B])])[0].length == 2
    assert proposer.propose([_first([A], key="other")])[0].length == 0  # no free slot
    assert proposer.propose([ProposeItem("s", 5, [A], 2)])[0].length == 0  # beyond what is held
    assert proposer.held == 0
    assert proposer.propose([_first([A] * 11)])[0].length == 0  # longer than max_len
    assert proposer.corpus.tokens == 0  # refused sequences leave nothing in the corpus


def test_a_new_stream_starts_the_sequence_over_without_adding_it_to_the_corpus():
    proposer = SuffixProposer(2, 100)
    proposer.propose([_first([A, B, C], output_start=1)])
    proposer.propose([_first([A, B, C, D], output_start=1)])  # rollback_to 0 again: a resync
    assert proposer.corpus.tokens == 0 and proposer.held == 1
    proposer.release(["s"])
    assert list(proposer.corpus.outputs.values()) == [("", [B, C, D])]


def test_only_committed_tokens_join_the_corpus():
    """Forced tokens (and a model's guesses behind suffix+model) are held as context but may yet be
    refused: a released sequence gives the corpus what the target had appended, no more."""
    proposer = SuffixProposer(2, 100)
    proposer.propose([_first([A, B, C], output_start=1, forced=[D, E])])
    assert proposer.sequences["s"].tokens == [A, B, C, D, E]
    proposer.release(["s"])
    assert list(proposer.corpus.outputs.values()) == [("", [B, C])]


def test_the_salt_and_output_start_travel_on_the_wire():
    item = _first([A, B, C], salt="tenant", output_start=2, key=7)
    assert item_from_pb(7, item_to_pb(item)) == item


# ----- through the engine -------------------------------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [1, 2, 3, 4, 9, 1, 2], [40, 41, 42, 40, 41], [9, 10, 11, 12, 13, 14]]


@pytest.mark.parametrize("kind", ["suffix", "suffix+model"])
def test_greedy_speculation_equals_plain_decoding(model_zoo, kind):
    plain, _ = run_engine(model_zoo["target"], None, PROMPTS * 2, 0, 40)
    suffix = SuffixProposer(16, 512)
    proposer = suffix if kind == "suffix" else \
        NgramPlusModelProposer(DraftProposer(load_model(model_zoo["partial"]), 16, 512), 16, lookup=suffix)
    # Two rows at a time: the second half's prompts are the first's, drafted from their outputs.
    spec, finals = run_engine(model_zoo["target"], None, PROMPTS * 2, 4, 40, proposer=proposer, max_slots=2)
    assert spec == plain
    assert sum(f.stats.accepted_tokens for f in finals) > 0  # the guesses really took part
    assert suffix.corpus.tokens > 0 and proposer.held == 0  # outputs kept, sequences released


def test_config_and_command_line_name_the_suffix_proposers():
    assert tuple(PROPOSERS) == DraftConfig.PROPOSERS
    assert {"suffix", "suffix+model"} <= set(DraftConfig.PROPOSERS)
    built = PROPOSERS["suffix"](DraftConfig(None, proposer="suffix", max_slots=3, max_seq_len=99, suffix_capacity=50))
    assert (built.name, built.free_slots, built.max_len, built.corpus.capacity) == ("suffix", 3, 99, 50)
    with pytest.raises(ValueError, match="model=ModelSpec"):
        DraftConfig(ModelSpec("m"), proposer="suffix")
    with pytest.raises(ValueError, match="model=None"):
        DraftConfig(None, proposer="suffix+model")
    with pytest.raises(ValueError, match="suffix_capacity=-1"):
        DraftConfig(None, proposer="suffix", suffix_capacity=-1)
    args = build_parser().parse_args(["draft", "--proposer", "suffix", "--suffix-capacity", "1000"])
    assert (args.proposer, args.suffix_capacity) == ("suffix", 1000)
