"""The `specstream` command line: run the stack or one service, and call it.

All flags and environment variables are parsed here, once, into the config dataclasses of
`specstream.data.config`; nothing else reads them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from specstream.tools.launcher import SERVICE_SECURITY_ENV


def _env(name: str) -> str | None:
    """An environment variable's value as a flag default; unset or empty: None."""
    return os.environ.get(name) or None


def _server_flags(p: argparse.ArgumentParser, default_port: int, reflection: bool = False,
                  max_message_bytes: int = 64 * 1024 * 1024) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=default_port)
    p.add_argument("--max-message-bytes", type=int, default=max_message_bytes,
                   help=f"largest message received or sent (default {max_message_bytes >> 20} MiB)")
    p.add_argument("--keepalive-time", type=float, default=30.0, help="seconds between keepalive pings")
    p.add_argument("--keepalive-timeout", type=float, default=10.0)
    p.add_argument("--min-ping-interval", type=float, default=0.5,
                   help="seconds: the shortest interval between a peer's keepalive pings this server accepts "
                        "(shorter: GOAWAY too_many_pings); the gateway pings its targets every second")
    p.add_argument("--grace", type=float, default=5.0, help="seconds in-flight RPCs get on shutdown")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics over HTTP on --host at this port (0: a free one; default: off)")
    p.add_argument("--log-level", default=os.environ.get("SPECSTREAM_LOG_LEVEL", "INFO"))
    p.add_argument("--trace-file", help="append one JSON span per line to this file (OTLP export: the OTEL_* "
                                        "environment variables)")
    sec = p.add_argument_group("security (all off by default; SIGHUP reads the files again for new connections "
                               "and calls; grpc.health.v1 stays open for probes)")
    sec.add_argument("--tls-cert", default=_env("SPECSTREAM_TLS_CERT"), metavar="FILE",
                     help="PEM certificate chain to serve TLS with, with --tls-key (env SPECSTREAM_TLS_CERT); the "
                          "gateway's HTTP API then serves HTTPS with it")
    sec.add_argument("--tls-key", default=_env("SPECSTREAM_TLS_KEY"), metavar="FILE",
                     help="its PEM private key, unencrypted (env SPECSTREAM_TLS_KEY)")
    sec.add_argument("--tls-client-ca", default=_env("SPECSTREAM_TLS_CLIENT_CA"), metavar="FILE",
                     help="mTLS: every caller must present a certificate signed by this PEM CA bundle "
                          "(env SPECSTREAM_TLS_CLIENT_CA)")
    sec.add_argument("--allowed-peers", default=_env("SPECSTREAM_ALLOWED_PEERS"), metavar="NAMES",
                     help="with --tls-client-ca: comma-separated names, one of which a caller's certificate must "
                          "carry as a subject alternative name or common name (env SPECSTREAM_ALLOWED_PEERS)")
    sec.add_argument("--token-file", default=_env("SPECSTREAM_TOKEN_FILE"), metavar="FILE",
                     help="callers must send `authorization: Bearer <token>` with a token of this file (one per "
                          "line, # comments) (env SPECSTREAM_TOKEN_FILE)")
    sec.add_argument("--reflection", action=argparse.BooleanOptionalAction, default=reflection,
                     help=f"serve grpc.reflection (default: {'on' if reflection else 'off'})")


def _upstream_flags(p: argparse.ArgumentParser, upstream: str) -> None:
    """How this service calls the `upstream` service (gateway -> target, target -> draft)."""
    env = f"SPECSTREAM_{upstream.upper()}_"
    sec = p.add_argument_group(f"security towards the {upstream} (off by default; read at start)")
    sec.add_argument(f"--{upstream}-tls-ca", default=_env(env + "TLS_CA"), metavar="FILE",
                     help=f"TLS to the {upstream}: its certificate must chain to this PEM CA bundle "
                          f"(env {env}TLS_CA)")
    sec.add_argument(f"--{upstream}-tls-cert", default=_env(env + "TLS_CERT"), metavar="FILE",
                     help=f"mTLS: the PEM certificate to present to the {upstream} (env {env}TLS_CERT)")
    sec.add_argument(f"--{upstream}-tls-key", default=_env(env + "TLS_KEY"), metavar="FILE",
                     help=f"its PEM private key (env {env}TLS_KEY)")
    sec.add_argument(f"--{upstream}-server-name", default=_env(env + "SERVER_NAME"), metavar="NAME",
                     help=f"the name the {upstream}'s certificate must carry, where its address is one no "
                          f"certificate names, e.g. a pod IP (env {env}SERVER_NAME)")
    sec.add_argument(f"--{upstream}-token-file", default=_env(env + "TOKEN_FILE"), metavar="FILE",
                     help=f"send the first token of this file to the {upstream} (env {env}TOKEN_FILE)")


def _channel_security(args: argparse.Namespace, upstream: str):
    from specstream.data.config import ChannelSecurity

    def get(name: str) -> str | None:
        return getattr(args, f"{upstream}_{name}")

    return ChannelSecurity(label=f"{upstream}_security", ca_file=get("tls_ca"), cert_file=get("tls_cert"),
                           key_file=get("tls_key"), server_name=get("server_name"), token_file=get("token_file"))


def _weights_flag(p: argparse.ArgumentParser) -> None:
    from specstream.data.config import WEIGHT_FORMATS

    p.add_argument("--weights", default="auto", choices=WEIGHT_FORMATS,
                   help="int4: serve a GGUF file's Q4_0/Q4_1 matrices as 4-bit blocks (CPU); dense: dequantize "
                        "them to --dtype; int4-rtn: round a dense model to 4 bits at load (drafts only); auto: on a "
                        "CPU in bfloat16, int4 where the model has 4-bit blocks, int4-rtn for a draft, else dense")


def _model_flags(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required,
                   help="a model name (smollm2), a .gguf file or a Hugging Face checkpoint directory")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 where the device computes it natively, else float32")
    _weights_flag(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0, help="CPU threads for the model (0: one per core)")


def _memory_flags(p: argparse.ArgumentParser) -> None:
    from specstream.data.config import MemoryConfig

    p.add_argument("--kernel-cache-capacity", type=int, default=MemoryConfig.kernel_cache_capacity,
                   help="entries kept by oneDNN's and ideep's shape-keyed kernel caches (their default, 1024, "
                        "grows a long-running CPU service's memory for minutes)")
    p.add_argument("--heap-trim-interval", type=float, default=MemoryConfig.heap_trim_interval_s,
                   help="seconds between handing the heap's free pages back to the system (glibc "
                        "malloc_trim, on the torch thread); 0: never")


def _memory_config(args: argparse.Namespace):
    from specstream.data.config import MemoryConfig

    return MemoryConfig(kernel_cache_capacity=args.kernel_cache_capacity,
                        heap_trim_interval_s=args.heap_trim_interval)


def _server_config(args: argparse.Namespace):
    from specstream.data.config import ServerConfig, ServerSecurity

    peers = tuple(name.strip() for name in (args.allowed_peers or "").split(",") if name.strip())
    security = ServerSecurity(cert_file=args.tls_cert, key_file=args.tls_key, client_ca_file=args.tls_client_ca,
                              allowed_peers=peers, token_file=args.token_file)
    return ServerConfig(host=args.host, port=args.port, max_message_bytes=args.max_message_bytes,
                        keepalive_time_s=args.keepalive_time, keepalive_timeout_s=args.keepalive_timeout,
                        min_ping_interval_s=args.min_ping_interval, grace_s=args.grace,
                        metrics_port=args.metrics_port, security=security, reflection=args.reflection)


