"""A model-free proposer with a chosen acceptance rate, for measuring system overhead.

It replays the target's own greedy continuation of each prompt (recorded in a first pass, given
as an "oracle" file) and corrupts each proposed token independently with probability 1 − α. Its
proposals are accepted exactly as in Leviathan et al.'s i.i.d. model with rate α, and it costs
almost nothing (c ≈ 0), so the measured speedup against (1 − α^(γ+1)) / (1 − α) isolates the
serving system's own overhead from draft quality. A benchmark tool: never a default.
"""

from __future__ import annotations

import json
import random
from collections.abc import Hashable
from pathlib import Path

from specstream.data.propose import Proposal, ProposeItem, Proposer, with_forced_appended

SOURCE = "synthetic"  # Proposal.source of this proposer's guesses


class SyntheticProposer(Proposer):
    def __init__(self, oracle: list[list[int]], vocab_size: int, alpha: float, seed: int = 0,
                 max_len: int = 1 << 20) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha={alpha!r}: must be in [0, 1]")
        self.oracle = [list(seq) for seq in oracle]  # prompt + the target's greedy continuation
        self.vocab_size = vocab_size
        self.alpha = alpha
        self.max_len = max_len
        self.name = f"synthetic-alpha-{alpha:g}"
        self._rng = random.Random(seed)
        self._context: dict[Hashable, list[int]] = {}
        self._truth: dict[Hashable, list[int] | None] = {}

    @classmethod
    def from_file(cls, path: str | Path, alpha: float, seed: int = 0) -> SyntheticProposer:
        data = json.loads(Path(path).read_text())
        return cls(data["sequences"], data["vocab_size"], alpha, seed)

    @property
    def held(self) -> int:
        return len(self._context)

    @property
    def free_slots(self) -> int:
        return 1 << 16

    def release(self, keys: list[Hashable]) -> None:
        for key in keys:
            self._context.pop(key, None)
            self._truth.pop(key, None)

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        return [self._one(with_forced_appended(item)) for item in items]

    def _one(self, item: ProposeItem) -> Proposal:
        context = self._context.get(item.key)
        if context is None:
            if item.rollback_to != 0:
                return Proposal([], 0, source=SOURCE)
            context = self._context[item.key] = []
        if item.rollback_to > len(context):
            self.release([item.key])
            return Proposal([], 0, source=SOURCE)
        del context[item.rollback_to:]
        context.extend(item.append)
        truth = self._truth.get(item.key)
        if truth is None:
            truth = self._truth[item.key] = next(
                (seq for seq in self.oracle if seq[: len(context)] == context), [])
        upcoming = truth[len(context): len(context) + item.gamma] if truth[: len(context)] == context else []
        tokens = [t if self._rng.random() < self.alpha else self._other(t) for t in upcoming]
        # Holds the context and the guesses fed back, like a model-based draft would.
        context.extend(tokens[:-1])
        return Proposal(tokens, len(context), source=SOURCE)

    def _other(self, token: int) -> int:
        """A token that is certainly not the target's."""
        return (token + 1 + self._rng.randrange(self.vocab_size - 1)) % self.vocab_size
