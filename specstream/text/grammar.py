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
source; ``cached(constraint)`` looks without compiling); ``grammar.matcher()`` -> ``Matcher``, one
per sequence: ``allowed()`` the mask of the next position, ``valid_prefix(tokens)`` how many of some
guesses it accepts, ``consume(tokens)`` commits
the tokens it accepts, ``rollback(n)`` takes the last n back, ``forced()`` the tokens the grammar
allows alone from here, ``likely()`` those and the likely tokens on where the text it allows
alone may be tokenized more ways than one. ``fill_masks`` fills the masks of a whole batch of speculative rows (after
the committed tokens and after each valid guess): in one call off the GIL on llguidance's threads,
or on the calling thread, where a position whose token the grammar forces costs no mask
computation; ``sole_tokens`` reads which masks allow one token only.
A matcher that reaches llguidance's limits mid-output fails (``failed``, ``GrammarError``) without
failing the batch: its sequence ends with an error when it commits (target_service/sequence.py).

Masks are packed bits (``int32 [rows, ceil(V / 32)]``, bit j of word w: token 32 w + j), as the
library writes them; ``unpack`` turns them into booleans. No torch here: the gateway compiles
constraints to refuse bad ones before any work, and it does not load torch.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from pathlib import Path

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from specstream.data.constraint import Constraint
from specstream.data.errors import InvalidArgumentError
from specstream.text.token_habits import TokenHabits
from specstream.text.tokenizer import TextTokenizer

__all__ = ["JSON_OPTIONS", "LIMITS", "Grammar", "GrammarCompiler", "GrammarError", "Matcher", "compiler_for", "fill_masks",
           "mask_words", "sole_tokens", "unpack"]

# llguidance's defaults (lexer fuel ~50k/ms at compilation, ~14k/ms a mask), with error messages
# that name the reason but not the parser's state.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# JSON as json.dumps(separators=(",", ":")) writes it: no free whitespace, which a model can repeat
# until its budget ends (the answer never closing), and which hides the structure that is forced
# (after ``{`` the one required key follows with no choice). A schema's own "x-guidance" wins.
JSON_OPTIONS = {"whitespace_flexible": False}
_EXECUTOR = llguidance.LLExecutor()  # llguidance's thread pool: a batch's masks in parallel, off the GIL


def mask_words(vocab_size: int) -> int:
    """int32 words in one packed mask."""
    return (vocab_size + 31) // 32