def _run_service(args: argparse.Namespace, coro_factory) -> int:
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {args.command} %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # uvloop is optional (e.g. on Windows)
        pass
    from specstream.serving import telemetry

    telemetry.configure(f"specstream-{args.command}", args.trace_file)
    try:
        asyncio.run(coro_factory())
    finally:
        telemetry.shutdown()  # after the server stopped: the last spans are flushed
    return 0


def _colocated_draft(args: argparse.Namespace):
    """The DraftConfig of a draft run inside the target (--draft-model, or --proposer other than
    model), or None; ValueError when it clashes with --draft-url."""
    from specstream.data.config import DraftConfig, ModelSpec

    if not args.draft_model and args.proposer == "model":
        return None
    if args.draft_url:
        raise ValueError(f"--draft-url {args.draft_url}: the draft runs at --draft-url or in this process "
                         "(--draft-model, --proposer), not both")
    model = ModelSpec(args.draft_model, args.dtype, args.device) if args.draft_model else None
    return DraftConfig(model=model, proposer=args.proposer, ngram_max=args.ngram_max, ngram_min=args.ngram_min,
                       max_slots=max(args.max_slots, args.max_batch), max_seq_len=args.max_seq_len)


def _target_config(args: argparse.Namespace):
    from specstream.data.config import ModelSpec, TargetConfig

    return TargetConfig(model=ModelSpec(args.model, args.dtype, args.device, args.weights), server=_server_config(args),
                        max_slots=max(args.max_slots, args.max_batch), max_seq_len=args.max_seq_len,
                        default_gamma=args.gamma, max_gamma=args.max_gamma, gamma_policy=args.gamma_policy,
                        speculative_sampling=args.speculative_sampling,
                        calibrate=not args.no_calibrate, draft_url=args.draft_url,
                        draft_timeout_s=args.draft_timeout, draft_deadline_floor_s=args.draft_deadline_floor,
                        draft_deadline_factor=args.draft_deadline_factor, draft_retry_s=args.draft_retry,
                        torch_threads=args.threads, memory=_memory_config(args),
                        colocated_draft=_colocated_draft(args), draft_security=_channel_security(args, "draft"),
                        **_batching_config(args))


def cmd_target(args: argparse.Namespace) -> int:
    from draft_service.build import build_proposer
    from target_service.server import serve

    try:
        config = _target_config(args)
    except ValueError as exc:
        print(f"specstream target: error: {exc}", file=sys.stderr)
        return 2
    return _run_service(args, lambda: serve(config, build_proposer))


def _gamma_flags(p: argparse.ArgumentParser) -> None:
    """The target's speculation settings (γ: target_service/gamma.py; verification of sampled
    proposals: target_service/settle.py); `serve` passes them on to its targets."""
    from specstream.data.config import GAMMA_POLICIES, SPECULATIVE_SAMPLING, TargetConfig

    p.add_argument("--gamma-policy", choices=GAMMA_POLICIES, default=TargetConfig.gamma_policy,
                   help="how γ is chosen for requests with speculation=auto: goodput: per sequence and step, the "
                        "γ that maximises the batch's expected tokens per second from measured acceptance and "
                        "costs; fixed: always --gamma; hf: Hugging Face's heuristic (start at 5, +2 after a fully "
                        "accepted step, -1 otherwise); leviathan: per sequence, the batch-1 optimum of Leviathan "
                        "et al.")
    p.add_argument("--gamma", type=int, default=TargetConfig.default_gamma,
                   help="speculation=auto's γ under --gamma-policy fixed, and under goodput and leviathan until "
                        "the first step is measured")
    p.add_argument("--max-gamma", type=int, default=TargetConfig.max_gamma,
                   help="the largest γ a request may ask for (a fixed γ, or generate/chat --max-gamma), and "
                        "the controller may pick")
    p.add_argument("--no-calibrate", action="store_true",
                   help="do not time verify forwards of each step shape at start-up (the controller then learns "
                        "its verify costs from the first requests)")
    p.add_argument("--speculative-sampling", choices=SPECULATIVE_SAMPLING, default=TargetConfig.speculative_sampling,
                   help="how sampled proposals are verified: leviathan: accept with min(1, p/q), else sample the "
                        "residual (most tokens per pass); coupled: accept a proposal iff it is the target's own "
                        "sample, so a seed gives exactly the text of plain sampling whatever gamma, the draft or "
                        "a resubmission of the request (fewer accepted proposals)")


def _batching_flags(p: argparse.ArgumentParser) -> None:
    """Batching policy of the target engine (design §4; target_service/scheduler.py)."""
    p.add_argument("--policy", choices=["static", "topup"], default="topup",
                   help="static: fill a batch and run it to completion; topup: refill freed slots")
    p.add_argument("--refill-threshold", type=float, default=1.0,
                   help="topup's epsilon: refill once running <= epsilon * max-batch (1: every step)")
    p.add_argument("--max-batch", type=int, default=0,
                   help="rows expanded per step (0: --max-slots); a larger value raises --max-slots to match")
    p.add_argument("--row-selection", choices=["all", "min_length", "fifo"], default="all")
    p.add_argument("--min-length-slack", type=int, default=0)
    p.add_argument("--max-wait-steps", type=int, default=8, help="starvation bound for row selection")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens prefilled per step")


def _batching_args(args: argparse.Namespace) -> list[str]:
    """The batching flags again, for `serve` to pass on to its target processes."""
    return ["--policy", args.policy, "--refill-threshold", str(args.refill_threshold), "--max-batch",
            str(args.max_batch), "--row-selection", args.row_selection, "--min-length-slack",
            str(args.min_length_slack), "--max-wait-steps", str(args.max_wait_steps), "--prefill-chunk",
            str(args.prefill_chunk)]


def _batching_config(args: argparse.Namespace) -> dict:
    return dict(policy=args.policy, refill_threshold=args.refill_threshold, max_batch=args.max_batch,
                row_selection=args.row_selection, min_length_slack=args.min_length_slack,
                max_wait_steps=args.max_wait_steps, prefill_chunk=args.prefill_chunk)


def _draft_config(args: argparse.Namespace):
    from specstream.data.config import DraftConfig, ModelSpec

    model = ModelSpec(args.model, args.dtype, args.device, args.weights) if args.model else None
    return DraftConfig(model=model, server=_server_config(args), max_slots=args.max_slots,
                       max_seq_len=args.max_seq_len, torch_threads=args.threads, q_support=args.q_support,
                       memory=_memory_config(args),
                       synthetic_oracle=args.synthetic_oracle, synthetic_alpha=args.synthetic_alpha,
                       proposer=args.proposer, ngram_max=args.ngram_max, ngram_min=args.ngram_min)


def cmd_draft(args: argparse.Namespace) -> int:
    from draft_service.server import serve

    try:
        config = _draft_config(args)
    except ValueError as exc:
        print(f"specstream draft: error: {exc}", file=sys.stderr)
        return 2
    return _run_service(args, lambda: serve(config))


