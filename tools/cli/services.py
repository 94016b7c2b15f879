"""`specstream target`, `draft` and `gateway`: run one service. Their flags and environment
variables become the services' config dataclasses (`specstream.data.config`) here and nowhere
else; the services know nothing about flags.

Each service's `serve` is imported inside its cmd_* function: `specstream --help` and the other
services do not load it, and the gateway never loads torch.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable

from specstream.data.config import (
    ChannelSecurity,
    DraftConfig,
    GatewayConfig,
    MemoryConfig,
    ModelSpec,
    ServerConfig,
    ServerSecurity,
    StallConfig,
    TargetConfig,
)
from tools.cli.flags import (
    DTYPES,
    batching_flags,
    env,
    fixed_threads_flag,
    gamma_flags,
    http_port_flag,
    grammar_draft_flag,
    proposer_flags,
    weights_flag,
    work_ahead_flags,
)


def register(sub: argparse._SubParsersAction) -> None:
    _add_target(sub)
    _add_draft(sub)
    _add_gateway(sub)


# --- flags ------------------------------------------------------------------------------------------------

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
    _server_security_flags(p, reflection)


def _server_security_flags(p: argparse.ArgumentParser, reflection: bool) -> None:
    """Every variable these read is one the launcher keeps from its children (SERVICE_SECURITY_ENV)."""
    sec = p.add_argument_group("security (all off by default; SIGHUP reads the files again for new connections "
                               "and calls; grpc.health.v1 stays open for probes)")
    sec.add_argument("--tls-cert", default=env("SPECSTREAM_TLS_CERT"), metavar="FILE",
                     help="PEM certificate chain to serve TLS with, with --tls-key (env SPECSTREAM_TLS_CERT); the "
                          "gateway's HTTP API then serves HTTPS with it")
    sec.add_argument("--tls-key", default=env("SPECSTREAM_TLS_KEY"), metavar="FILE",
                     help="its PEM private key, unencrypted (env SPECSTREAM_TLS_KEY)")
    sec.add_argument("--tls-client-ca", default=env("SPECSTREAM_TLS_CLIENT_CA"), metavar="FILE",
                     help="mTLS: every caller must present a certificate signed by this PEM CA bundle "
                          "(env SPECSTREAM_TLS_CLIENT_CA)")
    sec.add_argument("--allowed-peers", default=env("SPECSTREAM_ALLOWED_PEERS"), metavar="NAMES",
                     help="with --tls-client-ca: comma-separated names, one of which a caller's certificate must "
                          "carry as a subject alternative name or common name (env SPECSTREAM_ALLOWED_PEERS)")
    sec.add_argument("--token-file", default=env("SPECSTREAM_TOKEN_FILE"), metavar="FILE",
                     help="callers must send `authorization: Bearer <token>` with a token of this file (one per "
                          "line, # comments) (env SPECSTREAM_TOKEN_FILE)")
    sec.add_argument("--reflection", action=argparse.BooleanOptionalAction, default=reflection,
                     help=f"serve grpc.reflection (default: {'on' if reflection else 'off'})")


def _upstream_flags(p: argparse.ArgumentParser, upstream: str) -> None:
    """How this service calls the `upstream` service (gateway -> target, target -> draft)."""
    prefix = f"SPECSTREAM_{upstream.upper()}_"
    sec = p.add_argument_group(f"security towards the {upstream} (off by default; read at start)")
    sec.add_argument(f"--{upstream}-tls-ca", default=env(prefix + "TLS_CA"), metavar="FILE",
                     help=f"TLS to the {upstream}: its certificate must chain to this PEM CA bundle "
                          f"(env {prefix}TLS_CA)")
    sec.add_argument(f"--{upstream}-tls-cert", default=env(prefix + "TLS_CERT"), metavar="FILE",
                     help=f"mTLS: the PEM certificate to present to the {upstream} (env {prefix}TLS_CERT)")
    sec.add_argument(f"--{upstream}-tls-key", default=env(prefix + "TLS_KEY"), metavar="FILE",
                     help=f"its PEM private key (env {prefix}TLS_KEY)")
    sec.add_argument(f"--{upstream}-server-name", default=env(prefix + "SERVER_NAME"), metavar="NAME",
                     help=f"the name the {upstream}'s certificate must carry, where its address is one no "
                          f"certificate names, e.g. a pod IP (env {prefix}SERVER_NAME)")
    sec.add_argument(f"--{upstream}-token-file", default=env(prefix + "TOKEN_FILE"), metavar="FILE",
                     help=f"send the first token of this file to the {upstream} (env {prefix}TOKEN_FILE)")


def _model_flags(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--model", required=required,
                   help="a model name (smollm2), a .gguf file or a Hugging Face checkpoint directory")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="auto: bfloat16 where the device computes it natively, else float32")
    weights_flag(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0, help="CPU threads for the model (0: one per core)")


def _memory_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernel-cache-capacity", type=int, default=MemoryConfig.kernel_cache_capacity,
                   help="entries kept by oneDNN's and ideep's shape-keyed kernel caches (their default, 1024, "
                        "grows a long-running CPU service's memory for minutes)")
    p.add_argument("--heap-trim-interval", type=float, default=MemoryConfig.heap_trim_interval_s,
                   help="seconds between handing the heap's free pages back to the system (glibc "
                        "malloc_trim, on the torch thread); 0: never")


# --- target -----------------------------------------------------------------------------------------------

def _add_target(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("target", help="run the target-model service")
    _model_flags(p)
    _server_flags(p, 50052)
    p.add_argument("--draft-url", help="host:port of the draft service (omit: plain decoding, or --draft-model)")
    _upstream_flags(p, "draft")
    p.add_argument("--draft-timeout", type=float, default=TargetConfig.draft_timeout_s,
                   help="the longest a propose round trip may take (seconds); the deadline of each round trip "
                        "is derived from the measured ones and never exceeds this. Keep it well below the "
                        "gateway's --target-stall-floor: the target sends nothing while it waits")
    p.add_argument("--draft-deadline-floor", type=float, default=0.25,
                   help="the shortest propose deadline (seconds): a reply later than its deadline means the "
                        "step decodes without the draft and the stream is reopened")
    p.add_argument("--draft-deadline-factor", type=float, default=2.0,
                   help="a propose deadline is this many times the round trip predicted for its shape")
    p.add_argument("--draft-retry", type=float, default=1.0,
                   help="seconds between attempts to reach a draft that failed")
    p.add_argument("--draft-model", help="run the draft in this process instead of a draft service (no gRPC hop "
                                         "between the two models): a model reference; exclusive with --draft-url")
    proposer_flags(p, model_flag="--draft-model, in this process; with --proposer ngram no draft model is needed")
    grammar_draft_flag(p)
    work_ahead_flags(p, "the draft in this process (--draft-model) drafts the next round of its chains on the "
                        "torch thread while the target does a pass's host work: at SCHED_IDLE (idle) or the "
                        "thread's priority (normal)")
    gamma_flags(p)
    fixed_threads_flag(p, "--threads")
    p.add_argument("--max-slots", type=int, default=8)
    batching_flags(p)
    _memory_flags(p)
    p.set_defaults(func=cmd_target)


def cmd_target(args: argparse.Namespace) -> int:
    from draft_service.build import build_proposer
    from target_service.server import serve

    return _serve_with(args, _target_config, lambda config: serve(config, build_proposer))


def _target_config(args: argparse.Namespace) -> TargetConfig:
    return TargetConfig(model=ModelSpec(args.model, args.dtype, args.device, args.weights), server=_server_config(args),
                        max_slots=max(args.max_slots, args.max_batch), max_seq_len=args.max_seq_len,
                        default_gamma=args.gamma, max_gamma=args.max_gamma, gamma_policy=args.gamma_policy,
                        speculative_sampling=args.speculative_sampling, tree_branches=args.tree_branches,
                        forced_tokens=not args.no_forced_tokens,
                        calibrate=not args.no_calibrate, draft_url=args.draft_url,
                        draft_timeout_s=args.draft_timeout, draft_deadline_floor_s=args.draft_deadline_floor,
                        draft_deadline_factor=args.draft_deadline_factor, draft_retry_s=args.draft_retry,
                        draft_early=args.draft_early, torch_threads=args.threads, adapt_threads=not args.fixed_threads,
                        memory=_memory_config(args),
                        colocated_draft=_colocated_draft(args), draft_security=_channel_security(args, "draft"),
                        **_batching_config(args))


def _colocated_draft(args: argparse.Namespace) -> DraftConfig | None:
    """The DraftConfig of a draft run inside the target (--draft-model, or --proposer other than
    model), or None; ValueError when it clashes with --draft-url."""
    if not args.draft_model and args.proposer == "model":
        if args.work_ahead != "off":
            raise ValueError(f"--work-ahead {args.work_ahead}: works ahead with a draft in this process "
                             "(--draft-model); a draft service takes its own --work-ahead")
        return None
    if args.draft_url:
        raise ValueError(f"--draft-url {args.draft_url}: the draft runs at --draft-url or in this process "
                         "(--draft-model, --proposer), not both")
    model = ModelSpec(args.draft_model, args.dtype, args.device) if args.draft_model else None
    return DraftConfig(model=model, proposer=args.proposer, ngram_max=args.ngram_max, ngram_min=args.ngram_min,
                       suffix_capacity=args.suffix_capacity, max_slots=max(args.max_slots, args.max_batch), max_seq_len=args.max_seq_len,
                       work_ahead=args.work_ahead, work_ahead_outcomes=args.work_ahead_outcomes,
                       grammar_draft=not args.no_grammar_draft, prefix_cache_slots=args.prefix_cache_slots)


def _batching_config(args: argparse.Namespace) -> dict:
    return dict(policy=args.policy, refill_threshold=args.refill_threshold, max_batch=args.max_batch,
                row_selection=args.row_selection, min_length_slack=args.min_length_slack,
                max_wait_steps=args.max_wait_steps, prefill_chunk=args.prefill_chunk,
                prefix_cache_slots=args.prefix_cache_slots)


# --- draft ------------------------------------------------------------------------------------------------

def _add_draft(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("draft", help="run the draft-model service")
    _model_flags(p, required=False)
    proposer_flags(p, model_flag="--model")
    grammar_draft_flag(p)
    p.add_argument("--synthetic-oracle", help="benchmarks: replay greedy continuations from this JSON file "
                                              "instead of running a model")
    p.add_argument("--synthetic-alpha", type=float, default=0.7, help="benchmarks: acceptance rate to simulate")
    _server_flags(p, 50053)
    p.add_argument("--max-slots", type=int, default=64)
    p.add_argument("--prefix-cache-slots", type=int, default=DraftConfig.prefix_cache_slots,
                   help="finished sequences' slots kept so that a prompt that starts the same way continues "
                        "from their state (default -1: every idle one of --max-slots, evicted when needed; "
                        "0: none, and the target sends a feature draft every position's features)")
    p.add_argument("--q-support", type=int, default=256,
                   help="sampling: q is cut to this many most likely tokens before it is sampled and sent")
    p.add_argument("--compute-thread", action="store_true",
                   help="compute proposals on a worker thread, not the event loop's own (which saves a thread hop "
                        "a call; a draft working ahead always uses a worker)")
    work_ahead_flags(p, "after each reply, draft the next round of its chains until the next request: at "
                        "SCHED_IDLE (idle) or the thread's priority (normal)")
    _memory_flags(p)
    p.set_defaults(func=cmd_draft)


def cmd_draft(args: argparse.Namespace) -> int:
    from draft_service.server import serve

    return _serve_with(args, _draft_config, serve)


def _draft_config(args: argparse.Namespace) -> DraftConfig:
    model = ModelSpec(args.model, args.dtype, args.device, args.weights) if args.model else None
    return DraftConfig(model=model, server=_server_config(args), max_slots=args.max_slots,
                       max_seq_len=args.max_seq_len, torch_threads=args.threads, q_support=args.q_support,
                       memory=_memory_config(args),
                       synthetic_oracle=args.synthetic_oracle, synthetic_alpha=args.synthetic_alpha,
                       proposer=args.proposer, ngram_max=args.ngram_max, ngram_min=args.ngram_min,
                       suffix_capacity=args.suffix_capacity, work_ahead=args.work_ahead, work_ahead_outcomes=args.work_ahead_outcomes,
                       compute_on_loop=not args.compute_thread, grammar_draft=not args.no_grammar_draft,
                       prefix_cache_slots=args.prefix_cache_slots)


# --- gateway ----------------------------------------------------------------------------------------------

def _add_gateway(sub: argparse._SubParsersAction) -> None:
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
    _gateway_admission_flags(p)
    _gateway_replica_flags(p)
    http_port_flag(p)
    p.set_defaults(func=cmd_gateway)


def _gateway_admission_flags(p: argparse.ArgumentParser) -> None:
    """What the gateway admits: request sizes, requests in flight and waiting, what it shows."""
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


def _gateway_replica_flags(p: argparse.ArgumentParser) -> None:
    """How the gateway finds its target replicas and tells a hung or lost one."""
    p.add_argument("--replica-backlog", type=int, default=None,
                   help="requests a replica may hold waiting beyond its slots (default: its max_slots)")
    p.add_argument("--prefix-routing-imbalance", type=int, default=4,
                   help="cache-aware routing: a request goes to the replica believed to hold the longest prefix "
                        "of its prompt unless it holds more than this many requests above the least loaded one "
                        "(-1: route by load alone)")
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


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.server import serve

    return _serve_with(args, _gateway_config, serve)


def _gateway_config(args: argparse.Namespace) -> GatewayConfig:
    # --target-url is repeatable and each may be a comma-separated list.
    urls = [url.strip() for flag in args.target_url for url in flag.split(",") if url.strip()]
    return GatewayConfig(target_url=urls[0] if urls else "", target_urls=urls[1:], tokenizer_path=args.tokenizer,
                         server=_server_config(args), max_new_tokens_limit=args.max_new_tokens_limit,
                         max_in_flight=args.max_in_flight, max_queue=args.max_queue,
                         replica_backlog=args.replica_backlog, max_messages=args.max_messages,
                         prefix_routing_imbalance=args.prefix_routing_imbalance,
                         max_prompt_chars=args.max_prompt_chars, tokenize_threads=args.tokenize_threads,
                         expose_replica_addresses=args.expose_replica_addresses,
                         http_port=args.http_port, target_keepalive_time_s=args.target_keepalive_time,
                         target_keepalive_timeout_s=args.target_keepalive_timeout,
                         stall=StallConfig(floor_s=args.target_stall_floor, ceiling_s=args.target_stall_timeout),
                         target_resolve_interval_s=args.target_resolve_interval,
                         target_security=_channel_security(args, "target"))


# --- what all three share ---------------------------------------------------------------------------------

def _server_config(args: argparse.Namespace) -> ServerConfig:
    peers = tuple(name.strip() for name in (args.allowed_peers or "").split(",") if name.strip())
    security = ServerSecurity(cert_file=args.tls_cert, key_file=args.tls_key, client_ca_file=args.tls_client_ca,
                              allowed_peers=peers, token_file=args.token_file)
    return ServerConfig(host=args.host, port=args.port, max_message_bytes=args.max_message_bytes,
                        keepalive_time_s=args.keepalive_time, keepalive_timeout_s=args.keepalive_timeout,
                        min_ping_interval_s=args.min_ping_interval, grace_s=args.grace,
                        metrics_port=args.metrics_port, security=security, reflection=args.reflection)


def _channel_security(args: argparse.Namespace, upstream: str) -> ChannelSecurity:
    def get(name: str) -> str | None:
        return getattr(args, f"{upstream}_{name}")

    return ChannelSecurity(label=f"{upstream}_security", ca_file=get("tls_ca"), cert_file=get("tls_cert"),
                           key_file=get("tls_key"), server_name=get("server_name"), token_file=get("token_file"))


def _memory_config(args: argparse.Namespace) -> MemoryConfig:
    return MemoryConfig(kernel_cache_capacity=args.kernel_cache_capacity,
                        heap_trim_interval_s=args.heap_trim_interval)


def _serve_with(args: argparse.Namespace, config_of: Callable, serve: Callable) -> int:
    """Builds the service's config from the flags (exit 2 with the config's error), then runs
    `serve(config)` until the server stops."""
    try:
        config = config_of(args)
    except ValueError as exc:
        print(f"specstream {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return _run_service(args, lambda: serve(config))


def _run_service(args: argparse.Namespace, coro_factory: Callable) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {args.command} %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # uvloop is optional (e.g. on Windows)
        pass
    from specstream.serving import telemetry  # OpenTelemetry's import: only for a service that starts

    telemetry.configure(f"specstream-{args.command}", args.trace_file)
    try:
        asyncio.run(coro_factory())
    finally:
        telemetry.shutdown()  # after the server stopped: the last spans are flushed
    return 0
