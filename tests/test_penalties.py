"""Penalties (presence, frequency, repetition, logit_bias) exactly under speculation.

The rule is one dataclass that checks itself (specstream/data/penalties.py) and one rule against
the vocabulary and beam search (request_rules.check_penalties); every hop carries it; the target
applies it at every verified node with the counts that node's position has (its path's proposals
on top of the committed tokens: target_service/penalties.py). Checked: the application against a
direct computation; plain decoding against decoding by full recomputation with the same
penalties; greedy speculative output equals plain output token for token with each penalty on,
for every draft and γ, and for a tree; sampled output under coupled verification equals plain's
token for token, and under Leviathan's rule has plain's distribution (two-sample chi-square,
false alarm 1e-3 per position). The draft applies the same penalties (draft_service/penalty_state.py):
a draft with the target's weights is never refused, and every draft counts exactly what it holds.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specstream.data.engine import SequenceRequest
from specstream.data.engine_wire import request_from_pb, request_to_pb
from specstream.data.errors import InvalidArgumentError
from specstream.data.penalties import MAX_LOGIT_BIAS, Penalties
from specstream.data.sampling import SamplingParams
from specstream.models.loader import load_model
from specstream_client.options import GenerateOptions
from target_service.penalties import PenaltyState, node_paths, penalize
from tests.support.chi_square import two_sample_p_value
from tests.support.engine_harness import run_engine

THRESHOLD = 1e-3
MAX_NEW = 24
PENALTIES = {
    "frequency": Penalties(frequency=1.5),
    "presence": Penalties(presence=1.2),
    "repetition": Penalties(repetition=1.8),
    "logit_bias": Penalties(logit_bias=((7, 4.0), (12, -100.0), (40, 3.0))),
    "all": Penalties(presence=0.5, frequency=0.75, repetition=1.25, logit_bias=((3, 2.5),)),
}


# ----- the rule ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "field"), [
    ({"presence": 2.5}, "penalties.presence_penalty"),
    ({"frequency": -3.0}, "penalties.frequency_penalty"),
    ({"frequency": float("nan")}, "penalties.frequency_penalty"),
    ({"repetition": 0.0}, "penalties.repetition_penalty"),
    ({"repetition": 2.5}, "penalties.repetition_penalty"),
    ({"logit_bias": ((5, 101.0),)}, "penalties.logit_bias[5]"),
    ({"logit_bias": tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1))}, "penalties.logit_bias"),
])
def test_a_penalty_out_of_range_is_refused_naming_it(kwargs, field):
    with pytest.raises(InvalidArgumentError) as info:
        Penalties(**kwargs)
    assert info.value.field == field


def test_ids_past_the_vocabulary_and_beam_search_are_refused():
    from specstream.data.beam import BeamOptions
    from specstream.data.request_rules import RequestLimits, check_request

    limits = RequestLimits(vocab_size=100, max_context_length=64, max_new_tokens=32, max_gamma=8, max_top_logprobs=5,
                           max_beams=4)
    with pytest.raises(InvalidArgumentError) as info:
        check_request(SequenceRequest("a", [1, 2], 4, penalties=Penalties(logit_bias=((100, 1.0),))), limits)
    assert info.value.field == "penalties.logit_bias[100]"
    with pytest.raises(InvalidArgumentError) as info:
        check_request(SequenceRequest("a", [1, 2], 4, beam=BeamOptions(num_beams=2), penalties=Penalties(presence=1.0)),
                      limits)
    assert info.value.field == "beam"


def test_every_hop_carries_them_and_none_is_sent_when_they_change_nothing():
    p = PENALTIES["all"]
    request = SequenceRequest("a", [1, 2, 3], 5, penalties=p)
    assert request_from_pb(request_to_pb(request)).penalties == p
    assert request_from_pb(request_to_pb(SequenceRequest("a", [1], 5))).penalties is None
    pb = GenerateOptions(presence_penalty=0.5, frequency_penalty=0.75, repetition_penalty=1.25,
                         logit_bias={3: 2.5}).to_pb()
    assert Penalties.from_pb(pb.penalties) == p
    assert not GenerateOptions().to_pb().HasField("penalties")


# ----- the application ---------------------------------------------------------------------------------
def test_each_node_sees_its_own_positions_counts():
    """A chain's node j counts the committed output plus its first j proposals; a tree's node its
    ancestors; the prompt counts for repetition only."""
    assert node_paths([5, 6, 7], [], 4) == [[], [5], [5, 6], [5, 6, 7]]
    assert node_paths([5, 6, 8], [0, 1, 0], 4) == [[], [5], [5, 6], [8]]

    class Row:  # prompt 9, 5; output so far 2, 5
        proposals, parents = [5, 6], []
        penalties = PenaltyState(Penalties(presence=0.5, frequency=1.0, repetition=2.0, logit_bias=((6, 3.0),)), [9, 5])

    for token in (2, 5):
        Row.penalties.take(token)

    logits = torch.randn(1, 3, 12)
    got = logits.clone()
    penalize(got, [Row])
    for j, path in enumerate([[], [5], [5, 6]]):
        want = logits[0, j].clone()
        want[6] += 3.0
        output = Counter([2, 5, *path])
        for t in {9, 5} | set(output):  # the prompt (9, 5) and the output
            want[t] = want[t] / 2.0 if want[t] > 0 else want[t] * 2.0
        for t, n in output.items():
            want[t] -= n * 1.0 + 0.5
        assert torch.equal(got[0, j], want), j


@torch.inference_mode()
def _penalised_greedy(target, prompt: list[int], p: Penalties) -> list[int]:
    """Plain greedy decoding by full recomputation with the penalties applied by hand."""
    model = load_model(target)
    tokens = list(prompt)
    for _ in range(MAX_NEW):
        cache = model.new_cache(1, len(tokens) + 1)
        logits = model(torch.tensor([tokens]), cache, torch.tensor([0]), torch.tensor([0]))[0, -1].float()
        for t, bias in p.logit_bias:
            logits[t] += bias
        if p.repetition != 1.0:
            for t in set(tokens):
                logits[t] = logits[t] / p.repetition if logits[t] > 0 else logits[t] * p.repetition
        for t, n in Counter(tokens[len(prompt):]).items():
            logits[t] -= n * p.frequency + p.presence
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def prompts(model_zoo):
    from specstream.text.tokenizer import TextTokenizer
    from tests.test_engine_lossless import _prompts

    tok = TextTokenizer.from_dir(model_zoo["target"])
    return _prompts(tok, tok.vocab_size)[:4]


@pytest.fixture(scope="module")
def plain(model_zoo, prompts):
    return {name: run_engine(model_zoo["target"], None, prompts, gamma=0, max_new_tokens=MAX_NEW, penalties=p)[0]
            for name, p in PENALTIES.items()}


@pytest.mark.parametrize("name", list(PENALTIES))
def test_plain_decoding_applies_them_as_recomputation_does(model_zoo, prompts, plain, name):
    free, _ = run_engine(model_zoo["target"], None, prompts, gamma=0, max_new_tokens=MAX_NEW)
    assert plain[name] != free  # they change the output
    for prompt, got in zip(prompts[:2], plain[name][:2]):
        assert got == _penalised_greedy(model_zoo["target"], prompt, PENALTIES[name])


@pytest.mark.parametrize("name", list(PENALTIES))
@pytest.mark.parametrize(("draft", "gamma"), [("same", 3), ("partial", 2), ("partial", None), ("unrelated", 4)])
def test_speculative_greedy_equals_plain_with_each_penalty(model_zoo, prompts, plain, name, draft, gamma):
    tokens, finals = run_engine(model_zoo["target"], model_zoo[draft], prompts, gamma=gamma, max_new_tokens=MAX_NEW,
                                penalties=PENALTIES[name], config={"calibrate": False})
    assert tokens == plain[name]
    # The draft penalises its own logits as the target does at each guess's position
    # (draft_service/penalty_state.py): the target's own weights as the draft guess its penalised
    # argmax every time, even where a +4 logit_bias moves it on this tiny model's flat logits.
    if draft == "same":
        assert sum(f.stats.rejections for f in finals) == 0
        assert sum(f.stats.accepted_tokens for f in finals) == sum(f.stats.draft_tokens for f in finals) > 0


def test_a_tree_gives_plain_output_with_penalties(model_zoo, prompts, plain):
    """Each node counts its own ancestors (a branch does not see its siblings' tokens)."""
    tokens, finals = run_engine(model_zoo["target"], model_zoo["partial"], prompts, gamma=2, max_new_tokens=MAX_NEW,
                                penalties=PENALTIES["all"], config={"calibrate": False, "tree_branches": 2,
                                                                   "gamma_policy": "fixed"})
    assert tokens == plain["all"]


# ----- sampled -----------------------------------------------------------------------------------------
SAMPLES, SAMPLED_NEW = 1500, 4
SAMPLED = Penalties(frequency=1.5, presence=0.5, logit_bias=((4, 1.5),))


def _sampled(pair, draft, gamma, seeds, coupled=False):
    params = [SamplingParams(temperature=1.0, seed=s) for s in seeds]
    config = {"calibrate": False, **({"speculative_sampling": "coupled"} if coupled else {})}
    tokens, _ = run_engine(pair["target"], pair[draft] if draft else None, [[5, 9, 17, 3, 22]] * len(seeds), gamma,
                           SAMPLED_NEW, sampling=params, max_slots=64, penalties=SAMPLED, config=config)
    return tokens


@pytest.fixture(scope="module")
def sampled_plain(sampling_pair):
    return _sampled(sampling_pair, None, 0, range(SAMPLES))


def test_coupled_speculative_sampling_equals_plain_sampling_with_penalties(sampling_pair, sampled_plain):
    assert _sampled(sampling_pair, "draft", 3, range(200), coupled=True) == sampled_plain[:200]


def test_leviathan_speculative_sampling_keeps_the_penalised_distribution(sampling_pair, sampled_plain):
    """Each position's marginal, and the pair of the first two, under speculation (γ = 3, other
    seeds) against plain sampling's (two-sample chi-square, false alarm 1e-3 each); the penalties
    change the distribution (the free one differs)."""
    spec = _sampled(sampling_pair, "draft", 3, range(1 << 20, (1 << 20) + SAMPLES))
    for position in range(SAMPLED_NEW):
        p_value = two_sample_p_value(Counter(t[position] for t in spec), Counter(t[position] for t in sampled_plain))
        assert p_value > THRESHOLD, (position, p_value)
    p_value = two_sample_p_value(Counter(tuple(t[:2]) for t in spec), Counter(tuple(t[:2]) for t in sampled_plain))
    assert p_value > THRESHOLD, p_value
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(SAMPLES)]
    free, _ = run_engine(sampling_pair["target"], None, [[5, 9, 17, 3, 22]] * SAMPLES, 0, SAMPLED_NEW,
                         sampling=params, max_slots=64)
    repeats = [sum(n - 1 for seq in runs for n in Counter(seq).values()) for runs in (free, sampled_plain)]
    assert repeats[1] < repeats[0] * 0.8  # the frequency penalty makes repeats rarer


