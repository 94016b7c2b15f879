"""Native memory of a long-running model service: the kernel-cache cap and heap trimming
(specstream/serving/native_memory.py)."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from tests.support.hardware import NEEDS_NATIVE_BF16

from specstream.data.config import MemoryConfig
from specstream.serving.native_memory import KERNEL_CACHE_VARIABLES, HeapTrimmer, bound_kernel_caches
from tools.cli import build_parser
from tools.cli.services import _draft_config, _target_config

GLIBC = HeapTrimmer(1.0).available

# A fresh process does bfloat16 matmuls of 300 shapes it has not seen (as decode steps do: the
# keys grow by one each step) and prints how much more malloc'd memory it holds afterwards.
SHAPES = textwrap.dedent("""
    import ctypes, sys, torch
    from specstream.serving.native_memory import bound_kernel_caches
    if sys.argv[1] != "default":
        bound_kernel_caches(int(sys.argv[1]))
    libc = ctypes.CDLL("libc.so.6")
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    libc.mallinfo2.restype = Info
    def used():
        info = libc.mallinfo2()
        return (info.uordblks + info.hblkhd) / 2**20
    torch.set_num_threads(1)
    q = torch.randn(9, 64, dtype=torch.bfloat16)  # [rows, head_dim]
    for keys in range(8, 40):  # warm up: torch's own one-off allocations
        q @ torch.randn(64, keys, dtype=torch.bfloat16)
    before = used()
    for keys in range(40, 340):
        q @ torch.randn(64, keys, dtype=torch.bfloat16)  # [9, keys]
    print(used() - before)
""")


def _grown_mb(capacity: str) -> float:
    out = subprocess.run([sys.executable, "-c", SHAPES, capacity], capture_output=True, text=True, timeout=120,
                         check=True)
    return float(out.stdout.strip())


@NEEDS_NATIVE_BF16
@pytest.mark.skipif(not GLIBC, reason="mallinfo2 and malloc_trim are glibc's")
def test_the_kernel_cache_cap_stops_memory_growing_with_new_shapes():
    default = _grown_mb("default")
    capped = _grown_mb("16")
    # Measured: ~160 MB for 300 shapes with the libraries' 1,024-entry caches, < 1 MB at 16 entries.
    assert default > 50, f"the uncapped caches grew by only {default:.1f} MB: the premise of the cap is gone"
    assert capped < 10, f"capped at 16 entries, 300 new shapes still held {capped:.1f} MB more"


def test_bound_kernel_caches_sets_both_libraries_variables(monkeypatch):
    for name in KERNEL_CACHE_VARIABLES:  # recorded, so the test leaves the environment as it was
        monkeypatch.setenv(name, "1024")
    bound_kernel_caches(32)
    import os
    assert {name: os.environ[name] for name in KERNEL_CACHE_VARIABLES} == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "32", "LRU_CACHE_CAPACITY": "32"}


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_trim_gives_freed_heap_pages_back():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block = 32 * 1024  # below the mmap threshold: these live in the heap
    # 256 MB of touched blocks; all but the last freed, which keeps the heap's top from shrinking,
    # so the free pages stay resident until trimmed (the pattern a forward's temporaries leave).
    blocks = [libc.malloc(block) for _ in range(8192)]
    for address in blocks:
        ctypes.memset(address, 1, block)
    for address in blocks[:-1]:
        libc.free(address)
    before = _rss_mb()
    trimmer = HeapTrimmer(10.0)
    trimmer.trim()
    after = _rss_mb()
    libc.free(blocks[-1])
    assert trimmer.trims == 1 and trimmer.seconds > 0
    assert before - after > 128, f"RSS {before:.0f} MB before the trim, {after:.0f} MB after"


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_the_trimmer_runs_on_the_given_executor_until_cancelled():
    threads: list[str] = []

    class Recording(HeapTrimmer):
        def trim(self) -> None:
            threads.append(threading.current_thread().name)
            super().trim()

    async def main() -> int:
        trimmer = Recording(0.02)
        with ThreadPoolExecutor(1, thread_name_prefix="torch-thread") as executor:
            task = asyncio.create_task(trimmer.run(executor))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        return trimmer.trims

    trims = asyncio.run(main())
    assert trims >= 3
    assert set(threads) == {threads[0]} and threads[0].startswith("torch-thread")


def test_a_zero_interval_never_trims():
    trimmer = HeapTrimmer(0.0)
    with ThreadPoolExecutor(1) as executor:
        asyncio.run(asyncio.wait_for(trimmer.run(executor), timeout=1.0))  # returns at once
    assert trimmer.trims == 0


@pytest.mark.parametrize("field, value", [("kernel_cache_capacity", -1), ("heap_trim_interval_s", -0.5)])
def test_memory_settings_are_validated(field, value):
    with pytest.raises(ValueError, match=f"{field}={value}"):
        MemoryConfig(**{field: value})


def test_the_target_and_draft_commands_take_the_memory_flags():
    flags = ["--kernel-cache-capacity", "8", "--heap-trim-interval", "0"]
    target = _target_config(build_parser().parse_args(["target", "--model", "m", *flags]))
    draft = _draft_config(build_parser().parse_args(["draft", "--model", "m", *flags]))
    assert target.memory == draft.memory == MemoryConfig(kernel_cache_capacity=8, heap_trim_interval_s=0.0)
    default = _target_config(build_parser().parse_args(["target", "--model", "m"])).memory
    assert (default.kernel_cache_capacity, default.heap_trim_interval_s) == (16, 10.0)
