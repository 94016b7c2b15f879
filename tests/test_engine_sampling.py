"""Sampling requests in the engine: reproducible per seed whatever shares the batch, temperature 0
is greedy, log-probabilities are the target's, stops cut accepted runs, bad settings and bad
draft tables are handled. (Exactness of the distribution: test_sampling_exact.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from tests.support.engine_harness import naive_greedy, run_engine

from draft_service.proposer import DraftProposer
from kernels.processing import process_logits
from kernels.random import RESIDUAL, SAMPLE, race, row_keys
from specstream.data.propose import ProposeItem
from specstream.data.sampling import SamplingParams
from specstream.models.loader import load_model

PROMPTS = [[5, 9, 17, 3, 22], [1, 2], [7, 7, 7, 7, 7, 7, 7, 7, 7], [30, 4, 11]]
CHOSEN = SamplingParams(temperature=0.8, top_p=0.95, seed=7)


def test_same_seed_same_tokens_whatever_shares_the_batch(sampling_pair):
    target, draft = sampling_pair["target"], sampling_pair["draft"]
    alone, _ = run_engine(target, draft, [PROMPTS[0]], 3, 24, sampling=[CHOSEN])
    again, _ = run_engine(target, draft, [PROMPTS[0]], 3, 24, sampling=[CHOSEN])
    neighbours = [SamplingParams(), SamplingParams(temperature=1.5, seed=7), SamplingParams(temperature=0.8, top_k=3, seed=1)]
    for order in ([CHOSEN, *neighbours], [*neighbours, CHOSEN]):
        prompts = [PROMPTS[0], *PROMPTS[1:]] if order[0] is CHOSEN else [*PROMPTS[1:], PROMPTS[0]]
        mixed, _ = run_engine(target, draft, prompts, 3, 24, sampling=order)
        assert mixed[order.index(CHOSEN)] == alone[0]
    assert again == alone
    other_seed, _ = run_engine(target, draft, [PROMPTS[0]], 3, 24, sampling=[SamplingParams(temperature=0.8, top_p=0.95, seed=8)])
    assert other_seed != alone  # the seed matters (24 tokens from ~2 nats each cannot all agree)


@pytest.mark.parametrize("gamma", [0, 1, 4])
def test_temperature_zero_is_greedy_exactly(sampling_pair, gamma):
    greedy_with_extras = SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=99)  # cuts are ignored
    tokens, _ = run_engine(sampling_pair["target"], sampling_pair["draft"], PROMPTS, gamma, 20,
                           sampling=[greedy_with_extras] * len(PROMPTS))
    assert tokens == [naive_greedy(sampling_pair["target"], p, 20) for p in PROMPTS]


@torch.inference_mode()
def _reference_logprobs(target, prompt: list[int], generated: list[int], params: SamplingParams) -> list[torch.Tensor]:
    """log p of each position by full recomputation, independent of the engine and its cache."""
    model = load_model(target)
    tokens, out = list(prompt), []
    for token in generated:
        logits = model(torch.tensor([tokens]), model.new_cache(1, len(tokens) + 1), torch.tensor([0]), torch.tensor([0]))
        out.append(process_logits(logits[:, -1], params)[0].log())
        tokens.append(token)
    return out


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=6, seed=3),
                                    SamplingParams(temperature=1.3, top_p=0.9, seed=4)],
                         ids=["greedy", "top_k", "top_p"])
def test_logprobs_are_the_targets_processed_distribution(sampling_pair, params):
    tokens, finals = run_engine(sampling_pair["target"], sampling_pair["draft"], [PROMPTS[0]], 3, 12,
                                sampling=[params], logprobs=4)
    logprobs = finals[0].logprobs
    assert [lp.token_id for lp in logprobs] == tokens[0]
    for lp, expected in zip(logprobs, _reference_logprobs(sampling_pair["target"], PROMPTS[0], tokens[0], params)):
        assert math.isclose(lp.logprob, float(expected[lp.token_id]), abs_tol=1e-4)
        top = torch.topk(expected, 4)
        finite = [(int(i), float(v)) for i, v in zip(top.indices, top.values) if v > float("-inf")]
        assert [t for t, _ in lp.top] == [i for i, _ in finite]
        assert all(math.isclose(got, v, abs_tol=1e-4) for (_, got), (_, v) in zip(lp.top, finite))
    if params.top_k:
        assert all(len(lp.top) == 4 for lp in logprobs)  # 6 tokens survive the cut: 4 alternatives
    none, finals = run_engine(sampling_pair["target"], sampling_pair["draft"], [PROMPTS[0]], 3, 12, sampling=[params])
    assert none == tokens and len(finals[0].logprobs) == 0  # asking for logprobs changes nothing else


def test_a_stop_id_inside_an_accepted_run_ends_the_sequence(sampling_pair):
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(40)]
    free, _ = run_engine(sampling_pair["target"], sampling_pair["draft"], [PROMPTS[0]] * 40, 6, 16, sampling=params)
    stop = max(range(32), key=lambda t: sum(seq[1:].count(t) for seq in free))  # common after the first token
    stopped, finals = run_engine(sampling_pair["target"], sampling_pair["draft"], [PROMPTS[0]] * 40, 6, 16,
                                 sampling=params, stop_ids=[stop], logprobs=0)
    cut = 0
    for seq, out, final in zip(free, stopped, finals):
        expected = seq[: seq.index(stop) + 1] if stop in seq else seq
        assert out == expected  # the same draws up to the stop, nothing after it
        assert len(final.logprobs) == len(out)
        cut += stop in seq
    assert cut >= 10


def test_sampling_settings_are_validated_at_the_target(sampling_pair):
    """Through the servicer's edge (protobuf -> the engine's dataclasses): every bad request gets
    its own error event naming the field and value; the good one in the same Submit runs."""
    from specstream.data.config import ModelSpec, TargetConfig
    from specstream_pb import common_pb2, target_pb2
    from target_service.connection import Connection
    from target_service.engine import Engine
    from target_service.server import TargetServicer

    engine = Engine(load_model(sampling_pair["target"]), TargetConfig(model=ModelSpec("t"), max_slots=2, max_seq_len=64), None)
    conn = Connection()
    bad = [target_pb2.SequenceRequest(id="p", prompt_token_ids=[1], max_new_tokens=2,
                                      sampling=common_pb2.Sampling(temperature=1.0, top_p=0.0)),
           target_pb2.SequenceRequest(id="t", prompt_token_ids=[1], max_new_tokens=2,
                                      sampling=common_pb2.Sampling(temperature=float("nan"), top_p=1.0)),
           target_pb2.SequenceRequest(id="l", prompt_token_ids=[1], max_new_tokens=2, logprobs=True, top_logprobs=33),
           target_pb2.SequenceRequest(id="m", prompt_token_ids=[1], max_new_tokens=2,
                                      speculation=common_pb2.Speculation(mode=7)),
           target_pb2.SequenceRequest(id="ok", prompt_token_ids=[1], max_new_tokens=2)]
    TargetServicer(engine)._submit(conn, bad)
    errors = {}
    while not conn.outbox.empty():
        for event in conn.outbox.get_nowait().events:
            errors[event.id] = str(event.error)
    assert set(errors) == {"p", "t", "l", "m"} and [s.request_id for s in engine.waiting] == ["ok"]
    assert errors["m"].startswith("speculation.mode=7")
    assert errors["p"].startswith("sampling.top_p=0.0")
    assert errors["t"].startswith("sampling.temperature=nan")
    assert errors["l"].startswith("top_logprobs=33")


def test_draft_sends_q_bounded_by_its_support_and_samples_from_it(sampling_pair):
    proposer = DraftProposer(load_model(sampling_pair["draft"]), max_slots=4, max_seq_len=64, q_support=4)
    params = SamplingParams(temperature=1.5, seed=11)
    (proposal,) = proposer.propose([ProposeItem("a", 0, PROMPTS[0], 5, params)])
    assert len(proposal.tokens) == 5 and 1 <= proposal.q_width <= 4  # 32-token vocabulary, 4 sent
    for j, token in enumerate(proposal.tokens):
        ids = proposal.q_ids[j * proposal.q_width : (j + 1) * proposal.q_width]
        probs = proposal.q_probs[j * proposal.q_width : (j + 1) * proposal.q_width]
        assert math.isclose(sum(probs), 1.0, rel_tol=1e-5)
        assert probs[ids.index(token)] > 0  # the guess was drawn from the q that is sent
    greedy = proposer.propose([ProposeItem("b", 0, PROMPTS[0], 5)])[0]
    assert greedy.q_width == 0 and greedy.q_ids == []


def test_a_malformed_draft_table_is_ignored_not_trusted(sampling_pair):
    class Corrupting(DraftProposer):
        def propose(self, items):
            proposals = super().propose(items)
            for p in proposals:
                if p.q_ids:
                    p.q_ids[0] = 1000  # outside the vocabulary
            return proposals

    params = SamplingParams(temperature=1.0, seed=5)
    corrupt = Corrupting(load_model(sampling_pair["draft"]), max_slots=16, max_seq_len=512)
    tokens, finals = run_engine(sampling_pair["target"], None, [PROMPTS[0]], 3, 10, sampling=[params], proposer=corrupt)
    assert finals[0].stats.accepted_tokens == 0 and finals[0].stats.draft_tokens == 0
    # Proposals dropped: every token is a plain draw from p, the first (from the prefill) with the
    # plain sample's noise, the later ones with RESIDUAL noise, since the draft drew at their
    # positions (its guesses, and whether the table came out malformed, may depend on that noise).
    p = _reference_logprobs(sampling_pair["target"], PROMPTS[0], tokens[0], params)
    expected = []
    for i, logp in enumerate(p):
        key = row_keys([params.seed], [len(PROMPTS[0]) + i], SAMPLE if i == 0 else RESIDUAL)
        expected.append(int(race(logp.exp()[None], key)[0]))
    assert tokens[0] == expected