# ----- the draft's own penalties ----------------------------------------------------------------------------
def test_the_draft_counts_what_it_holds_through_guesses_and_rollbacks():
    from draft_service.penalty_state import DraftPenalties
    from specstream.data.propose import ProposeItem

    held, p = DraftPenalties(), PENALTIES["all"]
    row = held.sync(ProposeItem("s", 0, [5, 6, 7, 9], 3, penalties=p, output_start=3))  # prompt 5 6 7, output 9
    assert row.penalties == p and row.output == Counter({9: 1})
    row.take([9, 4])  # two guesses picked
    assert row.output == Counter({9: 2, 4: 1})
    held.hold("s", 5)  # a token draft holds its guesses but the last
    assert row.tokens == [5, 6, 7, 9, 9] and row.output == Counter({9: 2})
    row = held.sync(ProposeItem("s", 4, [8], 3))  # the target kept none of them: rolled back, its token appended
    assert row.tokens == [5, 6, 7, 9, 8] and row.output == Counter({9: 1, 8: 1})
    assert held.sync(ProposeItem("s", 9, [1], 3)) is None and "s" not in held.rows  # past what it holds: dropped
    assert held.sync(ProposeItem("t", 0, [5, 6], 3)) is None  # not penalised


def test_a_subset_head_is_penalised_as_the_whole_vocabulary_is():
    from kernels.penalties import apply_penalties, count_vector, id_mask

    torch.manual_seed(0)
    vocab, p = 50, PENALTIES["all"]
    full = torch.randn(vocab)
    columns = torch.tensor([3, 7, 0, 12, 40, 41, 9])  # a head over these ids, in its own order
    counts, prompt = count_vector({3: 2, 12: 1, 8: 4}, vocab, torch.float32, full.device), id_mask([0, 40], vocab, full.device)
    subset = full[columns].clone()
    apply_penalties(full, p, counts, prompt)
    apply_penalties(subset, p, counts, prompt, columns)
    assert torch.equal(subset, full[columns])


