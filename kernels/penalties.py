"""Penalties on one position's logits, as every scorer of both services applies them: the target at
each node it verifies (target_service/penalties.py) and a draft at each guess
(draft_service/penalty_state.py), so the draft's q is the distribution the target's p is
penalised into there.

Order (specstream/data/penalties.py): logit_bias added; repetition_penalty on each token of the
prompt and of the output (a positive logit divided by it, any other multiplied); then
frequency_penalty times the token's count in the output plus presence_penalty, subtracted. Each
is a vocabulary-wide elementwise operation on the row (a token no penalty touches gets exactly its
logit back). This is the torch reference and the only implementation: penalties are rare, and
they cost a few vocabulary-sized vector operations per penalised row and position.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from specstream.data.penalties import Penalties

__all__ = ["apply_penalties", "count_vector", "id_mask"]


def apply_penalties(scores: torch.Tensor, p: Penalties, counts: torch.Tensor, prompt: torch.Tensor,
                    columns: torch.Tensor | None = None) -> None:
    """One position's logits [N], in place, given its output's counts [V] and the prompt's ids [V]
    bool, by token id. ``columns`` [N]: the token id of each logit column, for a head over a subset
    of the vocabulary (a draft's); None: column j is token j."""
    if p.logit_bias:
        bias = count_vector(dict(p.logit_bias), counts.shape[0], scores.dtype, scores.device)  # by token id
        scores.add_(bias if columns is None else bias[columns])
    if columns is not None:
        counts, prompt = counts[columns], prompt[columns]
    present = counts > 0
    if p.repetition != 1.0:
        seen = prompt | present
        scores.copy_(torch.where(seen, torch.where(scores > 0, scores / p.repetition, scores * p.repetition), scores))
    if p.uses_counts:
        scores.sub_(counts * p.frequency + present.to(scores.dtype) * p.presence)  # 0 where absent: unchanged


def count_vector(counts: Mapping[int, float], vocab: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """token -> count (or bias) as a [V] vector (ids past ``vocab`` dropped: no logit to penalise)."""
    out = torch.zeros(vocab, dtype=dtype, device=device)
    ids = [t for t in counts if t < vocab]
    if ids:
        out[torch.tensor(ids, device=device)] = torch.tensor([counts[t] for t in ids], dtype=dtype, device=device)
    return out


def id_mask(ids: Iterable[int], vocab: int, device: torch.device) -> torch.Tensor:
    """The ids as a bool [V] vector (ids past ``vocab`` dropped)."""
    out = torch.zeros(vocab, dtype=torch.bool, device=device)
    kept = [t for t in ids if t < vocab]
    if kept:
        out[torch.tensor(kept, device=device)] = True
    return out
