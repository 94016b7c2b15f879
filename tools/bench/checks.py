"""The checks a benchmark makes on its own results before it reports them.

A benchmark that measures a wrong answer has measured nothing: speculative decoding must give
plain decoding's tokens (greedy), and peers we call "the same" must be. These checks raise
BenchmarkError, never `assert` (which `python -O` removes), and say what differed: which run,
which prompt, the first differing position and the two tokens there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["BenchmarkError", "check_same_tokens", "check_runs_match", "require", "token_difference"]


class BenchmarkError(RuntimeError):
    """A benchmark's result is wrong (not slow: wrong); the run stops instead of reporting it."""


def require(condition: object, message: str) -> None:
    """Raises BenchmarkError(message) unless `condition` holds."""
    if not condition:
        raise BenchmarkError(message)


def token_difference(expected: Sequence[Sequence[int]], actual: Sequence[Sequence[int]]) -> str | None:
    """Where two runs' token ids (one list per prompt) first differ, in words; None when equal."""
    if len(expected) != len(actual):
        return f"{len(actual)} outputs, expected {len(expected)} (one per prompt)"
    for prompt, (want, got) in enumerate(zip(expected, actual)):
        want, got = list(want), list(got)
        if want == got:
            continue
        position = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        token = lambda ids: ids[position] if position < len(ids) else "end of output"  # noqa: E731
        return (f"prompt {prompt}: first difference at generated position {position}: token {token(got)}, "
                f"expected {token(want)} ({len(got)} tokens, expected {len(want)})")
    return None


def check_same_tokens(name: str, expected: Sequence[Sequence[int]], actual: Sequence[Sequence[int]]) -> None:
    """Raises BenchmarkError naming `name` and the first difference unless the runs are equal."""
    difference = token_difference(expected, actual)
    if difference is not None:
        raise BenchmarkError(f"{name}: {difference}")


def check_runs_match(what: str, reference: str, expected: Sequence[Sequence[int]],
                     runs: Mapping[str, Sequence[Sequence[int]]]) -> None:
    """Raises one BenchmarkError listing every run in `runs` whose token ids differ from
    `reference`'s (`expected`), each with its first difference; `what` says what was compared."""
    differences = {name: token_difference(expected, ids) for name, ids in runs.items()}
    lines = [f"  {name}: {d}" for name, d in differences.items() if d is not None]
    if lines:
        raise BenchmarkError(f"{what} differs from {reference}:\n" + "\n".join(lines))