class _Holdings:
    """A proposer passed through, keeping after each call, per penalised sequence, the tokens its
    draft counts (``draft`` is the model proposer holding the ``penalties`` rows)."""

    def __init__(self, inner, draft) -> None:
        self.inner, self.draft, self.first, self.held = inner, draft, {}, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, items):
        replies = self.inner.propose(items)
        for item, reply in zip(items, replies):
            if item.rollback_to == 0:
                self.first[item.key] = item
            row = self.draft.penalties.rows.get(item.key)
            self.held.append((item, reply, list(row.tokens) if row is not None else None))
        return replies


@pytest.mark.parametrize("kind", ["token", "feature+lookup"])
def test_the_draft_penalises_with_the_tokens_it_holds(model_zoo, feature_pair, prompts, plain, kind):
    """The penalties reach the draft (through prompt lookup too) with the sequence's first item, and
    after every call it counts exactly what it holds: the sequence's prompt and committed output,
    then the guesses it keeps (a token draft's, but the last). Plain output, token for token."""
    from pathlib import Path

    from draft_service.combined import NgramPlusModelProposer
    from draft_service.feature import FeatureProposer
    from draft_service.proposer import DraftProposer
    from specstream.models.feature_draft import load_feature_draft

    if kind == "token":
        draft = DraftProposer(load_model(model_zoo["partial"]), max_slots=16, max_seq_len=512)
        proposer = _Holdings(draft, draft)
    else:
        draft = FeatureProposer(load_feature_draft(feature_pair["draft"], Path), 16, 512)
        proposer = _Holdings(NgramPlusModelProposer(draft, 16, min_n=1), draft)
    tokens, _ = run_engine(model_zoo["target"], None, prompts, 3, MAX_NEW, proposer=proposer,
                           penalties=PENALTIES["all"], config={"calibrate": False})
    assert tokens == plain["all"]
    seq_prompts = {}
    for key, item in proposer.first.items():
        assert item.penalties == PENALTIES["all"]
        seq_prompts[key] = item.append[: item.output_start]
    assert sorted(map(tuple, seq_prompts.values())) == sorted(map(tuple, prompts))
    counted = [(item, reply, held) for item, reply, held in proposer.held if held is not None]
    assert counted
    outputs = {tuple(p): out for p, out in zip(prompts, tokens)}
    for item, reply, held in counted:
        whole = seq_prompts[item.key] + outputs[tuple(seq_prompts[item.key])]
        sent = item.rollback_to + len(item.append)  # committed: the sequence's own tokens
        assert held == [*whole[:sent], *reply.tokens][: len(held)]
        assert len(held) == reply.length or reply.source != "model"  # lookup's answers leave the model behind
