"""Dequantization of GGML tensor types to float32, vectorised over all blocks at once.

Contract: ``dequantize(raw, type_name, shape, tensor)`` turns the bytes of one GGUF tensor
(``raw``: a 1-D uint8 numpy array or memmap) into a float32 torch tensor of ``shape`` (row-major,
torch order: the GGUF ``ne`` dimensions reversed). Block formats follow ggml's reference code
(``ggml-quants.c``, ``dequantize_row_*``), computed in the same order (``d * q`` then ``+ m``) so
the values are bit-identical to ggml's on every supported type. ``DEQUANTIZERS`` lists the types;
anything else raises ``ModelLoadError`` naming the tensor and the type.

What it does not know: file layout, tensor names, models. It never loops over blocks in Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specstream.models.config import ModelLoadError

__all__ = ["BlockFormat", "DEQUANTIZERS", "FORMATS", "Q4_TYPES", "dequantize", "nbytes", "q4_parts"]


@dataclass(frozen=True)
class BlockFormat:
    block: int  # elements per block
    nbytes: int  # bytes per block


# ggml's block layouts (ggml-common.h): scales are IEEE half precision, little-endian.
FORMATS: dict[str, BlockFormat] = {
    "F32": BlockFormat(1, 4),
    "F16": BlockFormat(1, 2),
    "BF16": BlockFormat(1, 2),
    "Q8_0": BlockFormat(32, 2 + 32),  # d, 32 x int8
    "Q4_0": BlockFormat(32, 2 + 16),  # d, 32 x 4-bit (low nibbles: elements 0..15, high: 16..31)
    "Q4_1": BlockFormat(32, 2 + 2 + 16),  # d, m, 32 x 4-bit
    "Q5_0": BlockFormat(32, 2 + 4 + 16),  # d, 32 high bits, 32 x 4-bit
    "Q5_1": BlockFormat(32, 2 + 2 + 4 + 16),  # d, m, 32 high bits, 32 x 4-bit
}


def nbytes(type_name: str, n_elements: int) -> int:
    """Bytes a tensor of ``n_elements`` of this type occupies (``n_elements`` is a block multiple)."""
    fmt = FORMATS[type_name]
    return n_elements // fmt.block * fmt.nbytes


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 scale at byte ``offset`` of every block, as float32: [n_blocks, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n_blocks, 16] uint8 -> [n_blocks, 32] uint8: low nibbles are elements 0..15, high 16..31."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=1)


def _high_bits(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """Q5's 32 fifth bits (a little-endian uint32 at ``offset``), bit j for element j: [n_blocks, 32] uint8."""
    qh = blocks[:, offset : offset + 4]  # [n, 4] bytes, little-endian
    bits = torch.arange(8, dtype=torch.uint8)  # [8]
    return ((qh[:, :, None] >> bits) & 1).reshape(-1, 32)  # byte b bit k -> element 8b + k


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _half(blocks, 0)  # [n, 1]
    q = blocks[:, 2:].contiguous().view(torch.int8).float()  # [n, 32]
    return q * d


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _half(blocks, 0)  # [n, 1]
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8  # [n, 32]
    return q.float() * d


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _half(blocks, 0), _half(blocks, 2)  # [n, 1] each
    q = _nibbles(blocks[:, 4:]).float()  # [n, 32]
    return d * q + m


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _half(blocks, 0)  # [n, 1]
    q = (_nibbles(blocks[:, 6:]) | (_high_bits(blocks, 2) << 4)).to(torch.int8) - 16  # [n, 32]
    return q.float() * d


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _half(blocks, 0), _half(blocks, 2)  # [n, 1] each
    q = (_nibbles(blocks[:, 8:]) | (_high_bits(blocks, 4) << 4)).float()  # [n, 32]
    return d * q + m


def _plain(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda blocks: blocks.reshape(-1).view(dtype).float()


# Type name (gguf.GGMLQuantizationType.name) -> [n_blocks, bytes per block] uint8 -> [n_blocks, block] float32.
DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": _plain(torch.float32),
    "F16": _plain(torch.float16),
    "BF16": _plain(torch.bfloat16),
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
}
assert set(DEQUANTIZERS) == set(FORMATS), "every block format needs a dequantizer"

# Rows dequantized per chunk: bounds the temporaries (a [rows, cols] int tensor per op) for big tensors.
_CHUNK_ELEMENTS = 1 << 24


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...], tensor: str) -> torch.Tensor:
    """The float32 values of one tensor; ``tensor`` names it in errors."""
    fmt = FORMATS.get(type_name)
    if fmt is None:
        raise ModelLoadError(
            f"tensor {tensor!r}: quantization type {type_name} is not supported (supported: {sorted(FORMATS)})"
        )
    n = int(np.prod(shape)) if shape else 1
    if (shape[-1] if shape else 1) % fmt.block:  # blocks never straddle rows
        raise ModelLoadError(f"tensor {tensor!r}: rows of {shape[-1] if shape else 1} elements are not a multiple "
                             f"of the {type_name} block ({fmt.block})")
    want = nbytes(type_name, n)
    if raw.size != want:
        raise ModelLoadError(f"tensor {tensor!r}: {raw.size} bytes of {type_name} data, expected {want} for shape {list(shape)}")
    # Copy out of the file mapping once: the result must not alias a file that may be closed.
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True).reshape(-1, fmt.nbytes))  # [n_blocks, nbytes] uint8
    out = torch.empty(n // fmt.block, fmt.block, dtype=torch.float32)  # [n_blocks, block]
    step = max(1, _CHUNK_ELEMENTS // fmt.block)
    fn = DEQUANTIZERS[type_name]
    for lo in range(0, blocks.shape[0], step):
        out[lo : lo + step] = fn(blocks[lo : lo + step]).reshape(-1, fmt.block)
    return out.reshape(shape)


# Types whose values are exactly scale * code + min with 4-bit codes in blocks of 32 along a row:
# served as they are by ``models/int4.py`` instead of dequantized.
Q4_TYPES = ("Q4_0", "Q4_1")


def q4_parts(raw: np.ndarray, type_name: str, shape: tuple[int, ...], tensor: str) -> tuple[torch.Tensor, ...]:
    """(codes [rows, cols] uint8 in 0..15, scale [rows, cols/32] float32, min [rows, cols/32] float32)
    of a Q4_0/Q4_1 matrix, such that value = scale * code + min (Q4_0: min = -8 * scale) exactly as
    ``dequantize`` computes it."""
    if type_name not in Q4_TYPES or len(shape) != 2:
        raise ModelLoadError(f"tensor {tensor!r}: {type_name} {list(shape)} is not a 4-bit matrix ({', '.join(Q4_TYPES)})")
    fmt = FORMATS[type_name]
    rows, cols = shape
    want = nbytes(type_name, rows * cols)
    if cols % fmt.block or raw.size != want:
        raise ModelLoadError(f"tensor {tensor!r}: {raw.size} bytes of {type_name} data do not hold a {list(shape)} matrix")
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True).reshape(-1, fmt.nbytes))  # [n_blocks, nbytes]
    scale = _half(blocks, 0)  # [n_blocks, 1]
    if type_name == "Q4_0":
        minimum, codes = -8 * scale, _nibbles(blocks[:, 2:])  # [n_blocks, 1], [n_blocks, 32]
    else:
        minimum, codes = _half(blocks, 2), _nibbles(blocks[:, 4:])
    per_row = cols // fmt.block
    return codes.reshape(rows, cols), scale.reshape(rows, per_row), minimum.reshape(rows, per_row)
