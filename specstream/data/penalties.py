"""A request's logits adjustments that depend on what came before (``Penalties``): OpenAI's
``presence_penalty``, ``frequency_penalty`` and ``logit_bias``, and vLLM's ``repetition_penalty``,
checked once when built (ranges, the size of the bias map; the ids against the vocabulary in
``check_ids``), with their wire form. Field names are the public request's
(``penalties.presence_penalty``, ...).

How they are applied, at every position the target verifies (target_service/penalties.py):
logit_bias added, then repetition_penalty on every token of the prompt and of the output so far
(a positive logit divided by it, any other multiplied), then frequency_penalty times each token's
count in the output and presence_penalty once for each token the output holds, subtracted.
Plain data: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specstream.data.errors import InvalidArgumentError
from specstream_pb import common_pb2

__all__ = ["MAX_LOGIT_BIAS", "Penalties"]

MAX_LOGIT_BIAS = 1024  # ids in one logit_bias map (OpenAI allows 300)


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending

    def __post_init__(self) -> None:
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidArgumentError(f"penalties.{name}", value, "must be in -2..2")
        if not (math.isfinite(self.repetition) and 0.0 < self.repetition <= 2.0):
            raise InvalidArgumentError("penalties.repetition_penalty", self.repetition, "must be in (0, 2] (1: off)")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgumentError("penalties.logit_bias", f"<{len(self.logit_bias)} ids>",
                                       f"at most {MAX_LOGIT_BIAS} ids")
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise InvalidArgumentError(f"penalties.logit_bias[{token}]", bias, "must be in -100..100")

    @property
    def active(self) -> bool:
        """Whether they change anything."""
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.logit_bias)

    @property
    def uses_counts(self) -> bool:
        """Whether the output's token counts matter (frequency, presence)."""
        return bool(self.presence or self.frequency)

    def check_ids(self, vocab_size: int) -> None:
        """logit_bias names only tokens of the model's vocabulary."""
        for token, _ in self.logit_bias:
            if token >= vocab_size:
                raise InvalidArgumentError(f"penalties.logit_bias[{token}]", token,
                                           f"is not a token id (the vocabulary has {vocab_size})")

    @classmethod
    def from_pb(cls, pb: common_pb2.Penalties) -> Penalties | None:
        """The wire form (every hop's); None where it changes nothing. Checks itself as built."""
        penalties = cls(pb.presence_penalty, pb.frequency_penalty, pb.repetition_penalty or 1.0,
                        tuple(sorted(pb.logit_bias.items())))
        return penalties if penalties.active else None

    def to_pb(self) -> common_pb2.Penalties:
        return common_pb2.Penalties(presence_penalty=self.presence, frequency_penalty=self.frequency,
                                    repetition_penalty=0.0 if self.repetition == 1.0 else self.repetition,
                                    logit_bias=dict(self.logit_bias))
