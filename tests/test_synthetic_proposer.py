"""The synthetic-α proposer: lossless through the engine, and accepted at the rate it is set to."""

from __future__ import annotations

import asyncio
import math

import pytest
from tests.support.engine_harness import run_engine, speculation

from draft_service.synthetic import SyntheticProposer
from specstream.data.config import ModelSpec, TargetConfig
from specstream.data.engine import SequenceRequest
from specstream.models.loader import load_model
from target_service.connection import Connection
from target_service.engine import Engine
from target_service.local_draft import LocalDraft

PROMPTS = [[0, 5, 6, 7], [0, 9], [0, 40, 41, 42, 43, 44]]
MAX_NEW = 60


def _run(model_zoo, oracle, alpha: float, gamma: int):
    model = load_model(model_zoo["target"])
    proposer = SyntheticProposer(oracle, model.config.vocab_size, alpha, seed=1)
    engine = Engine(model, TargetConfig(model=ModelSpec(str(model_zoo["target"])), max_slots=4, max_seq_len=512,
                                        max_gamma=8), LocalDraft(proposer))

    async def main():
        conn = Connection()
        engine.attach(conn)
        task = asyncio.create_task(engine.run())
        engine.submit(conn, [SequenceRequest(str(i), list(p), MAX_NEW, speculation=speculation(gamma))
                             for i, p in enumerate(PROMPTS)])
        tokens, final = {str(i): [] for i in range(len(PROMPTS))}, {}
        while len(final) < len(PROMPTS):
            for event in (await asyncio.wait_for(conn.outbox.get(), 30)).events:
                tokens[event.id] += event.token_ids
                if event.finish_reason:
                    final[event.id] = event
        task.cancel()
        return [tokens[str(i)] for i in range(len(PROMPTS))], list(final.values())

    return asyncio.run(main())


@pytest.fixture(scope="module")
def oracle(model_zoo):
    plain, _ = run_engine(model_zoo["target"], None, PROMPTS, gamma=0, max_new_tokens=MAX_NEW)
    return [p + c for p, c in zip(PROMPTS, plain)], plain


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.9, 1.0])
def test_lossless_and_accepted_at_rate_alpha(model_zoo, oracle, alpha):
    sequences, plain = oracle
    tokens, finals = _run(model_zoo, sequences, alpha, gamma=1)
    assert tokens == plain
    accepted = sum(f.stats.accepted_tokens for f in finals)
    proposed = sum(f.stats.draft_tokens for f in finals)
    assert proposed > 0
    # With gamma=1 every proposal is one Bernoulli(alpha) trial: allow 5 sigma.
    sigma = math.sqrt(max(alpha * (1 - alpha), 1e-12) / proposed)
    assert abs(accepted / proposed - alpha) <= 5 * sigma + 1e-9, (accepted, proposed)


def test_all_accepted_at_alpha_one_with_long_gamma(model_zoo, oracle):
    sequences, plain = oracle
    tokens, finals = _run(model_zoo, sequences, 1.0, gamma=8)
    assert tokens == plain
    assert all(f.stats.accepted_tokens == f.stats.draft_tokens for f in finals)
    assert sum(f.stats.target_passes for f in finals) < len(PROMPTS) * MAX_NEW / 4


def test_rejects_bad_alpha():
    with pytest.raises(ValueError, match="alpha=1.5"):
        SyntheticProposer([], 10, 1.5)


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_rejection_count_estimates_alpha_at_long_gamma(model_zoo, oracle, alpha):
    """accepted / proposed understates alpha when gamma > 1 (proposals after a rejection never get
    a chance); accepted / (accepted + rejections) is the i.i.d. estimate of alpha itself."""
    sequences, plain = oracle
    tokens, finals = _run(model_zoo, sequences, alpha, gamma=4)
    assert tokens == plain
    accepted = sum(f.stats.accepted_tokens for f in finals)
    rejections = sum(f.stats.rejections for f in finals)
    trials = accepted + rejections
    assert abs(accepted / trials - alpha) <= 5 * math.sqrt(alpha * (1 - alpha) / trials), (accepted, rejections)
    assert accepted / sum(f.stats.draft_tokens for f in finals) < alpha