def _proposer_flags(p: argparse.ArgumentParser, model_flag: str, pair: bool = False) -> None:
    """What the draft service proposes with; `serve` passes them on to its draft. With ``pair``
    (commands that take --models) --proposer and --ngram-min default to the pair's: _chosen_proposer."""
    from specstream.data.config import DraftConfig

    p.add_argument("--proposer", default=None if pair else DraftConfig.proposer, choices=DraftConfig.PROPOSERS,
                   help=f"model: the draft model ({model_flag}); ngram: prompt lookup, copying what followed the "
                        "latest earlier occurrence of the last n tokens (no model); ngram+model: n-grams where "
                        "they match, the model elsewhere" + (" (default: the --models pair's)" if pair else ""))
    p.add_argument("--ngram-max", type=int, default=DraftConfig.ngram_max, help="prompt lookup tries n from this ...")
    p.add_argument("--ngram-min", type=int, default=None if pair else DraftConfig.ngram_min,
                   help="... down to this" + (f" (default: the --models pair's with its proposer, else "
                                              f"{DraftConfig.ngram_min})" if pair else ""))


def _chosen_proposer(args: argparse.Namespace) -> tuple[str, int]:
    """(proposer, ngram_min) from --proposer/--ngram-min, filled from the --models pair where not
    given (when --target is, from DraftConfig's defaults). The pair's ngram_min goes with its
    proposer only: another proposer asked for by name gets DraftConfig's."""
    from specstream.data.config import DraftConfig
    from specstream.models.registry import PAIRS

    pair = PAIRS[args.models] if args.target is None else None
    proposer = args.proposer or (pair.proposer if pair else DraftConfig.proposer)
    if args.ngram_min is not None:
        return proposer, args.ngram_min
    return proposer, pair.ngram_min if pair and proposer == pair.proposer else DraftConfig.ngram_min


def _gateway_config(args: argparse.Namespace):
    from specstream.data.config import GatewayConfig, StallConfig

    # --target-url is repeatable and each may be a comma-separated list.
    urls = [url.strip() for flag in args.target_url for url in flag.split(",") if url.strip()]
    return GatewayConfig(target_url=urls[0] if urls else "", target_urls=urls[1:], tokenizer_path=args.tokenizer,
                         server=_server_config(args), max_new_tokens_limit=args.max_new_tokens_limit,
                         max_in_flight=args.max_in_flight, max_queue=args.max_queue,
                         replica_backlog=args.replica_backlog, max_messages=args.max_messages,
                         max_prompt_chars=args.max_prompt_chars, tokenize_threads=args.tokenize_threads,
                         expose_replica_addresses=args.expose_replica_addresses,
                         http_port=args.http_port, target_keepalive_time_s=args.target_keepalive_time,
                         target_keepalive_timeout_s=args.target_keepalive_timeout,
                         stall=StallConfig(floor_s=args.target_stall_floor, ceiling_s=args.target_stall_timeout),
                         target_resolve_interval_s=args.target_resolve_interval,
                         target_security=_channel_security(args, "target"))


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.server import serve

    try:
        config = _gateway_config(args)
    except ValueError as exc:
        print(f"specstream gateway: error: {exc}", file=sys.stderr)
        return 2
    return _run_service(args, lambda: serve(config))


def _models_flag(p: argparse.ArgumentParser) -> None:
    from specstream.models.registry import DEFAULT_PAIR, PAIRS

    p.add_argument("--models", choices=sorted(PAIRS), default=DEFAULT_PAIR,
                   help="named target + draft pair: " + "; ".join(f"{k}: {v.about}" for k, v in PAIRS.items()))


def _chosen_models(args: argparse.Namespace) -> tuple[str, str | None, str]:
    """--target/--draft/--dtype, filled from the --models pair where not given."""
    from specstream.models.registry import pair_refs

    if args.target is None:
        target, draft, dtype = pair_refs(args.models)
        draft = args.draft or draft
    else:
        target, draft, dtype = args.target, args.draft, "auto"
    return target, draft, args.dtype or dtype


def _serve_draft(args: argparse.Namespace, draft: str | None, proposer: str) -> tuple[str | None, str]:
    """(the draft model `serve` starts its draft with (None: none), its proposer), from the chosen
    proposer, --draft (given: `draft` is it; else the --models pair's) and --no-draft; ValueError
    naming the flags that clash. --no-draft turns the pair's default proposer off with the draft."""
    if args.no_draft:
        if args.proposer not in (None, "model"):
            raise ValueError(f"--no-draft runs no draft service; --proposer {args.proposer} needs one")
        return None, "model"
    if proposer == "ngram":
        if args.draft:
            raise ValueError(f"--draft {args.draft}: --proposer ngram uses no draft model")
        return None, proposer  # the pair's draft model is not needed
    if proposer == "ngram+model" and draft is None:
        raise ValueError("--proposer ngram+model needs a draft model (--draft)")
    return draft, proposer


def _stack_spec(args: argparse.Namespace):
    from specstream.data.config import DraftConfig, RestartPolicy
    from specstream.tools.launcher import StackSpec

    # The draft's own check of the n-gram range, here so that it fails before any process starts.
    proposer, ngram_min = _chosen_proposer(args)
    DraftConfig(None, proposer="ngram", ngram_max=args.ngram_max, ngram_min=ngram_min)
    target, draft, dtype = _chosen_models(args)
    draft, proposer = _serve_draft(args, draft, proposer)
    return StackSpec(target_model=target, draft_model=draft, gateway_port=args.port, http_port=args.http_port,
                     host=args.host,
                     gamma=args.gamma, max_gamma=args.max_gamma, gamma_policy=args.gamma_policy,
                     calibrate=not args.no_calibrate, proposer=proposer, ngram_max=args.ngram_max,
                     ngram_min=ngram_min,
                     max_slots=max(args.max_slots, args.max_batch), max_seq_len=args.max_seq_len, dtype=dtype,
                     weights=args.weights, colocate_draft=args.colocate_draft, log_dir=args.log_dir,
                     draft_threads=args.draft_threads, target_threads=args.target_threads,
                     target_replicas=args.replicas, metrics=args.metrics,
                     extra_target_args=[*_batching_args(args), "--speculative-sampling", args.speculative_sampling],
                     trace_file=os.path.abspath(args.trace_file) if args.trace_file else None,
                     security=_serve_security(args),
                     supervise=None if args.no_supervise else RestartPolicy(max_delay_s=args.restart_max_delay))


def _serve_security(args: argparse.Namespace):
    """The StackSecurity of --tls-dir (None without it); ValueError for --client-certs alone."""
    from specstream.tools.launcher import StackSecurity

    if args.tls_dir is None:
        if args.client_certs:
            raise ValueError("--client-certs needs --tls-dir (where the client certificate is)")
        return None
    return StackSecurity(args.tls_dir, client_certs=args.client_certs)


def _ensure_tls_dir(directory: str) -> bool:
    """Writes a CA, certificates and tokens into `directory` when it holds none of the stack's
    files; whether it did. A directory with some of them is left for StackSecurity to report."""
    from specstream.tools.launcher import StackSecurity

    if any((Path(directory) / name).exists() for name in StackSecurity.FILES):
        return False
    from specstream.tools.certs import write_stack_files

    write_stack_files(directory)
    return True


