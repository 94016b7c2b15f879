"""Prompt lookup: guesses copied from where the sequence's latest tokens occurred before. No model.

For n = max_n down to min_n, the sequence's last n tokens (its suffix) are looked up among its
earlier n-grams; the longest n with an earlier occurrence wins, and among the occurrences of that
n-gram the latest one (the largest start p below len - n: never the suffix itself). The guesses are
the tokens that followed it, copied as if each guess were already appended (an LZ77 overlapping
copy): guess j is token p + n + j of the sequence extended by guesses 0..j-1. So an occurrence that
overlaps the suffix extrapolates the repeat ("a b a b a", n = 2: suffix "b a" occurs at p = 1,
guesses "b a b a ..."), and up to γ tokens come from any match. Every earlier occurrence has at
least one token after it (p + n <= len - 1), so "a match with no continuation" cannot happen: the
only n-gram with nothing after it is the suffix itself, which never counts. No earlier occurrence
for any n: no guesses (the target then decodes plainly, or a combined proposer asks its model).

A greedy item that allows branches (``ProposeItem.branches``) also gets the other earlier
occurrences' next tokens as branches at the first position: each shorter suffix's latest
occurrence (one per n below the winning one) whose next token differs from the chain's first guess
and from the branches before it, up to ``branches`` of them (``Proposal.parents``: children of the
root), so where the text could go on as it did after more than one earlier passage, the target
checks both in one pass.

Guesses are deterministic, so they go out with q_width 0 and the target verifies them as point
masses, which is exact for greedy and sampled requests alike. They are not held: `length` is the
sequence as committed by the target (whose next append then starts with the accepted guesses).

The cost of a step does not grow with the sequence: each sequence keeps a dict from n-gram to its
latest start, updated as tokens arrive, and an undo log so that a rollback restores exactly the
dict it had before the dropped tokens (see `NgramIndex`).
Knows nothing about gRPC, the target or tokenizers: keys are opaque, tokens are ints.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from specstream.data.propose import Proposal, ProposeItem, Proposer, with_forced_appended, without_masked

SOURCE = "ngram"  # Proposal.source of this proposer's guesses
# Reported as the vocabulary size: ids are copied back whatever they are, so the target need not
# keep any sequence from speculating (the largest id the wire's uint32 can say).
ANY_ID = 2**32 - 1


class NgramIndex:
    """One sequence's tokens, and where each of its n-grams (min_n <= n <= max_n) last started.

    Invariant: `_latest` maps each n-gram that ends before the last token (start p with
    p + n <= len - 1) to its largest such p, and nothing else. So looking up the suffix itself
    finds its latest *earlier* occurrence. `_undo` holds, in the order entries were written, what
    each write replaced (-1: no entry), so `truncate` unwinds writes newest first back to exactly
    the dict the shorter sequence had.
    """

    def __init__(self, min_n: int, max_n: int, canonical: Sequence[int] | None = None) -> None:
        """``canonical``: per token id the id its n-grams are matched by (``space_free_ids``: a
        word with its leading space is the word without), so that a JSON value that starts after a
        quote finds the prompt's words; None: the ids themselves. Guesses are the ids that followed."""
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._canonical = canonical
        self._keys: list[int] = self.tokens if canonical is None else []  # what n-grams are made of
        self._latest: dict[tuple[int, ...], int] = {}  # one dict for every n: tuple lengths differ
        self._undo: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            # The n-grams ending at the current last token stop being suffixes: index them.
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                gram = tuple(self._keys[end - n:end])
                self._undo.append(self._latest.get(gram, -1))
                self._latest[gram] = end - n
            self.tokens.append(token)
            if self._canonical is not None:
                self._keys.append(self._canonical[token] if 0 <= token < len(self._canonical) else token)

    def truncate(self, length: int) -> None:
        """Keeps the first `length` tokens (at most len(self))."""
        assert 0 <= length <= len(self.tokens)
        # Unindex the n-grams that `extend` indexed when tokens length..len-1 arrived, newest first.
        for end in range(len(self.tokens) - 1, length - 1, -1):
            for n in range(min(self.max_n, end), self.min_n - 1, -1):
                gram = tuple(self._keys[end - n:end])
                previous = self._undo.pop()
                if previous < 0:
                    del self._latest[gram]
                else:
                    self._latest[gram] = previous
        if length == 0:
            assert not self._undo and not self._latest
        del self.tokens[length:]
        if self._canonical is not None:
            del self._keys[length:]

    def proposal(self, gamma: int, branches: int) -> tuple[list[int], list[int]]:
        """(tokens, parents): the chain, up to `gamma` guesses after the latest earlier occurrence of
        the longest suffix that has one (module docstring; none when none has), then up to
        ``branches`` other first guesses as children of the root: the token after the latest earlier
        occurrence of each shorter suffix (longest first) where it differs from the chain's first and
        the branches before it (parents empty when there are none)."""
        size = len(self.tokens)
        suffixes = range(min(self.max_n, size - 1), self.min_n - 1, -1)
        match = next(((n, start) for n in suffixes if (start := self._latest.get(tuple(self._keys[size - n:])))
                      is not None), None)
        if match is None or gamma <= 0:
            return [], []
        n, start = match
        source = start + n  # <= size - 1: at least one token follows the occurrence
        chain: list[int] = []
        for j in range(gamma):  # chain[j] copies position source + j of tokens + chain
            at = source + j
            chain.append(self.tokens[at] if at < size else chain[at - size])
        others: list[int] = []
        for shorter in range(n - 1, self.min_n - 1, -1):
            if len(others) == branches:
                break
            earlier = self._latest.get(tuple(self._keys[size - shorter:]))
            token = self.tokens[earlier + shorter] if earlier is not None else None
            if token is not None and token != chain[0] and token not in others:
                others.append(token)
        return chain + others, (list(range(len(chain))) + [0] * len(others)) if others else []


