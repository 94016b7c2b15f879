"""Counter-based random numbers for the sampling kernels: one uniform per (row key, token id).

A row's 64-bit key comes from (seed, position, purpose) by the same splitmix64 finaliser as
``uniform`` (below) (so a request's draws depend on nothing else in the batch); each
token id then gets its uniform from two rounds of murmur3's 32-bit finaliser over (key, id). The
Triton helper ``_uniform`` and the torch twin ``uniform_table`` compute the same bits, so a kernel
and its reference draw the same numbers and can be compared token for token.

Uniforms are (h + 0.5) / 2^23 for the hash's top 23 bits h: never 0 or 1, so -log(u) is finite
and positive. (With 24 bits, h + 0.5 is not a float32 for h >= 2^23 and the largest h rounded up to
2^24, i.e. u = 1: once per 2^24 draws a token won the race with key +inf whatever its probability,
on a 49,152-token vocabulary one row in 340.)

``gumbel`` is the noise itself, -log(-log(u)), and ``race`` samples from a probability table with it:
argmax over tokens of log(prob) + noise is a sample from the (normalised) table, and which noise a
token gets depends only on (row key, token id), so two tables raced with the same key pick the same
token as often as they can without knowing each other (Gumbel coupling; the draft uses it to guess
the target's own sample, target_service/settle.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kernels import native
from kernels.triton_shim import tl, triton

# What a draw is for, so that e.g. accepting position 7 and sampling position 7 use unrelated numbers:
# - SAMPLE: the token at a position as plain sampling draws it (the per-token race noise of
#   kernels/random.py): a request's first token, a γ = 0 step, the bonus token after a fully
#   accepted run, and under coupled verification every position. The draft guesses a position
#   with the same noise, so where q is close to p its guess is the target's own sample.
# - ACCEPT: Leviathan's acceptance test of the proposal at a position (one uniform).
# - RESIDUAL: a target draw at a position the draft drew for (the residual after a rejection):
#   the draft's noise there is spent, and reusing it would bias the draw.
# - SIBLING + r (r >= 1): the acceptance test of a tree's r-th runner-up at a position, the child
#   tried after r earlier siblings were refused (kernels/tree_sampling.py); the first child is
#   tested with ACCEPT, as a chain's guess is.
# (1 was the draft's own inverse-CDF uniform before the draft shared SAMPLE's noise.)
ACCEPT, SAMPLE, RESIDUAL, SIBLING = 2, 3, 4, 16


_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64
_MASK64 = (1 << 64) - 1


def uniform(seed: int, position: int, purpose: int) -> float:
    """A float in [0, 1) that depends only on (seed, position, purpose): splitmix64 finalizer over
    a counter, 53 bits of mantissa. Counter-based, so no generator state is shared or carried.

    Each position's draws are used at most once in what a sequence commits: the acceptance and
    final draws of position i only in the step that settles token i, and a draft draw that was
    thrown away (its proposal came after a rejection) never influenced anything committed."""
    return _bits53(seed, position, purpose) / float(1 << 53)


def _bits53(seed: int, position: int, purpose: int) -> int:
    """The top 53 bits of splitmix64's finaliser over the counter (seed, position, purpose)."""
    x = (seed * _GOLDEN + position * _MIX1 + purpose * _MIX2) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    x ^= x >> 31
    return x >> 11


