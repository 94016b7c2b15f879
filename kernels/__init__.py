"""Output-layer and verification ops of the target engine, one function each.

Today every op is its plain-torch reference; the fused Triton versions slot in behind the same
functions (Triton on CUDA, torch on CPU) without changing callers.
"""

from kernels.output import argmax
from kernels.speculative import speculative_verify
from kernels.verify import greedy_verify

__all__ = ["argmax", "greedy_verify", "speculative_verify"]