class NgramProposer(Proposer):
    """Prompt-lookup proposals (module docstring) for up to `max_slots` sequences of up to
    `max_len` tokens each; the same interface and protocol errors as DraftProposer."""

    def __init__(self, max_slots: int, max_len: int, min_n: int = 1, max_n: int = 4,
                 canonical: Sequence[int] | None = None) -> None:
        """``canonical``: a constrained sequence's n-grams are matched by these ids (NgramIndex),
        down to single tokens (its guesses are checked against its grammar: GrammarLookup)."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"min_n={min_n!r}, max_n={max_n!r}: must be 1 <= min_n <= max_n")
        if max_slots < 1:
            raise ValueError(f"max_slots={max_slots!r}: must be >= 1")
        self.max_slots = max_slots  # bounds the memory: about 100 bytes per token per n
        self.max_len = max_len
        self.min_n, self.max_n = min_n, max_n
        self.canonical = canonical
        self.name = SOURCE
        self.vocab_size = ANY_ID
        self.sequences: dict[Hashable, NgramIndex] = {}

    @property
    def held(self) -> int:
        return len(self.sequences)

    @property
    def free_slots(self) -> int:
        return self.max_slots - len(self.sequences)

    def release(self, keys: list[Hashable]) -> None:
        for key in keys:
            self.sequences.pop(key, None)

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        out = []
        for item in items:
            item = with_forced_appended(item)  # forced tokens are held as context: lookup goes on from them
            sequence = self.sync(item)
            if sequence is None:
                out.append(Proposal([], 0, source=SOURCE))
                continue
            gamma = min(item.gamma, self.max_len - len(sequence))
            tokens, parents = sequence.proposal(gamma, item.branches if item.sampling.greedy else 0)
            tokens, parents = without_masked(item, tokens, parents)  # lookup's guesses draw nothing at random
            out.append(Proposal(tokens, len(sequence), source=SOURCE, parents=parents))
        return out

    def sync(self, item: ProposeItem) -> NgramIndex | None:
        """Brings the sequence to its first `rollback_to` tokens plus `append`; None (its state
        dropped) when it is unknown and rollback_to > 0, no slot is free, or the item breaks the
        protocol (rollback_to beyond what is held, nothing appended, longer than max_len)."""
        sequence = self.sequences.get(item.key)
        if sequence is None:
            if item.rollback_to != 0 or len(self.sequences) >= self.max_slots:
                return None
            constrained = item.constraint is not None and self.canonical is not None
            sequence = self.sequences[item.key] = (NgramIndex(1, self.max_n, self.canonical) if constrained
                                                   else NgramIndex(self.min_n, self.max_n))
        if item.rollback_to > len(sequence) or not item.append or item.rollback_to + len(item.append) > self.max_len:
            self.release([item.key])
            return None
        sequence.truncate(item.rollback_to)
        sequence.extend(item.append)
        return sequence
