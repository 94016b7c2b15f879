"""Which implementation of the output-layer ops runs: the Triton kernels or their torch references.

``backend(tensor)`` answers per call. By default (``auto``) it is ``"torch"``, on CUDA too: when
the Triton kernels walked a row's whole vocabulary in one program (one GPU core for the row block),
on an H100 (`make gpu-check`) the fused 1-best was hundreds of times slower than torch's unfused
head (docs/benchmarks.md, "GPU"). The row pass now splits
the vocabulary across programs (kernels/row_pass.py); ``auto`` goes back to Triton on CUDA once
that measures faster than torch there.
Two overrides, for tests, benchmarks and operators:

- the environment variable ``SPECSTREAM_KERNELS`` = ``auto`` (the default), ``torch`` or ``triton``;
- ``with use("triton"): ...`` for the calls made while the block runs (every thread: the engine
  runs its torch work on a compute thread of its own).

Forcing ``triton`` on CPU tensors needs ``TRITON_INTERPRET=1`` set before Triton is imported (the
interpreter runs the kernels with numpy: exact, and slow; that is how CI tests them).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch

BACKENDS = ("auto", "torch", "triton")
_forced: list[str] = []  # the innermost `use` block's choice last


@cache
def triton_available() -> bool:
    """Triton is installed (an optional dependency: ``pip install 'specstream[kernels]'``)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _choice() -> str:
    if _forced:
        return _forced[-1]
    value = os.environ.get("SPECSTREAM_KERNELS", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"SPECSTREAM_KERNELS={value!r}: must be one of {', '.join(BACKENDS)}")
    return value


def backend(tensor: torch.Tensor) -> str:
    """"triton" or "torch" for an op on ``tensor``."""
    choice = _choice()
    if choice == "torch":
        return "torch"
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("SPECSTREAM_KERNELS=triton but Triton is not installed "
                               "(pip install 'specstream[kernels]')")
        if tensor.device.type != "cuda" and not interpreting():
            raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before start-up")
        return "triton"
    return "torch"  # auto: see the module's docstring


@contextmanager
def use(name: str) -> Iterator[None]:
    """Force ``name`` ("auto", "torch" or "triton") for the ops called while this block runs."""
    if name not in BACKENDS:
        raise ValueError(f"kernel backend {name!r}: must be one of {', '.join(BACKENDS)}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()
