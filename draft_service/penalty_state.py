"""A draft's own count of each penalised sequence's tokens, so that it guesses from its logits
penalised as the target's are at each position (kernels/penalties.py): with a strong logit_bias or
repetition penalty the target's argmax moves, and a draft that did not follow would guess what the
target then refuses; a sampled row's q is the penalised distribution, nearer the target's p.

The penalties travel with a sequence's first item (``ProposeItem.penalties``, on an item with
``rollback_to`` 0; ``output_start`` the prompt's length). The draft keeps the sequence's tokens
that it holds (the appended ones, the forced ones and the guesses it keeps) and the output's counts
beside them: each item rolls them back to ``rollback_to`` and appends; each guess is taken as it
is picked, so guess j is scored with the counts its position would have; after the call they are
cut to what the draft holds.

A row that falls out of step (the target rolls back past what it holds) is dropped: that sequence
is drafted unpenalised from then on, which costs acceptance, never exactness (the target verifies
against its own penalised p).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable

import torch

from kernels.penalties import apply_penalties, count_vector, id_mask
from specstream.data.penalties import Penalties
from specstream.data.propose import ProposeItem

log = logging.getLogger(__name__)

__all__ = ["DraftPenalties", "PenaltyRow"]


class PenaltyRow:
    """One sequence's penalties and the tokens it holds: the prompt's (before ``start``) and the output's counts."""

    def __init__(self, penalties: Penalties, start: int) -> None:
        self.penalties = penalties
        self.start = start
        self.tokens: list[int] = []
        self.output: Counter[int] = Counter()
        self._prompt: torch.Tensor | None = None  # the prompt's ids as a bool [V], built once

    def take(self, tokens: list[int]) -> None:
        for token in tokens:
            if len(self.tokens) >= self.start:
                self.output[token] += 1
            self.tokens.append(token)

    def hold(self, length: int) -> bool:
        """Cuts back to the first ``length`` tokens; False when it holds fewer."""
        if length > len(self.tokens):
            return False
        for token in self.tokens[max(length, self.start):]:
            self.output[token] -= 1
            if not self.output[token]:
                del self.output[token]
        del self.tokens[length:]
        return True

    def apply(self, scores: torch.Tensor, vocab: int, columns: torch.Tensor | None) -> None:
        """The logits [N] of the next position (after every token taken), penalised in place."""
        if self._prompt is None:
            self._prompt = id_mask(self.tokens[: self.start], vocab, scores.device)
        counts = count_vector(self.output, vocab, scores.dtype, scores.device)
        apply_penalties(scores, self.penalties, counts, self._prompt, columns)


class DraftPenalties:
    """The penalty rows of a draft's penalised sequences, by key."""

    def __init__(self) -> None:
        self.rows: dict[Hashable, PenaltyRow] = {}

    def sync(self, item: ProposeItem) -> PenaltyRow | None:
        """The item's row with ``append`` taken (None: not penalised, or dropped). A first item
        with penalties starts the row."""
        if item.rollback_to == 0:
            self.rows.pop(item.key, None)
            if item.penalties is not None:
                self.rows[item.key] = PenaltyRow(item.penalties, item.output_start)
        row = self.rows.get(item.key)
        if row is None:
            return None
        if not row.hold(item.rollback_to):
            self.rows.pop(item.key, None)
            log.debug("sequence %r drafts unpenalised from now on: rolled back past what it holds", item.key)
            return None
        row.take(item.append)
        return row

    def hold(self, key: Hashable, length: int) -> None:
        """After a call: the row cut to the ``length`` tokens the draft now holds."""
        row = self.rows.get(key)
        if row is not None and not row.hold(length):
            self.rows.pop(key, None)

    def release(self, keys: list[Hashable]) -> None:
        for key in keys:
            self.rows.pop(key, None)
