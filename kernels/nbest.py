"""Fused n-best for beams: scores (+ bias) -> each row's k best log-softmax values plus the row's
running score (the hypothesis' score so far), with their ids (Marian's fused softmax + n-best).

One pass over each row: per vocabulary tile the kernel keeps the tile's k largest scores (k
rounds of max-and-remove; ties: the lowest id first) and the online log-sum-exp; the candidates
(k per tile, [rows, tiles, k] — a few thousand numbers per row, never [rows, vocab]) are merged by
a stable sort in torch. Values come out sorted, best first; among equal values the lower id
first. A row with fewer than k finite scores gets -inf for the rest, with unspecified ids.
"""

from __future__ import annotations

import torch

from kernels.dispatch import backend
from kernels.lm_head import Hidden, Scores, _score_tile, kernel_args, rows_and_vocab, scores_reference
from kernels.row_pass import CHUNK_V, _block_and_chunk, launch_rows, tile
from kernels.triton_shim import tl, triton

MAX_K = 64  # the widest n-best the kernel keeps per tile


@triton.jit
def _nbest_kernel(values_out, ids_out, lse_out, inv_temperature, N, V, CHUNK, logits, logits_stride, hidden,
                  hidden_stride, weight, weight_stride, bias, H, K: tl.constexpr, FROM_HIDDEN: tl.constexpr,
                  HAS_BIAS: tl.constexpr, ROUND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """Program (i, c): rows i*BLOCK_R.. over the vocabulary chunk c (kernels/row_pass.py).
    values_out, ids_out [N, tiles, K]: each tile's K best raw scores and ids; lse_out [N, chunks]:
    the chunk's log-sum-exp of score * inv_temperature."""
    rows, ok, c, lo, hi = _block_and_chunk(N, V, CHUNK, BLOCK_R)
    inv_t = tl.load(inv_temperature + rows, mask=ok, other=1.0)
    tiles = tl.cdiv(V, BLOCK_V)
    neg_inf = float("-inf")
    m = tl.full([BLOCK_R], neg_inf, dtype=tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V).to(tl.int64)
        t = _score_tile(logits, logits_stride, hidden, hidden_stride, weight, weight_stride, bias, H,
                        rows, ok, cols, cols < hi, FROM_HIDDEN, HAS_BIAS, ROUND, BLOCK_R, BLOCK_V, BLOCK_H)
        s = t * inv_t[:, None]
        new_m = tl.maximum(m, tl.max(s, axis=1))
        shift = tl.where(new_m == neg_inf, 0.0, new_m)
        total = total * tl.exp(m - shift) + tl.sum(tl.exp(s - shift[:, None]), axis=1)
        m = new_m
        out = (rows * tiles + start // BLOCK_V) * K  # [R]: this tile's K slots
        for j in range(K):  # a loop, not unrolled: 64 unrolled max-and-remove rounds took LLVM minutes to compile
            best, at = tl.max(t, axis=1, return_indices=True)  # the first maximum: the lowest id
            tl.store(values_out + out + j, best, mask=ok)
            tl.store(ids_out + out + j, start + at.to(tl.int64), mask=ok)
            t = tl.where(tl.arange(0, BLOCK_V)[None, :] == at[:, None], neg_inf, t)
    tl.store(lse_out + rows * tl.num_programs(1) + c, tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)),
                                                                neg_inf), mask=ok)


def topk_logprobs(scores: Scores, k: int, running: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """scores: logits [N, V] or Hidden; running [N] scores so far (None: 0) ->
    (values [N, k] = log_softmax + running, best first; ids [N, k] int64)."""
    states = scores.states if isinstance(scores, Hidden) else scores
    n, vocab = rows_and_vocab(scores)
    if not 0 < k <= min(vocab, MAX_K):
        raise ValueError(f"topk_logprobs: k={k} must be in 1..{min(vocab, MAX_K)}")
    if backend(states) == "torch":
        return topk_logprobs_reference(scores, k, running)
    best, chosen, lse = top_scores(scores, k)
    return _finish(best, lse, running), chosen


def top_scores(scores: Scores, k: int, inv_temperature: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's raw result: (the k largest raw scores [N, k], best first, lower id first among
    ties; their ids [N, k]; the log-sum-exp [N] of score * inv_temperature (default 1))."""
    states = scores.states if isinstance(scores, Hidden) else scores
    n, vocab = rows_and_vocab(scores)
    device = states.device
    block_v = tile(vocab)
    tiles = triton.cdiv(vocab, block_v)
    values = torch.full((n, tiles, k), float("-inf"), dtype=torch.float32, device=device)
    ids = torch.zeros((n, tiles, k), dtype=torch.int64, device=device)
    chunks = triton.cdiv(vocab, CHUNK_V)
    lse = torch.full((n, chunks), float("-inf"), dtype=torch.float32, device=device)
    inv_t = (inv_temperature if inv_temperature is not None else torch.ones(n)).to(device, torch.float32).contiguous()
    if n:
        rows = launch_rows(n)
        _nbest_kernel[(triton.cdiv(n, rows), chunks)](values, ids, lse, inv_t, n, vocab, CHUNK_V, **kernel_args(scores),
                                                      K=k, BLOCK_R=rows, BLOCK_V=block_v)
    lse = torch.logsumexp(lse, dim=1)  # [N]: the chunks' normalisers combined
    # Candidates are in id order within equal values (tiles in order, each tile lowest id first),
    # so a stable sort keeps the lower id first among ties.
    order = torch.sort(values.view(n, -1), dim=1, descending=True, stable=True).indices[:, :k]  # [N, k]
    return values.view(n, -1).gather(1, order), ids.view(n, -1).gather(1, order), lse


def topk_logprobs_reference(scores: Scores, k: int, running: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = scores_reference(scores)  # [N, V]
    order = stable_topk(logits, k)  # [N, k]
    return _finish(logits.gather(1, order), torch.logsumexp(logits, dim=1), running), order


def stable_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ids [N, k] of each row's k largest values, best first and the lower id first among equal
    values (what a stable sort of the whole row gives, at the cost of a top-k: a sort of a
    49k-token row is much slower, docs/benchmarks.md, "Figures behind design choices"). NaN is not expected."""
    kth = torch.topk(x, k, dim=1).values[:, -1:]  # [N, 1]
    above = x > kth  # [N, V]: all of these are in
    tied = x == kth  # [N, V]: the lowest ids of these fill the rest
    room = k - above.sum(dim=1, keepdim=True)  # [N, 1]
    chosen = above | (tied & (tied.cumsum(dim=1) <= room))  # [N, V], k per row
    ids = chosen.nonzero()[:, 1].view(x.shape[0], k)  # [N, k], ascending ids
    order = torch.sort(x.gather(1, ids), dim=1, descending=True, stable=True).indices  # [N, k]
    return ids.gather(1, order)


def _finish(best: torch.Tensor, lse: torch.Tensor, running: torch.Tensor | None) -> torch.Tensor:
    out = best - torch.where(lse == float("-inf"), 0.0, lse)[:, None]  # [N, k] log-softmax
    return out if running is None else out + running.to(out.device, out.dtype)[:, None]