def cmd_serve(args: argparse.Namespace) -> int:
    from specstream.tools.launcher import Stack

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
    print(f"specstream gateway listening on {stack.gateway_address}", flush=True)
    if stack.http_address:
        print(f"  OpenAI-compatible API: {stack.http_base_url}", flush=True)
    targets = "  ".join(f"{name} {stack.addresses[name]}" for name in stack.target_names)
    print(f"  {targets}  draft {stack.addresses.get('draft', '-')}  (Ctrl-C stops them all)", flush=True)
    if stack.metrics_addresses:
        print("  metrics: " + "  ".join(f"{name} http://{address}/metrics"
                                        for name, address in stack.metrics_addresses.items()), flush=True)
    if spec.security is not None:
        tls = spec.security
        cert = f" --tls-cert {tls.path('client.crt')} --tls-key {tls.path('client.key')}" if tls.client_certs else ""
        print(f"  TLS on every hop; call with: SPECSTREAM_TOKEN=$(cat {tls.path('api-tokens')}) specstream generate "
              f"--url {stack.gateway_address} --tls-ca {tls.path('ca.crt')}{cert} PROMPT", flush=True)
    while stop["signal"] is None and stack.serving():
        time.sleep(0.2)
    gateway_exit = stack.supervisor.final_exit if stack.supervisor is not None else None
    codes = stack.stop()
    print(f"stopped: {codes}", flush=True)
    if stop["signal"] is not None:
        return 0
    if gateway_exit is not None:  # supervised: only the gateway's exit ends serve, with its code
        return gateway_exit if gateway_exit >= 0 else 128 - gateway_exit  # killed by signal N: 128 + N
    return 1


def _speculation(value: str) -> str | int:
    if value in ("auto", "off"):
        return value
    try:
        gamma = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gamma={value!r}: use auto, off or an integer") from None
    if gamma < 0:
        raise argparse.ArgumentTypeError(f"--gamma={value!r}: must be >= 0")
    return "off" if gamma == 0 else gamma


