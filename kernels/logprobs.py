"""Log-probabilities of chosen tokens and their most likely alternatives, under each row's processed
distribution (the plain softmax for greedy rows): what a request asking for ``logprobs`` gets.

On the Triton backend from one n-best pass (kernels/nbest.py: the 64 largest scores and the
normaliser) and the scores at the chosen tokens, the cut from kernels/cuts.py; the torch reference
processes the whole row (kernels/processing.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.cuts import cut_thresholds
from kernels.dispatch import backend
from kernels.lm_head import Hidden, Scores, rows_and_vocab, scores_at, scores_reference
from kernels.nbest import MAX_K, top_scores
from kernels.processing import process_logits
from specstream.data.sampling import SamplingParams

__all__ = ["token_logprobs", "token_logprobs_reference"]


def token_logprobs(scores: Scores, tokens: torch.Tensor, params: Sequence[SamplingParams], top_n: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities under each row's processed distribution (the plain softmax for greedy
    rows): of ``tokens`` [N], and the ``top_n`` most likely (ids, values) [N, n], -inf for tokens
    the cuts remove. On the Triton backend from one n-best pass (the 64 largest scores and the
    normaliser) and the scores at ``tokens``; a row whose cut the window does not settle, or a
    ``top_n`` wider than it, builds the logits for the reference."""
    states = scores.states if isinstance(scores, Hidden) else scores
    n, vocab = rows_and_vocab(scores)
    if backend(states) == "torch" or top_n > min(vocab, MAX_K):  # more alternatives than the window holds
        return token_logprobs_reference(scores_reference(scores), tokens, params, top_n)
    device = states.device
    inv_t = torch.tensor([1.0 if p.greedy else 1.0 / p.temperature for p in params], dtype=torch.float32, device=device)
    threshold = cut_thresholds(scores, params)  # [N], -inf without cuts
    values, ids, lse = top_scores(scores, min(vocab, MAX_K), inv_t)  # [N, W] raw, best first; [N] at T
    kept = values >= threshold[:, None]  # [N, W]
    cut = torch.isfinite(threshold)
    # With a cut, the normaliser is over the kept tokens, which the window holds when its last
    # score is already cut (or it covers the vocabulary).
    settled = ~cut | ~kept[:, -1] | (values.shape[1] == vocab)
    kept_lse = torch.where(cut, torch.logsumexp(torch.where(kept, values * inv_t[:, None], float("-inf")), dim=1), lse)
    at = scores_at(scores, tokens.clamp(min=0)[:, None])[:, 0]  # [N] raw score of each token
    chosen = torch.where(at >= threshold, at * inv_t - kept_lse, float("-inf"))
    top = torch.where(kept[:, :top_n], values[:, :top_n] * inv_t[:, None] - kept_lse[:, None], float("-inf"))
    top_ids = ids[:, :top_n]
    rest = (~settled).nonzero().flatten().tolist()
    if rest:
        part = Hidden(scores.states[rest], scores.head) if isinstance(scores, Hidden) else scores[rest]
        c, i, v = token_logprobs_reference(scores_reference(part), tokens[rest], [params[b] for b in rest], top_n)
        chosen[rest], top_ids[rest], top[rest] = c, i, v
    return chosen, top_ids, top


def token_logprobs_reference(logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams],
                             top_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = process_logits(logits, list(params)).log()  # [N, V]
    chosen = logp.gather(1, tokens.clamp(min=0)[:, None]).squeeze(1)
    top = torch.topk(logp, top_n, dim=-1)
    return chosen, top.indices, top.values
