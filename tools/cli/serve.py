"""`specstream serve` (gateway, target(s) and draft as OS processes, supervised) and `specstream
demo` (that stack on the default models, asked a few questions). Turns serve's flags into a
launcher `StackSpec`; what each process then does is the launcher's and the services' business.

The launcher and the demo are imported inside the functions that use them: they load gRPC,
which `specstream --help` and the services' start (`python -m tools.cli target`)
need not wait for here.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from specstream.data.config import DraftConfig, RestartPolicy
from tools.certs import write_stack_files
from tools.cli.flags import (
    DTYPES,
    batching_flags,
    fixed_threads_flag,
    gamma_flags,
    http_port_flag,
    int_in,
    grammar_draft_flag,
    proposer_flags,
    weights_flag,
    work_ahead_flags,
)
from tools.cli.pair import chosen_models, chosen_proposer, models_flag


def register(sub: argparse._SubParsersAction) -> None:
    """`serve`; `demo` registers apart (register_demo): `specstream --help` lists it last."""
    p = sub.add_parser("serve", help="start gateway, target and draft as three processes")
    models_flag(p)
    p.add_argument("--target", help="target model: name, .gguf file or checkpoint directory (default: --models)")
    p.add_argument("--draft", help="draft model directory (default: the --models pair's draft)")
    p.add_argument("--no-draft", action="store_true", help="run without a draft service (plain decoding)")
    p.add_argument("--colocate-draft", action="store_true",
                   help="run the draft inside each target process instead of as its own service: no gRPC hop "
                        "per step (faster on one machine); the draft then shares the target's threads")
    proposer_flags(p, model_flag="--draft or the --models pair's", pair=True)
    grammar_draft_flag(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="gateway port (0: pick a free one)")
    http_port_flag(p)
    gamma_flags(p)
    _serve_process_flags(p)
    batching_flags(p)
    p.add_argument("--trace-file", help="all three services append one JSON span per line to this file")
    p.add_argument("--no-supervise", action="store_true",
                   help="do not restart a draft or target that exits (then any service's exit stops them all)")
    p.add_argument("--restart-max-delay", type=float, default=10.0,
                   help="a crashed draft or target is restarted after 0.5 s, doubling per further crash up to "
                        "this many seconds (reset once it stays up 30 s)")
    _serve_security_flags(p)
    p.set_defaults(func=cmd_serve)


def _serve_process_flags(p: argparse.ArgumentParser) -> None:
    """The processes' sizes, precision, threads and logs."""
    p.add_argument("--max-slots", type=int, default=8)
    p.add_argument("--replicas", type=int_in("--replicas", 1, 64), default=1,
                   help="target processes behind the gateway (they share one draft service)")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="default: the --models pair's (auto: bfloat16 where native, else float32)")
    weights_flag(p)
    p.add_argument("--draft-threads", type=int, default=1, help="CPU threads of the draft model (0: one per core)")
    p.add_argument("--target-threads", type=int, default=0, help="CPU threads of the target model (0: one per core)")
    fixed_threads_flag(p, "--target-threads")
    work_ahead_flags(p, "the draft drafts the next round of its chains ahead: the draft service after each reply "
                        "until the next request, a draft in the target (--colocate-draft) on its torch thread during "
                        "a pass's host work; at SCHED_IDLE (idle) or the thread's priority (normal)")
    p.add_argument("--log-dir", help="write each service's log here instead of the terminal")
    p.add_argument("--metrics", action="store_true", help="each service serves Prometheus /metrics on a free port")


def _serve_security_flags(p: argparse.ArgumentParser) -> None:
    sec = p.add_argument_group("security (off by default)")
    sec.add_argument("--tls-dir", metavar="DIR",
                     help="TLS on every hop with DIR's files: mTLS and an internal token between the services "
                          "(each accepts only its caller's certificate), TLS and an API token on the public API "
                          "(gRPC and HTTPS). An empty or missing DIR gets a new CA, certificates and tokens "
                          "(needs the cryptography package); SIGHUP reloads the files in every service")
    sec.add_argument("--client-certs", action="store_true",
                     help="with --tls-dir: the public API also requires a client certificate (DIR/client.crt)")