def _int_in(flag: str, lo: int, hi: int):
    """An argparse type: an integer in lo..hi, or a usage error naming the flag."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}={value!r}: must be an integer") from None
        if not lo <= number <= hi:
            raise argparse.ArgumentTypeError(f"{flag}={value!r}: must be in {lo}..{hi}")
        return number

    return parse


def cmd_generate(args: argparse.Namespace) -> int:
    return _call(args, None)


def cmd_chat(args: argparse.Namespace) -> int:
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    return _call(args, messages)


def _call(args: argparse.Namespace, messages: list[dict[str, str]] | None) -> int:
    """One generate (messages None) or chat call with the shared flags; prints text or JSON."""
    from specstream_client import Client, SpecstreamError

    if args.max_gamma is not None and args.gamma != "auto":
        print(f"error: --max-gamma {args.max_gamma} caps automatic speculation and needs --gamma auto "
              f"(got --gamma {args.gamma})", file=sys.stderr)
        return 2
    beam_flags = [flag for flag, value in _beam_flags(args) if value is not None]
    if beam_flags and args.num_beams is None:
        print(f"error: {', '.join(beam_flags)} set beam search options and need --num-beams K", file=sys.stderr)
        return 2
    # Ranges of temperature / top-p are the server's to check; its error names the field.
    kwargs = dict(max_new_tokens=args.max_new_tokens, speculation=args.gamma, max_gamma=args.max_gamma,
                  stop=args.stop or None, timeout=args.timeout, ignore_eos=args.ignore_eos,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                  logprobs=args.logprobs is not None, top_logprobs=args.logprobs or 0,
                  num_beams=args.num_beams, num_return_sequences=args.num_return, length_penalty=args.length_penalty,
                  early_stopping=args.early_stopping, beam_threshold=args.beam_threshold,
                  max_candidates_per_parent=args.max_candidates_per_parent)
    sampled = args.temperature > 0
    try:
        client = Client(args.url, **_client_credentials(args))
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        with client:
            if args.stream:
                last = None
                stream = client.generate_stream(args.prompt, **kwargs) if messages is None \
                    else client.chat_stream(messages, **kwargs)
                for chunk in stream:
                    if args.json:
                        print(json.dumps(chunk.to_dict()), flush=True)
                    elif not chunk.sequences:  # a beam's one chunk is printed as its n-best list
                        print(chunk.text, end="", flush=True)
                    last = chunk
                if not args.json:
                    if last is not None and last.sequences:
                        _print_beams(last.sequences)
                    else:
                        print()
                    if last is not None and last.stats is not None:
                        _print_stats(last.stats, last.usage, last.timings, last.seed if sampled else None)
                return 0
            result = client.generate(args.prompt, **kwargs) if messages is None else client.chat(messages, **kwargs)
    except SpecstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    elif result.sequences:
        _print_beams(result.sequences)
        _print_stats(result.stats, result.usage, result.timings)
    else:
        print(result.text)
        _print_stats(result.stats, result.usage, result.timings, result.seed if sampled else None)
    return 0


def _beam_flags(args: argparse.Namespace) -> list[tuple[str, object]]:
    """The beam-search flags other than --num-beams, with their values (None: not given)."""
    return [("--num-return", args.num_return), ("--length-penalty", args.length_penalty),
            ("--early-stopping", args.early_stopping), ("--beam-threshold", args.beam_threshold),
            ("--max-candidates-per-parent", args.max_candidates_per_parent)]


def _print_beams(sequences) -> None:
    """The n best hypotheses, best first: rank, score, finish reason, then the text (indented)."""
    for rank, seq in enumerate(sequences, 1):
        print(f"#{rank}  score {seq.score:.4f}  logprob {seq.logprob:.3f}  {len(seq.token_ids)} tokens  "
              f"{seq.finish_reason}")
        print("    " + seq.text.replace("\n", "\n    "))


def _print_stats(stats, usage, timings, seed: int | None = None) -> None:
    tps = usage.completion_tokens / timings.total_seconds if timings.total_seconds else 0.0
    print(f"-- {usage.completion_tokens} tokens in {timings.total_seconds:.3f}s ({tps:.1f} tok/s); "
          f"draft proposed {stats.draft_tokens}, accepted {stats.accepted_tokens}; "
          f"{stats.target_passes} target passes, mean accepted length {stats.mean_accepted_length:.2f}"
          + (f"; {stats.beam_expansions} beam expansions" if stats.beam_expansions else "")
          + (f"; seed {seed}" if seed is not None else ""), file=sys.stderr)


def cmd_demo(args: argparse.Namespace) -> int:
    from specstream.tools.demo import run_demo

    return run_demo(args.models, max_new_tokens=args.max_new_tokens, gamma=args.gamma)


def cmd_train_demo(args: argparse.Namespace) -> int:
    from specstream.tools.train_demo import DEMO_DIR, TrainConfig, main

    cfg = TrainConfig(target_steps=args.target_steps, draft_steps=args.draft_steps, threads=args.threads)
    return main(Path(args.out) if args.out else DEMO_DIR, cfg, tuple(args.stage or ["all"]))


def cmd_train_draft(args: argparse.Namespace) -> int:
    from specstream.tools.distill.pipeline import DistillConfig, main
    from specstream.models.cache import models_home
    from specstream.models.registry import DRAFTS, resolve_model

    cfg = DistillConfig(threads=args.threads, rebuild_prompts=args.rebuild_prompts)
    work = Path(args.work_dir) if args.work_dir else models_home() / "distill" / "smollm2-135m-draft"
    out = Path(args.out) if args.out else DRAFTS / "smollm2-135m-draft"
    return main(resolve_model("smollm2"), out, work, cfg, tuple(args.stage or ["all"]))


def bench_models(args: argparse.Namespace):
    """The benchmarked pair from --models/--target/--draft/--dtype (specstream.tools.bench.models)."""
    from specstream.tools.bench.models import BenchModels

    target, draft, dtype = _chosen_models(args)
    proposer, ngram_min = _chosen_proposer(args)
    return BenchModels.from_refs(target, draft, dtype, args.models if args.target is None else Path(target).name,
                                 weights=args.weights, proposer=proposer, ngram_max=args.ngram_max, ngram_min=ngram_min)


def _reliability_flags(p: argparse.ArgumentParser, out: str) -> None:
    _models_flag(p)
    p.add_argument("--target", help="target model: name, .gguf file or directory (default: --models)")
    p.add_argument("--draft", help="draft model directory (default: the --models pair's draft)")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    _weights_flag(p)
    _proposer_flags(p, model_flag="--draft or the --models pair's", pair=True)
    p.add_argument("--gateway", help="a running gateway's gRPC host:port (default: start a stack on --models)")
    p.add_argument("--http", help="with --gateway: its OpenAI-compatible API's host:port")
    p.add_argument("--out", default=out, help="directory for the JSON results")


def cmd_fuzz(args: argparse.Namespace) -> int:
    import asyncio

    from specstream.tools.bench.report import table, write_json
    from specstream.tools.reliability.fuzz import fuzz
    from specstream.tools.reliability.runner import gateway_of

    # A stack of its own answers at most 4 tokens, so random bytes that parse stay cheap.
    with gateway_of(None if args.gateway else bench_models(args), args.gateway, args.http,
                    max_new_tokens_limit=4) as where:
        report = asyncio.run(fuzz(where.grpc, where.http, cases=args.cases, seed=args.seed,
                                  concurrency=args.concurrency))
    rows = [[kind_got.split()[0], kind_got.split()[1], n] for kind_got, n in sorted(report.outcomes.items())]
    print(table(["kind", "answer", "cases"], rows))
    print(f"{report.cases} cases in {report.seconds:.1f} s (seed {report.seed}): {report.crashes} crashes, "
          f"{report.wrong} wrong codes; serving afterwards: {report.serving_after}")
    for example in report.examples:
        print("  ", example)
    write_json(Path(args.out) / "fuzz.json", report.to_dict())
    return 0 if report.crashes == report.wrong == 0 and report.serving_after else 1


def cmd_soak(args: argparse.Namespace) -> int:
    import asyncio

    from specstream.tools.bench.report import table, write_json
    from specstream.tools.reliability import soak
    from specstream.tools.reliability.runner import gateway_of

    watched = dict(item.split("=", 1) for item in args.pid)
    with gateway_of(None if args.gateway else bench_models(args), args.gateway, args.http) as where:
        pids = {name: int(pid) for name, pid in watched.items()} if where.stack is None else \
            {name: proc.pid for name, proc in where.stack.procs.items()}
        report = asyncio.run(soak.soak(where.grpc, pids, args.duration, args.concurrency, args.seed,
                                       max_new_tokens=args.max_new_tokens))
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
    from specstream.tools.bench.report import write_json
    from specstream.tools.reliability.faults import RUNNERS, FaultCheckError

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
            result = RUNNERS[name](models)
        except FaultCheckError as exc:
            result, failed = {"scenario": name, "failed": str(exc)}, True
        results.append(result)
        shown = lambda items: ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"  # noqa: E731
                                        for k, v in items if k != "scenario" and not isinstance(v, dict))
        print("  " + shown(result.items()), flush=True)
        for key, value in result.items():
            if isinstance(value, dict):
                print(f"  {key}: {shown(value.items())}", flush=True)
    write_json(Path(args.out) / "faults.json", {"models": models.label, "scenarios": results})
    return 1 if failed else 0


def cmd_experiment(args: argparse.Namespace) -> int:
    from specstream.tools import experiment

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    experiment.run(bench_models(args), out, workload=args.workload, max_slots=args.max_slots)
    return 0


def _fronts(value: str) -> tuple[str, ...]:
    """An argparse type for `bench throughput --fronts`: comma-separated, of grpc,http, each once."""
    fronts = tuple(v.strip() for v in value.split(",") if v.strip())
    if not fronts or any(f not in ("grpc", "http") for f in fronts) or len(set(fronts)) != len(fronts):
        raise argparse.ArgumentTypeError(f"--fronts={value!r}: comma-separated, of grpc,http, each at most once")
    return fronts


def cmd_bench(args: argparse.Namespace) -> int:
    if args.kind == "kernels":
        from specstream.tools.bench import kernels as kernel_bench

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        ints = lambda text: tuple(int(v) for v in text.split(",")) if text else None  # noqa: E731
        kernel_bench.run(out, args.device, vocabs=ints(args.vocabs) or kernel_bench.VOCABS, rows=ints(args.rows),
                         hiddens=ints(args.hidden_sizes), models=None if args.no_model else bench_models(args))
        return 0
    if args.kind == "beam":
        from specstream.tools.bench import beam

        ks = tuple(int(k) for k in args.num_beams.split(",")) if args.num_beams else (5, 10)
        epsilons = tuple(float(e) for e in args.epsilons.split(",")) if args.epsilons else (1 / 6, 1 / 3, 1 / 2)
        beam.run(bench_models(args), Path(args.out), ks=ks, n_requests=args.prompts or 24,
                 max_new=args.max_new_tokens or 48, threshold=args.beam_threshold, epsilons=epsilons,
                 peer=not args.no_hf, repeats=args.repeats)
        return 0
    if args.kind != "gamma":
        args.prompts = args.prompts or 8
        args.max_new_tokens = args.max_new_tokens or 128
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gammas = [int(g) for g in args.gammas.split(",")] if args.gammas else None
    if args.kind == "latency":
        from specstream.tools.bench import latency

        latency.run(bench_models(args), out, n_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                    gammas=gammas, with_hf=not args.no_hf)
    elif args.kind == "sampling":
        from specstream.tools.bench import sampling

        temperatures = [float(t) for t in args.temperatures.split(",")] if args.temperatures else None
        sampling.run(bench_models(args), out, n_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                     temperatures=temperatures, gammas=gammas, with_hf=not args.no_hf)
    elif args.kind == "profile":
        from specstream.tools.bench import profile

        profile.run(bench_models(args), out)
    elif args.kind == "gamma":
        from specstream.tools.bench import gamma

        gamma.run(bench_models(args), out, [int(n) for n in (args.batch_sizes or "1,8,32").split(",")],
                  n_prompts=args.prompts or 4, max_new_tokens=args.max_new_tokens or 48,
                  names=args.workloads.split(",") if args.workloads else None,
                  fixed=tuple(gammas) if gammas else gamma.FIXED_GAMMAS,
                  proposers=tuple(args.proposers.split(",")) if args.proposers else gamma.PROPOSERS,
                  repeats=args.repeats)
    elif args.kind == "throughput":
        from specstream.tools.bench import throughput

        settings = throughput.default_settings()
        if args.gammas:
            settings = [s for s in settings if str(s.gamma) in args.gammas.split(",")]
        if args.batch_sizes:
            settings = [s for s in settings if str(s.n) in args.batch_sizes.split(",")]
        if args.policies:
            settings = [s for s in settings if s.policy_name in args.policies.split(",")]
        throughput.run(bench_models(args), out, kinds=(args.workloads or "short").split(","), settings=settings,
                       count=args.requests, fronts=args.fronts, repeats=args.repeats)
    else:
        from specstream.tools.bench import synthetic

        alphas = [float(a) for a in args.alphas.split(",")] if args.alphas else None
        # The synthetic target is random-init; it borrows the small pair's tokenizer.
        from specstream.models.registry import pair_refs

        synthetic.run(out, alphas=alphas, gammas=gammas, n_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                      tokenizer_dir=Path(pair_refs("demo-small")[0]))
    return 0


def _client_security_flags(p: argparse.ArgumentParser, token: bool) -> None:
    """How a client command reaches a secured server: TLS, a client certificate, a token."""
    sec = p.add_argument_group("security")
    sec.add_argument("--tls-ca", default=_env("SPECSTREAM_TLS_CA"), metavar="FILE",
                     help="TLS: the server's certificate must chain to this PEM CA bundle (env SPECSTREAM_TLS_CA)")
    sec.add_argument("--tls-cert", default=_env("SPECSTREAM_CLIENT_CERT"), metavar="FILE",
                     help="mTLS: the PEM client certificate to present (env SPECSTREAM_CLIENT_CERT)")
    sec.add_argument("--tls-key", default=_env("SPECSTREAM_CLIENT_KEY"), metavar="FILE",
                     help="its PEM private key (env SPECSTREAM_CLIENT_KEY)")
    sec.add_argument("--server-name", default=None, metavar="NAME",
                     help="the name the server's certificate must carry, when not the host in --url")
    if token:
        sec.add_argument("--token", default=_env("SPECSTREAM_TOKEN"),
                         help="bearer token for the API (env SPECSTREAM_TOKEN; prefer it: flags show in `ps`)")


def cmd_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specstream.serving.channels import open_blocking_channel
    from specstream.data.config import ChannelSecurity

    try:
        security = ChannelSecurity(label="health", ca_file=args.tls_ca, cert_file=args.tls_cert,
                                   key_file=args.tls_key, server_name=args.server_name)
        with open_blocking_channel(args.url, security=security) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                              timeout=args.timeout)
    except ValueError as exc:
        print(f"specstream health: error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"{args.url}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.url}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _client_credentials(args: argparse.Namespace) -> dict:
    """The SDK's security keywords from the client flags (checked by the SDK)."""
    return dict(tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key, server_name=args.server_name,
                token=args.token)


