"""The long-running commands' progress (tools/progress.py): a tqdm bar on a terminal, plain
lines elsewhere or when quiet (at most one per interval between phases), the time left from the
rate so far, and the command's own output kept on stdout around a bar. A fake clock and fake
streams: nothing here waits."""

from __future__ import annotations

import io
import re
import sys
import threading

import pytest
from tqdm import tqdm

from tools.progress import Progress, clock_text


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    """What a terminal's stderr looks like to the code: a TTY."""

    def isatty(self) -> bool:
        return True


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_a_terminal_gets_a_tqdm_bar_with_rate_and_time_left():
    stream = Terminal()
    with Progress(40, "generations", "latency", stream=stream) as progress:
        assert isinstance(progress.bar, tqdm)
        progress.update(10)
        progress.phase("latency: colocated")
        progress.update(30)
    out = stream.getvalue()
    assert "\r" in out  # redrawn in place, not one line per update
    final = out.rsplit("\r", 1)[-1]
    assert final.startswith("latency: colocated: 100%") and "40/40" in final
    assert "generations/s" in final and "<00:00" in final  # the rate, and tqdm's elapsed<left
    assert progress.bar.n == 40 and progress.done == 40


def test_quiet_on_a_terminal_prints_plain_lines_and_no_bar():
    stream, clock = Terminal(), Clock()
    with Progress(4, "cases", "fuzz", quiet=True, stream=stream, clock=clock) as progress:
        assert progress.bar is None
        clock.now += 5
        progress.update(4)
    assert "\r" not in stream.getvalue()
    assert lines(stream) == ["fuzz: 0/4 cases (0%), 0:00 elapsed", "fuzz: 4/4 cases (100%), 0:05 elapsed"]


def test_off_a_terminal_lines_come_at_most_once_per_interval_and_at_each_phase():
    stream, clock = io.StringIO(), Clock()
    progress = Progress(120, "generations", "latency", stream=stream, clock=clock, interval_s=10.0)
    assert progress.bar is None
    for _ in range(45):  # one generation every 2 s: 90 s
        clock.now += 2
        progress.update()
    progress.phase("latency: colocated")  # a phase gets its line at once, whatever the interval
    clock.now += 1
    progress.update()  # within 10 s of the phase's line: no line
    progress.close()
    progress.close()  # once only
    got = lines(stream)
    assert got[0] == "latency: 0/120 generations (0%), 0:00 elapsed"  # no rate yet: no time left
    periodic = got[1:-2]
    # a line every 10 s (every 5th update), never two within the interval
    assert [int(re.match(r"latency: (\d+)/120", line).group(1)) for line in periodic] == list(range(5, 46, 5))
    assert periodic[1] == "latency: 10/120 generations (8%), 0:20 elapsed, ~3:40 left"
    assert got[-2] == "latency: colocated: 45/120 generations (38%), 1:30 elapsed, ~2:30 left"
    assert got[-1] == "latency: colocated: 46/120 generations (38%), 1:31 elapsed"  # the end: no time left


def test_the_time_left_is_the_work_left_at_the_mean_rate():
    clock = Clock()
    progress = Progress(448, "generations", "latency", stream=io.StringIO(), clock=clock)
    assert progress.seconds_left() is None  # nothing done: no rate
    clock.now += 65
    progress.update(120)
    # 120 in 65 s: 328 more take 328 * 65 / 120 = 177.7 s
    assert progress.seconds_left() == pytest.approx(328 * 65 / 120)
    assert progress.line() == "latency: 120/448 generations (27%), 1:05 elapsed, ~2:58 left"
    clock.now += 65  # no more work in another 65 s: the rate halves, the estimate doubles
    assert progress.seconds_left() == pytest.approx(328 * 130 / 120)
    progress.update(328)
    assert progress.seconds_left() == 0.0


def test_advance_to_counts_a_running_total_never_backwards():
    clock = Clock()
    progress = Progress(8, "seconds", "soak", stream=io.StringIO(), clock=clock)
    progress.advance_to(3)
    progress.advance_to(2)
    assert progress.done == 3
    progress.advance_to(7.5)
    assert progress.done == 7.5
    assert progress.line().startswith("soak: 7.5/8 seconds (94%)")


def test_updates_from_several_threads_all_count():
    progress = Progress(4000, "requests", "gamma", stream=io.StringIO(), interval_s=0.0)
    workers = [threading.Thread(target=lambda: [progress.update() for _ in range(1000)]) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert progress.done == 4000


def test_print_keeps_the_commands_output_on_stdout_unchanged(capsys):
    plain_stream = io.StringIO()
    with Progress(2, "timings", "profile", stream=Terminal()) as with_bar, \
            Progress(2, "timings", "profile", stream=plain_stream) as plain:
        with_bar.print("\nthe table")
        plain.print("\nthe table")
    assert capsys.readouterr().out == "\nthe table\n" * 2  # byte for byte what print writes
    assert plain_stream.getvalue().count("\n") == 2  # its own first and last lines only


def test_print_clears_a_bar_on_the_terminal_and_draws_it_again(monkeypatch, capsys):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)  # stdout and stderr share the terminal
    with Progress(2, "timings", "profile") as progress:
        progress.update()
        before = len(terminal.getvalue())
        progress.print("a result line")
        after = terminal.getvalue()[before:]
    assert capsys.readouterr().out == "a result line\n"
    assert re.match(r"\r +\r", after)  # the bar's line blanked before the print ...
    assert "profile: " in after and "1/2" in after  # ... and drawn again after it


def test_a_total_of_nothing_and_bad_arguments():
    stream = io.StringIO()
    Progress(0, "requests", "throughput", stream=stream).close()
    assert lines(stream)[-1].startswith("throughput: 0/0 requests (100%)")
    with pytest.raises(ValueError, match="total=-1"):
        Progress(-1, "requests", "throughput", stream=stream)
    with pytest.raises(ValueError, match="interval_s=-1"):
        Progress(1, "requests", "throughput", stream=stream, interval_s=-1)


@pytest.mark.parametrize("seconds, text", [(0, "0:00"), (65, "1:05"), (176.6, "2:57"), (3599.6, "1:00:00"),
                                           (3725, "1:02:05")])
def test_clock_text(seconds, text):
    assert clock_text(seconds) == text
