"""One read of a block of score rows, tile by tile over the vocabulary: what every output op needs.

For rows r and tiles of the vocabulary, ``_row_pass`` keeps, online (each score is read once):

- the argmax of the raw scores (ties: the lowest id, as ``torch.argmax``) and their maximum;
- with ``LSE``, the log-sum-exp of s = score / T over the kept tokens (score >= the row's threshold;
  -inf for none), Marian's online softmax normaliser;
- with ``RACE``, the exponential race: argmax of s_i - log(E_i), E_i = -log(u_i) with u_i the row's
  counter-based uniform for token i (``kernels.random``). The winner is a sample from softmax(s)
  over the kept tokens (E_i ~ Exp(1): -log E_i is a Gumbel variable), and the race needs no
  normaliser, no cumulative sum and no sort. Tokens listed in the row's ``exclude`` ids are kept
  for the normaliser but left out of the race (the residual of speculative sampling treats them
  apart). A row with nothing to race leaves id 0 and key -inf.

The vocabulary is split into chunks of ``CHUNK_V`` ids across programs (a grid of row blocks ×
chunks, ``_chunk_kernel``), each writing its chunk's partial results, which ``row_partials``
combines in torch: the argmax is the first chunk's that holds the row's maximum (chunks ascend, so
ties still go to the lowest id), the log-sum-exp the log-sum-exp of the chunks', the race's winner
the first largest key's. One program walking a whole vocabulary had used one GPU core for a row
block: on an H100 the fused 1-best was hundreds of times slower than torch's unfused head
(docs/benchmarks.md, "GPU"). The chunks depend on the vocabulary only, never on the rows or the batch.

``row_pass_reference`` is the same computation in torch over materialised logits; the ops' own
references build on it.
"""

from __future__ import annotations

import torch

from kernels.lm_head import Hidden, Scores, _score_tile, kernel_args, rows_and_vocab
from kernels.random import _uniform, uniform_table
from kernels.triton_shim import tl, triton
BLOCK_V = 512  # vocabulary ids per tile
CHUNK_V = 2048  # vocabulary ids per program: 4 tiles (a multiple of every tile width); to be tuned on a GPU


