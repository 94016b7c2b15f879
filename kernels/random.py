"""Counter-based random numbers for the sampling kernels: one uniform per (row key, token id).

A row's 64-bit key comes from (seed, position, purpose) by the same splitmix64 finaliser as
``specstream.sampling.uniform`` (so a request's draws depend on nothing else in the batch); each
token id then gets its uniform from two rounds of murmur3's 32-bit finaliser over (key, id). The
Triton helper ``_uniform`` and the torch twin ``uniform_table`` compute the same bits, so a kernel
and its reference draw the same numbers and can be compared token for token.

Uniforms are (h + 0.5) / 2^24 for a 24-bit h: never 0 or 1, so -log(u) is finite and positive.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kernels.triton_shim import tl, triton
from specstream.sampling import _GOLDEN, _MIX1, _MIX2

_ID_MIX = 0x9E3779B1  # odd 32-bit constant: spreads consecutive ids over the hash's input
_ID_OFFSET = 0x7F4A7C15  # so that key 0 and id 0 do not hash to 0
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3 fmix32
_MASK32 = 0xFFFFFFFF


def row_keys(seeds: Sequence[int], starts: Sequence[int], purpose: int, device: torch.device | str = "cpu"
             ) -> torch.Tensor:
    """[N] int64 in [0, 2^53): the key of row b's draw at position starts[b] for `purpose`
    (splitmix64 over the counter, as ``specstream.sampling.uniforms``)."""
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
    return ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


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
    keys = keys.long()
    lo, hi = (keys & _MASK32)[:, None], (keys >> 32)[:, None]  # [N, 1]
    ids = ids.long().expand(keys.shape[0], -1) if ids.dim() == 1 else ids.long()
    h = _fmix32_torch((((ids & _MASK32) * _ID_MIX + _ID_OFFSET) & _MASK32) ^ lo)
    h = _fmix32_torch(h ^ hi)
    return ((h >> 8).float() + 0.5) * (1.0 / 16777216.0)
