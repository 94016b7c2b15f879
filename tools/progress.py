"""How far along a long-running command is (bench, train-draft, fuzz, soak, faults, experiment), on stderr.

``Progress(total, unit, description)`` counts units of real work whose total is known before they
start (generations, requests, cases, seconds of a soak, training steps), as each one finishes. The
description names the phase and may change with it (``phase``).

- On a terminal (the stream, stderr by default, is a TTY) and not ``quiet``: a tqdm bar with the
  rate and the time left.
- Otherwise (a pipe, CI logs, or ``quiet``): no bar but plain lines, one when the run starts and
  each time a phase begins, at most one every ``interval_s`` seconds in between, and one at the end::

      latency: 120/448 generations (27%), 1:05 elapsed, ~2:56 left

  The time left is the units still to do at the mean rate so far (``seconds_left``).

A command's own output (tables, result lines) stays on stdout, byte for byte: ``Progress.print``
writes a line there, clearing and redrawing a bar around it so that neither tears the other.
Updates may come from another thread (the torch thread, specstream.serving.compute).

What it does not know: what a unit is or how a command counts them; it writes nothing to stdout
but what ``print`` is given.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

__all__ = ["INTERVAL_S", "Progress", "clock_text"]

INTERVAL_S = 10.0  # plain lines: at most one per this many seconds between phases


def clock_text(seconds: float) -> str:
    """A duration as m:ss, or h:mm:ss from an hour on."""
    hours, rest = divmod(int(round(seconds)), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _count(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """Units done of ``total``, shown on ``stream`` (stderr) as a bar or as plain lines (module docstring).

    Use it as a context manager, or call ``close`` once the work is over (a plain line then says
    how far it got and how long it took)."""

    def __init__(self, total: float, unit: str, description: str, *, quiet: bool = False,
                 stream: TextIO | None = None, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if total < 0:
            raise ValueError(f"total={total!r}: the units of work to do, >= 0")
        if interval_s < 0:
            raise ValueError(f"interval_s={interval_s!r}: seconds between plain lines, >= 0")
        self.total = total
        self.unit = unit  # plural noun: "generations", "requests", "seconds"
        self.description = description
        self.done: float = 0
        self._stream = sys.stderr if stream is None else stream
        self._interval_s = interval_s
        self._clock = clock
        self._started = clock()
        self._last_line = self._started
        self._lock = threading.Lock()
        self._closed = False
        self.bar: tqdm | None = None
        if _is_terminal(self._stream) and not quiet:
            self.bar = tqdm(total=total, unit=unit, desc=description, file=self._stream, dynamic_ncols=True,
                            leave=True)
        else:
            self._write_line()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def elapsed(self) -> float:
        return self._clock() - self._started

    def seconds_left(self) -> float | None:
        """The units still to do at the mean rate so far; None before the first unit is done."""
        if self.done <= 0:
            return None
        return max(self.total - self.done, 0) * self.elapsed() / self.done

    def line(self, final: bool = False) -> str:
        """The plain progress line (the final one without the time left)."""
        share = 100 * self.done / self.total if self.total else 100.0
        text = (f"{self.description}: {_count(self.done)}/{_count(self.total)} {self.unit} ({share:.0f}%), "
                f"{clock_text(self.elapsed())} elapsed")
        left = self.seconds_left()
        if not final and left is not None and self.done < self.total:
            text += f", ~{clock_text(left)} left"
        return text

    def update(self, n: float = 1) -> None:
        """``n`` more units done."""
        with self._lock:
            self.done += n
            if self.bar is not None:
                self.bar.update(n)
            elif self._clock() - self._last_line >= self._interval_s:
                self._write_line()

    def advance_to(self, done: float) -> None:
        """``done`` units done in all (never backwards): for work measured as a running total."""
        if done > self.done:
            self.update(done - self.done)

    def phase(self, description: str) -> None:
        """A new phase of the run: the bar's description, or a plain line now."""
        with self._lock:
            self.description = description
            if self.bar is not None:
                self.bar.set_description(description)
            else:
                self._write_line()

    def print(self, text: str) -> None:
        """A line of the command's own output, on stdout as ``print`` writes it, around the bar."""
        if self.bar is None:
            print(text, flush=True)
            return
        with tqdm.external_write_mode(file=sys.stdout):
            print(text, flush=True)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.bar is not None:
                self.bar.close()
            else:
                self._write_line(final=True)

    def _write_line(self, final: bool = False) -> None:
        self._last_line = self._clock()
        self._stream.write(self.line(final) + "\n")
        self._stream.flush()
