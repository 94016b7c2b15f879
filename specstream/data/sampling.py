"""A request's sampling settings, validated in one place (``__post_init__``, whoever builds them:
the gateway, the target reading them off the wire, a tool): temperature, top-k, top-p and the seed.

Speculative sampling is exact only if the target's p and the draft's q come from the SAME
processing of their logits (docs/architecture.md §7.1), so both services process them with the request's
`SamplingParams` (kernels/processing.py); the seed keys every random draw (kernels/random.py).
Plain data: no torch. `from_pb` reads the `specstream.v1.Sampling` message at the edge.
"""

from __future__ import annotations

from dataclasses import dataclass

from specstream.data.errors import InvalidArgumentError

_MASK64 = (1 << 64) - 1  # seeds are uint64


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax); top_k and top_p then have no effect
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int = 0  # uint64; with the position, keys every random draw

    def __post_init__(self) -> None:
        # InvalidArgumentError is a ValueError that also carries the field and the value.
        if not (self.temperature >= 0.0 and self.temperature < float("inf")):
            raise InvalidArgumentError("temperature", self.temperature, "must be a finite number >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise InvalidArgumentError("top_k", self.top_k, "must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:  # NaN fails too
            raise InvalidArgumentError("top_p", self.top_p, "must be in (0, 1] (1 = off)")
        if not 0 <= self.seed <= _MASK64:
            raise InvalidArgumentError("seed", self.seed, "must fit in uint64")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def effective(self) -> SamplingParams:
        """What decoding uses: with temperature 0 the cuts have no effect (greedy), so they are dropped."""
        return SamplingParams(seed=self.seed) if self.greedy else self

    @classmethod
    def from_settings(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0
                      ) -> SamplingParams:
        """Params from settings as decoding reads them; raises InvalidArgumentError. With temperature
        0 the cuts are ignored (greedy), so unset settings (the wire's zeros) mean greedy. The
        gateway checks a public request's cuts even then: it builds the params as written, then
        takes ``effective()``."""
        if temperature == 0.0:
            return cls(seed=seed)
        return cls(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

    @classmethod
    def from_pb(cls, pb) -> SamplingParams:
        """A `Sampling` message -> params (see `from_settings`)."""
        return cls.from_settings(pb.temperature, pb.top_k, pb.top_p, pb.seed)


GREEDY = SamplingParams()
