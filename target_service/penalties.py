"""Penalties (specstream/data/penalties.py) on the target's logits at every node a pass verifies,
each node seeing the tokens its position would have in plain decoding: the sequence's committed
tokens (``PenaltyState``: the prompt's ids, kept once, and the output's counts, kept up to date as
tokens are committed) and the proposals on the node's path (a chain's first j for node j; a tree's
node's ancestors). Plain decoding is the same call with one node and no proposals, so greedy
speculative output equals plain output token for token, and a sampled row's p is the distribution
plain decoding samples there (Leviathan's rule against the draft's q, whatever q was, keeps it).

Order, the same at every node: logit_bias added; repetition_penalty on each token of the prompt
and the output (a positive logit divided by it, any other multiplied); then frequency_penalty
times the token's count in the output plus presence_penalty, subtracted. Each is a
vocabulary-wide elementwise operation on the node's own row of logits (a token the penalty does
not touch gets exactly its logit back), so a node's result does not depend on the others. This is
the torch reference and the only implementation: penalties are rare, and they cost a few
vocabulary-sized vector operations per penalised row and node.
"""

from __future__ import annotations

from collections import Counter

import torch

from specstream.data.penalties import Penalties

__all__ = ["PenaltyState", "node_paths", "penalize"]


class PenaltyState:
    """A penalised sequence's penalties and the tokens they count: its prompt's ids and its output's counts."""

    def __init__(self, penalties: Penalties, prompt: list[int]) -> None:
        self.penalties = penalties
        self.prompt_ids = torch.tensor(sorted(set(prompt)), dtype=torch.int64)
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
        counts = torch.zeros(vocab, dtype=logits.dtype, device=device)  # the committed output's counts
        if state.output:
            ids = list(state.output)
            counts[torch.tensor(ids, device=device)] = torch.tensor([state.output[t] for t in ids],
                                                                    dtype=logits.dtype, device=device)
        prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        prompt[state.prompt_ids.to(device)] = True
        nodes = min(len(row.proposals) + 1, logits.shape[1])
        for j, path in enumerate(node_paths(list(row.proposals), list(row.parents), nodes)):
            node = counts
            if path:
                node = counts.index_add(0, torch.tensor(path, device=device),
                                        torch.ones(len(path), dtype=logits.dtype, device=device))
            _apply(logits[b, j], state.penalties, node, prompt)


def _apply(scores: torch.Tensor, p: Penalties, counts: torch.Tensor, prompt: torch.Tensor) -> None:
    """One node's logits [V], in place, given its output counts [V] and the prompt's ids [V] bool."""
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.int64, device=scores.device)
        scores[ids] += torch.tensor([bias for _, bias in p.logit_bias], dtype=scores.dtype, device=scores.device)
    present = counts > 0
    if p.repetition != 1.0:
        seen = prompt | present
        scores.copy_(torch.where(seen, torch.where(scores > 0, scores / p.repetition, scores * p.repetition), scores))
    if p.uses_counts:
        scores.sub_(counts * p.frequency + present.to(scores.dtype) * p.presence)  # 0 where absent: unchanged
