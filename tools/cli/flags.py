"""Flag helpers that several subcommand groups share: each adds a set of arguments to a parser
(or builds an argparse type). They know nothing about what a command does with the values.

Argparse reports a `type=` function by its `__name__` in its errors, and the flag snapshot
(tests/data/cli_flags.json) records it: `int_in`'s parser stays named `parse`.
"""

from __future__ import annotations

import argparse
import os

from specstream.data.config import GAMMA_POLICIES, SPECULATIVE_SAMPLING, WEIGHT_FORMATS, DraftConfig, TargetConfig

DTYPES = ["auto", "float32", "bfloat16", "float16"]


def env(name: str) -> str | None:
    """An environment variable's value as a flag default; unset or empty: None."""
    return os.environ.get(name) or None


def int_in(flag: str, lo: int, hi: int):
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


def weights_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", default="auto", choices=WEIGHT_FORMATS,
                   help="int4: serve a GGUF file's Q4_0/Q4_1 matrices as 4-bit blocks (CPU); int4-a8: the same "
                        "with the layers' inputs rounded to 8 bits per block of 32, as llama.cpp multiplies them "
                        "(faster without AVX-512 BF16; llama.cpp's answers, not the file's); int4-a16: the same "
                        "to 16 bits (float32, AVX2: a faster step, logits within 0.001 of the file's); dense: "
                        "dequantize them to --dtype; int4-rtn: round a dense model to 4 bits at load (drafts only); "
                        "auto: on a CPU, int4 where the model has 4-bit blocks (int4-a16 in float32 where the native "
                        "kernel serves it), int4-rtn for a draft in bfloat16, else dense")


def work_ahead_flags(p: argparse.ArgumentParser, help: str) -> None:  # noqa: A002 - argparse's own word
    """--work-ahead (``help`` says where the work runs) and --work-ahead-outcomes (DraftConfig)."""
    p.add_argument("--work-ahead", choices=DraftConfig.WORK_AHEAD, default=DraftConfig.work_ahead, help=help)
    p.add_argument("--work-ahead-outcomes", type=int_in("--work-ahead-outcomes", 1, DraftConfig.MAX_WORK_AHEAD_OUTCOMES),
                   default=DraftConfig.work_ahead_outcomes, metavar="N",
                   help="working ahead: prepare the next round for the whole chain kept (1) and, up to N, for the "
                        "chain kept up to its k-th guess and corrected to the draft's runner-up there")


def http_port_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models, /health) on the gateway's host at this port (0: a free one; default: off)")


def quiet_flag(p: argparse.ArgumentParser) -> None:
    """For the long-running commands, which show a progress bar with an ETA by default."""
    p.add_argument("--quiet", action="store_true", help="no progress bar: plain progress lines only")


def proposer_flags(p: argparse.ArgumentParser, model_flag: str, pair: bool = False) -> None:
    """What the draft service proposes with; `serve` passes them on to its draft. With ``pair``
    (commands that take --models) --proposer and --ngram-min default to the pair's:
    pair.chosen_proposer."""
    p.add_argument("--proposer", default=None if pair else DraftConfig.proposer, choices=DraftConfig.PROPOSERS,
                   help=f"model: the draft model ({model_flag}); ngram: prompt lookup, copying what followed the "
                        "latest earlier occurrence of the last n tokens (no model); suffix: suffix drafting, from "
                        "the sequence and earlier outputs under the same cache salt, as far as the matches' "
                        "counts trust them (no model); ngram+model, suffix+model: either where it matches, the "
                        "model elsewhere" + (" (default: the --models pair's)" if pair else ""))
    p.add_argument("--ngram-max", type=int, default=DraftConfig.ngram_max, help="prompt lookup tries n from this ...")
    p.add_argument("--ngram-min", type=int, default=None if pair else DraftConfig.ngram_min,
                   help="... down to this" + (f" (default: the --models pair's with its proposer, else "
                                              f"{DraftConfig.ngram_min})" if pair else ""))
    p.add_argument("--suffix-capacity", type=int, default=DraftConfig.suffix_capacity,
                   help="tokens of earlier outputs suffix drafting keeps to draft from, over all cache salts "
                        "(the oldest output goes first; 0: none)")


def grammar_draft_flag(p: argparse.ArgumentParser) -> None:
    """Whether a draft masks constrained requests' guesses by their grammar (DraftConfig.grammar_draft)."""
    p.add_argument("--no-grammar-draft", action="store_true",
                   help="the draft guesses constrained requests' tokens unmasked (the target cuts what their "
                        "grammar refuses) instead of from its distribution masked by their grammar")


def gamma_flags(p: argparse.ArgumentParser) -> None:
    """The target's speculation settings (γ: target_service/gamma.py; verification of sampled
    proposals: target_service/settle.py); `serve` passes them on to its targets."""
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
    p.add_argument("--tree-branches", type=int, default=TargetConfig.tree_branches,
                   help="a request may add up to this many of the draft's runner-up guesses (a sampled one's: "
                        "its next draws, with q) as branches beside its chain, verified in the same pass (a tree): under --gamma-policy goodput "
                        "speculation=auto takes as many as the measured verify cost says pay (a fixed gamma stays "
                        "a chain), under fixed every drafting request all of them, hf and leviathan none; 0: "
                        "chains only")
    p.add_argument("--no-forced-tokens", action="store_true",
                   help="constrained requests do not propose their grammar's forced tokens (the text it allows "
                        "alone: a JSON schema's braces, keys and quotes); only the draft's guesses are verified")
    p.add_argument("--draft-early", action="store_true",
                   help="ask the draft service for a pass as soon as the pass before is verified (when the next "
                        "pass decodes the same requests), so the draft works during the host work between passes "
                        "(default: when the pass starts)")


def fixed_threads_flag(p: argparse.ArgumentParser, threads: str) -> None:
    p.add_argument("--fixed-threads", action="store_true",
                   help=f"the target runs every forward on {threads} threads (default: fewer while the process "
                        "gets less CPU time than they need, as beside busy work in another session, and more "
                        "again when it gets it back; the output is the same)")


def batching_flags(p: argparse.ArgumentParser) -> None:
    """Batching policy of the target engine (docs/architecture.md §4; target_service/scheduler.py)."""
    p.add_argument("--policy", choices=["static", "topup"], default="topup",
                   help="static: fill a batch and run it to completion; topup: refill freed slots")
    p.add_argument("--refill-threshold", type=float, default=1.0,
                   help="topup's epsilon: refill once running <= epsilon * max-batch (1: every step)")
    p.add_argument("--max-batch", type=int, default=0,
                   help="rows expanded per step (0: --max-slots); a larger value raises --max-slots to match")
    p.add_argument("--row-selection", choices=["all", "min_length", "fifo"], default="all")
    p.add_argument("--min-length-slack", type=int, default=0)
    p.add_argument("--max-wait-steps", type=int, default=8, help="starvation bound for row selection")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="prompt tokens prefilled per step, so a long prompt holds running streams up for one chunk "
                        "at a time (default 0: 128 on a CPU, 512 on a GPU)")
    p.add_argument("--prefix-cache-slots", type=int, default=-1,
                   help="KV-cache slots, beside --max-slots, that keep finished sequences' K/V for prompts that "
                        "start the same way (a conversation's next turn, a shared system prompt); each holds "
                        "--max-seq-len tokens (default -1: as many as --max-slots where a quarter of the "
                        "available memory holds them; 0: no prefix cache)")
