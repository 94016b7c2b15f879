"""`specstream train-demo` (the shipped demo pair, from the Python standard library) and
`specstream train-draft` (the shipped SmolLM2 draft, distilled). Flags to the training
pipelines' configs; the training itself is tools/train_demo.py and distill/.

The pipelines are imported inside the cmd_* functions: they load torch, which `specstream
--help` and the services' start must not pay for.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specstream.models.cache import models_home
from specstream.models.registry import DRAFTS, resolve_model
from tools.cli.flags import quiet_flag


def register(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--out", help="draft directory (default: the package's drafts/smollm2-135m-draft/, "
                                 "with --kind feature drafts/smollm2-135m-feature/)")
    p.add_argument("--work-dir", help="intermediate files (default: <model cache>/distill/smollm2-135m-draft)")
    p.add_argument("--kind", choices=["token", "feature"], default="token",
                   help="token: the shipped 2-layer draft that reads tokens; feature: an EAGLE-style head over the "
                        "target's own features, on everyday chat (stages prompts, generate, features, train, offline, token, "
                        "measure, structured, card)")
    p.add_argument("--stage", action="append", default=None,
                   choices=["all", "prompts", "generate", "features", "train", "offline", "token", "card", "measure",
                            "structured"],
                   help="run only these stages (repeatable)")
    p.add_argument("--epochs", type=int, default=None, help="feature: training epochs (default 4)")
    p.add_argument("--extra-layers", type=_layers, default=(), metavar="A,B",
                   help="feature: target layers (1-based, below the last) the head reads besides the final feature, "
                        "fused as EAGLE-3 does (default: the final feature only)")
    p.add_argument("--aligned", action="store_true",
                   help="feature: a drafting step's loss counts only where the head's earlier steps chose the answer's "
                        "tokens (GRIFFIN's token alignment)")
    p.add_argument("--train-fraction", type=float, default=1.0,
                   help="feature: train on this share of the training answers, drawn at random (data scaling)")
    p.add_argument("--head-vocab", type=int, default=0,
                   help="feature, stage measure: the draft scores only this many tokens, those the target answers with "
                        "most often (a cheaper output layer; default: all the head was trained on)")
    p.add_argument("--structured", type=int, default=0,
                   help="feature: also this many structured-output tasks (JSON extraction, classification, tool "
                        "calls), answered by the target under their constraints")
    p.add_argument("--per-subject", type=int, default=None,
                   help="feature: templates each everyday subject is asked in (default 8)")
    p.add_argument("--init-from", default="",
                   help="feature: a feature draft directory whose weights training starts from (a further training)")
    p.add_argument("--lr", type=float, default=None, help="feature: peak learning rate (default 1e-3)")
    p.add_argument("--vocab-out", type=int, default=None,
                   help="feature: tokens the head is trained to score (default 8192; with --init-from, that draft's "
                        "tokens and then the answers' most frequent others)")
    p.add_argument("--rebuild-prompts", action="store_true",
                   help="build the prompt set anew from this machine's documentation instead of the shipped list")
    p.add_argument("--threads", type=int, default=0)
    quiet_flag(p)
    p.set_defaults(func=cmd_train_draft)


def _layers(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--extra-layers={text!r}: comma-separated layer numbers") from None
    if any(layer < 1 for layer in layers) or list(layers) != sorted(set(layers)):
        raise argparse.ArgumentTypeError(f"--extra-layers={text!r}: ascending layer numbers from 1")
    return layers


def cmd_train_demo(args: argparse.Namespace) -> int:
    from tools.train_demo import DEMO_DIR, TrainConfig, main

    cfg = TrainConfig(target_steps=args.target_steps, draft_steps=args.draft_steps, threads=args.threads)
    return main(Path(args.out) if args.out else DEMO_DIR, cfg, tuple(args.stage or ["all"]))


def cmd_train_draft(args: argparse.Namespace) -> int:
    if args.kind == "feature":
        return _train_feature_draft(args)
    from tools.distill.pipeline import STAGES, DistillConfig, main

    if args.stage and set(args.stage) - {"all", *STAGES}:
        raise SystemExit(f"train-draft --kind token: stages are {', '.join(STAGES)}")
    cfg = DistillConfig(threads=args.threads, rebuild_prompts=args.rebuild_prompts)
    work = Path(args.work_dir) if args.work_dir else models_home() / "distill" / "smollm2-135m-draft"
    out = Path(args.out) if args.out else DRAFTS / "smollm2-135m-draft"
    return main(resolve_model("smollm2"), out, work, cfg, tuple(args.stage or ["all"]), quiet=args.quiet)


def _train_feature_draft(args: argparse.Namespace) -> int:
    from tools.distill.feature import STAGES, FeatureConfig, main

    if args.stage and set(args.stage) - {"all", *STAGES}:
        raise SystemExit(f"train-draft --kind feature: stages are {', '.join(STAGES)}")
    given = {name: getattr(args, name) for name in ("epochs", "per_subject", "lr", "vocab_out")}  # None: the default
    cfg = FeatureConfig(**{name: value for name, value in given.items() if value}, extra_layers=args.extra_layers,
                        aligned=args.aligned, train_fraction=args.train_fraction, head_vocab=args.head_vocab,
                        structured=args.structured, init_from=args.init_from)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    work = Path(args.work_dir) if args.work_dir else models_home() / "distill" / "smollm2-135m-feature"
    out = Path(args.out) if args.out else DRAFTS / "smollm2-135m-feature"
    main(resolve_model("smollm2"), work, cfg, tuple(args.stage or ["all"]), out)
    return 0
