"""`specstream bench synthetic`: system overhead against theory at a chosen acceptance rate.

The target is a random-weight Llama of about 100M parameters. A first pass records its greedy
continuation of each prompt (plain decoding, which is also the baseline); then the draft service
replays those continuations with each token corrupted with probability 1 − α
(draft_service/synthetic.py), so proposals are accepted i.i.d. with rate α and cost almost nothing.
Theory with c = 0 is (1 − α^(γ+1)) / (1 − α); what the measured speedup misses of it is the
serving system's own overhead (plus a wider verify forward costing more than a one-token step,
which the theory assumes free: reported alongside as the verify cost ratio).
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

from specstream.models.loader import read_config
from specstream.models.random_init import write_random_checkpoint
from specstream.text.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    TextTokenizer,
    build_byte_level_tokenizer,
    save_tokenizer_files,
)
from tools.bench import report
from tools.bench.checks import check_same_tokens
from tools.bench.costs import measure_costs
from tools.bench.latency import sweep
from tools.bench.models import BenchModels
from tools.bench.theory import expected_speedup
from tools.launcher import Stack, StackSpec
from tools.progress import Progress

TARGET_SHAPE = {"hidden_size": 768, "intermediate_size": 2560, "num_hidden_layers": 14, "num_attention_heads": 12,
                "num_key_value_heads": 4, "max_position_embeddings": 2048, "tie_word_embeddings": True}


def build_target(path: Path, tokenizer_dir: Path | None, seed: int = 0, shape: dict | None = None,
                 dtype: str = "float32") -> Path:
    """A random-init Llama (by default ~100M parameters) sharing a tokenizer (vocab) with the demo
    pair; its weights are stored in `dtype`."""

    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").exists():
        raw = TextTokenizer.from_dir(tokenizer_dir).tokenizer
    else:
        raw = build_byte_level_tokenizer(vocab_size=512)
    write_random_checkpoint(path, {**(shape or TARGET_SHAPE), "vocab_size": raw.get_vocab_size(), "bos_token_id": 0,
                                   "eos_token_id": 1}, seed=seed, dtype=dtype)
    save_tokenizer_files(raw, path, bos=BOS_TOKEN, eos=EOS_TOKEN)
    return path


HEADERS = ["alpha set", "gamma", "alpha measured", "tok/s", "measured x", "theory x (c=0)", "of theory",
           "verify cost (g+1 vs 1)", "theory x (verify cost)", "of that"]


def run(out_dir: Path, alphas: list[float] | None = None, gammas: list[int] | None = None, n_prompts: int = 4,
        max_new_tokens: int = 128, tokenizer_dir: Path | None = None, shape: dict | None = None,
        quiet: bool = False) -> dict:
    """Plain decoding, then every γ at every α; the table on stdout, ``synthetic.json`` and a plot
    in ``out_dir``. Progress on stderr (tools.progress; ``quiet``: plain lines, never a
    bar), counted in generations."""
    alphas = alphas or [0.5, 0.7, 0.9]
    gammas = gammas or [2, 4, 8]
    with tempfile.TemporaryDirectory() as tmp:
        target = build_target(Path(tmp) / "target", tokenizer_dir, shape=shape)
        vocab = read_config(target).vocab_size
        rng = random.Random(0)
        prompts = [[0] + [rng.randrange(2, vocab) for _ in range(31)] for _ in range(n_prompts)]
        costs = measure_costs(BenchModels("synthetic", target, None, "float32"), len(prompts[0]) + max_new_tokens // 2,
                              gammas)
        params = _params(target)
        print(f"random Llama target, {params / 1e6:.0f}M parameters; one-token step {costs['target_step_ms']:.1f} ms",
              flush=True)
        with Progress((1 + len(alphas) * len(gammas)) * n_prompts, "generations", "synthetic: plain decoding",
                      quiet=quiet) as progress:
            with Stack(StackSpec(str(target), None, log_dir=tmp + "/logs-plain")) as stack:
                plain = sweep(stack.gateway_address, prompts, [0], max_new_tokens, progress=progress)[0]
            oracle = Path(tmp) / "oracle.json"
            oracle.write_text(json.dumps({"vocab_size": vocab,
                                          "sequences": [p + t for p, t in zip(prompts, plain["token_ids"])]}))
            result = {"target_parameters": params, "costs": costs, "plain_tokens_per_s": plain["tokens_per_s"],
                      "prompts": n_prompts, "max_new_tokens": max_new_tokens, "alphas": {}}
            rows = []
            for alpha in alphas:
                progress.phase(f"synthetic: alpha {alpha}")
                spec = StackSpec(str(target), None, synthetic=(str(oracle), alpha), max_gamma=16,
                                 log_dir=f"{tmp}/logs-{alpha}")
                with Stack(spec) as stack:
                    runs = sweep(stack.gateway_address, prompts, gammas, max_new_tokens, progress=progress)
                result["alphas"][alpha] = {}
                for gamma in gammas:
                    rows.append(_score(result["alphas"][alpha], alpha, gamma, runs[gamma], plain, costs))
    print(f"\nplain decoding: {plain['tokens_per_s']:.1f} tok/s\n" + report.table(HEADERS, rows), flush=True)
    result["table_markdown"] = report.markdown_table(HEADERS, rows)
    report.plot_lines(out_dir / "synthetic_speedup.png", "Synthetic α: measured vs theory (c = 0)", "γ",
                      "speedup over plain (x)",
                      {**{f"measured α={a}": (gammas, [result["alphas"][a][g]["speedup"] for g in gammas]) for a in alphas},
                       **{f"theory α={a}": (gammas, [result["alphas"][a][g]["theory"] for g in gammas]) for a in alphas}},
                      hline=1.0)
    report.write_json(out_dir / "synthetic.json", result)
    print(f"wrote {out_dir / 'synthetic.json'}, {out_dir / 'synthetic_speedup.png'}", flush=True)
    return result


def _score(by_gamma: dict, alpha: float, gamma: int, r: dict, plain: dict, costs: dict) -> list:
    """Checks one (α, γ) run's tokens against plain decoding, adds its figures to ``by_gamma`` and
    returns its table row (HEADERS)."""
    check_same_tokens(f"synthetic alpha {alpha}, gamma {gamma} against plain decoding",
                      plain["token_ids"], r["token_ids"])
    speedup = r["tokens_per_s"] / plain["tokens_per_s"]
    theory = expected_speedup(r["alpha"], gamma, 0.0)
    verify = costs["target_verify_ms"][gamma] / costs["target_step_ms"]
    # The same theory with the verify forward priced as measured: what is left between
    # this and the measurement is the serving system's own overhead.
    priced = theory / verify
    by_gamma[gamma] = {"tokens_per_s": r["tokens_per_s"], "alpha_measured": r["alpha"],
                       "speedup": speedup, "theory": theory, "of_theory": speedup / theory,
                       "verify_cost_ratio": verify, "theory_with_verify_cost": priced,
                       "of_theory_with_verify_cost": speedup / priced}
    return [alpha, gamma, r["alpha"], r["tokens_per_s"], speedup, theory, speedup / theory, verify, priced,
            speedup / priced]


def _params(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
