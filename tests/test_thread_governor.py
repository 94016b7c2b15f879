"""The forward thread count follows the CPU time the process gets (specstream/serving/thread_governor.py),
and the model's results do not depend on it."""

from __future__ import annotations

import pytest
import torch

from specstream.serving import thread_governor as tg
from specstream.serving.thread_governor import ThreadGovernor


class _Host:
    """A fake clock and CPU counter: each forward takes ``step_s`` and gets ``share`` of its threads' time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.cpu_s = 0.0
        self.set: list[int] = []

    def clock(self) -> float:
        return self.now

    def cpu(self) -> float:
        return self.cpu_s

    def forward(self, governor: ThreadGovernor, share: float, step_s: float = 0.01) -> int:
        threads = governor.threads

        def work() -> int:
            self.now += step_s
            self.cpu_s += step_s * threads * share
            return threads

        return governor.run(work)


def _governor(host: _Host, most: int = 2) -> ThreadGovernor:
    return ThreadGovernor(most, clock=host.clock, cpu=host.cpu, set_threads=host.set.append)


def test_a_quiet_host_keeps_every_thread() -> None:
    host = _Host()
    governor = _governor(host)
    assert [host.forward(governor, 0.9) for _ in range(500)] == [2] * 500
    assert host.set == []


def test_a_starved_team_gives_up_a_thread_after_a_window_and_probes_back_with_a_growing_wait() -> None:
    host = _Host()
    governor = _governor(host)
    used = [host.forward(governor, 0.3) for _ in range(tg.WINDOW)]
    assert used == [2] * tg.WINDOW and governor.threads == 1 and host.set == []  # set on the next forward
    assert host.forward(governor, 1.0) == 1 and host.set == [1]
    # Still starved: each probe of 2 threads is given up after a window, and the next waits twice as long.
    probes, waits, last = [], [], None
    while host.now < 30:
        threads = host.forward(governor, 1.0 if governor.threads == 1 else 0.3)
        if threads == 2 and last == 1:
            probes.append(host.now)
        last = threads
    waits = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 4 and all(w2 >= w1 - 0.05 for w1, w2 in zip(waits, waits[1:]))
    assert max(waits) <= tg.MAX_PROBE_S + (tg.WINDOW + 2) * 0.01
    assert waits[0] < waits[-1]


def test_a_probe_that_gets_its_cores_keeps_them() -> None:
    host = _Host()
    governor = _governor(host)
    for _ in range(tg.WINDOW):
        host.forward(governor, 0.3)
    assert governor.threads == 1
    while host.now < 3:  # quiet again: the next probe stays
        host.forward(governor, 0.9)
    assert governor.threads == 2 and host.set == [1, 2]
    assert [host.forward(governor, 0.9) for _ in range(200)] == [2] * 200


def test_short_forwards_are_not_judged_and_one_thread_stays_one() -> None:
    host = _Host()
    governor = _governor(host)
    for _ in range(100):  # starved, but each forward under MIN_WALL_S
        host.forward(governor, 0.1, step_s=tg.MIN_WALL_S / 2)
    assert governor.threads == 2
    single = _governor(host, most=1)
    assert [host.forward(single, 0.1) for _ in range(100)] == [1] * 100
    with pytest.raises(ValueError, match="most=0"):
        ThreadGovernor(0)


@pytest.mark.parametrize("dtype, weights", [("float32", "dense"), ("float32", "int4-rtn"), ("bfloat16", "int4-rtn")])
def test_a_positions_logits_are_the_same_bits_on_one_two_and_three_threads(tmp_path, dtype, weights) -> None:
    """What lets the governor change the count mid-request: a prefill, a decode step and a verify
    window computed on 1, 2 and 3 threads give the same logits, bit for bit (the ops as served)."""
    from tests.test_native_ops import _logits, _tiny_model

    model = _tiny_model(tmp_path, dtype, weights)
    prompt = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            cache = model.new_cache(2, 64)
            prefill = _logits(model, [(prompt[:12], 0)], [0], cache)
            step = _logits(model, [([prompt[12]], 12)], [0], cache)
            window = _logits(model, [(prompt[13:20], 13)], [0], cache)
            results.append((prefill, step, window))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