def cmd_serve(args: argparse.Namespace) -> int:
    from tools.launcher import Stack

    try:
        if args.tls_dir and _ensure_tls_dir(args.tls_dir):
            print(f"wrote a new CA, certificates and tokens into {args.tls_dir}", flush=True)
        spec = _stack_spec(args)
    except (ValueError, RuntimeError) as exc:
        print(f"specstream serve: error: {exc}", file=sys.stderr)
        return 2
    stack = Stack(spec, report=lambda message: print(f"specstream serve: {message}", flush=True))
    stop = {"signal": None}

    def on_signal(signum, frame) -> None:  # noqa: ARG001
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    if spec.security is not None:  # the services reload their files on SIGHUP; pass it on
        signal.signal(signal.SIGHUP, lambda signum, frame: stack.reload())
    try:
        stack.start(should_stop=lambda: stop["signal"] is not None)
    except InterruptedError:
        print(f"stopped during startup: {stack.stop()}", flush=True)
        return 0
    _announce(stack)
    while stop["signal"] is None and stack.serving():
        time.sleep(0.2)
    return _stop(stack, signalled=stop["signal"] is not None)


def _announce(stack) -> None:
    """Where the started stack listens, and how to call it when it is secured."""
    print(f"specstream gateway listening on {stack.gateway_address}", flush=True)
    if stack.http_address:
        print(f"  OpenAI-compatible API: {stack.http_base_url}", flush=True)
    targets = "  ".join(f"{name} {stack.addresses[name]}" for name in stack.target_names)
    print(f"  {targets}  draft {stack.addresses.get('draft', '-')}  (Ctrl-C stops them all)", flush=True)
    if stack.metrics_addresses:
        print("  metrics: " + "  ".join(f"{name} http://{address}/metrics"
                                        for name, address in stack.metrics_addresses.items()), flush=True)
    tls = stack.spec.security
    if tls is not None:
        cert = f" --tls-cert {tls.path('client.crt')} --tls-key {tls.path('client.key')}" if tls.client_certs else ""
        print(f"  TLS on every hop; call with: SPECSTREAM_TOKEN=$(cat {tls.path('api-tokens')}) specstream generate "
              f"--url {stack.gateway_address} --tls-ca {tls.path('ca.crt')}{cert} PROMPT", flush=True)


def _stop(stack, signalled: bool) -> int:
    """Stops every process; serve's exit code: 0 when a signal stopped it, else the gateway's."""
    gateway_exit = stack.supervisor.final_exit if stack.supervisor is not None else None
    codes = stack.stop()
    print(f"stopped: {codes}", flush=True)
    if signalled:
        return 0
    if gateway_exit is not None:  # supervised: only the gateway's exit ends serve, with its code
        return gateway_exit if gateway_exit >= 0 else 128 - gateway_exit  # killed by signal N: 128 + N
    return 1


