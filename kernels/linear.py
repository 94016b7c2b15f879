"""The matmul every model layer and the output layer call: ``linear(x, weight, bias)``.

One home for how a weight is applied: a dense weight through torch's GEMM, with every row the same
however many rows the call has (so a plain step and a verify forward give the same logits: greedy
speculation reproduces plain decoding only then), and a 4-bit ``Q4Weight`` (kernels/int4.py)
through its own kernel, whose rows are independent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.int4 import Q4Weight, q4_linear

__all__ = ["linear"]


def linear(x: torch.Tensor, weight: torch.Tensor | Q4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose every row is the same however many rows the call has (half precision on CPU).

    A ``Q4Weight`` (4-bit blocks, ``int4.py``) goes to its own kernel, whose rows are independent.

    oneDNN computes a 1-row bfloat16/float16 product with a matrix-vector kernel that rounds
    differently from its matrix kernel, used for 2 rows or more; the matrix kernel's rows do not
    depend on the row count. A plain decode step (one row) and a verify forward (γ+1 rows) must give
    the same logits, or greedy speculation would not reproduce plain decoding, so a lone row is
    computed as two. x [..., K] -> [..., N]."""
    if isinstance(weight, Q4Weight):
        return q4_linear(x, weight, bias)
    if x.device.type == "cpu" and x.dtype != torch.float32 and x.numel() == x.shape[-1]:
        pair = x.reshape(1, -1).expand(2, -1).contiguous()  # [2, K]
        return F.linear(pair, weight, bias)[:1].reshape(*x.shape[:-1], weight.shape[0])  # [..., N]
    return F.linear(x, weight, bias)
