"""`specstream generate`, `chat` and `health`: call a running service and print its answer.
Everything goes through the public API: the SDK (`specstream_client`) for generate and chat,
grpc.health.v1 for health. Ranges the server checks (temperature, top-p) are left to it.

The SDK and gRPC are imported inside the cmd_* functions: `specstream --help` and the services'
start do not load them here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from specstream.data.config import ChannelSecurity
from tools.cli.flags import env, int_in


def register(sub: argparse._SubParsersAction) -> None:
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


# --- flags ------------------------------------------------------------------------------------------------

def _speculation(value: str) -> str | int:
    """An argparse type for --gamma: auto, off or a number of proposals per step (0: off)."""
    if value in ("auto", "off"):
        return value
    try:
        gamma = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gamma={value!r}: use auto, off or an integer") from None
    if gamma < 0:
        raise argparse.ArgumentTypeError(f"--gamma={value!r}: must be >= 0")
    return "off" if gamma == 0 else gamma


def _client_security_flags(p: argparse.ArgumentParser, token: bool) -> None:
    """How a client command reaches a secured server: TLS, a client certificate, a token."""
    sec = p.add_argument_group("security")
    sec.add_argument("--tls-ca", default=env("SPECSTREAM_TLS_CA"), metavar="FILE",
                     help="TLS: the server's certificate must chain to this PEM CA bundle (env SPECSTREAM_TLS_CA)")
    sec.add_argument("--tls-cert", default=env("SPECSTREAM_CLIENT_CERT"), metavar="FILE",
                     help="mTLS: the PEM client certificate to present (env SPECSTREAM_CLIENT_CERT)")
    sec.add_argument("--tls-key", default=env("SPECSTREAM_CLIENT_KEY"), metavar="FILE",
                     help="its PEM private key (env SPECSTREAM_CLIENT_KEY)")
    sec.add_argument("--server-name", default=None, metavar="NAME",
                     help="the name the server's certificate must carry, when not the host in --url")
    if token:
        sec.add_argument("--token", default=env("SPECSTREAM_TOKEN"),
                         help="bearer token for the API (env SPECSTREAM_TOKEN; prefer it: flags show in `ps`)")


def _call_flags(p: argparse.ArgumentParser, default_max_new_tokens: int) -> None:
    """Flags shared by `generate` and `chat`."""
    p.add_argument("--url", default=os.environ.get("SPECSTREAM_URL", "127.0.0.1:50051"),
                   help="host:port, grpc://host:port or grpcs://host:port (TLS with the system's CAs)")
    _client_security_flags(p, token=True)
    p.add_argument("--max-new-tokens", type=int, default=default_max_new_tokens)
    p.add_argument("--gamma", type=_speculation, default="auto",
                   help="auto (the server picks γ each step), off, or N proposals per step (0 = off)")
    p.add_argument("--max-gamma", type=int_in("--max-gamma", 1, 2**32 - 1), default=None, metavar="N",
                   help="with --gamma auto only: this request's cap on the γ the server picks, N >= 1 (default: "
                        "the server's own --max-gamma)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0 samples")
    p.add_argument("--top-k", type=int_in("--top-k", 0, 2**31 - 1), default=0,
                   help="sample from the k most likely tokens only (0: off)")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample from the smallest most-likely set with this much mass, in (0, 1] (default 1: off)")
    p.add_argument("--seed", type=int_in("--seed", 0, 2**64 - 1), default=None,
                   help="seed for sampling (default: the server picks one and reports it)")
    p.add_argument("--logprobs", type=int_in("--logprobs", 0, 2**31 - 1), default=None, metavar="N",
                   help="return each token's log-probability and its N most likely alternatives (N >= 0)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true", help="print the whole response as JSON")
    p.add_argument("--cache-salt", default=None, metavar="SALT",
                   help="reuse cached prompt prefixes only of requests with this salt (at most 256 characters)")
    p.add_argument("--n", type=int_in("--n", 1, 2**32 - 1), default=1, metavar="N",
                   help="N samples of the prompt (up to 16; above 1 needs --temperature above 0), with seeds "
                        "seed + i, prefilled once; each is printed under its number")
    _constraint_flags(p)
    _beam_search_flags(p)


def _constraint_flags(p: argparse.ArgumentParser) -> None:
    """What the output must match (at most one; the server compiles it and names what is wrong)."""
    out = p.add_argument_group("structured output (at most one)").add_mutually_exclusive_group()
    out.add_argument("--json-schema", metavar="FILE", help="the output is JSON this schema (a JSON file) validates")
    out.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    out.add_argument("--regex", metavar="RE", help="the output matches this regular expression, whole")
    out.add_argument("--choice", action="append", metavar="TEXT",
                     help="the output is one of these strings (repeat the flag for each)")
    out.add_argument("--grammar", metavar="FILE", help="the output is a sentence of this Lark grammar (a file)")


def _beam_search_flags(p: argparse.ArgumentParser) -> None:
    beam = p.add_argument_group("beam search (greedy only; prints the n best with their scores)")
    beam.add_argument("--num-beams", type=int_in("--num-beams", 1, 2**31 - 1), default=None, metavar="K",
                      help="beam search with K beams (1: greedy decoding; at most the server's slots)")
    beam.add_argument("--num-return", type=int_in("--num-return", 1, 2**31 - 1), default=None, metavar="N",
                      help="with --num-beams: the N best hypotheses to return (default 1)")
    beam.add_argument("--length-penalty", type=float, default=None,
                      help="score = sum of logprobs / length ** this (default 1; > 0 favours longer)")
    beam.add_argument("--early-stopping", choices=["heuristic", "first_k", "never"], default=None,
                      help="when the search ends, as transformers' early_stopping False / True / 'never' "
                           "(default heuristic)")
    beam.add_argument("--beam-threshold", type=float, default=None, metavar="DELTA",
                      help="variable width: prune hypotheses more than DELTA below the best log-probability")
    beam.add_argument("--max-candidates-per-parent", type=int_in("--max-candidates-per-parent", 1, 2**31 - 1),
                      default=None, metavar="M", help="variable width: at most M hypotheses extend one parent")


# --- generate and chat ------------------------------------------------------------------------------------

def cmd_generate(args: argparse.Namespace) -> int:
    return _call(args, None)


def cmd_chat(args: argparse.Namespace) -> int:
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    return _call(args, messages)


def _call(args: argparse.Namespace, messages: list[dict[str, str]] | None) -> int:
    """One generate (messages None) or chat call with the shared flags; prints text or JSON."""
    from specstream_client import Client, SpecstreamError

    problem = _flag_clash(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        options = _call_options(args)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        client = Client(args.url, **_client_credentials(args))
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        with client:
            if args.stream:
                stream = client.generate_stream(args.prompt, **options) if messages is None \
                    else client.chat_stream(messages, **options)
                _print_stream(args, stream)
                return 0
            result = client.generate(args.prompt, **options) if messages is None else client.chat(messages, **options)
    except SpecstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _print_result(args, result)
    return 0


def _flag_clash(args: argparse.Namespace) -> str | None:
    """Why the call's flags do not go together (checked before connecting), or None."""
    if args.max_gamma is not None and args.gamma != "auto":
        return (f"--max-gamma {args.max_gamma} caps automatic speculation and needs --gamma auto "
                f"(got --gamma {args.gamma})")
    beam_flags = [flag for flag, value in _beam_flags(args) if value is not None]
    if beam_flags and args.num_beams is None:
        return f"{', '.join(beam_flags)} set beam search options and need --num-beams K"
    return None


