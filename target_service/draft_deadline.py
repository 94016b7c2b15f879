"""How long the target waits for one `Draft.Speculate` round trip before it decodes without the draft.

A fixed timeout is either long enough for a draft's slowest honest reply (a batch of new prompts
to take in can cost a second on a CPU), and then a hung draft stalls every stream that long, or
short, and then a healthy stream is dropped whenever the draft takes in a long context. So the
deadline follows the round trips measured *for the shape of the request being sent*:

    predicted(shape) = t0 + t_depth·depth + t_prop·proposals + t_fed·fed
                       (recursive least squares, refit on every reply, old replies forgotten
                       (0.98 per reply); slopes are never negative when predicting)
    spread           = exp(m + 4·d)   m, d: running mean and mean deviation of log(measured /
                                       predicted): Jacobson's SRTT + 4·RTTVAR on a log scale, so it
                                       is a ratio that carries over from one shape to another
    deadline(shape)  = min(cap, clamp(factor × predicted(shape) × spread, floor, cap) × backoff)

with depth = the largest γ asked (the draft's sequential forwards), proposals = Σγ, and fed = the
tokens the draft must take in before guessing (a new sequence's prompt, everything since a row
last drafted, every context again on a fresh stream). `cap` is the configured
`draft_timeout_s`; until `min_samples` replies are measured nothing is known about the draft and
the deadline is `UNMEASURED_S` (or the cap, if smaller): generous for a cold draft's first replies,
and shorter than the gateway's 5 s floor for declaring a silent target hung, so a draft that hangs
in its first exchanges stalls one step instead of making its target look dead. Each timeout doubles `backoff` and a reply resets it, as TCP backs off its
retransmission timer: a deadline that was too tight for an honest draft (a load spike) is looser
next time instead of failing the same way again.

Knows nothing about gRPC or the engine: shapes in, seconds out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from target_service.linear_fit import LinearFit


@dataclass(frozen=True)
class Shape:
    """What one request asks of the draft (a Release is the empty shape)."""

    depth: int = 0  # the largest γ asked: the draft's sequential forwards
    proposals: int = 0  # Σγ over the items
    fed: int = 0  # tokens appended before guessing, over all items

    def features(self) -> list[float]:
        return [1.0, float(self.depth), float(self.proposals), float(self.fed)]


class DraftDeadline:
    """Seconds to wait for the reply to a request of a given `Shape` (see the module docstring)."""

    MEAN_GAIN, DEV_GAIN = 1 / 8, 1 / 4  # Jacobson's gains for the mean and the mean deviation
    UNMEASURED_S = 2.0  # the deadline before min_samples replies (see the module docstring)

    def __init__(self, cap_s: float, floor_s: float = 0.25, factor: float = 2.0, min_samples: int = 4) -> None:
        if not 0 < floor_s <= cap_s:
            raise ValueError(f"floor_s={floor_s!r}: must be in (0, cap_s={cap_s!r}]")
        if factor < 1.0:
            raise ValueError(f"factor={factor!r}: must be >= 1")
        self.cap_s, self.floor_s, self.factor, self.min_samples = cap_s, floor_s, factor, min_samples
        # Prior variances relative to the replies' noise: the first reply sets the intercept; the
        # slopes stay near 0 until replies of different shapes tell them apart.
        self.fit = LinearFit([0.0, 0.0, 0.0, 0.0], [1e6, 1.0, 1.0, 1.0], forget=0.98)
        self._mean = 0.0  # of log(measured / predicted)
        self._dev = 0.25  # its mean deviation; spread e^(4·0.25) ≈ 2.7 until replies say otherwise
        self.backoff = 1.0
        self.timeouts = 0  # in a row

    @property
    def samples(self) -> int:
        return self.fit.samples

    def predicted(self, shape: Shape) -> float:
        """The fitted round trip of `shape`, in seconds (at least 1 ms)."""
        t0, *slopes = self.fit.theta
        x = shape.features()
        return max(float(t0) + sum(max(float(s), 0.0) * v for s, v in zip(slopes, x[1:])), 1e-3)

    def deadline(self, shape: Shape) -> float:
        if self.samples < self.min_samples:
            return min(self.UNMEASURED_S, self.cap_s)
        spread = math.exp(self._mean + 4.0 * self._dev)
        wait = min(max(self.factor * self.predicted(shape) * spread, self.floor_s), self.cap_s)
        return min(wait * self.backoff, self.cap_s)

    def observe(self, shape: Shape, seconds: float) -> None:
        """The reply to a `shape` request came after `seconds`."""
        if self.samples:
            error = math.log(max(seconds, 1e-6) / self.predicted(shape))
            self._dev += self.DEV_GAIN * (abs(error - self._mean) - self._dev)
            self._mean += self.MEAN_GAIN * (error - self._mean)
        self.fit.observe(shape.features(), seconds)
        self.backoff, self.timeouts = 1.0, 0

    def timed_out(self) -> None:
        """A request got no reply within its deadline: twice as patient next time (up to the cap)."""
        self.timeouts += 1
        self.backoff = min(self.backoff * 2.0, self.cap_s / self.floor_s)
