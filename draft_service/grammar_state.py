"""A draft's own place in each constrained sequence's grammar, so that it guesses from its masked
distribution (docs/architecture.md §7.5): a guess the grammar refuses is one the target is sure to
reject, and masking it moves the draft's mass onto tokens the target can keep.

The constraint travels with a sequence's first item (``ProposeItem.constraint``, on an item with
``rollback_to`` 0; ``output_start`` the position of the first token the grammar reads: the
prompt's length). The draft compiles it on its own tokenizer (cached by source, as the target's)
and keeps one matcher per sequence at the tokens it holds: each item rolls the matcher back to
``rollback_to``, feeds it the appended tokens, and each guess is drawn from the draft's logits
masked by the matcher's mask there, then fed to it (``DraftProposer``'s and ``FeatureProposer``'s
picker, draft_service/proposer.py). After the call the matcher is rolled back to what the draft
holds.

A draft without a tokenizer, a constraint it cannot compile, or a matcher that falls out of step
with what the draft holds (its grammar ended inside a round of guesses) guesses that sequence's
tokens unmasked from then on: the target cuts what the grammar refuses (target_service/grammar_rows.py),
so the output is the same, only fewer guesses are kept.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

import numpy as np

from specstream.data.errors import InvalidArgumentError
from specstream.data.propose import ProposeItem
from specstream.text.grammar import GrammarCompiler, GrammarError, Matcher, fill_masks, unpack

log = logging.getLogger(__name__)

__all__ = ["DraftGrammars", "GrammarRow"]


class GrammarRow:
    """One sequence's matcher, at the tokens of positions ``start`` .. ``start + consumed - 1``."""

    def __init__(self, matcher: Matcher, start: int) -> None:
        self.matcher = matcher
        self.start = start
        self.consumed = 0
        self.live = True  # False once a guess went past where the grammar ends (this round only)

    def take(self, tokens: list[int]) -> bool:
        """Feeds ``tokens``; False (and nothing more is fed) when the grammar refuses one, or its
        matcher fails (llguidance's limits)."""
        try:
            n = self.matcher.consume(tokens) if tokens else 0
        except GrammarError:  # its place is lost: the sequence is drafted unmasked from now on
            self.live = False
            return False
        self.consumed += n
        if n < len(tokens):
            self.live = False
        return n == len(tokens)

    def hold(self, length: int) -> bool:
        """Rolls back to the first ``length`` tokens of the sequence; False when it holds fewer."""
        keep = max(0, length - self.start)
        if keep > self.consumed or self.matcher.failed is not None:
            return False
        self.matcher.rollback(self.consumed - keep)
        self.consumed = keep
        self.live = True
        return True


def allowed_rows(rows: list[GrammarRow]) -> list[np.ndarray | None]:
    """Per row, the tokens its grammar allows next (bool [V] over the tokenizer's ids), in one
    llguidance call; None where the row guesses unmasked (past its grammar's end, or nothing allowed)."""
    live = [i for i, row in enumerate(rows) if row.live and not row.matcher.stopped]
    out: list[np.ndarray | None] = [None] * len(rows)
    for i, bits in zip(live, fill_masks([(rows[i].matcher, []) for i in live])):
        allowed = unpack(bits[0], rows[i].matcher.vocab_size)
        if allowed.any():
            out[i] = allowed
    return out


class DraftGrammars:
    """The matchers of a draft's constrained sequences, by key."""

    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler
        self.rows: dict[Hashable, GrammarRow] = {}
        self.unmasked = 0  # sequences drafted unmasked: no compiler, a constraint refused, out of step

    def sync(self, item: ProposeItem) -> GrammarRow | None:
        """The item's row at ``rollback_to`` + ``append``, before its guesses (None: free text, or
        drafted unmasked). A first item with a constraint starts the row."""
        row = self._row(item)
        if row is None:
            return None
        if not row.hold(item.rollback_to) or not row.take(item.append[max(0, row.start - item.rollback_to):]):
            self._drop(item.key, "its matcher fell out of step with the tokens held")
            return None
        return row

    def follow(self, item: ProposeItem, tokens: list[int]) -> GrammarRow | None:
        """``sync`` for a holder that keeps the sequence's tokens itself (``tokens``: all of them,
        the item's applied) and may hold more than this row was fed (a lookup in front of a token
        draft keeps the model's guesses): the row is rolled back to what it shares with ``tokens``
        up to ``rollback_to``, then fed the rest."""
        row = self._row(item)
        if row is None:
            return None
        keep = max(row.start, min(row.start + row.consumed, item.rollback_to))
        if not row.hold(keep) or not row.take(tokens[keep:]):
            self._drop(item.key, "its matcher fell out of step with the tokens held")
            return None
        return row

    def hold(self, key: Hashable, length: int) -> None:
        """After a call: the row rolled back to the ``length`` tokens the draft now holds."""
        row = self.rows.get(key)
        if row is not None and not row.hold(length):
            self._drop(key, "its grammar ended inside the round of guesses")

    def release(self, keys: list[Hashable]) -> None:
        for key in keys:
            self.rows.pop(key, None)

    def _row(self, item: ProposeItem) -> GrammarRow | None:
        """The item's row as held (a first item with a constraint starts it afresh); None: none."""
        if item.constraint is not None and item.rollback_to == 0:
            self.rows.pop(item.key, None)
            if (row := self._start(item)) is None:
                return None
            self.rows[item.key] = row
        return self.rows.get(item.key)

    def _start(self, item: ProposeItem) -> GrammarRow | None:
        if self.compiler is None:
            self.unmasked += 1
            return None
        try:
            grammar = self.compiler.compile(item.constraint)
        except InvalidArgumentError as err:  # the target compiled it on its tokenizer; this draft's differs
            log.warning("sequence %r drafts unmasked: this draft cannot compile its constraint: %s", item.key, err)
            self.unmasked += 1
            return None
        return GrammarRow(grammar.matcher(), item.output_start)

    def _drop(self, key: Hashable, why: str) -> None:
        self.rows.pop(key, None)
        self.unmasked += 1
        log.debug("sequence %r drafts unmasked from now on: %s", key, why)
