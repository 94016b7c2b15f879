"""Sampling math shared by target and draft: logits processing and per-request random numbers.

Speculative sampling is exact only if the target's p and the draft's q come from the SAME
processing of their logits (design §5), so both services call `process_logits` with the request's
`SamplingParams`. Random numbers come from a counter-based generator keyed by (seed, position,
purpose): a request's draws depend on nothing else in the batch, so the same seed reproduces the
same text whatever shares the step. Knows nothing about models, engines or gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int = 0  # uint64; with the position, keys every random draw

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and self.temperature < float("inf")):
            raise ValueError(f"temperature={self.temperature!r}: must be >= 0 and finite")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]")
        if not 0 <= self.seed <= _MASK64:
            raise ValueError(f"seed={self.seed!r}: must fit in uint64")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (float32) after temperature, top-k and top-p.

    Ties at the top-k / top-p boundary are kept (everything with the boundary's value stays), so
    the result does not depend on how a sort orders equal logits."""
    assert not params.greedy, "greedy requests take the argmax; there is no distribution to process"
    scaled = logits.float() / params.temperature  # [..., V]
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [..., V]
    if params.top_p < 1.0:
        sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)  # [..., V]
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each entry
        # The smallest probability still needed to reach top_p: keep every entry >= it.
        needed = sorted_probs.masked_fill(before >= params.top_p, float("inf")).amin(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < needed, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


# Purposes of random draws, so that e.g. accepting position 7 and sampling position 7 differ.
DRAFT_SAMPLE, ACCEPT, TARGET_SAMPLE = 1, 2, 3


def uniform(seed: int, position: int, purpose: int) -> float:
    """A float in [0, 1) that depends only on (seed, position, purpose): splitmix64 finalizer over
    a counter, 53 bits of mantissa. Counter-based, so no generator state is shared or carried."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + purpose * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return (x >> 11) / float(1 << 53)


def sample(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample from probs [V] with the uniform u: the first token whose cumulative mass
    exceeds u * total. Zero-probability tokens are never returned (strict inequality)."""
    cdf = probs.double().cumsum(dim=0)  # [V]
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    index = min(index, probs.shape[0] - 1)
    while probs[index] <= 0:  # u * total landed exactly on a boundary before trailing zeros
        index -= 1
    return index
