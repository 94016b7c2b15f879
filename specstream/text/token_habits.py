"""How the served model tokenizes the text a grammar allows alone, where that is not the
tokenizer's canonical way: learned from the model's own committed output.

Where a grammar allows one text but several tokenizations of it (after a JSON key, ``":"`` may
be the one token ``":"`` or ``":`` then ``"``), the target proposes that text's tokens as likely
guesses (``Matcher.likely``). The canonical tokenization (how the tokenizer encodes a prompt) is
often not the model's: SmolLM2 writes ``":`` then ``"`` then the value, as JSON with a space
after the colon would be written. Each such guess it refuses costs a pass. ``TokenHabits`` keeps
rules "these canonical tokens -> the tokens the model wrote for the same bytes", learned by
lining up, at their common byte boundaries, the canonical tokens of a text and the tokens the
model then committed (``learn``), and applies them to later likely guesses (``rewrite``): one
key's ending teaches every later key's, in every request to the same model. The rules only change
guesses, which the target verifies as any guess: output is unchanged, greedy and sampled.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["TokenHabits"]

MAX_KEY = 3  # canonical tokens a rule replaces, at most
MAX_VALUE = 6  # tokens it writes instead, at most


class TokenHabits:
    """Rules from runs of canonical tokens to the model's own tokens for the same bytes, the
    ``capacity`` most recently learned kept. ``token_bytes``: a token id's bytes."""

    def __init__(self, token_bytes: Callable[[int], bytes], capacity: int = 512) -> None:
        self._token_bytes = token_bytes
        self._bytes: dict[int, bytes] = {}  # each token's bytes, as asked for
        self._rules: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rules)

    def rewrite(self, tokens: list[int]) -> list[int]:
        """``tokens`` (a canonical tokenization) with each run a rule knows replaced by the model's
        tokens, longest run first."""
        with self._lock:
            if not self._rules:
                return list(tokens)
            out: list[int] = []
            i = 0
            while i < len(tokens):
                for n in range(min(MAX_KEY, len(tokens) - i), 0, -1):
                    written = self._rules.get(tuple(tokens[i : i + n]))
                    if written is not None:
                        out += written
                        i += n
                        break
                else:
                    out.append(tokens[i])
                    i += 1
            return out

    def learn(self, canonical: list[int], written: list[int]) -> bool:
        """``canonical``: a text's canonical tokens; ``written``: the tokens the model committed
        from where that text starts (they may stop short of its end or go past it). Each stretch
        between byte offsets where both tokenizations have a boundary becomes a rule where the two
        differ, and drops one where they agree; a stretch the written tokens do not cover to its end
        teaches nothing, nor do written tokens whose bytes are not the text's. Returns whether the
        written tokens reached the text's end (nothing more to learn from them)."""
        canonical_ends = self._ends(canonical, None)
        if not canonical_ends:
            return True
        written_ends = self._ends(written, canonical_ends[-1])
        text = b"".join(map(self._text, canonical))
        if written_ends and b"".join(map(self._text, written[: len(written_ends)])) != text[: written_ends[-1]]:
            return True  # not the text (never, where a grammar allowed it alone): nothing to learn
        reached = bool(written_ends) and written_ends[-1] == canonical_ends[-1] or len(written) > len(written_ends)
        common = sorted({0} | (set(canonical_ends) & set(written_ends)))
        with self._lock:
            for start, end in zip(common, common[1:]):
                key = _between(canonical, canonical_ends, start, end)
                value = _between(written, written_ends, start, end)
                if key == value:
                    self._rules.pop(key, None)
                elif len(key) <= MAX_KEY and len(value) <= MAX_VALUE:
                    self._rules[key] = value
                    self._rules.move_to_end(key)
                    while len(self._rules) > self._capacity:
                        self._rules.popitem(last=False)
        return reached

    def _ends(self, tokens: list[int], limit: int | None) -> list[int]:
        """Byte offset of the end of each token, up to the last that ends within ``limit`` bytes."""
        ends, at = [], 0
        for token in tokens:
            size = len(self._text(token))
            if not size:  # a token with no text of its own
                break
            at += size
            if limit is not None and at > limit:
                break
            ends.append(at)
        return ends

    def _text(self, token: int) -> bytes:
        text = self._bytes.get(token)
        if text is None:
            text = self._bytes[token] = self._token_bytes(token)
        return text


def _between(tokens: list[int], ends: list[int], start: int, end: int) -> tuple[int, ...]:
    """The tokens that cover bytes ``start`` .. ``end`` (both token boundaries)."""
    return tuple(t for t, stop in zip(tokens, ends) if start < stop <= end)
