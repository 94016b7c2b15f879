"""Stop-string detection over a stream of text deltas.

Contract: ``StopStringMatcher`` receives the detokenized text of one sequence in arbitrary pieces
and returns text that is safe to emit. The result never depends on how the text was split: the
concatenation of everything it emits equals ``text[:match_start]`` for the first match, or the
whole text when nothing matches.

"First match" means the occurrence that *ends* first (ties: the longest stop string, i.e. the one
starting earliest). A streaming server cannot wait to see whether a longer stop string that
started earlier will complete, so this is the only definition that is independent of chunking:
with stops ``["abcd", "bc"]`` the text ``"abcd"`` stops at ``"a"``.

What it does not know: tokens (stop token ids are the engine's job), how many tokens the emitted
text corresponds to, and the gateway's limits on stop strings (count, length) -- those are
validated before a matcher is built. Matching is on Python code points, exact and case-sensitive.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopStringMatcher"]


class StopStringMatcher:
    """Finds the first occurrence of any stop string in a stream of text deltas. Holds back the
    longest suffix that could still be the start of a stop string, so emitted text never contains
    (part of) a stop string."""

    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a single str")
        stops: list[str] = []
        for s in stop:
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be str, got {type(s).__name__}")
            if not s:
                raise ValueError("stop strings must not be empty")
            stops.append(s)
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._max_len = max((len(s) for s in self._stops), default=0)
        # Proper prefixes only: a complete stop string is found by the search, not held.
        self._prefixes: frozenset[str] = frozenset(
            s[:k] for s in self._stops for k in range(1, len(s))
        )
        self._held = ""
        self._matched = False

    @property
    def held(self) -> str:
        """Text received but not yet emitted (a possible start of a stop string)."""
        return self._held

    def push(self, text: str) -> tuple[str, bool]:
        """Feed the next delta; return (text safe to emit, matched). After a match the emitted text
        ends right before the stop string, and further pushes raise RuntimeError."""
        if self._matched:
            raise RuntimeError("StopStringMatcher.push after a stop string matched")
        if not text:
            return "", False
        if not self._stops:
            return text, False
        buf = self._held + text
        # The held part holds no complete stop string (it was searched before), so any match
        # found here ends inside the new text.
        best_end = -1
        best_start = -1
        for s in self._stops:
            start = buf.find(s)
            if start < 0:
                continue
            end = start + len(s)
            if best_end < 0 or end < best_end or (end == best_end and start < best_start):
                best_end, best_start = end, start
        if best_end >= 0:
            self._matched = True
            self._held = ""
            return buf[:best_start], True
        keep = self._held_suffix_len(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """End of generation without a match: release held-back text ("" after a match)."""
        out = self._held
        self._held = ""
        return out

    def _held_suffix_len(self, buf: str) -> int:
        for k in range(min(len(buf), self._max_len - 1), 0, -1):
            if buf[len(buf) - k :] in self._prefixes:
                return k
        return 0