def _stack_spec(args: argparse.Namespace):
    from tools.launcher import StackSpec

    # The draft's own check of the n-gram range and suffix capacity, here so that it fails before any process starts.
    proposer, ngram_min = chosen_proposer(args)
    DraftConfig(None, proposer="ngram", ngram_max=args.ngram_max, ngram_min=ngram_min,
                suffix_capacity=args.suffix_capacity)
    target, draft, dtype = chosen_models(args)
    draft, proposer = _serve_draft(args, draft, proposer)
    return StackSpec(target_model=target, draft_model=draft, gateway_port=args.port, http_port=args.http_port,
                     host=args.host,
                     gamma=args.gamma, max_gamma=args.max_gamma, gamma_policy=args.gamma_policy,
                     calibrate=not args.no_calibrate, proposer=proposer, ngram_max=args.ngram_max,
                     ngram_min=ngram_min, suffix_capacity=args.suffix_capacity,
                     max_slots=max(args.max_slots, args.max_batch), max_seq_len=args.max_seq_len, dtype=dtype,
                     weights=args.weights, colocate_draft=args.colocate_draft, log_dir=args.log_dir,
                     draft_threads=args.draft_threads, target_threads=args.target_threads,
                     target_replicas=args.replicas, metrics=args.metrics, grammar_draft=not args.no_grammar_draft,
                     extra_target_args=[*_batching_args(args), "--speculative-sampling", args.speculative_sampling,
                                        "--tree-branches", str(args.tree_branches),
                                        *(["--no-forced-tokens"] if args.no_forced_tokens else []),
                                        *(["--draft-early"] if args.draft_early else []),
                                        *(["--fixed-threads"] if args.fixed_threads else [])],
                     extra_draft_args=["--prefix-cache-slots", str(args.prefix_cache_slots)],  # off on both, or on
                     work_ahead=args.work_ahead, work_ahead_outcomes=args.work_ahead_outcomes,
                     trace_file=os.path.abspath(args.trace_file) if args.trace_file else None,
                     security=_serve_security(args),
                     supervise=None if args.no_supervise else RestartPolicy(max_delay_s=args.restart_max_delay))


def _serve_draft(args: argparse.Namespace, draft: str | None, proposer: str) -> tuple[str | None, str]:
    """(the draft model `serve` starts its draft with (None: none), its proposer), from the chosen
    proposer, --draft (given: `draft` is it; else the --models pair's) and --no-draft; ValueError
    naming the flags that clash. --no-draft turns the pair's default proposer off with the draft."""
    if args.no_draft:
        if args.proposer not in (None, "model"):
            raise ValueError(f"--no-draft runs no draft service; --proposer {args.proposer} needs one")
        return None, "model"
    if proposer in DraftConfig.MODEL_FREE:
        if args.draft:
            raise ValueError(f"--draft {args.draft}: --proposer {proposer} uses no draft model")
        return None, proposer  # the pair's draft model is not needed
    if proposer.endswith("+model") and draft is None:
        raise ValueError(f"--proposer {proposer} needs a draft model (--draft)")
    return draft, proposer


def _batching_args(args: argparse.Namespace) -> list[str]:
    """The batching flags again, for `serve` to pass on to its target processes."""
    return ["--policy", args.policy, "--refill-threshold", str(args.refill_threshold), "--max-batch",
            str(args.max_batch), "--row-selection", args.row_selection, "--min-length-slack",
            str(args.min_length_slack), "--max-wait-steps", str(args.max_wait_steps), "--prefill-chunk",
            str(args.prefill_chunk), "--prefix-cache-slots", str(args.prefix_cache_slots)]


def _serve_security(args: argparse.Namespace):
    """The StackSecurity of --tls-dir (None without it); ValueError for --client-certs alone."""
    from tools.launcher import StackSecurity

    if args.tls_dir is None:
        if args.client_certs:
            raise ValueError("--client-certs needs --tls-dir (where the client certificate is)")
        return None
    return StackSecurity(args.tls_dir, client_certs=args.client_certs)


def _ensure_tls_dir(directory: str) -> bool:
    """Writes a CA, certificates and tokens into `directory` when it holds none of the stack's
    files; whether it did. A directory with some of them is left for StackSecurity to report."""
    from tools.launcher import StackSecurity

    if any((Path(directory) / name).exists() for name in StackSecurity.FILES):
        return False
    write_stack_files(directory)
    return True


# --- demo -------------------------------------------------------------------------------------------------

def register_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start the stack on the default models and ask it a few questions")
    models_flag(p)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--gamma", default="auto", type=lambda v: v if v == "auto" else int(v),
                   help="speculation for the 'on' runs: auto (the γ controller, default) or a fixed γ")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from tools.demo import run_demo

    return run_demo(args.models, max_new_tokens=args.max_new_tokens, gamma=args.gamma)
