"""Penalties (specstream/data/penalties.py) on the target's logits at every node a pass verifies,
each node seeing the tokens its position would have in plain decoding: the committed ones (the
row's ``history``, its output from ``output_start`` on) and the proposals on the node's path
(a chain's first j for node j; a tree's node's ancestors). Plain decoding is the same call with
one node and no proposals, so greedy speculative output equals plain output token for token, and
a sampled row's p is the distribution plain decoding samples there (Leviathan's rule against
the draft's q, whatever q was, keeps it).

Order, the same at every node: logit_bias added; repetition_penalty on each token of the prompt
and the output (a positive logit divided by it, any other multiplied); then frequency_penalty
times the token's count in the output plus presence_penalty, subtracted. Every operation is
elementwise on the node's own row of logits, so a node's result does not depend on the others.
This is the torch reference and the only implementation: penalties are rare, and their cost is a
few vocabulary-sized vector operations per penalised row and node.
"""

from __future__ import annotations

from collections import Counter

import torch

from specstream.data.penalties import Penalties

__all__ = ["node_paths", "penalize"]


def node_paths(proposals: list[int], parents: list[int], nodes: int) -> list[list[int]]:
    """Per node (0: the last committed token, j: proposal j - 1), the proposals from the root to it."""
    paths: list[list[int]] = [[]]
    for j in range(1, nodes):
        parent = parents[j - 1] if parents else j - 1
        paths.append([*paths[parent], proposals[j - 1]])
    return paths


def penalize(logits: torch.Tensor, rows: list) -> None:
    """logits [B, N, V], in place: each row with penalties (a ``VerifyRow``) at each of its nodes."""
    for b, row in enumerate(rows):
        p: Penalties | None = row.penalties
        if p is None:
            continue
        nodes = min(len(row.proposals) + 1, logits.shape[1])
        output = Counter(row.history[row.output_start:])
        prompt = set(row.history[: row.output_start]) if p.repetition != 1.0 else set()
        for j, path in enumerate(node_paths(list(row.proposals), list(row.parents), nodes)):
            _apply(logits[b, j], p, output + Counter(path) if path else output, prompt)


def _apply(scores: torch.Tensor, p: Penalties, output: Counter, prompt: set[int]) -> None:
    """One node's logits [V], in place."""
    device = scores.device
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.int64, device=device)
        scores[ids] += torch.tensor([bias for _, bias in p.logit_bias], dtype=scores.dtype, device=device)
    if p.repetition != 1.0:
        seen = torch.tensor(sorted(prompt | output.keys()), dtype=torch.int64, device=device)
        if len(seen):
            picked = scores[seen]
            scores[seen] = torch.where(picked > 0, picked / p.repetition, picked * p.repetition)
    if p.uses_counts and output:
        ids = sorted(output)
        counts = torch.tensor([output[t] for t in ids], dtype=scores.dtype, device=device)
        scores[torch.tensor(ids, dtype=torch.int64, device=device)] -= counts * p.frequency + p.presence