def unpack(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """Packed masks int32 [..., W] -> bool [..., vocab_size] (ids past 32 W: False). One pass of
    numpy's bit unpacking over the words' little-endian bytes (bit j of word w: byte 4w + j // 8)."""
    octets = np.ascontiguousarray(bits, dtype="<i4").view(np.uint8)  # [..., 4 W]
    flat = np.unpackbits(octets, axis=-1, bitorder="little").view(bool)  # [..., 32 W]
    if flat.shape[-1] >= vocab_size:
        return flat[..., :vocab_size]
    return np.concatenate([flat, np.zeros((*flat.shape[:-1], vocab_size - flat.shape[-1]), dtype=bool)], axis=-1)


def fill_masks(rows: list[tuple[Matcher, list[int]]], threads: bool = True) -> list[np.ndarray]:
    """Per (matcher, guesses), the packed masks int32 [len(guesses) + 1, W] of the position after
    the committed tokens and after each guess, the matcher left where it was. Every guess must be
    one the grammar accepts (``Matcher.valid_prefix``). ``threads``: one call for the batch, which
    llguidance fills on its own threads without the GIL (worth it where a core is free beside the
    target's forward); else here, position after position (``Matcher.fill``: a forced position
    costs no mask computation)."""
    if not rows:
        return []
    words = mask_words(rows[0][0].vocab_size)
    counts = [len(guesses) + 1 for _, guesses in rows]
    out = np.zeros((sum(counts), words), dtype=np.int32)
    starts = np.cumsum([0, *counts[:-1]]).tolist()
    if threads:
        drafted = [(m._m, at, list(guesses)) for (m, guesses), at in zip(rows, starts) if guesses]
        plain = [(m._m, at) for (m, guesses), at in zip(rows, starts) if not guesses]
        if drafted:
            _EXECUTOR.unsafe_compute_mask_ptr_with_draft_token(drafted, out.ctypes.data, words * 4, out.shape[0])
        if plain:
            _EXECUTOR.unsafe_compute_mask_ptr(plain, out.ctypes.data, words * 4, out.shape[0])
    else:
        for (matcher, guesses), at, count in zip(rows, starts, counts):
            matcher.fill(out[at : at + count], guesses)
    masks = [out[at : at + count] for at, count in zip(starts, counts)]
    for (matcher, _), mask in zip(rows, masks):
        if matcher.failed is not None:  # refuses nothing, as Matcher.mask
            mask[:] = -1
    return masks


def sole_tokens(masks: np.ndarray) -> list[int | None]:
    """Per packed mask int32 [..., W] (flattened to rows), the one token it allows, or None where it
    allows more (or none)."""
    bits = np.ascontiguousarray(masks).reshape(-1, masks.shape[-1]).view(np.uint32)
    single = np.flatnonzero(np.bitwise_count(bits).sum(axis=1) == 1)
    out: list[int | None] = [None] * bits.shape[0]
    for n in single.tolist():
        word = int(np.flatnonzero(bits[n])[0])
        out[n] = 32 * word + int(bits[n, word]).bit_length() - 1
    return out


class GrammarError(RuntimeError):
    """A matcher that can go no further: llguidance's parser limits reached at this point of the
    output (a grammar costlier than its first positions showed). The sequence ends with an error;
    the others in its batch go on."""


class Grammar:
    """A compiled constraint: a matcher at its start, copied for every sequence (not compiled again)."""

    def __init__(self, start: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer,
                 habits: TokenHabits | None = None) -> None:
        self._start = start
        self._tokenizer = tokenizer
        self._habits = habits

    def matcher(self) -> Matcher:
        return Matcher(self._start.deep_copy(), self._tokenizer, self._habits)


class Matcher:
    """One sequence's place in its grammar. ``habits``: how the model writes the text the grammar
    allows alone, where not canonically (``likely``; shared by the compiler's grammars)."""

    def __init__(self, matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer,
                 habits: TokenHabits | None = None) -> None:
        self._m = matcher
        self._tokenizer = tokenizer
        self.habits = habits
        self.vocab_size = tokenizer.vocab_size
        self._bits = llg_numpy.allocate_token_bitmask(1, self.vocab_size)  # [1, W] int32

    def mask(self) -> np.ndarray:
        """The packed mask int32 [W] of the next position; a failed matcher's (``failed``) refuses
        nothing, as in ``fill_masks``: its sequence ends with an error when it commits."""
        self.fill(self._bits, [])
        if self.failed is not None:
            self._bits[0] = -1
        return self._bits[0].copy()

    def fill(self, out: np.ndarray, guesses: list[int]) -> None:
        """Writes into ``out`` (int32 [len(guesses) + 1, W]) the packed masks of the next position
        and of the position after each guess (all accepted by the grammar), the matcher left where
        it was. Where the grammar forces a token, its mask is that token alone (tests/test_grammar.py:
        what llguidance's mask computation gives there) and costs no mask computation."""
        taken = 0
        for j in range(len(guesses) + 1):
            forced = self._m.compute_ff_tokens()
            if forced:
                out[j] = 0
                out[j].view(np.uint32)[forced[0] >> 5] = np.uint32(1 << (forced[0] & 31))
            else:
                llg_numpy.fill_next_token_bitmask(self._m, out, j)
            # A grammar that has ended (its guess j can only be EOS) takes no more tokens: the masks
            # after it stay empty (never reached), as llguidance's executor leaves them.
            if j == len(guesses) or self._m.is_stopped() or not self._m.consume_tokens([guesses[j]]):
                break
            taken += 1
        if taken:
            self._m.rollback(taken)

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows at the next position (EOS where it may end) -> bool [V]."""
        return unpack(self.mask(), self.vocab_size)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from here (nothing committed)."""
        known = next((i for i, t in enumerate(tokens) if not 0 <= t < self.vocab_size), len(tokens))
        return self._m.validate_tokens(tokens[:known]) if known else 0

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

    def likely(self, forced: list[int] | None = None, canonical: list[int] | None = None) -> list[int]:
        """``forced()`` and, where the text that follows whatever the model says may be tokenized
        more ways than one (after a JSON key, ``":"`` is the token ``":"``, or ``":`` then a token
        starting with a quote), the likely way on: that text's canonical tokenization (as the
        tokenizer encodes a prompt), rewritten where ``habits`` learned that the model writes it
        otherwise. The tokens past ``forced()`` are guesses, not certain. ``forced`` and
        ``canonical``: ``forced()`` and ``forced_text()`` here, where the caller has them already."""
        forced = self.forced() if forced is None else forced
        canonical = self.forced_text() if canonical is None else canonical
        if canonical[:len(forced)] != forced:  # the canonical way disagrees with what is certain
            return forced
        tail = canonical[len(forced):]
        tokens = forced + (self.habits.rewrite(tail) if self.habits is not None else tail)
        return tokens[:self.valid_prefix(tokens)]

    def ends_after(self, tokens: list[int]) -> bool:
        """Whether the grammar allows nothing but the end of the output once it takes ``tokens``
        (it accepts them; nothing is committed): the model's next token is its end."""
        if not tokens:
            return self._m.is_stopped()
        if self._m.validate_tokens(tokens) < len(tokens) or not self._m.consume_tokens(tokens):
            return False
        stopped = self._m.is_stopped()
        self.rollback(len(tokens))
        return stopped

    def forced_text(self) -> list[int]:
        """The canonical tokens of the text that follows whatever the model says (what the model's
        tokens for it are lined up with: ``TokenHabits.learn``)."""
        text = self._m.compute_ff_bytes()
        return self._tokenizer.tokenize_bytes(text) if text else []

    @property
    def accepting(self) -> bool:
        """Whether the output may end here."""
        return self._m.is_accepting()

    @property
    def stopped(self) -> bool:
        """Whether the grammar allows nothing more (only EOS, or it has ended)."""
        return self._m.is_stopped()

    @property
    def failed(self) -> str | None:
        """Why the matcher can go no further (a parser limit reached mid-output), or None."""
        return self._m.get_error() if self._m.is_error() else None

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"grammar matcher: {self._m.get_error()}")


