"""Benchmark prompts: the openings of held-out standard-library files (never trained on), and
nonsense: made-up words that no draft can predict (what a user sends to test a model, or text in
a script or language nobody trained on)."""

from __future__ import annotations

import random

from specstream.text.tokenizer import TextTokenizer

# Syllables for made-up words: pronounceable, so a tokenizer splits them into several common pieces.
SYLLABLES = ("zor", "blik", "quan", "fet", "mu", "grax", "tiv", "oob", "plen", "shra", "dek", "wum", "yal", "kro",
             "nib")


def held_out_prompts(tok: TextTokenizer, n: int, length: int = 48) -> list[list[int]]:
    from tools.train_demo import held_out_prompts as first_tokens
    from tools.train_demo import read_texts, stdlib_files

    _, held_out = stdlib_files()
    return first_tokens(tok, read_texts(held_out), n, length)


def nonsense_texts(n: int, seed: int = 7) -> list[str]:
    """``n`` lines of 8-20 made-up words (1-3 syllables each), the same for the same seed."""
    rng = random.Random(seed)

    def word() -> str:
        return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))

    return [" ".join(word() for _ in range(rng.randint(8, 20))) for _ in range(n)]
