"""Copying a JSON string value from the prompt when the answer spells it in other tokens.

A value copied from the prompt is often tokenized differently in the answer: the prompt's
`` Berlin`` (one token, with its space) becomes ``Ber`` ``lin`` after a quote, `` Manchester``
becomes ``M`` ``anc`` ``hester``; ``space_free_ids`` matches a word only where the vocabulary holds
it without its space as one token, so prompt lookup's n-grams never meet these. Here the lookup
works on text: the bytes of the string value written so far (after the output's last quote) are
found in the prompt's bytes, and the guesses are the rest of the prompt token the match ends in,
tokenized canonically (``lin``), then the prompt's own tokens after it, up to a token that would
close the value in the prompt's sentence (punctuation that ends a phrase) or ``room``.

The first token of a value is not guessed here (no text to match yet: the draft model's choice).
Every guess is a point mass the target verifies against its masked distribution, so a wrong one
costs a verify position and never an output token. Knows nothing about grammars or gRPC.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Hashable, Sequence

from specstream.text.tokenizer import TextTokenizer

__all__ = ["PromptSpelling"]

QUOTE = b'"'
MAX_VALUE_TOKENS = 24  # how far back the value's opening quote is looked for
# A prompt token that would end the copied phrase in its sentence: a comma, semicolon, colon,
# bracket or quote anywhere in it, or a full stop, question or exclamation mark before a space or
# the prompt's end (``tom.lee`` goes on).
_SEPARATES = re.compile(rb'[,;:()\[\]{}"\'\n]')
_ENDS = re.compile(rb"[.?!]\s*$")
# A value worth matching starts with a letter or digit (not the separators after a closing quote).
_VALUE = re.compile(rb"[0-9A-Za-z\x80-\xff]")


class PromptSpelling:
    """Per sequence, its prompt's bytes and each token's offset in them (computed once)."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self._prompts: dict[Hashable, tuple[bytes, list[int], list[int]]] = {}

    def release(self, keys: list[Hashable]) -> None:
        for key in keys:
            self._prompts.pop(key, None)

    def guesses(self, key: Hashable, tokens: Sequence[int], prompt_len: int, room: int) -> list[int]:
        """Up to ``room`` guesses after ``tokens`` (the prompt's ``prompt_len`` tokens, then the
        output and any guesses before) that continue the string value being written as the prompt
        spells it; [] when the output is not inside a value that starts with a letter or digit, or
        the prompt does not hold it."""
        if room <= 0 or len(tokens) <= prompt_len:
            return []
        value = self._value(tokens, prompt_len)
        if not value or not _VALUE.match(value):
            return []
        text, starts, ids = self._prompt(key, tokens, prompt_len)
        at = _word_start_find(text, value)
        if at < 0:
            return []
        end = at + len(value)
        i = bisect.bisect_right(starts, end) - 1  # the prompt token the match ends in (or before)
        guesses: list[int] = []
        if starts[i] < end:  # inside token i: the rest of its text, tokenized as the answer would
            after = _end(starts, i, text)
            if _closes(text, end, after):
                return []
            guesses = self._tokenizer.encode(text[end:after].decode("utf-8", errors="ignore")) if after > end else []
            i += 1
        while len(guesses) < room and i < len(ids) and not _closes(text, starts[i], _end(starts, i, text)):
            guesses.append(ids[i])
            i += 1
        return guesses[:room]

    def _value(self, tokens: Sequence[int], prompt_len: int) -> bytes:
        """The bytes after the output's last quote, if it is within MAX_VALUE_TOKENS tokens."""
        pieces: list[bytes] = []
        for position in range(len(tokens) - 1, max(prompt_len, len(tokens) - MAX_VALUE_TOKENS) - 1, -1):
            piece = self._tokenizer.token_bytes(tokens[position])
            quote = piece.rfind(QUOTE)
            if quote >= 0:
                pieces.append(piece[quote + 1:])
                return b"".join(reversed(pieces))
            pieces.append(piece)
        return b""

    def _prompt(self, key: Hashable, tokens: Sequence[int], prompt_len: int) -> tuple[bytes, list[int], list[int]]:
        cached = self._prompts.get(key)
        if cached is None or len(cached[2]) != prompt_len:
            ids = list(tokens[:prompt_len])
            pieces = [self._tokenizer.token_bytes(t) for t in ids]
            starts, at = [], 0
            for piece in pieces:
                starts.append(at)
                at += len(piece)
            cached = self._prompts[key] = (b"".join(pieces), starts, ids)
        return cached


def _end(starts: list[int], i: int, text: bytes) -> int:
    return starts[i + 1] if i + 1 < len(starts) else len(text)


def _closes(text: bytes, start: int, end: int) -> bool:
    """Whether the prompt's bytes ``start:end`` end the phrase being copied."""
    piece = text[start:end]
    if _SEPARATES.search(piece):
        return True
    return bool(_ENDS.search(piece)) and (end >= len(text) or text[end:end + 1].isspace())


def _word_start_find(text: bytes, value: bytes) -> int:
    """The last occurrence of ``value`` in ``text`` that starts a word (the user's words come after
    a chat template's system text), else the last anywhere; -1 when none."""
    last = at = text.rfind(value)
    while at > 0 and text[at - 1:at].isalnum():
        at = text.rfind(value, 0, at)
    return at if at >= 0 else last
