"""The propose deadline (target_service/draft_deadline.py): the cap until the draft is measured,
then a multiple of the round trip predicted for the request's shape, within [floor, cap]; looser
for a noisy draft and for a bigger request; backed off after a timeout."""

from __future__ import annotations

import random

import pytest

from specstream.data.config import ModelSpec, StallConfig, TargetConfig
from target_service.draft_deadline import DraftDeadline, Shape

STEP = Shape(depth=4, proposals=16, fed=8)  # 4 rows drafting 4 tokens each, one or two tokens fed per row


def _measured(deadline: DraftDeadline, rounds: int = 60, noise: float = 0.0, seed: int = 0) -> DraftDeadline:
    """Replies from a draft that takes 10 ms + 0.5 ms per token fed (a prefill) + 1 ms per depth."""
    rng = random.Random(seed)
    for _ in range(rounds):
        shape = Shape(depth=rng.choice([1, 4]), proposals=16, fed=rng.choice([4, 8, 300]))
        seconds = 0.010 + 0.0005 * shape.fed + 0.001 * shape.depth
        deadline.observe(shape, seconds * (1.0 + rng.uniform(0.0, noise)))
    return deadline


def test_a_fixed_deadline_under_the_gateways_stall_floor_until_the_draft_has_been_measured():
    deadline = DraftDeadline(cap_s=10.0, floor_s=0.05, min_samples=4)
    # 2 s: a cold draft's slow first replies fit, and a hang stalls a step for less than the 5 s
    # after which the gateway takes a silent target for hung.
    assert deadline.deadline(STEP) == DraftDeadline.UNMEASURED_S == 2.0
    for _ in range(3):
        deadline.observe(STEP, 0.02)
    assert deadline.deadline(STEP) == 2.0
    deadline.observe(STEP, 0.02)
    assert deadline.deadline(STEP) < 1.0
    assert DraftDeadline(cap_s=0.5, floor_s=0.05).deadline(STEP) == 0.5  # a cap below it wins


def test_a_multiple_of_the_predicted_round_trip_for_the_shape():
    deadline = _measured(DraftDeadline(cap_s=10.0, floor_s=0.01, factor=2.0))
    small, prefill = Shape(depth=4, proposals=16, fed=8), Shape(depth=4, proposals=16, fed=300)
    true_small, true_prefill = 0.010 + 0.004 + 0.004, 0.010 + 0.15 + 0.004
    assert deadline.predicted(small) == pytest.approx(true_small, rel=0.2)
    assert deadline.predicted(prefill) == pytest.approx(true_prefill, rel=0.2)
    # At least the factor over the round trip (no honest reply is cut off), at most a few times it.
    for shape, true in ((small, true_small), (prefill, true_prefill)):
        assert 2.0 * true <= deadline.deadline(shape) <= 6.0 * true, (shape, deadline.deadline(shape))
    # A resync that feeds a thousand tokens is given the time a thousand tokens take.
    assert deadline.deadline(Shape(depth=4, proposals=16, fed=1000)) >= 2.0 * (0.010 + 0.5 + 0.004)


def test_floor_and_cap_bound_it():
    fast = _measured(DraftDeadline(cap_s=10.0, floor_s=0.25))
    assert fast.deadline(STEP) == 0.25  # 18 ms round trips: the floor
    slow = DraftDeadline(cap_s=0.5, floor_s=0.1)
    for _ in range(10):
        slow.observe(STEP, 2.0)
    assert slow.deadline(STEP) == 0.5  # never past draft_timeout_s


def test_by_default_a_hung_draft_cannot_make_its_target_look_hung():
    """Timeouts in a row on a loaded host push the deadline to its cap; the target sends the
    gateway nothing while it waits, so the default cap stays well inside the gateway's hang floor."""
    config = TargetConfig(ModelSpec("m"), draft_url="h:1")
    deadline = _measured(DraftDeadline(config.draft_timeout_s, config.draft_deadline_floor_s), noise=2.0)
    for _ in range(8):
        deadline.timed_out()
    assert deadline.deadline(STEP) == config.draft_timeout_s
    assert deadline.deadline(STEP) <= StallConfig().floor_s / 2


def test_a_noisy_draft_gets_more_slack_than_a_steady_one():
    steady = _measured(DraftDeadline(cap_s=10.0, floor_s=0.001))
    noisy = _measured(DraftDeadline(cap_s=10.0, floor_s=0.001), noise=2.0)
    assert noisy.deadline(STEP) > 1.5 * steady.deadline(STEP)


def test_timeouts_back_off_and_a_reply_resets():
    deadline = _measured(DraftDeadline(cap_s=10.0, floor_s=0.05))
    base = deadline.deadline(STEP)
    deadline.timed_out()
    assert deadline.deadline(STEP) == pytest.approx(2 * base)
    deadline.timed_out()
    assert deadline.deadline(STEP) == pytest.approx(4 * base)
    for _ in range(30):
        deadline.timed_out()
    assert deadline.deadline(STEP) == 10.0
    deadline.observe(STEP, 0.018)
    assert deadline.deadline(STEP) == pytest.approx(base, rel=0.5)


@pytest.mark.parametrize("kwargs,match", [(dict(cap_s=1.0, floor_s=0.0), "floor_s=0.0"),
                                          (dict(cap_s=1.0, floor_s=2.0), "floor_s=2.0"),
                                          (dict(cap_s=1.0, factor=0.5), "factor=0.5")])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DraftDeadline(**kwargs)