def _call_flags(p: argparse.ArgumentParser, default_max_new_tokens: int) -> None:
    """Flags shared by `generate` and `chat`."""
    p.add_argument("--url", default=os.environ.get("SPECSTREAM_URL", "127.0.0.1:50051"),
                   help="host:port, grpc://host:port or grpcs://host:port (TLS with the system's CAs)")
    _client_security_flags(p, token=True)
    p.add_argument("--max-new-tokens", type=int, default=default_max_new_tokens)
    p.add_argument("--gamma", type=_speculation, default="auto",
                   help="auto (the server picks γ each step), off, or N proposals per step (0 = off)")
    p.add_argument("--max-gamma", type=_int_in("--max-gamma", 1, 2**32 - 1), default=None, metavar="N",
                   help="with --gamma auto only: this request's cap on the γ the server picks, N >= 1 (default: "
                        "the server's own --max-gamma)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0 samples")
    p.add_argument("--top-k", type=_int_in("--top-k", 0, 2**31 - 1), default=0,
                   help="sample from the k most likely tokens only (0: off)")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample from the smallest most-likely set with this much mass, in (0, 1] (default 1: off)")
    p.add_argument("--seed", type=_int_in("--seed", 0, 2**64 - 1), default=None,
                   help="seed for sampling (default: the server picks one and reports it)")
    p.add_argument("--logprobs", type=_int_in("--logprobs", 0, 2**31 - 1), default=None, metavar="N",
                   help="return each token's log-probability and its N most likely alternatives (N >= 0)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true", help="print the whole response as JSON")
    beam = p.add_argument_group("beam search (greedy only; prints the n best with their scores)")
    beam.add_argument("--num-beams", type=_int_in("--num-beams", 1, 2**31 - 1), default=None, metavar="K",
                      help="beam search with K beams (1: greedy decoding; at most the server's slots)")
    beam.add_argument("--num-return", type=_int_in("--num-return", 1, 2**31 - 1), default=None, metavar="N",
                      help="with --num-beams: the N best hypotheses to return (default 1)")
    beam.add_argument("--length-penalty", type=float, default=None,
                      help="score = sum of logprobs / length ** this (default 1; > 0 favours longer)")
    beam.add_argument("--early-stopping", choices=["heuristic", "first_k", "never"], default=None,
                      help="when the search ends, as transformers' early_stopping False / True / 'never' "
                           "(default heuristic)")
    beam.add_argument("--beam-threshold", type=float, default=None, metavar="DELTA",
                      help="variable width: prune hypotheses more than DELTA below the best log-probability")
    beam.add_argument("--max-candidates-per-parent", type=_int_in("--max-candidates-per-parent", 1, 2**31 - 1),
                      default=None, metavar="M", help="variable width: at most M hypotheses extend one parent")



def _http_port_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models, /health) on the gateway's host at this port (0: a free one; default: off)")