def _call_options(args: argparse.Namespace) -> dict:
    """The SDK's generate/chat keywords from the flags."""
    # Ranges of temperature / top-p are the server's to check; its error names the field.
    return dict(max_new_tokens=args.max_new_tokens, speculation=args.gamma, max_gamma=args.max_gamma,
                stop=args.stop or None, timeout=args.timeout, ignore_eos=args.ignore_eos,
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                logprobs=args.logprobs is not None, top_logprobs=args.logprobs or 0,
                num_beams=args.num_beams, num_return_sequences=args.num_return, length_penalty=args.length_penalty,
                early_stopping=args.early_stopping, beam_threshold=args.beam_threshold,
                max_candidates_per_parent=args.max_candidates_per_parent, cache_salt=args.cache_salt, n=args.n,
                **_constraint_options(args))


def _constraint_options(args: argparse.Namespace) -> dict:
    """The SDK's constraint keyword from the flags (files read here; their text is checked by the
    SDK and the server, which name what is wrong)."""
    if args.json_schema:
        return {"json_schema": Path(args.json_schema).read_text(encoding="utf-8")}
    if args.grammar:
        return {"grammar": Path(args.grammar).read_text(encoding="utf-8")}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": args.choice}
    return {}


def _client_credentials(args: argparse.Namespace) -> dict:
    """The SDK's security keywords from the client flags (checked by the SDK)."""
    return dict(tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key, server_name=args.server_name,
                token=args.token)


