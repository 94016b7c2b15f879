"""``triton`` and ``triton.language`` when Triton is installed; stand-ins otherwise.

Triton is an optional dependency (the ``kernels`` extra): the CPU runtime serves with the torch
references and never launches a kernel. The stand-ins let the kernel modules be imported without
it — ``@triton.jit`` functions are only compiled when launched, and launching one without Triton
raises — so every op's file can hold its kernel, launcher and reference together.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU runtime: kernels are defined, never launched
    class _Missing:
        def __init__(self, name: str) -> None:
            self._name = name

        def __getitem__(self, grid):
            raise RuntimeError(f"Triton kernel {self._name} launched, but Triton is not installed "
                               "(pip install 'specstream[kernels]')")

        __call__ = __getitem__

    class _Triton:
        @staticmethod
        def jit(fn=None, **_):
            return _Missing(fn.__name__) if fn is not None else (lambda f: _Missing(f.__name__))

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(int(n) - 1, 0).bit_length()

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

    class _Language:
        constexpr = int  # only ever an annotation here

    triton = _Triton()  # type: ignore[assignment]
    tl = _Language()  # type: ignore[assignment]

__all__ = ["triton", "tl"]
