"""Fused sampling: temperature + top-k/top-p + one sample per row, by the exponential race.

Row r draws token argmax_i (s_i - log E_i) over its kept tokens, s = score / T and E_i = -log(u_i)
with u_i the row's counter-based uniform for token i (kernels/random.py): that is a sample from
softmax(s) over the kept tokens (Gumbel-max), in one pass over the row, with no softmax, no
cumulative sum and no sort of the vocabulary. Rows are independent: a row's draw depends only on
its key, whatever shares the batch.

The cuts are one threshold per row on the raw scores (keep score >= threshold): top-k keeps the k
largest scores, top-p then the fewest most likely tokens whose mass reaches p, ties at either
boundary kept (as ``kernels.processing.process_logits``). ``cut_thresholds`` (kernels/cuts.py)
reads them off one fused n-best pass (the row's 64 largest scores and its normaliser); rows without
cuts need none, so a row without cuts is read once and a row with cuts twice, and the vocabulary is
never sorted.
"""

from __future__ import annotations

import torch

from kernels.dispatch import backend
from kernels.lm_head import Hidden, Scores, kernel_args, rows_and_vocab, scores_reference
from kernels.row_pass import _row_pass, launch_rows, row_pass_reference, tile
from kernels.triton_shim import tl, triton


@triton.jit
def _sample_kernel(ids_out, N, V, inv_temperature, threshold, keys, logits, logits_stride, hidden, hidden_stride,
                   weight, weight_stride, bias, H, FROM_HIDDEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                   ROUND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < N
    inv_t = tl.load(inv_temperature + rows, mask=ok, other=1.0)
    thr = tl.load(threshold + rows, mask=ok, other=float("-inf"))
    key = tl.load(keys + rows, mask=ok, other=0)
    _, _, _, race, _ = _row_pass(logits, logits_stride, hidden, hidden_stride, weight, weight_stride, bias,
                                 H, V, rows, ok, inv_t, thr, key, keys, 0,
                                 False, True, 0, FROM_HIDDEN, HAS_BIAS, ROUND, BLOCK_R, BLOCK_V, BLOCK_H)
    tl.store(ids_out + rows, race, mask=ok)


def sample(scores: Scores, temperature: torch.Tensor, keys: torch.Tensor,
           threshold: torch.Tensor | None = None) -> torch.Tensor:
    """scores: logits [N, V] or Hidden; temperature [N] (> 0); keys [N] int64 row keys
    (kernels.random.row_keys); threshold [N] raw-score cut per row (None: no cuts) -> ids [N]."""
    states = scores.states if isinstance(scores, Hidden) else scores
    if backend(states) == "torch":
        return sample_reference(scores, temperature, keys, threshold)
    n, vocab = rows_and_vocab(scores)
    device = states.device
    ids = torch.empty(n, dtype=torch.int64, device=device)
    if n:
        inv_t = (1.0 / temperature.to(device, torch.float32)).contiguous()
        thr = (threshold if threshold is not None else torch.full((n,), float("-inf"))).to(device, torch.float32)
        rows = launch_rows(n)
        _sample_kernel[(triton.cdiv(n, rows),)](ids, n, vocab, inv_t, thr.contiguous(), keys.to(device).contiguous(),
                                                **kernel_args(scores), BLOCK_R=rows, BLOCK_V=tile(vocab))
    return ids


def sample_reference(scores: Scores, temperature: torch.Tensor, keys: torch.Tensor,
                     threshold: torch.Tensor | None = None) -> torch.Tensor:
    logits = scores_reference(scores)
    inv_t = 1.0 / temperature.to(logits.device, torch.float32)
    return row_pass_reference(logits, inv_t, threshold, keys.to(logits.device))[3]
