"""`specstream bench KIND` (the benchmarks of tools/bench/, one registry entry per
kind) and `specstream experiment` (the traced latency experiment). This module turns flags into
each benchmark's arguments; what is measured and written is the benchmark's business.

Each benchmark is imported inside its entry: they load torch, which `specstream --help`, the
other benchmarks and the services' start must not pay for.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from specstream.models.registry import pair_refs, resolve_model
from tools.cli.flags import proposer_flags, quiet_flag
from tools.cli.pair import bench_models, pair_flags, tool_pair_flags


def register(sub: argparse._SubParsersAction) -> None:
    _add_bench(sub)
    p = sub.add_parser("experiment", help="traced latency experiment: where each request's time goes")
    p.add_argument("--workload", choices=["single", "busy"], default="single",
                   help="single: 16 requests one at a time; busy: 64 requests from 16 callers")
    tool_pair_flags(p)
    p.add_argument("--max-slots", type=int, default=8)
    p.add_argument("--out", default="experiment-results", help="directory for experiment_<workload>.json and .png")
    quiet_flag(p)
    p.set_defaults(func=cmd_experiment)


def cmd_experiment(args: argparse.Namespace) -> int:
    from tools import experiment

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    experiment.run(bench_models(args), out, workload=args.workload, max_slots=args.max_slots, quiet=args.quiet)
    return 0


# --- the benchmarks ---------------------------------------------------------------------------------------

def _numbers(text: str | None, kind: type = int) -> list | None:
    """A comma-separated flag's values (None: not given)."""
    return [kind(v) for v in text.split(",")] if text else None


def _latency(args: argparse.Namespace, out: Path) -> None:
    from tools.bench import latency

    latency.run(bench_models(args), out, n_prompts=args.prompts or 8, max_new_tokens=args.max_new_tokens or 128,
                gammas=_numbers(args.gammas), with_hf=not args.no_hf, quiet=args.quiet,
                compare_draft=resolve_model(args.compare_draft) if args.compare_draft else None,
                with_trees=not args.no_trees)


def _sampling(args: argparse.Namespace, out: Path) -> None:
    from tools.bench import sampling

    sampling.run(bench_models(args), out, n_prompts=args.prompts or 8, max_new_tokens=args.max_new_tokens or 128,
                 temperatures=_numbers(args.temperatures, float), gammas=_numbers(args.gammas),
                 with_hf=not args.no_hf, quiet=args.quiet, with_trees=not args.no_trees, repeats=args.repeats,
                 auto_stack=args.auto_stack)


def _synthetic(args: argparse.Namespace, out: Path) -> None:
    from tools.bench import synthetic

    # The synthetic target is random-init; it borrows the small pair's tokenizer.
    synthetic.run(out, alphas=_numbers(args.alphas, float), gammas=_numbers(args.gammas),
                  n_prompts=args.prompts or 8, max_new_tokens=args.max_new_tokens or 128,
                  tokenizer_dir=Path(pair_refs("demo-small")[0]), quiet=args.quiet)


def _throughput(args: argparse.Namespace, out: Path) -> None:
    from tools.bench import throughput

    settings = throughput.default_settings()
    if args.gammas:
        settings = [s for s in settings if str(s.gamma) in args.gammas.split(",")]
    if args.batch_sizes:
        settings = [s for s in settings if str(s.n) in args.batch_sizes.split(",")]
    if args.policies:
        settings = [s for s in settings if s.policy_name in args.policies.split(",")]
    throughput.run(bench_models(args), out, kinds=(args.workloads or "short").split(","), settings=settings,
                   count=args.requests, fronts=args.fronts, repeats=args.repeats, quiet=args.quiet)


def _profile(args: argparse.Namespace, out: Path) -> None:
    from tools.bench import profile

    profile.run(bench_models(args), out, quiet=args.quiet)


