"""Fused sampling: temperature + top-k/top-p + one sample per row, by the exponential race.

Row r draws token argmax_i (s_i - log E_i) over its kept tokens, s = score / T and E_i = -log(u_i)
with u_i the row's counter-based uniform for token i (kernels/random.py): that is a sample from
softmax(s) over the kept tokens (Gumbel-max), in one pass over the row, with no softmax, no
cumulative sum and no sort of the vocabulary. Rows are independent: a row's draw depends only on
its key, whatever shares the batch.

The cuts are one threshold per row on the raw scores (keep score >= threshold): top-k keeps the k
largest scores, top-p then the fewest most likely tokens whose mass reaches p, ties at either
boundary kept (as ``specstream.sampling.process_logits``). ``cut_thresholds`` reads them off one
fused n-best pass (the row's 64 largest scores and its normaliser); rows without cuts need none,
so a row without cuts is read once and a row with cuts twice, and the vocabulary is never sorted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.dispatch import backend
from kernels.lm_head import Hidden, Scores, kernel_args, rows_and_vocab, scores_reference
from kernels.nbest import MAX_K, top_scores
from kernels.row_pass import _row_pass, launch_rows, row_pass_reference, tile
from kernels.triton_shim import tl, triton
from specstream.sampling import SamplingParams


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


_SEARCH = 256  # top-p looks among this many largest scores first


def cut_thresholds(scores: Scores, params: Sequence[SamplingParams]) -> torch.Tensor:
    """scores (logits [N, V] or Hidden) -> [N] float32 raw-score thresholds: row b keeps scores >=
    out[b] (-inf for rows without cuts). Probabilities for top-p are softmax(score * (1 / T)) over
    the top-k survivors. On the Triton backend the rows with cuts take one n-best pass
    (kernels/nbest.py: their 64 largest scores and the normaliser at T, no logits built) and the
    cut is read off those; a row whose top-k is wider, or whose nucleus reaches past them (a flat
    row), builds its logits and takes the torch reference."""
    states = scores.states if isinstance(scores, Hidden) else scores
    if backend(states) == "torch":
        return cut_thresholds_reference(scores_reference(scores), params)
    n, vocab = rows_and_vocab(scores)
    out = torch.full((n,), float("-inf"), device=states.device)
    cut = [b for b, p in enumerate(params) if not p.greedy and (0 < p.top_k < vocab or p.top_p < 1.0)]
    if not cut:
        return out
    part = Hidden(scores.states[cut], scores.head) if isinstance(scores, Hidden) else scores[cut]
    inv_t = 1.0 / torch.tensor([params[b].temperature for b in cut], dtype=torch.float32)
    width = min(vocab, MAX_K)
    values, _, lse = top_scores(part, width, inv_t)  # [C, W] raw, best first; [C] at T
    wide = []
    for i, b in enumerate(cut):
        found = _cut_from_top(values[i], lse[i], inv_t[i], params[b], vocab)
        if found is None:
            wide.append(i)
        else:
            out[b] = found
    if wide:  # rows the window does not settle: their logits, and the reference
        rows = [cut[i] for i in wide]
        logits = scores_reference(Hidden(scores.states[rows], scores.head) if isinstance(scores, Hidden)
                                  else scores[rows])
        out[rows] = cut_thresholds_reference(logits, [params[b] for b in rows]).to(out.device)
    return out


def _cut_from_top(values: torch.Tensor, lse: torch.Tensor, inv_t: torch.Tensor, p: SamplingParams, vocab: int
                  ) -> torch.Tensor | None:
    """A row's threshold from its W largest raw scores (best first) and log-sum-exp at T; None when
    they do not settle it (the top-k or the nucleus reaches past them)."""
    width = values.shape[0]
    finite = int(torch.isfinite(values).sum())
    if finite == 0:
        return None
    kth = torch.tensor(float("-inf"), device=values.device)
    if 0 < p.top_k < vocab:
        if p.top_k > finite or (width < vocab and values[-1] == values[min(p.top_k, width) - 1]):
            return None  # the k-th score, or a tie with it, may lie past the window
        kth = values[p.top_k - 1]
        if p.top_p >= 1.0:
            return kth
        kept = values[values >= kth]
        lse = torch.logsumexp(kept * inv_t, dim=0)
    else:
        kept = values[:finite]
    probs = torch.exp(kept * inv_t - lse)
    inside = int(((probs.cumsum(0) - probs) < p.top_p).sum())
    if inside == len(kept) and len(kept) < vocab and not (0 < p.top_k < vocab):
        return None  # the nucleus may reach past the window
    return kept[max(inside, 1) - 1]


def cut_thresholds_reference(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [N, V] -> [N] float32 raw-score thresholds, in torch (the definition above)."""
    n, vocab = logits.shape
    out = torch.full((n,), float("-inf"), device=logits.device)
    for b, p in enumerate(params):  # rows with cuts are few, and each costs a few small ops
        if p.greedy or not (0 < p.top_k < vocab or p.top_p < 1.0):
            continue
        row = logits[b].float()  # [V]
        kth = torch.topk(row, p.top_k).values[-1] if 0 < p.top_k < vocab else torch.tensor(float("-inf"))
        if p.top_p >= 1.0:
            out[b] = kth
            continue
        inv_t = 1.0 / torch.tensor(p.temperature, dtype=torch.float32)
        kept = torch.where(row >= kth, row, float("-inf"))  # [V]
        lse = torch.logsumexp(kept * inv_t, dim=0)
        count = int((kept > float("-inf")).sum())
        if count == 0:  # nothing has mass: nothing to cut
            continue
        for width in (min(count, _SEARCH), count):  # the largest scores first; all of them if the nucleus is wider
            ranked = torch.topk(kept, width).values  # [W] descending
            probs = torch.exp(ranked * inv_t - lse)
            inside = int(((probs.cumsum(0) - probs) < p.top_p).sum())  # a prefix: mass before each entry
            if inside < width or width == count:
                out[b] = ranked[max(inside, 1) - 1]
                break
    return out
