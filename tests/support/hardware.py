"""What a test needs of the CPU it runs on, as pytest marks: the paths that only some CPUs take are
tested where they are taken, and a CPU without them skips those tests with the reason printed
(``pytest -rs``), never passes them unrun."""

from __future__ import annotations

import pytest
import torch

from kernels.int4 import q4_native
from specstream.models.registry import resolve_dtype

# The native 4-bit kernel (kernels/int4.py) for bfloat16 activations: the native library, AVX-512 BF16.
# Elsewhere bfloat16 4-bit matrices are served in ATen's layout.
NEEDS_Q4_NATIVE = pytest.mark.skipif(not q4_native(torch.bfloat16),
                                     reason="the native 4-bit kernel needs the native library and AVX-512 BF16")
# The native 4-bit kernel for float32 activations: the native library, AVX2, FMA and F16C. Elsewhere a
# model served "auto" in float32 is dense.
NEEDS_Q4_NATIVE_F32 = pytest.mark.skipif(not q4_native(torch.float32),
                                         reason="the float32 4-bit kernel needs the native library and AVX2, FMA, F16C")

# bfloat16 matmuls that run natively (AVX-512 BF16 or AMX; what resolve_dtype("auto") picks
# bfloat16 for): oneDNN builds and caches a kernel per shape for them.
NEEDS_NATIVE_BF16 = pytest.mark.skipif(resolve_dtype("auto") != "bfloat16",
                                       reason="this CPU runs no bfloat16 matmul natively (no AVX-512 BF16 or AMX)")
