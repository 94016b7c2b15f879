"""4-bit weight matrices served as they are stored: GGUF's Q4_0/Q4_1 blocks in a matmul that reads 4 bits a weight.

Contract: ``Q4Weight.from_parts(codes, scale, minimum, dtype)`` packs a [N, K] matrix whose value
is ``scale * code + min`` per block of ``GROUP`` = 32 consecutive columns (codes 0..15); ``q4_linear(x,
w, bias)`` is ``F.linear(x, q4_dense(...), bias)`` computed without materialising the dense matrix,
by one of two kernels; ``q4_linear_reference`` is the torch reference beside them. ``pack_codes``/
``unpack_codes`` are the on-disk layout (two codes a byte, the even column in the low nibble).
``rtn_parts`` rounds a dense matrix to such parts (for drafts, whose rounding only moves α).

The two kernels:
- the native one, with the native library built (kernels/native.py): ``q4_matmul`` in
  kernels/csrc/q4_matmul.cpp, for bfloat16 activations on a CPU with AVX-512 BF16 and for float32
  activations on one with AVX2, FMA and F16C (``q4_native``). Weight-stationary: each block's codes
  are formed once per call and applied to every row, so a verify over a few positions reads the
  weights once (ATen's kernel takes rows 4 at a time and forms the weights again for every 4).
  ``native_layout`` is its packing. It measured faster than ATen's kernel at every row count from 1
  to 16 (docs/benchmarks.md, "Figures behind design choices"; ``specstream bench step`` shows both
  in a whole forward).
- otherwise ATen's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``).

Why: at batch 1 a decode step on a CPU reads every weight once, so its time is the weights' bytes
over memory bandwidth. A Q4_1 model dequantized to bfloat16 reads 16 bits a weight; served as 4-bit
blocks it reads ~5 (4 bits + a scale and a min per 32), the same bytes llama.cpp reads.

Exactness: the native kernel sums each block as ``d * Σ q x + m * Σ x`` in float32 with the file's
scale and min exact (the codes are exact in bfloat16 and float32; with bfloat16 inputs each product
q x is exact in float32, with float32 inputs each is one fused multiply-add): the dequantized
matrix's dot product up to the order and rounding of float32 additions. ATen's kernel computes each
weight as ``(code - 8) * scale + zero`` with ``zero = min + 8 * scale`` in the activation dtype: in
float32 bit-identical to ggml's ``d * q + m``; in bfloat16 the scale and zero are rounded to
bfloat16 first. In both, each output row depends only on its own input row, however many rows the
call has, so a verify forward over γ+1 positions gives exactly the rows of γ+1 decode steps
(``tests/test_int4.py`` checks it).

What it does not know: files (``gguf.py`` writes the parts), models (``llama.py`` swaps its fused
projections for these). CUDA has a different int4 layout (tinygemm); this module is CPU only and
``load_model`` refuses ``weights="int4"`` elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import native

__all__ = ["GROUP", "Q4_FILE", "Q4Weight", "native_layout", "pack_codes", "q4_dense", "q4_linear", "q4_linear_reference",
           "q4_native", "q4_rounded_native", "rtn_parts", "unpack_codes"]

# A converted GGUF checkpoint keeps its 4-bit matrices here, beside model.safetensors (gguf.py writes it).
Q4_FILE = "weights.q4.safetensors"
GROUP = 32  # columns per (scale, min) pair: GGUF's block size
_INNER_K_TILES = 2  # ATen's packing parameter for the CPU kernel: K must be a multiple of 16 * this
_TILE = 16  # output features per tile of the native kernel (its vector lanes)


def q4_native(dtype: torch.dtype) -> bool:
    """Whether matrices for activations of ``dtype`` go to the native kernel: the native library
    built, and bfloat16 on a CPU with AVX-512 BF16 or float32 on one with AVX2, FMA and F16C."""
    if dtype not in (torch.bfloat16, torch.float32):
        return False
    library = native.library()
    if library is None:
        return False
    return library.has_avx512_bf16() if dtype == torch.bfloat16 else library.has_avx2_fma()


def q4_rounded_native(dtype: torch.dtype, bits: int) -> bool:
    """Whether the native kernel can round activations of ``dtype`` to ``bits`` (8 or 16) bits per
    block of 32 and multiply them in integers: where ``q4_native`` serves ``dtype``; float32 to 8 or
    16 bits (AVX2), bfloat16 to 8 (AVX-512 VNNI; it has no more than 8 to keep)."""
    if not q4_native(dtype) or bits not in (8, 16):
        return False
    return dtype == torch.float32 or (bits == 8 and native.library().has_avx512_vnni())


def native_layout(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [N, K] uint8 0..15, scale and min [N, K/GROUP] -> the native kernel's operands
    (kernels/csrc/q4_matmul.cpp, "Q4_1 with bfloat16 activations"): per tile of 16 features and block
    of 32 inputs, 8 chunks of 32 bytes, byte 2i+j of chunk c holding feature i's codes for inputs
    4c+j (low nibble) and 4c+2+j (high); and d, m [N/16, K/32, 16] float16 (GGUF's scales and mins
    are half precision; ``rtn_parts`` rounds its own to it)."""
    N, K = codes.shape
    T, B = N // _TILE, K // GROUP
    c = codes.reshape(T, _TILE, B, 8, 2, 2)  # [tile, feature i, block, chunk, low/high, j]
    packed = (c[..., 0, :] | (c[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).contiguous().reshape(-1)  # [T*B*8*16*2]
    d, m = (_exact_half(p, name).reshape(T, _TILE, B).permute(0, 2, 1).contiguous()  # [T, B, 16]
            for p, name in ((scale, "scale"), (minimum, "min")))
    return packed, d, m


def _from_native_layout(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``native_layout``: codes [N, K], scale, min [N, K/GROUP]."""
    T, B, _ = d.shape
    chunks = packed.reshape(T, B, 8, _TILE, 2)  # [tile, block, chunk, feature i, j]
    c = torch.stack((chunks & 0x0F, chunks >> 4), dim=-2)  # [T, B, 8, 16, low/high, j]
    codes = c.permute(0, 3, 1, 2, 4, 5).reshape(T * _TILE, B * GROUP)  # [N, K]
    return codes, *(p.permute(0, 2, 1).reshape(T * _TILE, B).float() for p in (d, m))


def _exact_half(values: torch.Tensor, name: str) -> torch.Tensor:
    half = values.to(torch.float16)
    if not torch.equal(half.float(), values.float()):
        raise ValueError(f"Q4Weight: the native kernel keeps {name}s in float16, and these are not all float16 values")
    return half


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
    """An [out_features, in_features] matrix of 4-bit codes with a scale and min per block of 32, in
    the layout of the kernel that serves it: the native one (``scale_zero`` None) or ATen's."""

    packed: torch.Tensor  # the native layout (native_layout), or ATen's, opaque: _weight_int4pack_mm_for_cpu reads it
    scale_zero: torch.Tensor | None  # ATen: [K/GROUP, N, 2] in the activation dtype: (scale, min + 8 * scale)
    d: torch.Tensor | None = None  # native: [N/16, K/GROUP, 16] float16 scale
    m: torch.Tensor | None = None  # native: [N/16, K/GROUP, 16] float16 min

    @property
    def native(self) -> bool:
        return self.scale_zero is None

    @classmethod
    def from_parts(cls, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                   dtype: torch.dtype, use_native: bool | None = None) -> Q4Weight:
        """codes [N, K] uint8 0..15; scale, minimum [N, K/GROUP] float32; dtype: the activations'.
        ``use_native``: the kernel (None: the native one wherever ``q4_native(dtype)``)."""
        N, K = codes.shape
        if not cls.fits(N, K) or scale.shape != (N, K // GROUP) or minimum.shape != scale.shape:
            raise ValueError(f"Q4Weight: codes {list(codes.shape)} need N a multiple of 16, K of {16 * _INNER_K_TILES}, "
                             f"and scale/min of shape [{N}, {K // GROUP}], got {list(scale.shape)}, {list(minimum.shape)}")
        if q4_native(dtype) if use_native is None else use_native:
            packed, d, m = native_layout(codes, scale, minimum)
            return cls(packed, None, d, m)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), _INNER_K_TILES)
        return cls(packed, _scale_zero(scale.float(), minimum.float(), dtype))

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scale, min) back from a native-layout weight (ATen's layout is opaque)."""
        if not self.native:
            raise ValueError("Q4Weight.parts: ATen's packed layout cannot be read back")
        return _from_native_layout(self.packed, self.d, self.m)

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        """Whether the kernel takes an [out_features, in_features] matrix (its tiles are 16 x 32)."""
        return out_features % 16 == 0 and in_features % (16 * _INNER_K_TILES) == 0


def rtn_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit quantization of a dense [N, K] matrix, per block of GROUP columns, in
    Q4_1's form: (codes [N, K] uint8 0..15, scale [N, K/GROUP], min [N, K/GROUP] float32 holding
    float16 values, as in a GGUF file), each block spanning about its own min..max in 15 steps. For
    drafts only: it changes the model (a target serves its checkpoint's values)."""
    N, K = weight.shape
    blocks = weight.float().reshape(N, K // GROUP, GROUP)  # [N, K/G, G]
    lo, hi = blocks.amin(-1).half().float(), blocks.amax(-1)  # [N, K/G]
    scale = ((hi - lo) / 15).half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant block: every code 0
    codes = torch.round((blocks - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)  # [N, K/G, G]
    return codes.reshape(N, K), scale, lo


def q4_linear(x: torch.Tensor, weight: Q4Weight, bias: torch.Tensor | None = None, bits: int = 0
              ) -> torch.Tensor:
    """x [..., K] (weight.dtype) -> [..., N]: x @ weightᵀ (+ bias), reading 4-bit weights. ``bits``
    8 or 16: the rows rounded to that many bits per block of 32 and multiplied in integers
    (``q4_rounded_native``: the native kernel only); 0: the rows as they are."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if weight.native:
        library = native.library()
        if library is None:  # turned off since the weight was made (SPECSTREAM_NATIVE=0): the reference serves
            return q4_linear_reference(x, *weight.parts(), bias)
        out = library.q4_matmul(rows, weight.packed, weight.d, weight.m, bits)  # [M, N]
    else:
        if bits:
            raise ValueError(f"q4_linear: {bits}-bit activations run on the native kernel only")
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weight.packed, GROUP, weight.scale_zero)  # [M, N]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def q4_dense(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] float32 weights as the kernel that serves activations of ``dtype`` forms them: the
    native one d * q + m exactly; ATen's (code - 8) * scale + zero with scale and zero rounded to
    ``dtype`` (in float32: ggml's d * q + m)."""
    if q4_native(dtype):
        return codes.float() * scale.float().repeat_interleave(GROUP, 1) + minimum.float().repeat_interleave(GROUP, 1)
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
