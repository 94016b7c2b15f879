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
from kernels.lm_head import Hidden, Scores, kernel_args, rows_and_vocab, scores_reference
from kernels.row_pass import _row_pass, launch_rows, row_pass_reference, tile
from kernels.triton_shim import tl, triton


@triton.jit
def _best_kernel(ids_out, logprob_out, N, V, logits, logits_stride, hidden, hidden_stride, weight, weight_stride,
                 bias, H, LOGPROB: tl.constexpr, FROM_HIDDEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ROUND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < N
    ones = tl.full([BLOCK_R], 1.0, dtype=tl.float32)
    none = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    keys = tl.zeros([BLOCK_R], dtype=tl.int64)
    best, top, lse, _, _ = _row_pass(logits, logits_stride, hidden, hidden_stride, weight, weight_stride, bias,
                                     H, V, rows, ok, ones, none, keys, ids_out, 0,
                                     LOGPROB, False, 0, FROM_HIDDEN, HAS_BIAS, ROUND, BLOCK_R, BLOCK_V, BLOCK_H)
    tl.store(ids_out + rows, best, mask=ok)
    if LOGPROB:
        tl.store(logprob_out + rows, top - tl.where(top == float("-inf"), 0.0, lse), mask=ok)


def best_token(scores: Scores, logprob: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """scores: logits [N, V] or Hidden -> (ids [N] int64, log-probabilities [N] float32 under the
    plain softmax, or None). A row with every score -inf gets id 0 and log-probability -inf."""
    device = scores.states.device if isinstance(scores, Hidden) else scores.device
    if backend(scores.states if isinstance(scores, Hidden) else scores) == "torch":
        return best_token_reference(scores, logprob)
    n, vocab = rows_and_vocab(scores)
    ids = torch.empty(n, dtype=torch.int64, device=device)
    lp = torch.empty(n, dtype=torch.float32, device=device) if logprob else ids
    if n:
        rows = launch_rows(n)
        _best_kernel[(triton.cdiv(n, rows),)](ids, lp, n, vocab, **kernel_args(scores), LOGPROB=logprob,
                                              BLOCK_R=rows, BLOCK_V=tile(vocab))
    return ids, lp if logprob else None


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
