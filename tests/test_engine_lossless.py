"""Losslessness in one process: speculative greedy output == plain target greedy output, token
for token, for 20 prompts x gamma in {1, 2, 4, 8} x three kinds of draft (docs/architecture.md §7)."""

from __future__ import annotations

import random

import pytest
from tests.support.engine_harness import naive_greedy, run_engine

from specstream.text.tokenizer import TextTokenizer

MAX_NEW = 24


def _prompts(tokenizer: TextTokenizer, vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    texts = ["def main():", "The weather", "x = 1", "import os", "Hello, world", "for i in range(3):",
             "She said", "return None", "class A:", "2 + 2 ="]
    prompts = [tokenizer.encode(t) for t in texts]
    prompts += [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(10)]
    return prompts


@pytest.fixture(scope="module")
def prompts(model_zoo):
    tok = TextTokenizer.from_dir(model_zoo["target"])
    return _prompts(tok, tok.vocab_size)


@pytest.fixture(scope="module")
def plain(model_zoo, prompts):
    tokens, finals = run_engine(model_zoo["target"], None, prompts, gamma=0, max_new_tokens=MAX_NEW)
    assert all(f.stats.draft_tokens == 0 for f in finals)
    return tokens


def test_plain_engine_matches_naive_greedy(model_zoo, prompts, plain):
    for prompt, got in list(zip(prompts, plain))[::4]:
        assert got == naive_greedy(model_zoo["target"], prompt, MAX_NEW)


def test_outputs_are_not_degenerate(plain):
    # A check that could pass vacuously if every prompt produced the same run of one token.
    assert len({tuple(t) for t in plain}) > 10
    assert sum(len(set(t)) > 3 for t in plain) > 10


@pytest.mark.parametrize("draft_kind", ["same", "unrelated", "partial"])
@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
def test_speculative_equals_plain(model_zoo, prompts, plain, draft_kind, gamma):
    tokens, finals = run_engine(model_zoo["target"], model_zoo[draft_kind], prompts, gamma=gamma,
                                max_new_tokens=MAX_NEW)
    for i, (got, want) in enumerate(zip(tokens, plain)):
        assert got == want, f"prompt {i}: speculative {got} != plain {want}"
    proposed = sum(f.stats.draft_tokens for f in finals)
    accepted = sum(f.stats.accepted_tokens for f in finals)
    assert proposed > 0
    alpha = accepted / proposed
    if draft_kind == "same":  # every proposal accepted: the bonus token path
        assert accepted == proposed, (accepted, proposed)
        passes = sum(f.stats.target_passes for f in finals)
        assert passes < len(prompts) * (1 + MAX_NEW)  # fewer target passes than plain decoding
    elif draft_kind == "unrelated":  # the rejection path
        assert alpha < 0.5, alpha
    else:
        assert 0.05 < alpha < 1.0, alpha


@pytest.mark.parametrize("prompt_index,at,is_eos,finish", [(0, 5, False, "stop"), (1, 3, True, "eos")],
                         ids=["stop-id", "eos"])
def test_stop_or_eos_inside_accepted_run_truncates(model_zoo, prompts, plain, prompt_index, at, is_eos, finish):
    """A stop id / EOS inside an accepted run ends the sequence there, exactly as plain decoding
    does, with finish reason stop or eos."""
    prompt, want = prompts[prompt_index], plain[prompt_index]
    stop = want[at]
    cut = want[: want.index(stop) + 1]
    for gamma in (0, 8):
        tokens, finals = run_engine(model_zoo["target"], model_zoo["same"], [prompt], gamma=gamma,
                                    max_new_tokens=MAX_NEW, stop_ids=[stop], eos_ids=[stop] if is_eos else [])
        assert tokens[0] == cut
        assert finals[0].finish_reason == finish


def test_max_new_tokens_is_exact_with_speculation(model_zoo, prompts, plain):
    for max_new in (1, 2, 5):
        tokens, finals = run_engine(model_zoo["target"], model_zoo["same"], prompts[:3], gamma=8,
                                    max_new_tokens=max_new)
        assert tokens == [p[:max_new] for p in plain[:3]]
        assert all(f.finish_reason == "length" for f in finals)
