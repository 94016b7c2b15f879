"""The shipped demo pair (specstream/demo_models): loads in our loader and in transformers
unchanged, shares one tokenizer, and speculative greedy output equals plain output on it."""

from __future__ import annotations

import json

import pytest
import torch
from tests.support.engine_harness import run_engine

from specstream.models.defaults import SHIPPED, default_model_dirs
from specstream.models.loader import load_model
from specstream.text.tokenizer import TextTokenizer

TARGET, DRAFT = SHIPPED / "target", SHIPPED / "draft"


def test_the_shipped_pair_is_the_default():
    target, draft, random_init = default_model_dirs()
    assert (target, draft, random_init) == (TARGET, DRAFT, False)


def test_files_cards_and_sizes():
    total = 0
    for path in (TARGET, DRAFT):
        names = {p.name for p in path.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"} <= names
        assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
        card = (path / "README.md").read_text()
        assert "held-out loss" in card and "α" in card and "specstream train-demo" in card
        total += sum(p.stat().st_size for p in path.iterdir())
    assert total <= 60 * 2**20, f"demo pair is {total / 2**20:.1f} MiB"


def test_shared_tokenizer_and_sizes():
    assert (TARGET / "tokenizer.json").read_bytes() == (DRAFT / "tokenizer.json").read_bytes()
    target, draft = load_model(TARGET), load_model(DRAFT)
    assert target.config.vocab_size == draft.config.vocab_size == TextTokenizer.from_dir(TARGET).vocab_size
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert 10e6 <= n_target <= 30e6, n_target
    assert n_draft * 5 <= n_target, (n_draft, n_target)


def test_transformers_loads_them_unchanged():
    from transformers import AutoModelForCausalLM

    ids = TextTokenizer.from_dir(TARGET).encode("def main():\n    return 0\n")
    for path in (TARGET, DRAFT):
        ours = load_model(path)
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.inference_mode():
            want = theirs(torch.tensor([ids])).logits
            got = ours(torch.tensor([ids]), ours.new_cache(1, 64), torch.tensor([0]), torch.tensor([0]))
        assert (got - want).abs().max().item() <= 1e-3


@pytest.mark.parametrize("gamma", [2, 4])
def test_speculative_equals_plain_on_the_pair(gamma):
    tok = TextTokenizer.from_dir(TARGET)
    prompts = [tok.encode(t) for t in ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n"]]
    plain, _ = run_engine(TARGET, None, prompts, gamma=0, max_new_tokens=48)
    spec, finals = run_engine(TARGET, DRAFT, prompts, gamma=gamma, max_new_tokens=48)
    assert spec == plain
    assert sum(f.stats.accepted_tokens for f in finals) > 0


def test_random_fallback_when_the_pair_is_missing(tmp_path, monkeypatch):
    """A stripped install without the shipped files still serves, on a random pair it says is random."""
    import specstream.models.defaults as defaults

    monkeypatch.setattr(defaults, "SHIPPED", tmp_path / "missing")
    monkeypatch.setenv("SPECSTREAM_HOME", str(tmp_path / "home"))
    target, draft, random_init = defaults.default_model_dirs()
    assert random_init and target.is_relative_to(tmp_path / "home")
    assert load_model(draft).config.vocab_size == load_model(target).config.vocab_size
    assert "RANDOM-INIT" in defaults.RANDOM_INIT_NOTICE
