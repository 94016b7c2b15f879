"""The native CPU library (kernels/csrc/: one .cpp per op, cpu_ops.h what they share, cpu_ops.cpp the
Python bindings; SOURCES below): built as ONE library with torch's C++ extension tools the first
time a process asks for it, then loaded from torch's extension cache (TORCH_EXTENSIONS_DIR, by
default ~/.cache/torch_extensions: a second start loads it in a fraction of a second).

``library()`` returns the loaded module, or None where it cannot be built (no C++ compiler, a
build error: the reason is logged once), so callers fall back to their torch path. Building takes
a while (docs/benchmarks.md), hence once per cache; ``SPECSTREAM_NATIVE=0`` turns the library off
(the torch paths serve). ``SPECSTREAM_CPU_ISA`` caps the vector paths the library runs (``CPU_ISAS``):
``avx2`` runs an AVX-512 CPU's ops on their AVX2 paths, as an AVX2-only CPU does (with float32
activations, as ``--dtype auto`` picks there), ``generic`` on the portable ones; the tests and the
benchmarks use it to cover every class's paths on one machine.

What it does not know: when an op should use it (kernels/int4.py, kernels/int8.py and the models decide).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# One library from these files, each op's file named by its op. cpu_ops.h, which they all include, is
# no source of its own: ninja, run at each process's first load, rebuilds the files that include it
# when it changes (its depfiles), though torch's version hash covers these sources only.
SOURCES = [CSRC / name for name in (
    "cpu_ops.cpp",  # the Python module: every op's binding
    "q8_matmul.cpp",
    "q4_matmul.cpp",
    "attention.cpp",
    "layer_stack.cpp",
    "greedy_verify.cpp",
    "race_candidates.cpp",
)]
NAME = "specstream_cpu_ops"
# -O3 for the compiler's own vectorisation of the generic paths; no implicit fused multiply-adds
# (-ffp-contract=off): the compiler would fuse in some places and not others, and a row's bits would
# depend on how many rows share its call (only the explicit ones in the source). The AVX-512 paths carry their own
# target attributes and run only where the CPU has them. No -march=native: the build must run on any
# x86-64 machine of a fleet, not only the one that built it.
CFLAGS = ["-O3", "-std=c++17", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]
# at::parallel_for runs on torch's OpenMP threads only if the library is built with OpenMP; it then
# shares torch's own libgomp (same soname, loaded first), so one thread team serves both.
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


CPU_ISAS = ("avx512", "avx2", "generic")  # SPECSTREAM_CPU_ISA's values; unset: the CPU's own (avx512 where it has it)


def cpu_isa_cap() -> str:
    """SPECSTREAM_CPU_ISA, checked: the widest vector paths the library may run."""
    value = os.environ.get("SPECSTREAM_CPU_ISA", "avx512")
    if value not in CPU_ISAS:
        raise ValueError(f"SPECSTREAM_CPU_ISA={value!r}: must be one of {', '.join(CPU_ISAS)}")
    return value


def enabled() -> bool:
    """Whether the library may be used at all (SPECSTREAM_NATIVE=0 turns it off)."""
    return os.environ.get("SPECSTREAM_NATIVE", "1") != "0"


def library() -> ModuleType | None:
    """The built library, or None (off, or it could not be built: logged once)."""
    if not enabled():
        return None
    cpu_isa_cap()  # a wrong value is an error, not the CPU's own paths
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def _build() -> ModuleType | None:
    started = time.perf_counter()
    try:
        # Imported here: the build tools pull in setuptools, which only a process that builds needs.
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        module = load(name=NAME, sources=[str(path) for path in SOURCES], extra_cflags=CFLAGS,
                      extra_ldflags=LDFLAGS, verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means: serve with the torch paths
        log.warning("native CPU ops unavailable (%s: %s); the torch paths serve", type(exc).__name__, exc)
        return None
    log.info("native CPU ops loaded in %.1f s (AVX-512: %s, AVX2: %s%s)", time.perf_counter() - started,
             module.has_avx512(), module.has_avx2_fma(),
             f"; capped by SPECSTREAM_CPU_ISA={cpu_isa_cap()}" if "SPECSTREAM_CPU_ISA" in os.environ else "")
    return module


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` package (a dependency) carries one, in a
    virtual environment's bin/ that is not on PATH unless the environment is activated."""
    try:
        import ninja  # the PyPI package: only its binary's location is needed
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
