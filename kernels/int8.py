"""8-bit weight matrices served as GGUF's Q8_0 stores them: an int8 code per weight and a scale per
block of 32 (w = d * q), read at 8.5 bits a weight instead of bfloat16's 16.

Contract: ``Q8Weight.from_exact(dense)`` recovers the blocks from a float32 matrix whose every block
IS a Q8_0 block (what converting a GGUF file's Q8_0 tensor to float32 gives: d * q exactly), or
returns None when some block is not; ``q8_linear(x, w)`` is x @ wᵀ in float32 through the native
CPU kernel (kernels/csrc/q8_matmul.cpp), which forms each block's weights once per call and reads
them for every row; ``q8_linear_reference`` is the torch reference beside it (and serves when the
native library is off).

Exactness: d is a half-precision scale and q an integer of 8 bits, so d * q is exact in float32.
With bfloat16 activations the kernel rounds each d * q to bfloat16: the very values of the dense
bfloat16 matrix converted from the same file, so the logits differ from the dense path's only in
the order of float32 additions. Each output row depends only on its own input row, however many
rows the call has.

What it does not know: where the matrix comes from (models/llama.py serves a tied embedding's
output layer this way) or CUDA (CPU only; the Triton head reads a dense matrix there).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels import native

__all__ = ["GROUP", "Q8Weight", "q8_linear", "q8_linear_reference", "rounded_rows"]

GROUP = 32  # columns per scale: GGUF's block size
_LARGEST = 127  # Q8_0 codes are -127..127: a block's largest magnitude is 127 * d
_TILE = 8  # output features per tile of the 16-bit kernel's layout (``Q8Weight.tiles``)


@dataclass(frozen=True)
class Q8Weight:
    """An [out_features, in_features] matrix as int8 codes and a float32 scale per block of 32."""

    codes: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N, K/GROUP] float32

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @functools.cached_property
    def tiles(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and scales as the 16-bit kernel reads them (``q8_linear``'s ``bits`` 16; made at
        its first call): per tile of 8 output features (the last one padded with zero codes), block of
        32 inputs and pair of inputs (32 b + 2 p, + 1), 16 codes, feature f's two at 2 f, 2 f + 1 —
        [N/8, K/32, 16, 8, 2] int8 — and the scales [N/8, K/32, 8] float32
        (kernels/csrc/q8_matmul.cpp)."""
        N, K = self.codes.shape
        T = -(-N // _TILE)
        codes = torch.zeros(T * _TILE, K, dtype=torch.int8)
        codes[:N] = self.codes
        scale = torch.zeros(T * _TILE, K // GROUP)
        scale[:N] = self.scale
        tiles = codes.view(T, _TILE, K // GROUP, GROUP // 2, 2).permute(0, 2, 3, 1, 4).contiguous()
        return tiles, scale.view(T, _TILE, K // GROUP).permute(0, 2, 1).contiguous()

    @classmethod
    def from_exact(cls, dense: torch.Tensor) -> Q8Weight | None:
        """The blocks of a float32 [N, K] matrix whose every block of 32 equals d * q for one scale d
        and codes q in -127..127 (d = the block's largest magnitude / 127, as llama.cpp quantizes);
        None if any block does not, or K is not a multiple of 32."""
        N, K = dense.shape
        if dense.dtype != torch.float32 or K % GROUP:
            return None
        blocks = dense.reshape(N, K // GROUP, GROUP)  # [N, K/G, G]
        scale = blocks.abs().amax(-1) / _LARGEST  # [N, K/G]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = blocks / safe[..., None]  # [N, K/G, G]
        rounded = codes.round()
        if not (torch.equal(rounded, codes) and torch.equal(rounded * scale[..., None], blocks)):
            return None
        return cls(rounded.to(torch.int8).reshape(N, K).contiguous(), scale.contiguous())


def q8_linear(x: torch.Tensor, weight: Q8Weight, bits: int = 0) -> torch.Tensor:
    """x [..., K] -> [..., N] float32: x @ weightᵀ through the native kernel. ``bits`` 16: float32
    rows rounded to 16 bits per block of 32 and multiplied in integers (``q4_rounded_native``'s
    16-bit case: AVX2); 0: the rows as they are."""
    library = native.library()
    if library is None:  # turned off since the weight was made (SPECSTREAM_NATIVE=0): the reference serves
        return q8_linear_reference(x, weight, bits)
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if bits == 16:
        tiles, scales = weight.tiles
        out = library.q8_matmul_i16(rows, tiles, scales, weight.shape[0])  # [M, N] float32
    elif bits:
        raise ValueError(f"q8_linear: inputs are rounded to 16 bits or not at all, got {bits}")
    else:
        out = library.q8_matmul(rows, weight.codes, weight.scale)  # [M, N] float32
    return out.reshape(*x.shape[:-1], out.shape[-1])


def q8_linear_reference(x: torch.Tensor, weight: Q8Weight, bits: int = 0) -> torch.Tensor:
    """The torch reference: the dense matrix (d * q, rounded to x's dtype), float32 products; with
    ``bits`` the rows rounded first as the kernel rounds them (``rounded_rows``), float64 products."""
    dense = (weight.codes.float().reshape(weight.codes.shape[0], -1, GROUP) * weight.scale[..., None])
    dense = dense.reshape(weight.codes.shape).to(x.dtype).float()  # [N, K]
    if bits:
        return (rounded_rows(x, bits) @ dense.double().T).float()  # [..., N]
    return x.float() @ dense.T  # [..., N]


def rounded_rows(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [..., K] as the native kernels round their inputs to ``bits`` (8 or 16) per block of 32
    (kernels/csrc/q4_matmul.cpp): dx = max|x| / (2^(bits-1) - 1) and the codes nearest(x / dx), the
    quotient in float32 (its last bit decides a near-tie); the values dx * code in float64."""
    blocks = x.float().reshape(*x.shape[:-1], -1, GROUP)  # [..., K/G, G]
    dx = blocks.abs().amax(-1, keepdim=True) / float(2 ** (bits - 1) - 1)  # [..., K/G, 1] float32
    codes = torch.round(blocks / torch.where(dx > 0, dx, 1))
    return (codes.double() * dx.double()).reshape(x.shape)
