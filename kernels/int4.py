"""4-bit weight matrices served as they are stored: GGUF's Q4_0/Q4_1 blocks in a matmul that reads 4 bits a weight.

Contract: ``Q4Weight.from_parts(codes, scale, minimum, dtype)`` packs a [N, K] matrix whose value
is ``scale * code + min`` per block of ``GROUP`` = 32 consecutive columns (codes 0..15); ``q4_linear(x,
w, bias)`` is ``F.linear(x, q4_dense(...), bias)`` computed by ATen's CPU int4 kernel
(``_weight_int4pack_mm_for_cpu``), which never materialises the dense matrix; ``q4_linear_reference`` is
the torch reference beside it. ``pack_codes``/``unpack_codes`` are the on-disk layout (two codes a
byte, the even column in the low nibble). ``rtn_parts`` rounds a dense matrix to such parts (for
drafts, whose rounding only moves α).

Why: at batch 1 a decode step on a CPU reads every weight once, so its time is the weights' bytes
over memory bandwidth. A Q4_1 model dequantized to bfloat16 reads 16 bits a weight; served as 4-bit
blocks it reads ~5 (4 bits + a scale and a min per 32), the same bytes llama.cpp reads.

Exactness: the kernel computes each weight as ``(code - 8) * scale + zero`` with ``zero = min + 8 *
scale`` in the activation dtype. In float32 that is bit-identical to ggml's ``d * q + m`` (every
term is exact: f16 scales, 4-bit codes); in bfloat16 the scale and zero are rounded to bfloat16
first (comparable to rounding each dequantized weight to bfloat16, which the dense path does). Each
output row depends only on its own input row, however many rows the call has, so a verify forward
over γ+1 positions gives exactly the rows of γ+1 decode steps (``tests/test_int4.py`` checks it).

What it does not know: files (``gguf.py`` writes the parts), models (``llama.py`` swaps its fused
projections for these). CUDA has a different int4 layout (tinygemm); this module is CPU only and
``load_model`` refuses ``weights="int4"`` elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["GROUP", "Q4_FILE", "Q4Weight", "pack_codes", "q4_dense", "q4_linear", "q4_linear_reference", "rtn_parts",
           "unpack_codes"]

# A converted GGUF checkpoint keeps its 4-bit matrices here, beside model.safetensors (gguf.py writes it).
Q4_FILE = "weights.q4.safetensors"
GROUP = 32  # columns per (scale, min) pair: GGUF's block size
_INNER_K_TILES = 2  # ATen's packing parameter for the CPU kernel: K must be a multiple of 16 * this


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] uint8 codes 0..15 -> [N, K/2] uint8, column 2j in the low nibble, 2j+1 in the high."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] uint8, the inverse of ``pack_codes``."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def _scale_zero(scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, K/G] float32 scale and min -> [K/G, N, 2] (scale, min + 8 * scale) in ``dtype``, the kernel's form."""
    zero = minimum + 8 * scale  # [N, K/G] float32: exact for f16 scales and mins
    return torch.stack((scale.t(), zero.t()), dim=-1).to(dtype).contiguous()  # [K/G, N, 2]


@dataclass(frozen=True)
class Q4Weight:
    """An [out_features, in_features] matrix in ATen's packed int4 layout, with its per-block scale and zero."""

    packed: torch.Tensor  # ATen's layout, opaque: only _weight_int4pack_mm_for_cpu reads it
    scale_zero: torch.Tensor  # [K/GROUP, N, 2] in the activation dtype: (scale, min + 8 * scale)

    @classmethod
    def from_parts(cls, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                   dtype: torch.dtype) -> Q4Weight:
        """codes [N, K] uint8 0..15; scale, minimum [N, K/GROUP] float32; dtype: the activations'."""
        N, K = codes.shape
        if not cls.fits(N, K) or scale.shape != (N, K // GROUP) or minimum.shape != scale.shape:
            raise ValueError(f"Q4Weight: codes {list(codes.shape)} need N a multiple of 16, K of {16 * _INNER_K_TILES}, "
                             f"and scale/min of shape [{N}, {K // GROUP}], got {list(scale.shape)}, {list(minimum.shape)}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), _INNER_K_TILES)
        return cls(packed, _scale_zero(scale.float(), minimum.float(), dtype))

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        """Whether the kernel takes an [out_features, in_features] matrix (its tiles are 16 x 32)."""
        return out_features % 16 == 0 and in_features % (16 * _INNER_K_TILES) == 0


def rtn_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit quantization of a dense [N, K] matrix, per block of GROUP columns, in
    Q4_1's form: (codes [N, K] uint8 0..15, scale [N, K/GROUP], min [N, K/GROUP] float32), each block
    spanning its own min..max in 15 steps. For drafts only: it changes the model (a target serves its
    checkpoint's values)."""
    N, K = weight.shape
    blocks = weight.float().reshape(N, K // GROUP, GROUP)  # [N, K/G, G]
    lo, hi = blocks.amin(-1), blocks.amax(-1)  # [N, K/G]
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant block: every code 0
    codes = torch.round((blocks - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)  # [N, K/G, G]
    return codes.reshape(N, K), scale, lo


def q4_linear(x: torch.Tensor, weight: Q4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (weight.dtype) -> [..., N]: x @ weightᵀ (+ bias), reading 4-bit weights."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weight.packed, GROUP, weight.scale_zero)  # [M, N]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def q4_dense(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] float32 weights as the kernel forms them for activations of ``dtype``:
    (code - 8) * scale + zero with scale and zero rounded to ``dtype`` (in float32: ggml's d * q + m)."""
    sz = _scale_zero(scale.float(), minimum.float(), dtype).float()  # [K/G, N, 2]
    s = sz[..., 0].t().repeat_interleave(GROUP, dim=1)  # [N, K]
    z = sz[..., 1].t().repeat_interleave(GROUP, dim=1)  # [N, K]
    return (codes.float() - 8) * s + z


def q4_linear_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference of ``q4_linear`` over the same parts: dense weights, F.linear in float32."""
    w = q4_dense(codes, scale, minimum, x.dtype)  # [N, K]
    out = F.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)
