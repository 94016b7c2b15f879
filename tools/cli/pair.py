"""The model pair a command runs on: `--models` (a named target + draft pair of the registry),
overridden by `--target`, `--draft`, `--dtype`, `--proposer` and `--ngram-min` where given.
Shared by `serve`, `demo`, the benchmarks and the reliability probes; knows nothing about what
they do with the pair.

`bench_models` imports the benchmarks' model loader inside the function: it loads torch, which
`specstream --help` and the services' start must not pay for.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specstream.data.config import DraftConfig
from specstream.models.registry import DEFAULT_PAIR, PAIRS, pair_refs
from tools.cli.flags import DTYPES, proposer_flags, weights_flag


def models_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", choices=sorted(PAIRS), default=DEFAULT_PAIR,
                   help="named target + draft pair: " + "; ".join(f"{k}: {v.about}" for k, v in PAIRS.items()))


def pair_flags(p: argparse.ArgumentParser, dtype_help: str | None = None) -> None:
    """--models, and --target, --draft, --dtype, --weights to override it (chosen_models)."""
    models_flag(p)
    p.add_argument("--target", help="target model: name, .gguf file or directory (default: --models)")
    p.add_argument("--draft", help="draft model directory (default: the --models pair's draft)")
    p.add_argument("--dtype", default=None, choices=DTYPES, help=dtype_help)
    weights_flag(p)


def tool_pair_flags(p: argparse.ArgumentParser) -> None:
    """pair_flags and the proposer flags, as the experiment and the reliability probes take them."""
    pair_flags(p)
    proposer_flags(p, model_flag="--draft or the --models pair's", pair=True)


def chosen_models(args: argparse.Namespace) -> tuple[str, str | None, str]:
    """--target/--draft/--dtype, filled from the --models pair where not given."""
    if args.target is None:
        target, draft, dtype = pair_refs(args.models)
        draft = args.draft or draft
    else:
        target, draft, dtype = args.target, args.draft, "auto"
    return target, draft, args.dtype or dtype


def chosen_proposer(args: argparse.Namespace) -> tuple[str, int]:
    """(proposer, ngram_min) from --proposer/--ngram-min, filled from the --models pair where not
    given (when --target is, from DraftConfig's defaults). The pair's ngram_min goes with its
    proposer only: another proposer asked for by name gets DraftConfig's."""
    pair = PAIRS[args.models] if args.target is None else None
    proposer = args.proposer or (pair.proposer if pair else DraftConfig.proposer)
    if args.ngram_min is not None:
        return proposer, args.ngram_min
    return proposer, pair.ngram_min if pair and proposer == pair.proposer else DraftConfig.ngram_min


def bench_models(args: argparse.Namespace):
    """The benchmarked pair from --models/--target/--draft/--dtype (tools.bench.models)."""
    from tools.bench.models import BenchModels  # loads torch: see the module's docstring

    target, draft, dtype = chosen_models(args)
    proposer, ngram_min = chosen_proposer(args)
    pair = PAIRS[args.models] if args.target is None else None
    return BenchModels.from_refs(target, draft, dtype, args.models if args.target is None else Path(target).name,
                                 weights=args.weights, proposer=proposer, ngram_max=args.ngram_max, ngram_min=ngram_min,
                                 suffix_capacity=args.suffix_capacity,
                                 prompt_set=getattr(args, "prompt_set", "draft"),
                                 token_draft=pair.token_draft if pair else None)