@triton.jit
def _row_pass(logits, logits_stride, hidden, hidden_stride, weight, weight_stride, bias, H, LO, HI,
              rows, row_ok, inv_temperature, threshold, keys, exclude, exclude_stride,
              LSE: tl.constexpr, RACE: tl.constexpr, N_EXCLUDE: tl.constexpr,
              FROM_HIDDEN: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    """rows [R] int64 with row_ok [R], over the vocabulary ids LO..HI-1 (LO a multiple of BLOCK_V);
    inv_temperature, threshold [R] float32; keys [R] int64; exclude: row r's N_EXCLUDE ids at
    exclude + r * exclude_stride (-1: none).
    Returns (argmax [R] int64, max [R], lse [R], race id [R] int64, race key [R])."""
    neg_inf = float("-inf")
    best = tl.zeros([BLOCK_R], dtype=tl.int64)
    top = tl.full([BLOCK_R], neg_inf, dtype=tl.float32)
    m = tl.full([BLOCK_R], neg_inf, dtype=tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    race = tl.zeros([BLOCK_R], dtype=tl.int64)
    race_key = tl.full([BLOCK_R], neg_inf, dtype=tl.float32)
    for start in range(LO, HI, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V).to(tl.int64)
        t = _score_tile(logits, logits_stride, hidden, hidden_stride, weight, weight_stride, bias, H,
                        rows, row_ok, cols, cols < HI, FROM_HIDDEN, HAS_BIAS, ROUND, BLOCK_R, BLOCK_V, BLOCK_H)
        tile_top, at = tl.max(t, axis=1, return_indices=True)  # first maximum in the tile
        best = tl.where(tile_top > top, start + at.to(tl.int64), best)
        top = tl.maximum(top, tile_top)
        if LSE or RACE:
            s = tl.where(t >= threshold[:, None], t * inv_temperature[:, None], neg_inf)  # [R, V] kept, scaled
        if LSE:
            new_m = tl.maximum(m, tl.max(s, axis=1))
            shift = tl.where(new_m == neg_inf, 0.0, new_m)  # an all -inf row so far: nothing to shift
            total = total * tl.exp(m - shift) + tl.sum(tl.exp(s - shift[:, None]), axis=1)
            m = new_m
        if RACE:
            u = _uniform(keys[:, None], cols[None, :])  # [R, V]
            k = s - tl.log(-tl.log(u))  # u in (0, 1): -log(u) > 0
            for j in tl.static_range(N_EXCLUDE):
                out = tl.load(exclude + rows * exclude_stride + j, mask=row_ok, other=-1)  # [R]
                k = tl.where(cols[None, :] == out[:, None], neg_inf, k)
            tile_key, won = tl.max(k, axis=1, return_indices=True)
            race = tl.where(tile_key > race_key, start + won.to(tl.int64), race)
            race_key = tl.maximum(race_key, tile_key)
    lse = tl.where(total > 0, m + tl.log(tl.where(total > 0, total, 1.0)), neg_inf)
    return best, top, lse, race, race_key


@triton.jit
def _block_and_chunk(N, V, CHUNK, BLOCK_R: tl.constexpr):
    """A program (i, c) of a grid of row blocks x vocabulary chunks: its rows [BLOCK_R] int64, which
    of them exist, its chunk c and the chunk's ids lo..hi-1."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1).to(tl.int64)
    lo = c * CHUNK
    return rows, rows < N, c, lo, tl.minimum(lo + CHUNK, V)


@triton.jit
def _chunk_kernel(best_out, top_out, lse_out, race_out, race_key_out, N, V, CHUNK, inv_temperature, threshold, keys,
                  exclude, exclude_stride, logits, logits_stride, hidden, hidden_stride, weight, weight_stride, bias, H,
                  BEST: tl.constexpr, LSE: tl.constexpr, RACE: tl.constexpr, N_EXCLUDE: tl.constexpr,
                  FROM_HIDDEN: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (i, c): rows i*BLOCK_R.. over the vocabulary chunk c; each output [N, chunks] gets
    the chunk's partial result at [row, c] (only those asked for: what is not stored, the compiler
    does not compute)."""
    rows, ok, c, lo, hi = _block_and_chunk(N, V, CHUNK, BLOCK_R)
    inv_t = tl.load(inv_temperature + rows, mask=ok, other=1.0)
    thr = tl.load(threshold + rows, mask=ok, other=float("-inf"))
    key = tl.load(keys + rows, mask=ok, other=0)
    best, top, lse, race, race_key = _row_pass(logits, logits_stride, hidden, hidden_stride, weight, weight_stride,
                                               bias, H, lo, hi, rows, ok, inv_t, thr, key, exclude, exclude_stride,
                                               LSE, RACE, N_EXCLUDE, FROM_HIDDEN, HAS_BIAS, ROUND,
                                               BLOCK_R, BLOCK_V, BLOCK_H)
    at = rows * tl.num_programs(1) + c
    if BEST:
        tl.store(best_out + at, best, mask=ok)
        tl.store(top_out + at, top, mask=ok)
    if LSE:
        tl.store(lse_out + at, lse, mask=ok)
    if RACE:
        tl.store(race_out + at, race, mask=ok)
        tl.store(race_key_out + at, race_key, mask=ok)


def row_partials(scores: Scores, inv_temperature: torch.Tensor | None = None, threshold: torch.Tensor | None = None,
                 keys: torch.Tensor | None = None, exclude: torch.Tensor | None = None, best: bool = True,
                 lse: bool = False, race: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton row pass over scores (logits [N, V] or Hidden), as ``row_pass_reference``
    computes it: (argmax [N] int64, max [N], lse [N], race id [N] int64, race key [N]); the argmax
    and max only with ``best`` (else id 0, -inf), lse only with ``lse`` (else -inf), the race only
    with ``race`` (else id 0, key -inf). inv_temperature,
    threshold [N] float32 (default 1, -inf); keys [N] int64; exclude [N, K] ids left out of the race."""
    n, vocab = rows_and_vocab(scores)
    states = scores.states if isinstance(scores, Hidden) else scores
    device = states.device
    chunks = triton.cdiv(vocab, CHUNK_V)
    best_parts = torch.zeros(n, chunks, dtype=torch.int64, device=device)
    top = torch.full((n, chunks), float("-inf"), dtype=torch.float32, device=device)
    lse_parts, key_parts = torch.full_like(top, float("-inf")), torch.full_like(top, float("-inf"))
    race_parts = torch.zeros_like(best_parts)
    width = 0 if exclude is None else exclude.shape[1]
    if n:
        inv_t = (inv_temperature if inv_temperature is not None else torch.ones(n)).to(device, torch.float32)
        thr = (threshold if threshold is not None else torch.full((n,), float("-inf"))).to(device, torch.float32)
        key = (keys if keys is not None else torch.zeros(n, dtype=torch.int64)).to(device).contiguous()
        excluded = exclude.to(device).contiguous() if width else key  # with none, never read
        rows = launch_rows(n)
        _chunk_kernel[(triton.cdiv(n, rows), chunks)](
            best_parts, top, lse_parts, race_parts, key_parts, n, vocab, CHUNK_V, inv_t.contiguous(),
            thr.contiguous(), key, excluded, width, **kernel_args(scores), BEST=best, LSE=lse, RACE=race,
            N_EXCLUDE=width, BLOCK_R=rows, BLOCK_V=tile(vocab))
    # torch.argmax returns the first maximum: the lowest chunk, so the lowest id among equal values.
    first = top.argmax(dim=1, keepdim=True)  # [N, 1]
    winner = key_parts.argmax(dim=1, keepdim=True)  # [N, 1]
    return (best_parts.gather(1, first)[:, 0], top.gather(1, first)[:, 0],
            torch.logsumexp(lse_parts, dim=1) if lse else lse_parts[:, 0],
            race_parts.gather(1, winner)[:, 0], key_parts.gather(1, winner)[:, 0])


def row_pass_reference(logits: torch.Tensor, inv_temperature: torch.Tensor | None = None,
                       threshold: torch.Tensor | None = None, keys: torch.Tensor | None = None,
                       exclude: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, V] float32 -> (argmax, max, lse, race id, race key), each [N], as ``_row_pass``
    computes them (race outputs only with ``keys``; exclude [N, K] ids, -1 for none)."""
    n, vocab = logits.shape
    t = logits.float()
    top, best = t.max(dim=-1)  # torch.max returns the first maximum's index
    inv_t = inv_temperature if inv_temperature is not None else torch.ones(n, device=t.device)
    thr = threshold if threshold is not None else torch.full((n,), float("-inf"), device=t.device)
    s = torch.where(t >= thr[:, None], t * inv_t[:, None], float("-inf"))  # [N, V]
    lse = torch.logsumexp(s, dim=-1)  # [N]
    race = torch.zeros(n, dtype=torch.int64, device=t.device)
    race_key = torch.full((n,), float("-inf"), device=t.device)
    if keys is not None:
        u = uniform_table(keys, torch.arange(vocab, device=t.device))  # [N, V]
        k = s - torch.log(-torch.log(u))
        if exclude is not None and exclude.numel():
            hit = (torch.arange(vocab, device=t.device) == exclude[:, :, None]).any(dim=1)  # [N, V]
            k = k.masked_fill(hit, float("-inf"))
        race_key, race = k.max(dim=-1)
    return best, top, lse, race, race_key


def launch_rows(n: int) -> int:
    """Rows per program: a power of two >= 16 (tl.dot's smallest tile) for the fused head."""
    return 16 if n <= 16 else 32 if n <= 32 else 64


def tile(vocab: int) -> int:
    return min(BLOCK_V, max(16, triton.next_power_of_2(vocab)))
