"""Suffix drafting: guesses from what was already said, in this sequence and in earlier outputs. No model.

SuffixDecoding's idea (arXiv 2411.04975), on n-gram indexes rather than a suffix tree: an agent or
an application repeats itself, within a conversation and across requests, so the tokens that
followed earlier occurrences of the sequence's latest tokens are likely to follow again, and the
more often and the longer they matched, the further they can be trusted.

Two indexes are searched, each mapping an n-gram (``min_n`` <= n <= ``max_n``) to where it occurred
with at least one token after it:

- the sequence's own (its prompt and output, as prompt lookup has: draft_service/ngram.py), and
- its salt's corpus: the outputs of the sequences this proposer held before, under the same cache
  salt (``ProposeItem.cache_salt``), so one tenant's outputs are never proposed to another. The
  corpus is bounded (``capacity`` tokens over all salts; the oldest output goes first).

The longest suffix of the sequence (n from ``max_n`` down) that occurs in either gives the
candidates: its latest ``MAX_CANDIDATES`` occurrences in both. Each is weighed by how far back it
matches the sequence (compared token by token, up to ``MAX_MATCH``), and continues with the tokens
that followed it (an overlapping copy where it runs into the sequence's end, as prompt lookup's).
The chain follows, position by position, the continuation with the most weight, while its
confidence stays at or above ``MIN_CONFIDENCE``: each step multiplies it by

    weight of the chosen next token / (weight of every candidate still on the chain + 1)

so one short match is trusted for a token or two, a long or often repeated one for many: the
speculation length is scored from the counts, and the target's γ is the cap. A greedy item that
allows branches also gets the other first tokens with weight, heaviest first, as children of the
root. Guesses are deterministic (q_width 0: the target verifies point masses) and not held.

Knows nothing about gRPC, the target or tokenizers: keys are opaque, tokens are ints.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from itertools import islice

from draft_service.ngram import ANY_ID
from specstream.data.propose import Proposal, ProposeItem, Proposer, with_forced_appended, without_masked

SOURCE = "suffix"  # Proposal.source of this proposer's guesses
MAX_CANDIDATES = 32  # latest occurrences of the matched suffix weighed, in the sequence and in the corpus each
MAX_MATCH = 32  # how far back an occurrence is compared with the sequence (its weight's cap)
MIN_CONFIDENCE = 0.3  # the chain stops where its confidence would fall below this


class _Occurrences:
    """One growing token list's n-gram index: gram -> the positions right after its occurrences
    (ascending), for occurrences with a token after them. ``truncate`` undoes ``extend`` exactly."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # the grams ending at the last token now have a token after them
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.after.setdefault(tuple(self.tokens[end - n:end]), []).append(end)
            self.tokens.append(token)

    def truncate(self, length: int) -> None:
        for end in range(len(self.tokens) - 1, length - 1, -1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                gram = tuple(self.tokens[end - n:end])
                positions = self.after[gram]
                positions.pop()  # the latest: the one `extend` added for this end
                if not positions:
                    del self.after[gram]
        del self.tokens[length:]


class Corpus:
    """Earlier outputs, by salt, bounded in tokens: gram -> (output, position after it) of its
    occurrences, oldest first. The oldest output goes first when ``capacity`` is passed."""

    def __init__(self, capacity: int, min_n: int, max_n: int) -> None:
        self.capacity, self.min_n, self.max_n = capacity, min_n, max_n
        self.outputs: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()  # id -> (salt, tokens)
        self.after: dict[str, dict[tuple[int, ...], deque[tuple[int, int]]]] = {}  # salt -> gram -> occurrences
        self.tokens = 0
        self._next = 0

    def add(self, salt: str, tokens: list[int]) -> None:
        tokens = tokens[-self.capacity:]
        if len(tokens) < 2:
            return
        while self.outputs and self.tokens + len(tokens) > self.capacity:
            self._evict()
        doc, self._next = self._next, self._next + 1
        self.outputs[doc] = (salt, tokens)
        self.tokens += len(tokens)
        index = self.after.setdefault(salt, {})
        for gram, end in self._grams(tokens):
            index.setdefault(gram, deque()).append((doc, end))

    def occurrences(self, salt: str, gram: tuple[int, ...]) -> list[tuple[list[int], int]]:
        """(output tokens, position after the gram) of the latest MAX_CANDIDATES occurrences."""
        found = list(islice(reversed(self.after.get(salt, {}).get(gram, ())), MAX_CANDIDATES))[::-1]
        return [(self.outputs[doc][1], end) for doc, end in found]

    def _grams(self, tokens: list[int]):
        for end in range(1, len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                yield tuple(tokens[end - n:end]), end

    def _evict(self) -> None:
        doc, (salt, tokens) = self.outputs.popitem(last=False)
        self.tokens -= len(tokens)
        index = self.after[salt]
        for gram, _ in self._grams(tokens):
            occurrences = index[gram]
            occurrences.popleft()  # the oldest output's occurrences come first, in the order added
            if not occurrences:
                del index[gram]
        if not index:
            del self.after[salt]


class SuffixSequence(_Occurrences):
    """One sequence as the suffix proposer holds it: its tokens and their index, its salt's corpus
    and where its output starts (what the corpus gets when it is released: its committed output)."""

    def __init__(self, min_n: int, max_n: int, corpus: Corpus, salt: str, output_start: int) -> None:
        super().__init__(min_n, max_n)
        self.corpus, self.salt, self.output_start = corpus, salt, output_start
        # Leading tokens the target has committed (it appended them): past them, guesses held
        # as context (a draft model's, forced tokens) that may yet be rejected.
        self.confirmed = 0

    def proposal(self, gamma: int, branches: int) -> tuple[list[int], list[int]]:
        """(tokens, parents) as the module docstring says: a chain whose length the candidates'
        weights decide (at most ``gamma``), then up to ``branches`` other first tokens."""
        size = len(self.tokens)
        if gamma <= 0 or size == 0:
            return [], []
        candidates: list[tuple[int, list[int]]] = []  # (weight, continuation)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            gram = tuple(self.tokens[size - n:])
            for end in self.after.get(gram, [])[-MAX_CANDIDATES:]:
                candidates.append((self._match(self.tokens, end), self._copy(end, gamma)))
            for tokens, end in self.corpus.occurrences(self.salt, gram):
                candidates.append((self._match(tokens, end), tokens[end:end + gamma]))
            if candidates:
                break
        chain: list[int] = []
        others: list[int] = []  # the other first tokens with weight, heaviest first
        confidence = 1.0
        alive = candidates
        while len(chain) < gamma:
            weights: dict[int, int] = {}
            for weight, continuation in alive:
                if len(continuation) > len(chain):
                    weights[continuation[len(chain)]] = weights.get(continuation[len(chain)], 0) + weight
            if not weights:
                break
            token = max(weights, key=weights.get)
            confidence *= weights[token] / (sum(weights.values()) + 1)
            if confidence < MIN_CONFIDENCE:
                break
            if not chain:
                others = sorted((t for t in weights if t != token), key=lambda t: -weights[t])[:branches]
            chain.append(token)
            alive = [(w, c) for w, c in alive if len(c) > len(chain) - 1 and c[len(chain) - 1] == token]
        if not chain:
            return [], []
        if not others:
            return chain, []
        return chain + others, list(range(len(chain))) + [0] * len(others)

    def _match(self, tokens: list[int], end: int) -> int:
        """How many tokens before ``end`` in ``tokens`` equal the sequence's last ones (up to MAX_MATCH)."""
        own, size, k = self.tokens, len(self.tokens), 0
        while k < MAX_MATCH and k < end and k < size and tokens[end - 1 - k] == own[size - 1 - k]:
            k += 1
        return k

    def _copy(self, start: int, gamma: int) -> list[int]:
        """``gamma`` tokens from ``start`` on of the sequence extended by the copy itself (LZ77's
        overlapping copy: a repeat running into the end goes on repeating)."""
        size, out = len(self.tokens), []
        for j in range(gamma):
            at = start + j
            out.append(self.tokens[at] if at < size else out[at - size])
        return out


class SuffixProposer(Proposer):
    """Suffix drafting (module docstring) for up to ``max_slots`` sequences of up to ``max_len``
    tokens, with a corpus of ``capacity`` tokens of earlier outputs; the same interface and
    protocol errors as NgramProposer."""

    def __init__(self, max_slots: int, max_len: int, min_n: int = 1, max_n: int = 4, capacity: int = 65536) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"min_n={min_n!r}, max_n={max_n!r}: must be 1 <= min_n <= max_n")
        if max_slots < 1:
            raise ValueError(f"max_slots={max_slots!r}: must be >= 1")
        if capacity < 0:
            raise ValueError(f"capacity={capacity!r}: must be >= 0")
        self.max_slots, self.max_len = max_slots, max_len
        self.min_n, self.max_n = min_n, max_n
        self.name = SOURCE
        self.vocab_size = ANY_ID
        self.corpus = Corpus(capacity, min_n, max_n)
        self.sequences: dict[Hashable, SuffixSequence] = {}

    @property
    def held(self) -> int:
        return len(self.sequences)

    @property
    def free_slots(self) -> int:
        return self.max_slots - len(self.sequences)

    def release(self, keys: list[Hashable]) -> None:
        """Forgets the sequences; the output each had committed so far joins its salt's corpus."""
        for key in keys:
            sequence = self.sequences.pop(key, None)
            if sequence is not None and self.corpus.capacity:
                self.corpus.add(sequence.salt, sequence.tokens[sequence.output_start:sequence.confirmed])

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        out = []
        for item in items:
            committed = item.rollback_to + len(item.append)
            item = with_forced_appended(item)  # forced tokens are held as context: matching goes on from them
            sequence = self.sync(item)
            if sequence is None:
                out.append(Proposal([], 0, source=SOURCE))
                continue
            sequence.confirmed = committed
            gamma = min(item.gamma, self.max_len - len(sequence))
            tokens, parents = sequence.proposal(gamma, item.branches if item.sampling.greedy else 0)
            tokens, parents = without_masked(item, tokens, parents)
            out.append(Proposal(tokens, len(sequence), source=SOURCE, parents=parents))
        return out

    def sync(self, item: ProposeItem) -> SuffixSequence | None:
        """Brings the sequence to its first ``rollback_to`` tokens plus ``append``; None (its state
        dropped) as NgramProposer.sync. A sequence's first item names its salt and output start."""
        sequence = self.sequences.get(item.key)
        if item.rollback_to == 0:  # its first item (again, on a new stream): it starts over
            if sequence is None and len(self.sequences) >= self.max_slots:
                return None
            sequence = self.sequences[item.key] = SuffixSequence(self.min_n, self.max_n, self.corpus,
                                                                 item.cache_salt, item.output_start)
        elif sequence is None:
            return None
        if item.rollback_to > len(sequence) or not item.append or item.rollback_to + len(item.append) > self.max_len:
            self.sequences.pop(item.key, None)
            return None
        sequence.truncate(item.rollback_to)
        sequence.extend(item.append)
        sequence.confirmed = len(sequence)  # what the target appended is committed
        return sequence
