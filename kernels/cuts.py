"""The top-k / top-p cut of a row as one raw-score threshold: keep the scores >= it.

Top-k keeps the k largest scores, top-p then the fewest most likely tokens whose mass reaches p,
ties at either boundary kept (as ``kernels.processing.process_logits``). ``cut_thresholds`` reads
the threshold off one fused n-best pass (kernels/nbest.py: the row's 64 largest scores and its
normaliser), so the vocabulary is never sorted; the fused sampler (kernels/sample.py) and the
log-probabilities of sampled tokens (kernels/logprobs.py) cut with it. ``cut_thresholds_reference``
is the torch definition.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.dispatch import backend
from kernels.lm_head import Hidden, Scores, rows_and_vocab, scores_reference
from kernels.nbest import MAX_K, top_scores
from specstream.data.sampling import SamplingParams

__all__ = ["cut_thresholds", "cut_thresholds_reference"]

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