def build_parser() -> argparse.ArgumentParser:
    from specstream.tools.reliability import FAULT_SCENARIOS

    parser = argparse.ArgumentParser(prog="specstream", description="Speculative-decoding LLM inference service")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start gateway, target and draft as three processes")
    _models_flag(p)
    p.add_argument("--target", help="target model: name, .gguf file or checkpoint directory (default: --models)")
    p.add_argument("--draft", help="draft model directory (default: the --models pair's draft)")
    p.add_argument("--no-draft", action="store_true", help="run without a draft service (plain decoding)")
    p.add_argument("--colocate-draft", action="store_true",
                   help="run the draft inside each target process instead of as its own service: no gRPC hop "
                        "per step (faster on one machine); the draft then shares the target's threads")
    _proposer_flags(p, model_flag="--draft or the --models pair's", pair=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="gateway port (0: pick a free one)")
    _http_port_flag(p)
    _gamma_flags(p)
    p.add_argument("--max-slots", type=int, default=8)
    p.add_argument("--replicas", type=_int_in("--replicas", 1, 64), default=1,
                   help="target processes behind the gateway (they share one draft service)")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="default: the --models pair's (auto: bfloat16 where native, else float32)")
    _weights_flag(p)
    p.add_argument("--draft-threads", type=int, default=1, help="CPU threads of the draft model (0: one per core)")
    p.add_argument("--target-threads", type=int, default=0, help="CPU threads of the target model (0: one per core)")
    p.add_argument("--log-dir", help="write each service's log here instead of the terminal")
    p.add_argument("--metrics", action="store_true", help="each service serves Prometheus /metrics on a free port")
    _batching_flags(p)
    p.add_argument("--trace-file", help="all three services append one JSON span per line to this file")
    p.add_argument("--no-supervise", action="store_true",
                   help="do not restart a draft or target that exits (then any service's exit stops them all)")
    p.add_argument("--restart-max-delay", type=float, default=10.0,
                   help="a crashed draft or target is restarted after 0.5 s, doubling per further crash up to "
                        "this many seconds (reset once it stays up 30 s)")
    sec = p.add_argument_group("security (off by default)")
    sec.add_argument("--tls-dir", metavar="DIR",
                     help="TLS on every hop with DIR's files: mTLS and an internal token between the services "
                          "(each accepts only its caller's certificate), TLS and an API token on the public API "
                          "(gRPC and HTTPS). An empty or missing DIR gets a new CA, certificates and tokens "
                          "(needs the cryptography package); SIGHUP reloads the files in every service")
    sec.add_argument("--client-certs", action="store_true",
                     help="with --tls-dir: the public API also requires a client certificate (DIR/client.crt)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("target", help="run the target-model service")
    _model_flags(p)
    _server_flags(p, 50052)
    p.add_argument("--draft-url", help="host:port of the draft service (omit: plain decoding, or --draft-model)")
    _upstream_flags(p, "draft")
    p.add_argument("--draft-timeout", type=float, default=10.0,
                   help="the longest a propose round trip may take (seconds); the deadline of each round trip "
                        "is derived from the measured ones and never exceeds this")
    p.add_argument("--draft-deadline-floor", type=float, default=0.25,
                   help="the shortest propose deadline (seconds): a reply later than its deadline means the "
                        "step decodes without the draft and the stream is reopened")
    p.add_argument("--draft-deadline-factor", type=float, default=2.0,
                   help="a propose deadline is this many times the round trip predicted for its shape")
    p.add_argument("--draft-retry", type=float, default=1.0,
                   help="seconds between attempts to reach a draft that failed")
    p.add_argument("--draft-model", help="run the draft in this process instead of a draft service (no gRPC hop "
                                         "between the two models): a model reference; exclusive with --draft-url")
    _proposer_flags(p, model_flag="--draft-model, in this process; with --proposer ngram no draft model is needed")
    _gamma_flags(p)
    p.add_argument("--max-slots", type=int, default=8)
    _batching_flags(p)
    _memory_flags(p)
    p.set_defaults(func=cmd_target)

    p = sub.add_parser("draft", help="run the draft-model service")
    _model_flags(p, required=False)
    _proposer_flags(p, model_flag="--model")
    p.add_argument("--synthetic-oracle", help="benchmarks: replay greedy continuations from this JSON file "
                                              "instead of running a model")
    p.add_argument("--synthetic-alpha", type=float, default=0.7, help="benchmarks: acceptance rate to simulate")
    _server_flags(p, 50053)
    p.add_argument("--max-slots", type=int, default=64)
    p.add_argument("--q-support", type=int, default=256,
                   help="sampling: q is cut to this many most likely tokens before it is sampled and sent")
    _memory_flags(p)
    p.set_defaults(func=cmd_draft)

    p = sub.add_parser("gateway", help="run the public gateway")
    # Public: 4 MiB holds the longest prompt an 8k-token context can take in any script (and the
    # HTTP front's bodies); the internal services' messages batch many requests and keep 64 MiB.
    # The gateway's API is public (the SDK ships its protos), so reflection shows nothing new; with
    # --token-file it needs a token like every other method.
    _server_flags(p, 50051, reflection=True, max_message_bytes=4 * 1024 * 1024)
    _upstream_flags(p, "target")
    p.add_argument("--target-url", required=True, action="append",
                   help="host:port or dns:///host:port of a target replica; repeatable or comma-separated. "
                        "A name resolving to several addresses is one replica per address (re-resolved every "
                        "--target-resolve-interval)")
    p.add_argument("--tokenizer", required=True,
                   help="the target's model (name, .gguf file or directory with tokenizer.json)")
    p.add_argument("--max-new-tokens-limit", type=int, default=1024)
    p.add_argument("--max-in-flight", type=int, default=256)
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for a replica with room; more get RESOURCE_EXHAUSTED at once")
    p.add_argument("--max-messages", type=int, default=256, help="chat turns a request may carry")
    p.add_argument("--max-prompt-chars", type=int, default=0,
                   help="characters a text prompt (or a chat's contents) may have, checked before tokenizing "
                        "(default 0: the context length x the longest token's characters: nothing that could fit)")
    p.add_argument("--expose-replica-addresses", action="store_true",
                   help="GetModelInfo lists each target replica's ip:port (default: replica-<n>; the API is public)")
    p.add_argument("--tokenize-threads", type=int, default=2,
                   help="threads that validate and tokenize requests off the event loop")
    p.add_argument("--replica-backlog", type=int, default=None,
                   help="requests a replica may hold waiting beyond its slots (default: its max_slots)")
    p.add_argument("--target-resolve-interval", type=float, default=10.0,
                   help="seconds between DNS resolutions of the target entries: new addresses become replicas, "
                        "replicas whose address is gone are drained (0: resolve once, at startup)")
    p.add_argument("--target-stall-timeout", type=float, default=30.0,
                   help="seconds: a target replica holding requests that sends nothing (no engine step) for this "
                        "long is declared hung and its requests move to another replica (sooner when its steps are "
                        "fast: 20x its p99 step interval, at least --target-stall-floor)")
    p.add_argument("--target-stall-floor", type=float, default=5.0,
                   help="seconds: a replica is never declared hung after less silence than this")
    p.add_argument("--target-keepalive-time", type=float, default=1.0,
                   help="seconds between keepalive pings on the connections to the targets")
    p.add_argument("--target-keepalive-timeout", type=float, default=1.0,
                   help="seconds: a target connection whose ping is unanswered this long is dropped")
    _http_port_flag(p)
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("generate", help="call a running gateway: complete a text prompt")
    p.add_argument("prompt")
    _call_flags(p, default_max_new_tokens=64)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="call a running gateway: ask the model a question (its chat template)")
    p.add_argument("prompt", help="the user's message")
    p.add_argument("--system", help="a system message before it (default: the template's own)")
    _call_flags(p, default_max_new_tokens=256)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("health", help="ask a service's grpc.health.v1 status: exit 0 when SERVING (probes, "
                                      "scripts)")
    p.add_argument("--url", default=os.environ.get("SPECSTREAM_URL", "127.0.0.1:50051"), help="host:port")
    p.add_argument("--service", default="", help="a service's name (default: the server's overall status)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds")
    _client_security_flags(p, token=False)
    p.set_defaults(func=cmd_health)


    p = sub.add_parser("train-demo", help="reproduce the shipped demo pair from the Python standard library")
    p.add_argument("--out", help="output directory (default: the package's demo_models/)")
    p.add_argument("--stage", action="append", default=None,
                   choices=["all", "tokenizer", "target", "draft", "card"], help="run only these stages (repeatable)")
    p.add_argument("--target-steps", type=int, default=1100)
    p.add_argument("--draft-steps", type=int, default=1100)
    p.add_argument("--threads", type=int, default=0)
    p.set_defaults(func=cmd_train_demo, stage=None)

    p = sub.add_parser("train-draft", help="reproduce the shipped SmolLM2 draft: distillation on the target's "
                                           "own chat responses (hours on 2 CPU cores)")
    p.add_argument("--out", help="draft directory (default: the package's drafts/smollm2-135m-draft/)")
    p.add_argument("--work-dir", help="intermediate files (default: <model cache>/distill/smollm2-135m-draft)")
    p.add_argument("--stage", action="append", default=None, choices=["all", "prompts", "generate", "train", "card"],
                   help="run only these stages (repeatable)")
    p.add_argument("--rebuild-prompts", action="store_true",
                   help="build the prompt set anew from this machine's documentation instead of the shipped list")
    p.add_argument("--threads", type=int, default=0)
    p.set_defaults(func=cmd_train_draft)

    p = sub.add_parser("bench", help="benchmarks: table on stdout, JSON and PNG plots in --out")
    p.add_argument("kind", choices=["latency", "sampling", "synthetic", "throughput", "profile", "gamma", "kernels",
                                    "beam"],
                   help="latency: gamma sweep vs theory, Hugging Face and (when installed) llama.cpp; "
                        "gamma: fixed gamma vs the HF heuristic, Leviathan's optimum and our controller, with "
                        "model / n-gram / n-gram+model proposers, per workload and batch size; "
                        "sampling: the same at several temperatures (speculative sampling); "
                        "synthetic: overhead vs theory at set acceptance rates on a ~100M random target; "
                        "throughput: batching policies under load; profile: where one decode step's time goes; "
                        "kernels: the output layer, fused kernels against unfused torch; "
                        "beam: FIXED / VAR-BATCH / VAR-STREAM / VAR-STR-FIFO beam search and transformers' beams")
    _models_flag(p)
    p.add_argument("--target", help="target model: name, .gguf file or directory (default: --models)")
    p.add_argument("--draft", help="draft model directory (default: the --models pair's draft)")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="default: the --models pair's")
    _weights_flag(p)
    p.add_argument("--out", default="bench-results", help="directory for JSON and PNG output")
    p.add_argument("--prompts", type=int, default=None, help="prompts per workload (default 8; gamma 4)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128; gamma 48")
    p.add_argument("--gammas", help="comma-separated gamma values (default: latency 0,1,2,3,4,6,8; sampling 0,2,4,6)")
    p.add_argument("--alphas", help="comma-separated acceptance rates (synthetic)")
    p.add_argument("--temperatures", help="comma-separated temperatures, 0 = greedy (sampling; default 0,0.7,1.0)")
    p.add_argument("--workloads", help="throughput: comma-separated, of short,long (default short); "
                                       "gamma: of code,chat,repetitive,sampled,mix (default all)")
    _proposer_flags(p, model_flag="--draft or the --models pair's; latency, sampling, throughput: what our "
                                  "speculative runs propose with", pair=True)
    p.add_argument("--proposers", help="gamma: comma-separated, of model,ngram,ngram+model (default all)")
    p.add_argument("--repeats", type=int, default=1,
                   help="gamma, beam: run every setting this many times, interleaved, and report the median; "
                        "throughput: passes per setting (with --fronts grpc,http: rounds of grpc, http, http, grpc), "
                        "pooled")
    p.add_argument("--requests", type=int, default=200, help="throughput: requests per setting")
    p.add_argument("--batch-sizes", help="throughput: only these n (comma-separated, of 8,32); gamma: default 1,8,32")
    p.add_argument("--policies", help="throughput: only these settings, comma-separated, of 'static all', "
                                      "'topup ε=0.5 all', 'topup ε=1 all', 'topup ε=1 min_length', 'topup ε=1 fifo'")
    p.add_argument("--fronts", type=_fronts, default=("grpc",),
                   help="throughput: comma-separated, of grpc,http (default grpc): with http the stack also serves "
                        "the OpenAI-compatible API and every setting sends the same requests through each front, "
                        "in the same stack, and reports the HTTP front's overhead")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face comparison (latency, sampling, beam)")
    p.add_argument("--vocabs", help="kernels: comma-separated vocabulary sizes (default 32000,49152,128256,151936)")
    p.add_argument("--rows", help="kernels: comma-separated row counts (default 1,8,64,576 on CUDA; 1,8,64 on CPU)")
    p.add_argument("--hidden-sizes", help="kernels: comma-separated hidden sizes (default 576,2048,4096 on CUDA; "
                                          "576 on CPU)")
    p.add_argument("--device", default=None, help="kernels: cuda or cpu (default: cuda when there is one)")
    p.add_argument("--no-model", action="store_true", help="kernels: skip the decode-step share on the target")
    p.add_argument("--num-beams", help="beam: comma-separated k (default 5,10)")
    p.add_argument("--beam-threshold", type=float, default=1.5, help="beam: the variable width's δ (default 1.5)")
    p.add_argument("--epsilons", help="beam: VAR-STREAM refill thresholds (default 1/6,1/3,1/2 as decimals)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("experiment", help="traced latency experiment: where each request's time goes")
    p.add_argument("--workload", choices=["single", "busy"], default="single",
                   help="single: 16 requests one at a time; busy: 64 requests from 16 callers")
    _models_flag(p)
    p.add_argument("--target", help="target model: name, .gguf file or directory (default: --models)")
    p.add_argument("--draft", help="draft model directory (default: the --models pair's draft)")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    _weights_flag(p)
    _proposer_flags(p, model_flag="--draft or the --models pair's", pair=True)
    p.add_argument("--max-slots", type=int, default=8)
    p.add_argument("--out", default="experiment-results", help="directory for experiment_<workload>.json and .png")
    p.set_defaults(func=cmd_experiment)

    p = sub.add_parser("fuzz", help="seeded fuzzing of the public API (gRPC and HTTP): crashes and wrong codes")
    _reliability_flags(p, "fuzz-results")
    p.add_argument("--cases", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=8)
    p.set_defaults(func=cmd_fuzz)

    p = sub.add_parser("soak", help="a bounded load for a set time: memory slope per process, errors, latency drift")
    _reliability_flags(p, "soak-results")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--concurrency", type=int, default=8, help="callers at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=96, help="the most tokens a request asks for")
    p.add_argument("--pid", action="append", default=[],
                   help="with --gateway: NAME=PID of a process to watch (repeatable; default: the stack's own)")
    p.set_defaults(func=cmd_soak)

    p = sub.add_parser("faults", help="stage failures on a real stack (hung or killed draft and targets, a maximal "
                                      "prompt) under 8 streams and measure how the service rides them out")
    _reliability_flags(p, "faults-results")
    p.add_argument("--scenarios", default=",".join(FAULT_SCENARIOS),
                   help=f"comma-separated, of {','.join(FAULT_SCENARIOS)} (default all)")
    p.set_defaults(func=cmd_faults)

    p = sub.add_parser("demo", help="start the stack on the default models and ask it a few questions")
    _models_flag(p)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--gamma", default="auto", type=lambda v: v if v == "auto" else int(v),
                   help="speculation for the 'on' runs: auto (the γ controller, default) or a fixed γ")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
