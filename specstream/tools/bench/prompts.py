"""Benchmark prompts: the openings of held-out standard-library files (never trained on)."""

from __future__ import annotations

from specstream.text.tokenizer import TextTokenizer


def held_out_prompts(tok: TextTokenizer, n: int, length: int = 48) -> list[list[int]]:
    from specstream.tools.train_demo import held_out_prompts as first_tokens
    from specstream.tools.train_demo import read_texts, stdlib_files

    _, held_out = stdlib_files()
    return first_tokens(tok, read_texts(held_out), n, length)