def _gamma(args: argparse.Namespace, out: Path) -> None:
    from tools.bench import gamma

    gammas = _numbers(args.gammas)
    gamma.run(bench_models(args), out, _numbers(args.batch_sizes or "1,8,32"),
              n_prompts=args.prompts or 4, max_new_tokens=args.max_new_tokens or 48,
              names=args.workloads.split(",") if args.workloads else None,
              fixed=tuple(gammas) if gammas else gamma.FIXED_GAMMAS,
              proposers=tuple(args.proposers.split(",")) if args.proposers else gamma.PROPOSERS,
              repeats=args.repeats, quiet=args.quiet)


def _kernels(args: argparse.Namespace, out: Path) -> None:
    from tools.bench import kernels

    def ints(text: str | None) -> tuple[int, ...] | None:
        return tuple(_numbers(text)) if text else None

    kernels.run(out, args.device, vocabs=ints(args.vocabs) or kernels.VOCABS, rows=ints(args.rows),
                hiddens=ints(args.hidden_sizes), models=None if args.no_model else bench_models(args),
                quiet=args.quiet)


def _beam(args: argparse.Namespace, out: Path) -> None:
    from tools.bench import beam

    ks = tuple(_numbers(args.num_beams)) if args.num_beams else (5, 10)
    epsilons = tuple(_numbers(args.epsilons, float)) if args.epsilons else (1 / 6, 1 / 3, 1 / 2)
    beam.run(bench_models(args), out, ks=ks, n_requests=args.prompts or 24, max_new=args.max_new_tokens or 48,
             threshold=args.beam_threshold, epsilons=epsilons, peer=not args.no_hf, repeats=args.repeats,
             quiet=args.quiet)


def _step(args: argparse.Namespace, out: Path) -> None:
    from tools.bench import step

    step.run(bench_models(args), out, quiet=args.quiet, compiled=args.compiled)


def _overlap(args: argparse.Namespace, out: Path) -> None:
    from tools.bench import overlap

    temperatures = _numbers(args.temperatures, float) or [0.0]
    if len(temperatures) != 1:
        raise SystemExit(f"bench overlap: --temperatures {args.temperatures}: the served part takes one temperature")
    overlap.run(bench_models(args), out, gammas=_numbers(args.gammas), quiet=args.quiet,
                served_prompts=args.prompts or 4, max_new_tokens=args.max_new_tokens or 96,
                temperature=temperatures[0])


def _structured(args: argparse.Namespace, out: Path) -> None:
    from tools.bench import structured

    names = args.workloads.split(",") if args.workloads else None
    known = {w.name: w for w in structured.WORKLOADS}
    if names and any(n not in known for n in names):
        raise ValueError(f"--workloads={args.workloads!r}: structured takes a comma-separated list of {', '.join(known)}")
    structured.run(bench_models(args), out, max_new_tokens=args.max_new_tokens or 96, repeats=max(args.repeats, 1),
                   quiet=args.quiet, workloads=[known[n] for n in names] if names else None)


def _constraint_cost(args: argparse.Namespace, out: Path) -> None:
    from tools.bench import constraint_cost

    constraint_cost.run(bench_models(args), out, quiet=args.quiet)


def _prefix(args: argparse.Namespace, out: Path) -> None:
    from tools.bench import prefix

    prefix.run(bench_models(args), out, quiet=args.quiet)


def _samples(args: argparse.Namespace, out: Path) -> None:
    from tools.bench import samples

    samples.run(bench_models(args), out, quiet=args.quiet)


def _routing(args: argparse.Namespace, out: Path) -> None:
    from tools.bench import routing

    routing.run(bench_models(args), out, quiet=args.quiet)


def _agent(args: argparse.Namespace, out: Path) -> None:
    from tools.bench import agent_loop

    agent_loop.run(bench_models(args), out, quiet=args.quiet)


# `specstream bench KIND`: KIND's entry, called with the flags and --out (made beforehand).
BENCHES: dict[str, Callable[[argparse.Namespace, Path], None]] = {
    "latency": _latency, "sampling": _sampling, "synthetic": _synthetic, "throughput": _throughput,
    "profile": _profile, "gamma": _gamma, "kernels": _kernels, "beam": _beam, "step": _step,
    "overlap": _overlap, "structured": _structured, "constraint-cost": _constraint_cost, "prefix": _prefix,
    "agent": _agent, "routing": _routing, "samples": _samples,
}


