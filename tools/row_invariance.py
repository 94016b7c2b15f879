"""Whether a dense matmul row's bits depend on how many rows share the call, and what a call costs,
under each BLAS setting kernels/linear.py could choose: the figures behind its ``MKL_CBWR`` (float32,
MKL) and ``ONEDNN_MAX_CPU_ISA`` (bfloat16, oneDNN) choices (docs/benchmarks.md, "Figures behind
design choices").

    python tools/row_invariance.py [--json FILE] [--shapes 1536x576,49152x576]

Each setting runs in a process of its own (both libraries read their variable once, at their first
call), on one torch thread, through ``kernels.linear.linear`` (its row padding included): a row
count "differs" when some row of a call with that many rows is not the bits of the same row in a
256-row call. Prints the CPU, a table per dtype, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tools.bench.report import cpu_name

# (dtype, variable, values): "ours" is what kernels/linear.py sets, the rest what it could have left.
SETTINGS = {
    "float32": ("MKL_CBWR", {"MKL default": "AUTO", "ours (strict)": "AUTO,STRICT"}),
    "bfloat16": ("ONEDNN_MAX_CPU_ISA", {"oneDNN default (AMX where present)": "ALL",
                                        "ours (AVX-512 BF16)": "AVX512_CORE_BF16"}),
}
ROWS = (1, 2, 4, 8, 16, 64, 256)


def measure(dtype: str, shapes: list[tuple[int, int]], max_rows: int = 128) -> dict:
    """In this process (its variable already set): per shape, the row counts that differ, and µs a call."""
    import torch

    from kernels.linear import linear

    torch.set_num_threads(1)
    out = {}
    for n, k in shapes:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=gen).to(getattr(torch, dtype))
        x = torch.randn(256, k, generator=gen).to(w.dtype)
        reference = linear(x, w)
        differ = [m for m in range(1, max_rows + 1) if not torch.equal(linear(x[:m], w), reference[:m])]
        cost = {}
        for m in ROWS:
            repeats = max(3, int(2e7 // (n * k * m) + 1))
            linear(x[:m], w)
            started = time.perf_counter()
            for _ in range(repeats):
                linear(x[:m], w)
            cost[m] = (time.perf_counter() - started) / repeats * 1e6
        out[f"{n}x{k}"] = {"rows_that_differ": differ, "us_per_call": cost}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=Path("row_invariance.json"))
    parser.add_argument("--shapes", default="1536x576,49152x576", help="N x K of the weights, comma-separated")
    parser.add_argument("--max-rows", type=int, default=128)
    parser.add_argument("--one", nargs=2, metavar=("DTYPE", "VALUE"), help=argparse.SUPPRESS)  # a child's job
    args = parser.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.one:
        print(json.dumps(measure(args.one[0], shapes, args.max_rows)))
        return 0
    root = Path(__file__).resolve().parent.parent
    results = {"cpu": cpu_name(), "threads": 1, "settings": {}}
    print(f"{results['cpu']}, one torch thread; µs a call at {'/'.join(map(str, ROWS))} rows")
    for dtype, (variable, values) in SETTINGS.items():
        for label, value in values.items():
            env = {**os.environ, variable: value, "PYTHONPATH": str(root)}
            child = subprocess.run([sys.executable, __file__, "--one", dtype, value, "--shapes", args.shapes,
                                    "--max-rows", str(args.max_rows)], env=env, capture_output=True, text=True,
                                   check=True)
            got = json.loads(child.stdout.splitlines()[-1])
            results["settings"][f"{dtype}: {label}"] = {"variable": variable, "value": value, "shapes": got}
            for shape, row in got.items():
                differ = row["rows_that_differ"]
                said = f"{len(differ)} of 1..{args.max_rows} row counts differ" if differ else "no row count differs"
                cost = " / ".join(f"{row['us_per_call'][str(m)]:.0f}" for m in ROWS)
                print(f"  {dtype:8} {label:36} {shape:10} {said:34} {cost}")
    args.json.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
