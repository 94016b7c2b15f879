"""`specstream fuzz`, `soak` and `faults`: the reliability probes of tools/reliability/,
on a stack of their own (started on --models) or, for fuzz and soak, a running gateway
(--gateway). Flags in, a table on stdout and JSON in --out; the probes do the measuring.

The probes are imported inside the cmd_* functions: they start stacks and load what the
benchmarks load, which `specstream --help` and the services' start must not pay for.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from tools.cli.flags import quiet_flag
from tools.cli.pair import bench_models, tool_pair_flags
from tools.reliability import FAULT_SCENARIOS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fuzz", help="seeded fuzzing of the public API (gRPC and HTTP): crashes and wrong codes")
    _reliability_flags(p, "fuzz-results")
    p.add_argument("--cases", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--draft-side", action="store_true",
                   help="fuzz the target with a hostile draft instead (its replies corrupted, a --corrupt fraction "
                        "of them, around the pair's real draft): every answer must equal speculation=off, and "
                        "the target must refuse, per cause, exactly the replies corrupted; --cases requests")
    p.add_argument("--corrupt", type=float, default=0.25, help="with --draft-side: the fraction of replies corrupted")
    quiet_flag(p)
    p.set_defaults(func=cmd_fuzz)

    p = sub.add_parser("soak", help="a bounded load for a set time: memory slope per process, errors, latency drift")
    _reliability_flags(p, "soak-results")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--concurrency", type=int, default=8, help="callers at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=96, help="the most tokens a request asks for")
    p.add_argument("--pid", action="append", default=[],
                   help="with --gateway: NAME=PID of a process to watch (repeatable; default: the stack's own)")
    quiet_flag(p)
    p.set_defaults(func=cmd_soak)

    p = sub.add_parser("faults", help="stage failures on a real stack (hung or killed draft and targets, a maximal "
                                      "prompt) under 8 streams and measure how the service rides them out")
    _reliability_flags(p, "faults-results")
    p.add_argument("--scenarios", default=",".join(FAULT_SCENARIOS),
                   help=f"comma-separated, of {','.join(FAULT_SCENARIOS)} (default all)")
    quiet_flag(p)
    p.set_defaults(func=cmd_faults)


def _reliability_flags(p: argparse.ArgumentParser, out: str) -> None:
    tool_pair_flags(p)
    p.add_argument("--gateway", help="a running gateway's gRPC host:port (default: start a stack on --models)")
    p.add_argument("--http", help="with --gateway: its OpenAI-compatible API's host:port")
    p.add_argument("--out", default=out, help="directory for the JSON results")


def cmd_fuzz(args: argparse.Namespace) -> int:
    from tools.bench.report import table, write_json
    from tools.reliability.fuzz import fuzz
    from tools.reliability.runner import gateway_of

    if args.draft_side:
        return _fuzz_draft_side(args)

    # A stack of its own answers at most 4 tokens, so random bytes that parse stay cheap.
    with gateway_of(None if args.gateway else bench_models(args), args.gateway, args.http,
                    max_new_tokens_limit=4) as where:
        report = asyncio.run(fuzz(where.grpc, where.http, cases=args.cases, seed=args.seed,
                                  concurrency=args.concurrency, quiet=args.quiet))
    rows = [[kind_got.split()[0], kind_got.split()[1], n] for kind_got, n in sorted(report.outcomes.items())]
    print(table(["kind", "answer", "cases"], rows))
    print(f"{report.cases} cases in {report.seconds:.1f} s (seed {report.seed}): {report.crashes} crashes, "
          f"{report.wrong} wrong codes; serving afterwards: {report.serving_after}")
    for example in report.examples:
        print("  ", example)
    write_json(Path(args.out) / "fuzz.json", report.to_dict())
    return 0 if report.crashes == report.wrong == 0 and report.serving_after else 1


def _fuzz_draft_side(args: argparse.Namespace) -> int:
    from tools.bench.report import table, write_json
    from tools.reliability.draft_fuzz import fuzz_draft_side

    if args.gateway:
        print("specstream fuzz: error: --draft-side starts a stack of its own around the hostile draft; --gateway "
              "is not supported", file=sys.stderr)
        return 2
    if not 0.0 < args.corrupt <= 1.0:
        print(f"specstream fuzz: error: --corrupt={args.corrupt}: must be in (0, 1]", file=sys.stderr)
        return 2
    report = fuzz_draft_side(bench_models(args), requests=args.cases, seed=args.seed, rate=args.corrupt,
                             concurrency=args.concurrency, quiet=args.quiet)
    print(table(["cause", "replies corrupted", "refused by the target"],
                [[cause, report.injected.get(cause, 0), report.refused.get(cause, 0)]
                 for cause in sorted({*report.injected, *report.refused})]))
    print(f"{report.requests} requests ({report.sampled} sampled) in {report.seconds:.1f} s (seed {report.seed}), "
          f"{report.replies} draft replies: {report.mismatches} answers differ from speculation=off, "
          f"{report.failures} failed, {report.accepted_tokens} guesses accepted; serving afterwards: "
          f"{report.serving_after}")
    for example in report.examples:
        print("  ", example)
    write_json(Path(args.out) / "fuzz_draft_side.json", report.to_dict())
    return 0 if report.ok else 1


def cmd_soak(args: argparse.Namespace) -> int:
    from tools.bench.report import table, write_json
    from tools.reliability import soak
    from tools.reliability.runner import gateway_of

    watched = dict(item.split("=", 1) for item in args.pid)
    with gateway_of(None if args.gateway else bench_models(args), args.gateway, args.http) as where:
        pids = {name: int(pid) for name, pid in watched.items()} if where.stack is None else \
            {name: proc.pid for name, proc in where.stack.procs.items()}
        report = asyncio.run(soak.soak(where.grpc, pids, args.duration, args.concurrency, args.seed,
                                       max_new_tokens=args.max_new_tokens, quiet=args.quiet))
    print(table(["process", "RSS start MB", "RSS end MB", "slope MB/min (after warm-up)"],
                [[p.name, p.start_mb, p.end_mb, p.slope_mb_per_min] for p in report.processes]))
    print(f"{report.requests} requests, {report.tokens} tokens in {report.seconds:.0f} s at {report.concurrency} "
          f"callers; errors: {report.errors or 0}; latency per token, first third {report.latency_first_ms_per_token:.1f}"
          f" ms, last third {report.latency_last_ms_per_token:.1f} ms ({report.latency_drift:.2f}x)")
    out = Path(args.out)
    write_json(out / "soak.json", report.to_dict())
    soak.plot(out / "soak.png", report)
    return 0 if not report.errors else 1


def cmd_faults(args: argparse.Namespace) -> int:
    from tools.bench.report import write_json
    from tools.reliability.faults import RUNNERS, FaultCheckError

    if args.gateway:
        print("specstream faults: error: it kills and stops processes of its own stacks; --gateway is not "
              "supported", file=sys.stderr)
        return 2
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in RUNNERS]
    if unknown or not chosen:
        print(f"specstream faults: error: --scenarios={args.scenarios!r}: of {','.join(RUNNERS)}", file=sys.stderr)
        return 2
    models, results, failed = bench_models(args), [], False
    for name in chosen:
        print(f"{name} ...", flush=True)
        try:
            result = RUNNERS[name](models, quiet=args.quiet)
        except FaultCheckError as exc:
            result, failed = {"scenario": name, "failed": str(exc)}, True
        results.append(result)
        _print_scenario(result)
    write_json(Path(args.out) / "faults.json", {"models": models.label, "scenarios": results})
    return 1 if failed else 0


def _print_scenario(result: dict) -> None:
    """A scenario's figures on one line, then one line per group of figures (a nested dict)."""
    def shown(items) -> str:
        return ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in items if k != "scenario" and not isinstance(v, dict))

    print("  " + shown(result.items()), flush=True)
    for key, value in result.items():
        if isinstance(value, dict):
            print(f"  {key}: {shown(value.items())}", flush=True)
