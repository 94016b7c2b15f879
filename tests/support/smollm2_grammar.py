"""SmolLM2's real tokenizer and a grammar compiler on it, for the tests of constraints and tool
calls (tests/test_grammar.py, tests/test_tools.py): imported by name as fixtures."""

from __future__ import annotations

import pytest

from specstream.models.registry import resolve_model
from specstream.text.grammar import GrammarCompiler
from specstream.text.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_dir(resolve_model("smollm2"))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer)
