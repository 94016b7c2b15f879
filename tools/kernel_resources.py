"""The fused output kernels compiled for a CUDA GPU on a machine without one: each fits the GPU's shared memory.

Triton sizes a kernel's shared memory when it compiles it (the tiles `tl.dot` stages, pipelined
`num_stages` deep, and the reductions' scratch), and a launch on a GPU with less raises
OutOfResources: on a server, at the first request that reaches the kernel. CI has no GPU and runs
the kernels in Triton's interpreter, which has no shared memory, so it cannot see this; compiling
does. This script compiles the variants the engine launches with the largest tiles (64 rows from
hidden states, the fused head, bfloat16 and float32 heads) for a target GPU with Triton's own
compiler (`ptxas` ships in its wheel), through a stand-in driver that compiles and never launches,
and prints each kernel's bytes against the limit. Exit status 1 if one does not fit.

    TRITON_INTERPRET=0 python tools/kernel_resources.py [--arch 90] [--limit-kib K] [--dtypes bfloat16]
        [--only "greedy,n-best"] [--json FILE]

All of them take minutes on a small machine (docs/benchmarks.md, "Figures behind design choices");
the test runs the two quickest, whose tiles are the others' (the same head GEMM step).

It must run in a process of its own: the kernels' modules must be imported with the interpreter off.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Shared memory a block may use, by compute capability (CUDA's "maximum shared memory per block, opt-in").
SHARED_LIMIT = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
ROWS = 64  # the most rows one program takes (kernels/row_pass.py, launch_rows): the largest tiles
HIDDEN, VOCAB = 2048, 4097  # the vocabulary's size changes the grid, not a program's tiles


class _Compiled(Exception):
    """Raised by the stand-in launch once the kernel is compiled: nothing runs."""


def _stand_in_driver(arch: int):
    import torch
    from triton.backends.compiler import GPUTarget

    class CompileOnly:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device=None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

        def is_active(self) -> bool:
            return True

    return CompileOnly()


def launches(dtypes: tuple[str, ...]):
    """(name, call) for each kernel variant, with heads in each of `dtypes`: the public ops on CPU
    tensors, which the stand-in driver compiles for the GPU instead of running."""
    import torch

    from kernels.lm_head import Hidden, OutputHead
    from kernels.random import ACCEPT, SAMPLE, row_keys, uniforms

    argmax = importlib.import_module("kernels.argmax")
    nbest = importlib.import_module("kernels.nbest")
    sample = importlib.import_module("kernels.sample")
    verify = importlib.import_module("kernels.verify")
    speculative = importlib.import_module("kernels.speculative")
    gen = torch.Generator().manual_seed(0)
    out = []
    for dtype in (getattr(torch, name) for name in dtypes):
        head = OutputHead((torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02).to(dtype))
        rows = Hidden(torch.randn(ROWS, HIDDEN, generator=gen).to(dtype), head)
        name = str(dtype).removeprefix("torch.")
        keys = row_keys(range(ROWS), [0] * ROWS, SAMPLE)
        temperature = torch.ones(ROWS)
        batch, gamma = ROWS // 4, 3  # verification: 16 sequences x (3 drafted + 1) positions = 64 rows
        draft = torch.randint(0, VOCAB, (batch, gamma), generator=gen)
        num_draft = torch.full((batch,), gamma)
        q_ids = torch.randint(0, VOCAB, (batch, gamma, 2), generator=gen)
        q_probs = torch.full((batch, gamma, 2), 0.5)
        out += [
            (f"1-best + logprob, {name} head", lambda rows=rows: argmax.best_token(rows, logprob=True)),
            (f"n-best (64), {name} head", lambda rows=rows: nbest.top_scores(rows, nbest.MAX_K)),
            (f"sample, {name} head", lambda rows=rows, keys=keys, t=temperature: sample.sample(rows, t, keys)),
            (f"greedy verify, {name} head", lambda rows=rows, d=draft, n=num_draft: verify.greedy_verify(d, n, rows)),
            (f"speculative verify, {name} head",
             lambda rows=rows, d=draft, n=num_draft, qi=q_ids, qp=q_probs, k=keys: speculative.speculative_verify_fused(
                 rows, qi, qp, d, n, torch.ones(batch), torch.full((batch, gamma + 1), float("-inf")),
                 k.view(batch, gamma + 1), uniforms(range(batch), [0] * batch, gamma, ACCEPT))),
        ]
    return out


def measure(arch: int, limit: int | None, dtypes: tuple[str, ...] = ("bfloat16", "float32"),
            only: tuple[str, ...] = ()) -> list[dict]:
    """Compiles every launch for sm_<arch> (those whose name starts with one of `only`, when given):
    [{variant, kernel, shared bytes, limit, fits}]."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    import kernels.dispatch as dispatch
    from kernels.dispatch import use

    driver.set_active(_stand_in_driver(arch))
    dispatch.interpreting = lambda: True  # let the ops take CPU tensors down the Triton path
    compiled: list[tuple[str, int]] = []
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel.metadata.shared))
        raise _Compiled

    JITFunction.run = compile_only
    results = []
    try:
        for variant, call in launches(dtypes):
            if only and not variant.startswith(only):
                continue
            compiled.clear()
            try:
                with use("triton"):
                    call()
            except _Compiled:
                pass
            kernel, shared = compiled[-1]
            results.append({"variant": variant, "kernel": kernel, "shared_bytes": shared, "limit_bytes": limit,
                            "fits": limit is None or shared <= limit})
            print(f"{variant:40s} {kernel:24s} {shared / 1024:7.1f} KiB of {limit / 1024 if limit else '?'} KiB"
                  f"{'' if results[-1]['fits'] else '  DOES NOT FIT'}", flush=True)
    finally:
        JITFunction.run = launch
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100, H200)")
    parser.add_argument("--limit-kib", type=float, help="shared memory a block may use (default: the arch's)")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="the heads' dtypes (default bfloat16,float32)")
    parser.add_argument("--only", default="", help="comma-separated variant names' beginnings (default: all)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled; run with TRITON_INTERPRET=0")
        return 2
    sys.path.insert(0, str(ROOT))
    limit = int(args.limit_kib * 1024) if args.limit_kib else SHARED_LIMIT.get(args.arch)
    results = measure(args.arch, limit, tuple(args.dtypes.split(",")), tuple(filter(None, args.only.split(","))))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if all(r["fits"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
