"""Fused 1-best: scores (+ bias) -> the argmax token, with its log-probability when asked.

The 1-best needs no softmax (Marian, "Faster NMT", Algorithm 3: the best class is the largest
logit), so none is computed; the log-probability of the chosen token is its logit minus the
log-sum-exp, which the same pass accumulates online when ``logprob=True``. Ties break toward the
lowest id, as ``torch.argmax`` and Hugging Face greedy decoding do. Reads logits or, with
``Hidden``, computes them tile by tile from the LM head (kernels/lm_head.py).
"""

from __future__ import annotations

import torch

from kernels.dispatch import backend
from kernels.lm_head import Hidden, Scores, scores_reference
from kernels.row_pass import row_pass_reference, row_partials


def best_token(scores: Scores, logprob: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """scores: logits [N, V] or Hidden -> (ids [N] int64, log-probabilities [N] float32 under the
    plain softmax, or None). A row with every score -inf gets id 0 and log-probability -inf."""
    if backend(scores.states if isinstance(scores, Hidden) else scores) == "torch":
        return best_token_reference(scores, logprob)
    best, top, lse, _, _ = row_partials(scores, lse=logprob)
    if not logprob:
        return best, None
    return best, top - torch.where(top == float("-inf"), 0.0, lse)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., vocab] -> token ids [...] (int64)."""
    if backend(logits) == "torch":
        return argmax_reference(logits)
    flat = logits.reshape(-1, logits.shape[-1])
    return best_token(flat)[0].view(logits.shape[:-1])


def best_token_reference(scores: Scores, logprob: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = scores_reference(scores)  # [N, V]
    if not logprob:
        return torch.argmax(logits, dim=-1), None
    best, top, lse, _, _ = row_pass_reference(logits)
    return best, torch.where(top == float("-inf"), top, top - lse) if logprob else None


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)
