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
from kernels.lm_head import Hidden, Scores, scores_reference
from kernels.row_pass import row_pass_reference, row_partials


def sample(scores: Scores, temperature: torch.Tensor, keys: torch.Tensor,
           threshold: torch.Tensor | None = None) -> torch.Tensor:
    """scores: logits [N, V] or Hidden; temperature [N] (> 0); keys [N] int64 row keys
    (kernels.random.row_keys); threshold [N] raw-score cut per row (None: no cuts) -> ids [N]."""
    states = scores.states if isinstance(scores, Hidden) else scores
    if backend(states) == "torch":
        return sample_reference(scores, temperature, keys, threshold)
    device = states.device
    inv_t = 1.0 / temperature.to(device, torch.float32)
    return row_partials(scores, inv_t, threshold, keys, best=False, race=True)[3]


def sample_reference(scores: Scores, temperature: torch.Tensor, keys: torch.Tensor,
                     threshold: torch.Tensor | None = None) -> torch.Tensor:
    logits = scores_reference(scores)
    inv_t = 1.0 / temperature.to(logits.device, torch.float32)
    return row_pass_reference(logits, inv_t, threshold, keys.to(logits.device))[3]
