"""The `specstream` command line: run the stack or one service, call it, benchmark, train and probe it.

All flags and environment variables are parsed here, in this package, once, into the config
dataclasses of `specstream.data.config`; nothing else reads them. One module per group of
subcommands, each registering its parsers and holding their cmd_* functions:

- serve: `serve` (the whole stack as processes) and `demo`
- services: `target`, `draft`, `gateway` (one service; how the launcher starts each)
- calls: `generate`, `chat`, `health` (a client of a running service)
- train: `train-demo`, `train-draft`
- bench: `bench KIND`, `experiment`
- reliability: `fuzz`, `soak`, `faults`

with the flags several of them share in `flags` (and the model pair's in `pair`). Each group
imports the service or tool it runs inside its cmd_* functions, so that `specstream --help` and
a service's start load only what they use, and the gateway never loads torch.
"""

from __future__ import annotations

import argparse
import sys

from tools.cli import bench, calls, reliability, serve, services, train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specstream", description="Speculative-decoding LLM inference service")
    sub = parser.add_subparsers(dest="command", required=True)
    # In the order `specstream --help` has always listed them.
    serve.register(sub)
    services.register(sub)
    calls.register(sub)
    train.register(sub)
    bench.register(sub)
    reliability.register(sub)
    serve.register_demo(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