def uniforms(seeds: Sequence[int], starts: Sequence[int], count: int, purpose: int,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(seeds), count] float64: row b holds uniform(seeds[b], starts[b] + j, purpose) for
    j < count, computed in wrapping uint64 arithmetic for the whole table at once (a decode step's
    few entries in Python integers: the same bits, without numpy's per-call overhead)."""
    if len(seeds) * count <= _FEW_KEYS:
        return torch.tensor([[_bits53(s, p + j, purpose) / float(1 << 53) for j in range(count)]
                             for s, p in zip(seeds, starts, strict=True)],
                            dtype=torch.float64, device=device).view(len(seeds), count)
    u64 = np.uint64
    seed = np.asarray(seeds, dtype=u64).reshape(-1, 1)  # [N, 1]
    position = np.asarray(starts, dtype=u64).reshape(-1, 1) + np.arange(count, dtype=u64)  # [N, count]
    with np.errstate(over="ignore"):  # uint64 products wrap modulo 2^64, as intended
        x = seed * u64(_GOLDEN) + position * u64(_MIX1) + u64(purpose) * u64(_MIX2)
        x = (x ^ (x >> u64(30))) * u64(_MIX1)
        x = (x ^ (x >> u64(27))) * u64(_MIX2)
        x ^= x >> u64(31)
    values = (x >> u64(11)).astype(np.float64) / float(1 << 53)  # exact: 53-bit integers
    return torch.from_numpy(values).to(device)


_ID_MIX = 0x9E3779B1  # odd 32-bit constant: spreads consecutive ids over the hash's input
_ID_OFFSET = 0x7F4A7C15  # so that key 0 and id 0 do not hash to 0
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3 fmix32
_MASK32 = 0xFFFFFFFF


_FEW_KEYS = 16  # row_keys and uniforms mix this many entries or fewer without numpy


def row_keys(seeds: Sequence[int], starts: Sequence[int], purpose: int, device: torch.device | str = "cpu"
             ) -> torch.Tensor:
    """[N] int64 in [0, 2^53): the key of row b's draw at position starts[b] for `purpose`
    (splitmix64 over the counter, as ``uniforms``). A few rows (a decode step's) are mixed in Python
    integers: the same bits, without numpy's per-call overhead."""
    if len(seeds) <= _FEW_KEYS:
        return torch.tensor([_bits53(s, p, purpose) for s, p in zip(seeds, starts, strict=True)],
                            dtype=torch.int64, device=device)
    u64 = np.uint64
    seed = np.asarray(seeds, dtype=u64)
    position = np.asarray(starts, dtype=u64)
    with np.errstate(over="ignore"):  # uint64 products wrap modulo 2^64, as intended
        x = seed * u64(_GOLDEN) + position * u64(_MIX1) + u64(purpose) * u64(_MIX2)
        x = (x ^ (x >> u64(30))) * u64(_MIX1)
        x = (x ^ (x >> u64(27))) * u64(_MIX2)
        x ^= x >> u64(31)
    return torch.from_numpy((x >> u64(11)).astype(np.int64)).to(device)


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _uniform(key, ids):
    """key [R] int64 row keys, ids [R, C] or [C] int token ids -> uniforms in (0, 1), float32."""
    lo = (key & 0xFFFFFFFF).to(tl.uint32)
    hi = (key >> 32).to(tl.uint32)
    h = _fmix32(ids.to(tl.uint32) * 0x9E3779B1 + 0x7F4A7C15 ^ lo)
    h = _fmix32(h ^ hi)
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


def _fmix32_torch(h: torch.Tensor) -> torch.Tensor:
    """murmur3 fmix32 on int64 tensors holding uint32 values (products wrap, then are masked)."""
    h = h ^ (h >> 16)
    h = (h * _M1) & _MASK32
    h = h ^ (h >> 13)
    h = (h * _M2) & _MASK32
    return h ^ (h >> 16)


def uniform_table(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """keys [N] int64, ids [N, C] (or [C]) token ids -> [N, C] float32 uniforms, bit for bit what
    the kernels draw for those rows and ids."""
    if keys.device.type == "cpu" and ids.device.type == "cpu":
        return torch.from_numpy(_uniform_table_numpy(keys.numpy(), ids.numpy()))
    keys = keys.long()
    lo, hi = (keys & _MASK32)[:, None], (keys >> 32)[:, None]  # [N, 1]
    ids = ids.long().expand(keys.shape[0], -1) if ids.dim() == 1 else ids.long()
    h = _fmix32_torch((((ids & _MASK32) * _ID_MIX + _ID_OFFSET) & _MASK32) ^ lo)
    h = _fmix32_torch(h ^ hi)
    return ((h >> 9).float() + 0.5) * (1.0 / 8388608.0)


def _uniform_table_numpy(keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The same bits in wrapping uint32 arithmetic: far less memory traffic than int64 tensors
    with masks, which is what makes a race over a 49,152-token row cheap on a CPU
    (docs/benchmarks.md, "Figures behind design choices")."""
    u32 = np.uint32
    keys = keys.astype(np.int64)
    lo = (keys & _MASK32).astype(u32)[:, None]  # [N, 1]
    hi = ((keys >> 32) & _MASK32).astype(u32)[:, None]  # [N, 1]
    with np.errstate(over="ignore"):
        h = ids.astype(np.int64).astype(u32) * u32(_ID_MIX) + u32(_ID_OFFSET)  # [C] or [N, C]
        h = np.broadcast_to(h, (keys.shape[0], h.shape[-1])) ^ lo  # [N, C], a new array
        _fmix32_numpy(h)
        h ^= hi
        _fmix32_numpy(h)
    h >>= u32(9)
    u = h.astype(np.float32)
    u += np.float32(0.5)
    u *= np.float32(1.0 / 8388608.0)
    return u


def _fmix32_numpy(h: np.ndarray) -> None:
    """murmur3 fmix32 in place on uint32 (products wrap modulo 2^32)."""
    h ^= h >> np.uint32(16)
    h *= np.uint32(_M1)
    h ^= h >> np.uint32(13)
    h *= np.uint32(_M2)
    h ^= h >> np.uint32(16)


def gumbel(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """keys [N], ids [N, C] or [C] -> [N, C] float32 Gumbel noise -log(-log(u)): the kernels' race
    adds exactly these to the scaled scores (``_row_pass``)."""
    return -torch.log(-torch.log(uniform_table(keys, ids)))


def race(probs: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """One sample per row from a probability table (need not be normalised; zeros are never
    picked) by the exponential race: probs [N, C], keys [N] row keys, ids [N, C] the token id of
    each column (None: column c is token c) -> the winning column [N]. Ties go to the first column.
    A row without mass returns column 0. No host sync on a GPU.

    On a CPU the torch ops score only the columns that can win, with the same winner bit for bit
    at a fraction of the cost: those the native library's log-free bounds leave (``_race_candidates``,
    a handful of 49,152), or without it, for a table that is mostly zeros (a top-p or top-k cut:
    tens of tokens), its support (``_race_support``)."""
    if probs.device.type == "cpu":
        winner = _race_candidates(probs, keys, ids)
        if winner is not None:
            return winner
    ids = torch.arange(probs.shape[-1], device=probs.device) if ids is None else ids
    if probs.device.type == "cpu":
        winner = _race_support(probs, keys, ids)
        if winner is not None:
            return winner
    return _race_dense(probs, keys, ids)


def _race_dense(probs: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``race`` over every column: the reference the support-only path must equal."""
    noise = gumbel(keys.to(probs.device), ids.to(probs.device))  # [N, C]
    # float64: a float32 log would drop tokens below 1e-45 from the support
    score = torch.where(probs > 0, torch.log(probs.double()) + noise, float("-inf"))  # [N, C]
    return score.argmax(dim=-1)


# The support-only race runs when its padded support is at most 1/_SPARSE_SHARE of the table.
_SPARSE_SHARE = 4
# Its elementwise ops (the hash, two logs, the sum) must give each token the bits the dense race
# gives it. Whether a loop's tail (past its last whole pair of vectors) goes through the same vector
# code depends on ATen's kernel for the op; padding the support to a multiple of _BLOCK, under
# ATen's grain size (one thread, no split point inside a block), sends every element through whole
# vectors, as in the dense race, whose rows of 49,152 columns are whole blocks. (On this build
# lengths 1..300 give the same bits unpadded too: tests/test_sampling.py.)
_BLOCK, _GRAIN = 64, 32768


def _race_candidates(probs: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor | None = None
                     ) -> torch.Tensor | None:
    """``race`` through the native library's log-free bounds (kernels/csrc/race_candidates.cpp,
    ``race_candidates``): a row where one column can win gets it with no noise computed at all (most
    rows); the columns of a row where several can are scored here. None without the library (or
    for a table it does not take)."""
    library = native.library()
    if library is None or probs.dim() != 2 or probs.dtype not in (torch.float32, torch.float64):
        return None
    if ids is not None:
        ids = ids.long().expand(probs.shape).contiguous() if ids.dim() == 1 else ids.long()
        if ids.shape != probs.shape:
            return None
    winner, contested = library.race_candidates(probs, keys.long(), ids)  # [N], [P] row * C + column
    if contested.numel():
        columns = probs.shape[-1]
        scored = _race_columns(probs, keys, torch.arange(columns) if ids is None else ids, contested // columns,
                               contested % columns)
        if scored is None:
            return None
        winner = torch.where(winner < 0, scored, winner)
    return winner


def _race_support(probs: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
    """``race`` over the columns with mass only, or None when they are too many for it to pay."""
    rows, cols = (probs > 0).nonzero(as_tuple=True)  # [P] each, row-major
    if -(-rows.numel() // _BLOCK) * _BLOCK * _SPARSE_SHARE > probs.numel():
        return None
    return _race_columns(probs, keys, ids, rows, cols)


def _race_columns(probs: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
                  cols: torch.Tensor) -> torch.Tensor | None:
    """``race`` scored at the given (row, column) pairs only (row-major, columns ascending within a
    row), which must include every column that can win; None when they are too many or the table's
    rows are not whole blocks (below)."""
    count = rows.numel()
    padded = -(-count // _BLOCK) * _BLOCK
    if padded > _GRAIN or probs.shape[-1] % _BLOCK:
        return None
    pad = padded - count
    token = (ids[rows, cols] if ids.dim() == 2 else ids[cols]).long()  # [P]
    token = torch.cat((token, token.new_zeros(pad)))  # [padded]
    key = torch.cat((keys.long()[rows], keys.new_zeros(pad).long()))  # [padded]
    mass = torch.cat((probs[rows, cols], probs.new_ones(pad)))  # [padded]
    noise = gumbel(key, token[:, None])[:, 0]  # [padded] float32
    score = (torch.log(mass.double()) + noise)[:count]  # [P]
    if probs.shape[0] == 1:  # the columns in order: their first maximum is the dense race's
        return cols[score.argmax()].view(1) if count else cols.new_zeros(1)
    # Per row, the first of its columns holding the row's largest score (rows without any: column 0).
    top = torch.full((probs.shape[0],), float("-inf"), dtype=torch.float64).scatter_reduce(0, rows, score, "amax")
    first = torch.full((probs.shape[0],), count, dtype=torch.int64)
    at = (score == top[rows]).nonzero().squeeze(-1)  # [h] in order
    first = first.scatter_reduce(0, rows[at], at, "amin")  # [N]
    return torch.where(first < count, torch.cat((cols, cols.new_zeros(1)))[first], 0)