class GrammarCompiler:
    """Compiles constraints for one tokenizer; keeps the last ``capacity`` grammars by source."""

    def __init__(self, tokenizer: TextTokenizer, capacity: int = 64) -> None:
        hf = tokenizer.tokenizer
        # What may end the output where the grammar lets it: the EOS ids and a chat's end of turn.
        ends = list(dict.fromkeys([*tokenizer.eos_token_ids, *([tokenizer.end_of_turn_id]
                                                             if tokenizer.end_of_turn_id is not None else [])]))
        self._tokenizer = llguidance.LLTokenizer(hf.to_str(), n_vocab=tokenizer.vocab_size, eos_token=ends)
        self.habits = TokenHabits(lambda token: self._tokenizer.decode_bytes([token]))
        self._text_tokenizer = tokenizer
        self._cache: OrderedDict[Constraint, Grammar] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    @property
    def text_tokenizer(self) -> TextTokenizer:
        """The tokenizer it compiles for."""
        return self._text_tokenizer

    @functools.cached_property
    def space_free_ids(self) -> list[int]:
        """TextTokenizer.space_free_ids: how a constrained row's lookup matches words (GrammarLookup)."""
        return self._text_tokenizer.space_free_ids()

    def cached(self, constraint: Constraint) -> Grammar | None:
        """The grammar if it is compiled already (costs nothing), else None."""
        with self._lock:
            grammar = self._cache.get(constraint)
            if grammar is not None:
                self._cache.move_to_end(constraint)
            return grammar

    def compile(self, constraint: Constraint) -> Grammar:
        """Raises InvalidArgumentError naming the constraint's field and the compiler's reason.
        Thread-safe; llguidance compiles without the GIL, so callers on an event loop run it in a
        thread (target_service/engine.py ``_compile``)."""
        grammar = self.cached(constraint)
        if grammar is not None:
            return grammar
        start = llguidance.LLMatcher(self._tokenizer, _grammar_text(constraint), log_level=0, limits=LIMITS)
        if start.is_error():
            raise InvalidArgumentError(constraint.field, constraint.source, start.get_error())
        grammar = Grammar(start, self._tokenizer, self.habits)
        first = grammar.matcher()  # its first mask, once: a grammar that allows no output at all is refused here
        allowed = first.mask()
        if first.failed is not None or not allowed.any():
            reason = f" ({first.failed})" if first.failed is not None else ""
            raise InvalidArgumentError(constraint.field, constraint.source,
                                       f"allows no output with this tokenizer{reason}")
        with self._lock:
            self._cache[constraint] = grammar
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return grammar


def compiler_for(model_dir: str | Path) -> GrammarCompiler | None:
    """The compiler for a model directory's tokenizer; None (constraints refused) without one."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return None
    return GrammarCompiler(TextTokenizer.from_dir(model_dir))


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
