"""A request's constraint (specstream/data/constraint.py) compiled against the model's tokenizer, and
the per-sequence matcher that says which tokens may come next.

The grammar library is llguidance: no dependencies, lazy compilation (a hostile schema costs little
before its limits refuse it), forced tokens, ``validate_tokens`` and ``rollback`` for speculation,
and work outside the GIL. xgrammar, the alternative, declares torch, transformers and triton and
compiles eagerly.

Bounds: llguidance's parser limits (``LIMITS``) cap a grammar's size and the lexer work of its
compilation and of each mask, so a costly schema or grammar is refused as an error, never left
running; the source's own size is bounded before it gets here (``MAX_SOURCE_BYTES``).

``GrammarCompiler(tokenizer).compile(constraint)`` -> ``Grammar`` (compiled once, cached by its
source); ``grammar.matcher()`` -> ``Matcher``, one per sequence: ``allowed()`` the mask of the next
position, ``consume(tokens)`` commits the tokens it accepts, ``rollback(n)`` takes the last n back,
``forced()`` the tokens the grammar allows alone from here.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import torch

from specstream.data.constraint import Constraint
from specstream.data.errors import InvalidArgumentError
from specstream.text.tokenizer import TextTokenizer

__all__ = ["JSON_OPTIONS", "LIMITS", "Grammar", "GrammarCompiler", "Matcher"]

# llguidance's defaults (lexer fuel ~50k/ms at compilation, ~14k/ms a mask), with error messages
# that name the reason but not the parser's state.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# JSON as json.dumps(separators=(",", ":")) writes it: no free whitespace, which a model can repeat
# until its budget ends (the answer never closing), and which hides the structure that is forced
# (after ``{`` the one required key follows with no choice). A schema's own "x-guidance" wins.
JSON_OPTIONS = {"whitespace_flexible": False}


class Grammar:
    """A compiled constraint: a matcher at its start, copied for every sequence (not compiled again)."""

    def __init__(self, start: llguidance.LLMatcher, vocab_size: int) -> None:
        self._start = start
        self._vocab_size = vocab_size

    def matcher(self) -> Matcher:
        return Matcher(self._start.deep_copy(), self._vocab_size)


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self._bits = llg_numpy.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
        self._shifts = np.arange(32, dtype=np.int32)

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows at the next position (EOS where it may end) -> bool [V]."""
        llg_numpy.fill_next_token_bitmask(self._m, self._bits, 0)
        self._check()
        bits = (self._bits[0, :, None] >> self._shifts) & 1  # [ceil(V / 32), 32]
        return torch.from_numpy(bits.reshape(-1)[: self.vocab_size].astype(bool))

    def consume(self, tokens: list[int]) -> int:
        """Commits the longest prefix of ``tokens`` the grammar accepts; how many that was."""
        n = self._m.validate_tokens(tokens)
        if n and not self._m.consume_tokens(tokens[:n]):
            self._check()
        return n

    def rollback(self, n: int) -> None:
        """Takes the last n committed tokens back."""
        if n and not self._m.rollback(n):
            self._check()

    def forced(self) -> list[int]:
        """The tokens that follow whatever the model says (the grammar allows nothing else)."""
        return self._m.compute_ff_tokens()

    @property
    def accepting(self) -> bool:
        """Whether the output may end here."""
        return self._m.is_accepting()

    @property
    def stopped(self) -> bool:
        """Whether the grammar allows nothing more (only EOS, or it has ended)."""
        return self._m.is_stopped()

    def _check(self) -> None:
        if self._m.is_error():
            raise RuntimeError(f"grammar matcher: {self._m.get_error()}")


class GrammarCompiler:
    """Compiles constraints for one tokenizer; keeps the last ``capacity`` grammars by source."""

    def __init__(self, tokenizer: TextTokenizer, capacity: int = 64) -> None:
        hf = tokenizer.tokenizer
        self._tokenizer = llguidance.LLTokenizer(hf.to_str(), n_vocab=tokenizer.vocab_size,
                                                 eos_token=list(tokenizer.eos_token_ids))
        self._cache: OrderedDict[Constraint, Grammar] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> Grammar:
        """Raises InvalidArgumentError naming the constraint's field and the compiler's reason."""
        with self._lock:
            grammar = self._cache.get(constraint)
            if grammar is not None:
                self._cache.move_to_end(constraint)
                return grammar
        start = llguidance.LLMatcher(self._tokenizer, _grammar_text(constraint), log_level=0, limits=LIMITS)
        if start.is_error():
            raise InvalidArgumentError(constraint.field, constraint.source, start.get_error())
        grammar = Grammar(start, self._tokenizer.vocab_size)
        with self._lock:
            self._cache[constraint] = grammar
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return grammar


def _grammar_text(c: Constraint) -> str:
    """The constraint as llguidance's grammar text."""
    try:
        if c.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(c.source, defaults=JSON_OPTIONS)
        if c.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if c.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(c.source)
        if c.kind == "choice":  # JSON string literals are Lark's
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in c.choices))
        return llguidance.LLMatcher.grammar_from_lark(c.source)
    except ValueError as err:
        raise InvalidArgumentError(c.field, c.source, str(err)) from None
