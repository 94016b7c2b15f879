"""StopStringMatcher: chunking independence, first-match semantics, hold-back, unicode."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specstream.text.stop_strings import StopStringMatcher


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """The specification, written the slow obvious way: the first position at which any stop
    string has been completed; cut at the start of the longest one completed there."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(len(s) for s in done)], True
    return text, False


def run_chunks(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    m = StopStringMatcher(stops)
    out: list[str] = []
    for chunk in chunks:
        emitted, matched = m.push(chunk)
        out.append(emitted)
        if matched:
            return "".join(out), True
    out.append(m.flush())
    return "".join(out), False


def split_at(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces: list[str] = []
    prev = 0
    for p in points + [len(text)]:
        pieces.append(text[prev:p])
        prev = p
    return pieces


# A small alphabet makes matches, partial matches and overlaps common.
small_text = st.text(alphabet="abc\u00e9\U0001f600", max_size=40)
small_stops = st.lists(st.text(alphabet="abc\u00e9\U0001f600", min_size=1, max_size=5), max_size=4)


@settings(max_examples=400, deadline=None)
@given(text=small_text, stops=small_stops, cuts=st.lists(st.integers(min_value=0, max_value=100), max_size=12))
def test_chunking_does_not_change_result(text: str, stops: list[str], cuts: list[int]) -> None:
    expected = reference(text, stops)
    assert run_chunks([text], stops) == expected
    assert run_chunks(split_at(text, cuts), stops) == expected
    assert run_chunks(list(text), stops) == expected


@settings(max_examples=200, deadline=None)
@given(text=small_text, stops=small_stops, cuts=st.lists(st.integers(min_value=0, max_value=100), max_size=12))
def test_emitted_never_contains_stop_and_held_is_a_prefix(text: str, stops: list[str], cuts: list[int]) -> None:
    m = StopStringMatcher(stops)
    emitted = ""
    fed = ""
    for chunk in split_at(text, cuts):
        out, matched = m.push(chunk)
        fed += chunk
        emitted += out
        for s in stops:
            assert s not in emitted
        if matched:
            break
        # Everything fed is either emitted or held, and only a possible stop start is held.
        assert emitted + m.held == fed
        if m.held:
            assert any(s.startswith(m.held) and s != m.held for s in stops)


def test_stop_spanning_chunks() -> None:
    m = StopStringMatcher(["###"])
    assert m.push("hello #") == ("hello ", False)
    assert m.held == "#"
    assert m.push("#") == ("", False)
    assert m.push("# world") == ("", True)


def test_false_start_is_released() -> None:
    m = StopStringMatcher(["END"])
    assert m.push("the EN") == ("the ", False)
    assert m.push("D") == ("", True)
    m = StopStringMatcher(["END"])
    assert m.push("the EN") == ("the ", False)
    assert m.push("JOY") == ("ENJOY", False)
    assert m.flush() == ""


def test_flush_releases_held_text() -> None:
    m = StopStringMatcher(["</answer>"])
    assert m.push("42 </ans") == ("42 ", False)
    assert m.flush() == "</ans"
    assert m.flush() == ""


def test_earliest_ending_match_wins() -> None:
    # "bc" completes before "abcd" could; a streaming server cannot wait.
    assert run_chunks(["abcd"], ["abcd", "bc"]) == ("a", True)
    assert run_chunks(["ab", "cd"], ["abcd", "bc"]) == ("a", True)
    # Same end: the longer (earlier-starting) one cuts more.
    assert run_chunks(["xabc"], ["bc", "abc"]) == ("x", True)


def test_overlapping_stop_strings() -> None:
    stops = ["abab", "bab"]
    for chunks in (["aabab"], ["a", "a", "b", "a", "b"], ["aab", "ab"]):
        assert run_chunks(chunks, stops) == reference("aabab", stops)
    # Self-overlapping stop string.
    assert run_chunks(["aaa", "ab"], ["aab"]) == ("aa", True)


def test_unicode_stop_strings() -> None:
    m = StopStringMatcher(["\u3002\u3002", "\U0001f6d1"])
    assert m.push("\u4f60\u597d\u3002") == ("\u4f60\u597d", False)
    assert m.push("\u4e16\U0001f6d1\u754c") == ("\u3002\u4e16", True)
    assert run_chunks(["caf", "e\u0301"], ["e\u0301"]) == ("caf", True)
    # Precomposed and decomposed forms are different strings: no normalization.
    assert run_chunks(["caf\u00e9"], ["e\u0301"]) == ("caf\u00e9", False)


def test_match_in_first_push_and_push_after_match() -> None:
    m = StopStringMatcher(["\n\n"])
    assert m.push("one\n\ntwo") == ("one", True)
    with pytest.raises(RuntimeError):
        m.push("more")
    assert m.flush() == ""


def test_no_stops_passes_everything() -> None:
    m = StopStringMatcher([])
    assert m.push("anything") == ("anything", False)
    assert m.push("") == ("", False)
    assert m.flush() == ""


def test_invalid_stops() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])
    with pytest.raises(TypeError):
        StopStringMatcher("stop")
    with pytest.raises(TypeError):
        StopStringMatcher([b"bytes"])  # type: ignore[list-item]