def cmd_bench(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    BENCHES[args.kind](args, out)
    return 0


# --- flags ------------------------------------------------------------------------------------------------

def _fronts(value: str) -> tuple[str, ...]:
    """An argparse type for `bench throughput --fronts`: comma-separated, of grpc,http, each once."""
    fronts = tuple(v.strip() for v in value.split(",") if v.strip())
    if not fronts or any(f not in ("grpc", "http") for f in fronts) or len(set(fronts)) != len(fronts):
        raise argparse.ArgumentTypeError(f"--fronts={value!r}: comma-separated, of grpc,http, each at most once")
    return fronts


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: table on stdout, JSON and PNG plots in --out")
    p.add_argument("kind", choices=list(BENCHES),
                   help="latency: gamma sweep vs theory, Hugging Face and (when installed) llama.cpp; "
                        "gamma: fixed gamma vs the HF heuristic, Leviathan's optimum and our controller, with "
                        "model / n-gram / n-gram+model proposers, per workload and batch size; "
                        "sampling: the same at several temperatures (speculative sampling); "
                        "synthetic: overhead vs theory at set acceptance rates on a ~100M random target; "
                        "throughput: batching policies under load; profile: where one decode step's time goes; "
                        "kernels: the output layer, fused kernels against unfused torch; "
                        "beam: FIXED / VAR-BATCH / VAR-STREAM / VAR-STR-FIFO beam search and transformers' beams; "
                        "step: one decode step against the bandwidth bound, verify cost by positions, host work "
                        "per engine step, a noisy neighbour, and (when installed) llama.cpp; "
                        "overlap: the target's verify and the draft's propose call alone and side by side, "
                        "what drafting while the target verifies could save (--gammas, default 1,2,4), and the "
                        "draft service working ahead as served (--prompts, default 4; --max-new-tokens, default 96); "
                        "structured: JSON schemas, a tool call, choice and regex, constrained plain against forced "
                        "tokens, a draft cut at the grammar's first refusal and our grammar-aware draft, and (when "
                        "installed) llama.cpp's JSON-schema mode (--max-new-tokens, default 96; --repeats: each "
                        "request timed on its fastest of this many); "
                        "constraint-cost: costly and hostile constraints and tool sets, compiled or refused on the "
                        "served tokenizer (time, first mask, mask per token), and sent to a stack while greedy "
                        "streams run (each case's answer, the streams' worst gap between chunks); "
                        "prefix: a conversation's turns and an agent's calls with one long system prompt, time to "
                        "first token with the prefix cache off and on, and (when installed) llama.cpp with its prompt "
                        "cache and without; "
                        "agent: an agent loop re-sending its growing tool-using transcript, tokens per second with "
                        "plain decoding, prompt lookup, suffix drafting (with the prefix cache off too), suffix "
                        "drafting + model and the pair's proposer; "
                        "routing: two target replicas, 16 conversations interleaved, the gateway's cache-aware "
                        "routing against load-only routing (hit rate, cached tokens, time to first token); "
                        "samples: n=4 samples of one long prompt in one HTTP request, against 4 requests at once "
                        "and 4 in a row")
    pair_flags(p, dtype_help="default: the --models pair's")
    p.add_argument("--out", default="bench-results", help="directory for JSON and PNG output")
    p.add_argument("--prompts", type=int, default=None, help="prompts per workload (default 8; gamma 4)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128; gamma 48")
    p.add_argument("--gammas", help="comma-separated gamma values (default: latency 0,1,2,3,4,6,8; sampling 0,2,4,6)")
    p.add_argument("--alphas", help="comma-separated acceptance rates (synthetic)")
    p.add_argument("--temperatures", help="comma-separated temperatures, 0 = greedy (sampling; default 0,0.7,1.0); "
                                          "overlap: one, its served part's (default 0)")
    p.add_argument("--workloads", help="throughput: comma-separated, of short,long (default short); "
                                       "gamma: of code,chat,repetitive,sampled,mix (default all); structured: of "
                                       "json-flat,json-nested,json-array,json-enum,tool-call,choice,regex-date "
                                       "(default all)")
    proposer_flags(p, model_flag="--draft or the --models pair's; latency, sampling, throughput: what our "
                                 "speculative runs propose with", pair=True)
    p.add_argument("--proposers", help="gamma: comma-separated, of model,ngram,ngram+model (default all)")
    p.add_argument("--repeats", type=int, default=1,
                   help="gamma, beam: run every setting this many times, interleaved, and report the median; "
                        "sampling: rounds of each temperature's sweep (gammas and auto), pooled; "
                        "throughput: passes per setting (with --fronts grpc,http: rounds of grpc, http, http, grpc), "
                        "pooled")
    _throughput_flags(p)
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face comparison (latency, sampling, beam)")
    p.add_argument("--prompt-set", choices=["draft", "everyday", "nonsense"], default="draft",
                   help="the held-out chat prompts a chat model gets: the token draft's questions about documentation "
                        "(draft) or everyday chat across nine domains (everyday); nonsense: made-up words that no "
                        "draft predicts, for any model")
    p.add_argument("--compare-draft", help="latency: also sweep with this draft of the same target (a feature draft, "
                                           "e.g. the package's drafts/smollm2-135m-feature), side by side")
    p.add_argument("--no-trees", action="store_true",
                   help="latency: skip the tree rows (gamma 1-3 with the draft's runner-ups as branches, both layouts); "
                        "sampling: skip its tree rows (each gamma with the draft's next draws as branches)")
    p.add_argument("--auto-stack", choices=["own", "shared"], default="own",
                   help="sampling: send speculation=auto's requests to a stack of their own, beside its own plain "
                        "decoding, as a user who never asks for a fixed gamma runs it (own), or to the stack the fixed "
                        "gammas use, whose traffic then feeds its controller (shared)")
    _kernels_flags(p)
    p.add_argument("--num-beams", help="beam: comma-separated k (default 5,10)")
    p.add_argument("--beam-threshold", type=float, default=1.5, help="beam: the variable width's δ (default 1.5)")
    p.add_argument("--epsilons", help="beam: VAR-STREAM refill thresholds (default 1/6,1/3,1/2 as decimals)")
    quiet_flag(p)
    p.set_defaults(func=cmd_bench)


def _throughput_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=200, help="throughput: requests per setting")
    p.add_argument("--batch-sizes", help="throughput: only these n (comma-separated, of 8,32); gamma: default 1,8,32")
    p.add_argument("--policies", help="throughput: only these settings, comma-separated, of 'static all', "
                                      "'topup ε=0.5 all', 'topup ε=1 all', 'topup ε=1 min_length', 'topup ε=1 fifo'")
    p.add_argument("--fronts", type=_fronts, default=("grpc",),
                   help="throughput: comma-separated, of grpc,http (default grpc): with http the stack also serves "
                        "the OpenAI-compatible API and every setting sends the same requests through each front, "
                        "in the same stack, and reports the HTTP front's overhead")


def _kernels_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocabs", help="kernels: comma-separated vocabulary sizes (default 32000,49152,128256,151936)")
    p.add_argument("--rows", help="kernels: comma-separated row counts (default 1,8,64,576 on CUDA; 1,8,64 on CPU)")
    p.add_argument("--hidden-sizes", help="kernels: comma-separated hidden sizes (default 576,2048,4096 on CUDA; "
                                          "576 on CPU)")
    p.add_argument("--device", default=None, help="kernels: cuda or cpu (default: cuda when there is one)")
    p.add_argument("--no-model", action="store_true", help="kernels: skip the decode-step share on the target")
    p.add_argument("--compiled", action="store_true",
                   help="step: also compile the forward with torch.compile over a static cache, one shape per "
                        "number of positions (gpt-fast's recipe), and time it beside ours (about a minute of "
                        "compiling per shape on 2 cores)")
