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

from dataclasses import dataclass

import torch

from kernels import native

__all__ = ["GROUP", "Q8Weight", "q8_linear", "q8_linear_reference"]

GROUP = 32  # columns per scale: GGUF's block size
_LARGEST = 127  # Q8_0 codes are -127..127: a block's largest magnitude is 127 * d


@dataclass(frozen=True)
class Q8Weight:
    """An [out_features, in_features] matrix as int8 codes and a float32 scale per block of 32."""

    codes: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N, K/GROUP] float32

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

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


def q8_linear(x: torch.Tensor, weight: Q8Weight) -> torch.Tensor:
    """x [..., K] -> [..., N] float32: x @ weightᵀ through the native kernel."""
    library = native.library()
    if library is None:  # turned off since the weight was made (SPECSTREAM_NATIVE=0): the reference serves
        return q8_linear_reference(x, weight)
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    out = library.q8_matmul(rows, weight.codes, weight.scale)  # [M, N] float32
    return out.reshape(*x.shape[:-1], out.shape[-1])


def q8_linear_reference(x: torch.Tensor, weight: Q8Weight) -> torch.Tensor:
    """The torch reference: the dense matrix (d * q, rounded to x's dtype), float32 products."""
    dense = (weight.codes.float().reshape(weight.codes.shape[0], -1, GROUP) * weight.scale[..., None])
    dense = dense.reshape(weight.codes.shape).to(x.dtype).float()  # [N, K]
    return x.float() @ dense.T  # [..., N]
