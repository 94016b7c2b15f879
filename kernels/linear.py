"""The matmul every model layer and the output layer call: ``linear(x, weight, bias)``.

One home for how a weight is applied: a dense weight through torch's GEMM, with every row the same
however many rows the call has (so a plain step and a verify forward give the same logits: greedy
speculation reproduces plain decoding only then), and a 4-bit ``Q4Weight`` (kernels/int4.py)
through its own kernel, whose rows are independent.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels.int4 import Q4Weight, q4_linear
from kernels.int8 import Q8Weight, q8_linear

__all__ = ["linear"]


def linear(x: torch.Tensor, weight: torch.Tensor | Q4Weight | Q8Weight, bias: torch.Tensor | None = None,
           bits: int = 0) -> torch.Tensor:
    """F.linear whose every row is the same however many rows the call has (half precision on CPU).

    A ``Q4Weight`` (4-bit blocks, ``int4.py``) and a ``Q8Weight`` (8-bit blocks, ``int8.py``: float32
    out) go to their own kernels, whose rows are independent.

    A plain decode step (one row) and a verify forward (γ+1 rows) must give the same logits, or
    greedy speculation would not reproduce plain decoding; but the CPU BLAS rounds rows differently
    depending on how many share the call: oneDNN computes a 1-row bfloat16/float16 product with a
    matrix-vector kernel, and in float32 it takes rows in blocks of 4 with other kernels for 1 row,
    for 2-3 rows and for the last 1-3 rows of 5-11 (checked: a row's bits matched across 1..300
    rows once padded). So rows are padded, with copies of the last one, to a multiple of
    ``_ROW_MULTIPLE`` for their dtype: then every row goes through the same kernel whatever the count.
    That held on AMD CPUs, where MKL takes its generic kernels; on an Intel CPU with AVX-512 MKL's
    float32 kernels round a row differently for every count below 16, and with two threads by how
    the rows split, so MKL runs in its strict reproducible mode there and everywhere (``MKL_CBWR``
    below), whose rows matched across 1..128 rows and 1 or 2 threads. Likewise oneDNN's AMX kernels
    for bfloat16 rows, so oneDNN stops at AVX-512 BF16 (``ONEDNN_MAX_CPU_ISA`` below).
    x [..., K] -> [..., N]. ``bits``: a 4-bit weight's rows rounded to 8 or 16 bits first (``q4_linear``),
    an 8-bit weight's to 16 (``q8_linear``)."""
    if isinstance(weight, Q4Weight):
        return q4_linear(x, weight, bias, bits)
    if isinstance(weight, Q8Weight):
        out = q8_linear(x, weight, bits)  # [..., N] float32
        return out if bias is None else out + bias
    rows = x.numel() // x.shape[-1]
    short = (-rows) % _ROW_MULTIPLE.get(x.dtype, 1) if x.device.type == "cpu" else 0
    if short:
        flat = x.reshape(rows, -1)  # [rows, K]
        padded = torch.cat([flat, flat[-1:].expand(short, -1)])  # [rows + short, K]
        return F.linear(padded, weight, bias)[:rows].reshape(*x.shape[:-1], weight.shape[0])  # [..., N]
    return F.linear(x, weight, bias)


# MKL's conditional numerical reproducibility, strict: each float32 GEMM row the same bits however many
# rows the call has and however many threads share it, on the best code path MKL has for the CPU
# (AUTO). MKL reads the variable at its first call, so this runs when the matmul's home is imported,
# before any model computes. Its cost: docs/benchmarks.md, "Figures behind design choices"
# (tools/row_invariance.py). A value the user set wins (and may give up the invariance;
# tests/test_native_ops.py says whether it holds).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# oneDNN (torch's bfloat16 and float16 matmuls on CPU) no higher than AVX-512 BF16: on a CPU with AMX
# its AMX kernels block rows by the row count, so a bfloat16 row's bits changed with the verify width
# and the batch (from 9 rows on at 1536 x 576); below AMX they do not, whatever the count. A no-op on
# CPUs without AMX. It costs dense bfloat16 models the AMX speed of many-row calls (prefill); the
# 4-bit layers and 8-bit output layer served by default do no oneDNN matmul. Figures:
# docs/benchmarks.md, "Figures behind design choices". A value the user set wins.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

# Rows the CPU matrix kernels of each dtype take together: other counts round some rows differently.
_ROW_MULTIPLE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
