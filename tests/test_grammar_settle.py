"""Settling constrained rows without the output layer where a grammar mask allows one token
(target_service/settle.py ``_logits``): the verdicts, tokens and log-probabilities are bit for bit
those of settling the full logits under the same masks, greedy and sampled (seeded draws, a
point-mass proposal, Leviathan's rule against a sparse q), and the output layer scored only the
other nodes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.lm_head import Hidden, OutputHead
from specstream.data.sampling import SamplingParams
from specstream.text.grammar import mask_words
from target_service.settle import VerifyRow, settle

VOCAB, WIDTH, POSITIONS = 300, 16, 4


@dataclass(frozen=True)
class CountingHead(OutputHead):
    """An output layer that records how many hidden states it scored."""

    scored: list = None  # type: ignore[assignment]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.scored.append(hidden.shape[0])
        return super().logits(hidden)


def _mask(allowed: list[int] | None, rng: np.random.Generator) -> np.ndarray:
    """A packed mask int32 [W] allowing ``allowed``, or (None) a random third of the vocabulary."""
    ids = allowed if allowed is not None else rng.choice(VOCAB, VOCAB // 3, replace=False).tolist()
    bits = np.zeros(mask_words(VOCAB), dtype=np.uint32)
    for token in ids:
        bits[token >> 5] |= np.uint32(1 << (token & 31))
    return bits.view(np.int32)


def _rows(seed: int) -> tuple[list[VerifyRow], int]:
    """Four rows of a pass: greedy with forced proposals, sampled with point masses and log-
    probabilities, sampled against a sparse q, free text; and how many nodes allow one token."""
    rng = np.random.default_rng(seed)
    greedy = VerifyRow(SamplingParams(), 10, proposals=[7, 31, 200])
    greedy.grammar_mask = np.stack([_mask([7], rng), _mask([31], rng), _mask(None, rng), _mask(None, rng)])
    points = VerifyRow(SamplingParams(temperature=0.8, seed=seed), 20, proposals=[255, 3], logprobs=3, forced=1)
    points.grammar_mask = np.stack([_mask([255], rng), _mask(None, rng), _mask([9], rng)])
    sparse = VerifyRow(SamplingParams(temperature=1.3, top_k=40, seed=seed + 1), 5, proposals=[64], drafted=1,
                       q_width=2, q_ids=[64, 65], q_probs=[0.7, 0.3])
    sparse.grammar_mask = np.stack([_mask([64, 65, 66], rng), _mask([299], rng)])
    free = VerifyRow(SamplingParams(), 30, proposals=[1, 2, 3], logprobs=2)
    return [greedy, points, sparse, free], 5


def test_nodes_a_mask_allows_one_token_settle_as_their_full_logits_without_the_output_layer() -> None:
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        weight = torch.randn(VOCAB, WIDTH, generator=gen)
        states = torch.randn(4 * POSITIONS, WIDTH, generator=gen)
        head = CountingHead(weight, scored=[])
        rows, sole = _rows(seed)
        skipped = settle(Hidden(states, head), rows)
        assert sum(head.scored) == 4 * POSITIONS - sole  # the sole-token nodes were not scored
        full = settle(OutputHead(weight).logits(states).view(4, POSITIONS, VOCAB), _rows(seed)[0])
        for a, b in zip(skipped, full):
            assert (a.accepted, a.tokens, a.logprobs) == (b.accepted, b.tokens, b.logprobs)
        assert skipped[0].tokens[:2] == [7, 31]  # the forced proposals stand whatever the logits say