def _beam_flags(args: argparse.Namespace) -> list[tuple[str, object]]:
    """The beam-search flags other than --num-beams, with their values (None: not given)."""
    return [("--num-return", args.num_return), ("--length-penalty", args.length_penalty),
            ("--early-stopping", args.early_stopping), ("--beam-threshold", args.beam_threshold),
            ("--max-candidates-per-parent", args.max_candidates_per_parent)]


def _print_stream(args: argparse.Namespace, stream) -> None:
    """Text as it arrives (or each chunk as a JSON line), then the n-best list and the stats."""
    last, samples = None, {}
    for chunk in stream:
        if args.json:
            print(json.dumps(chunk.to_dict()), flush=True)
        elif args.n > 1:  # samples interleave: each is printed whole when it ends
            samples[chunk.index] = samples.get(chunk.index, "") + chunk.text
            if chunk.is_final:
                _print_sample(chunk.index, chunk.seed, samples[chunk.index])
        elif not chunk.sequences:  # a beam's one chunk is printed as its n-best list
            print(chunk.text, end="", flush=True)
        last = chunk
    if args.json or samples:
        return
    if last is not None and last.sequences:
        _print_beams(last.sequences)
    else:
        print()
    if last is not None and last.stats is not None:
        _print_stats(last.stats, last.usage, last.timings, last.seed if args.temperature > 0 else None)


def _print_result(args: argparse.Namespace, result) -> None:
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    elif result.sequences:
        _print_beams(result.sequences)
        _print_stats(result.stats, result.usage, result.timings)
    elif result.samples:
        for sample in result.samples:
            _print_sample(sample.index, sample.seed, sample.text)
        _print_stats(result.stats, result.usage, result.timings)
    else:
        print(result.text)
        _print_stats(result.stats, result.usage, result.timings, result.seed if args.temperature > 0 else None)


def _print_sample(index: int, seed: int | None, text: str) -> None:
    print(f"#{index}  seed {seed}")
    print("    " + text.replace("\n", "\n    "), flush=True)


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
          f"{stats.target_passes} target passes, mean accepted length {stats.mean_accepted_length:.2f}; "
          f"{usage.cached_tokens} of {usage.prompt_tokens} prompt tokens cached"
          + (f"; {stats.beam_expansions} beam expansions" if stats.beam_expansions else "")
          + (f"; seed {seed}" if seed is not None else ""), file=sys.stderr)


# --- health -----------------------------------------------------------------------------------------------

def cmd_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specstream.serving.channels import open_blocking_channel

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
