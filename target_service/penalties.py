"""Penalties (specstream/data/penalties.py) on the target's logits at every node a pass verifies,
each node seeing the tokens its position would have in plain decoding: the sequence's committed
tokens (``PenaltyState``: the prompt's ids, kept once, and the output's counts, kept up to date as
tokens are committed) and the proposals on the node's path (a chain's first j for node j; a tree's
node's ancestors). Plain decoding is the same call with one node and no proposals, so greedy
speculative output equals plain output token for token, and a sampled row's p is the distribution
plain decoding samples there (Leviathan's rule against the draft's q, whatever q was, keeps it).
Each node's logits are penalised by kernels/penalties.py (the order, and the draft's same call).
"""

from __future__ import annotations

from collections import Counter

import torch

from kernels.penalties import apply_penalties, count_vector, id_mask
from specstream.data.penalties import Penalties

__all__ = ["PenaltyState", "node_paths", "penalize"]


class PenaltyState:
    """A penalised sequence's penalties and the tokens they count: its prompt's ids and its output's counts."""

    def __init__(self, penalties: Penalties, prompt: list[int]) -> None:
        self.penalties = penalties
        self.prompt_ids = sorted(set(prompt))
        self.output: Counter[int] = Counter()

    def take(self, token: int) -> None:
        """A committed output token."""
        self.output[token] += 1


def node_paths(proposals: list[int], parents: list[int], nodes: int) -> list[list[int]]:
    """Per node (0: the last committed token, j: proposal j - 1), the proposals from the root to it."""
    paths: list[list[int]] = [[]]
    for j in range(1, nodes):
        parent = parents[j - 1] if parents else j - 1
        paths.append([*paths[parent], proposals[j - 1]])
    return paths


def penalize(logits: torch.Tensor, rows: list) -> None:
    """logits [B, N, V], in place: each row (a ``VerifyRow``) with a ``PenaltyState`` at each of its nodes."""
    vocab, device = logits.shape[-1], logits.device
    for b, row in enumerate(rows):
        state: PenaltyState | None = row.penalties
        if state is None:
            continue
        counts = count_vector(state.output, vocab, logits.dtype, device)  # the committed output's counts
        prompt = id_mask(state.prompt_ids, vocab, device)
        nodes = min(len(row.proposals) + 1, logits.shape[1])
        for j, path in enumerate(node_paths(list(row.proposals), list(row.parents), nodes)):
            node = counts
            if path:
                node = counts.index_add(0, torch.tensor(path, device=device),
                                        torch.ones(len(path), dtype=logits.dtype, device=device))
            apply_penalties(logits[b, j], state.penalties, node, prompt)
