"""The fused output kernels, compiled for an H100 (sm_90) on this machine without a GPU, fit its
shared memory (tools/kernel_resources.py): the interpreter CI runs them in has no shared memory, and
a kernel over the limit fails only on a GPU, at its first launch (the head's GEMM step of 64 hidden
units needed 264-288 KiB of 227; it is 16 now)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNELS = {"_chunk_kernel", "_nbest_kernel"}  # the row pass (1-best, sample, both verifications) and the n-best
# The two quickest to compile (~15 s): the row pass as greedy verification runs it, and the n-best.
# The row pass's other variants (log-probability, race, exclusions) stage the same head GEMM tiles;
# `python tools/kernel_resources.py` compiles them all (3-6 minutes here).
ONLY = "greedy,n-best"

pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend compiles the kernels")


def _check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    tmp_path.mkdir(exist_ok=True)
    out = tmp_path / "resources.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path.parent / "triton-cache")}
    proc = subprocess.run([sys.executable, "tools/kernel_resources.py", "--dtypes", "bfloat16", "--only", ONLY,
                           "--json", str(out), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    return proc, json.loads(out.read_text()) if out.exists() else []


def test_every_fused_kernel_fits_an_h100s_shared_memory_and_the_check_can_fail(tmp_path: Path) -> None:
    proc, results = _check(tmp_path / "h100")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {r["kernel"] for r in results} == KERNELS
    assert all(0 < r["shared_bytes"] <= r["limit_bytes"] == 232_448 for r in results), results
    # The same kernels against a limit below what they need (the compiled kernels are cached by
    # now): the check fails and names them.
    smallest = min(r["shared_bytes"] for r in results)
    proc, results = _check(tmp_path / "small", "--limit-kib", str((smallest - 1024) / 1024))
    assert proc.returncode == 1 and "DOES NOT FIT" in proc.stdout
    assert not any(r["fits"] for r in results)
