"""Sampling math shared by target and draft: logits processing and per-request random numbers.

Speculative sampling is exact only if the target's p and the draft's q come from the SAME
processing of their logits (design §5), so both services call `process_logits` with the request's
`SamplingParams`. Random numbers come from a counter-based generator keyed by (seed, absolute
position in the sequence, purpose), never by how many draws a stream has made: a request's draws
depend on nothing else in the batch, so the same seed reproduces the same text whatever shares the
step, and a request resubmitted as its prompt plus the tokens generated so far draws at the same
positions with the same keys as the run it continues. Knows nothing about models or engines;
`from_pb` reads the `specstream.v1.Sampling` message at the edge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specstream.errors import InvalidArgumentError

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax); top_k and top_p then have no effect
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int = 0  # uint64; with the position, keys every random draw

    def __post_init__(self) -> None:
        # InvalidArgumentError is a ValueError that also carries the field and the value.
        if not (self.temperature >= 0.0 and self.temperature < float("inf")):
            raise InvalidArgumentError("temperature", self.temperature, "must be >= 0 and finite")
        if self.top_k < 0:
            raise InvalidArgumentError("top_k", self.top_k, "must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError("top_p", self.top_p, "must be in (0, 1]")
        if not 0 <= self.seed <= _MASK64:
            raise InvalidArgumentError("seed", self.seed, "must fit in uint64")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_settings(cls, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0
                      ) -> SamplingParams:
        """Params from a request's settings; raises InvalidArgumentError. With temperature 0 the
        cuts are ignored (greedy), so unset settings mean greedy."""
        if temperature == 0.0:
            return cls(seed=seed)
        return cls(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

    @classmethod
    def from_pb(cls, pb) -> SamplingParams:
        """A `Sampling` message -> params (see `from_settings`)."""
        return cls.from_settings(pb.temperature, pb.top_k, pb.top_p, pb.seed)


GREEDY = SamplingParams()


def process_logits(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor:
    """logits [B, ..., V] -> probabilities [B, ..., V] (float32) after temperature, top-k and top-p,
    with one SamplingParams per row (or one for all rows). Greedy rows get the plain softmax: it is
    what their log-probabilities are reported under.

    Ties at the top-k / top-p boundary are kept (everything with the boundary's value stays), so
    the result does not depend on how a sort orders equal logits."""
    rows = [params] * logits.shape[0] if isinstance(params, SamplingParams) else list(params)
    assert len(rows) == logits.shape[0], (len(rows), logits.shape)
    vocab, device = logits.shape[-1], logits.device
    per_row = (len(rows),) + (1,) * (logits.dim() - 1)  # broadcasts a [B] setting over [B, ..., V]
    # Any positive temperature below float32's smallest normal gives the same one-hot; clamping
    # keeps it from rounding to 0 (0 / 0 = NaN at the maximum).
    tiny = torch.finfo(torch.float32).tiny
    temperature = torch.tensor([max(p.temperature, tiny) if p.temperature else 1.0 for p in rows],
                               device=device).view(per_row)
    logits = logits.float()
    # Shift before dividing: a tiny temperature then sends the rest to -inf instead of inf - inf.
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature  # [B, ..., V]
    # The cuts touch only the rows that ask for them: a row's result must not depend on its batch.
    top_k = [b for b, p in enumerate(rows) if not p.greedy and 0 < p.top_k < vocab]
    if top_k:
        cut = scaled[top_k]  # [b, ..., V]
        k = torch.tensor([rows[b].top_k for b in top_k], device=device).view(len(top_k), *per_row[1:])
        ranked = torch.topk(cut, max(rows[b].top_k for b in top_k), dim=-1).values  # [b, ..., k_max]
        kth = ranked.gather(-1, (k - 1).expand(*cut.shape[:-1], 1))  # [b, ..., 1]
        scaled[top_k] = cut.masked_fill(cut < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [B, ..., V]
    top_p = [b for b, p in enumerate(rows) if not p.greedy and p.top_p < 1.0]
    if top_p:
        sub = probs[top_p]  # [b, ..., V]
        nucleus = torch.tensor([rows[b].top_p for b in top_p], device=device)
        nucleus = nucleus.view(len(top_p), *per_row[1:]).expand(*sub.shape[:-1], 1)  # [b, ..., 1]
        needed = _nucleus_threshold(sub.reshape(-1, vocab), nucleus.reshape(-1, 1)).view(nucleus.shape)
        cut = sub.masked_fill(sub < needed, 0.0)
        probs[top_p] = cut / cut.sum(dim=-1, keepdim=True)
    return probs


_NUCLEUS_SEARCH = 256  # top-p looks among this many most likely tokens first (a full sort is 10x slower)


def _nucleus_threshold(probs: torch.Tensor, nucleus: torch.Tensor) -> torch.Tensor:
    """probs [N, V], nucleus [N, 1] -> [N, 1]: the smallest probability still needed to reach
    top_p (keep every entry >= it). Rows whose most likely _NUCLEUS_SEARCH tokens already hold
    top_p get it from those alone, which is exact: every later token has at least that much mass
    above it and would be cut anyway. Other rows take a full sort. Which way a row goes depends
    only on the row, so its result does not depend on its batch."""
    def threshold(ranked: torch.Tensor, nucleus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cumulative = ranked.cumsum(dim=-1)
        before = cumulative - ranked  # mass strictly above each entry
        needed = ranked.masked_fill(before >= nucleus, float("inf")).amin(dim=-1, keepdim=True)
        return needed, cumulative[:, -1:] >= nucleus

    if probs.device.type != "cpu":  # a full sort is cheap there, and the shortcut would read the device
        return threshold(torch.sort(probs, dim=-1, descending=True).values, nucleus)[0]
    ranked = torch.topk(probs, min(_NUCLEUS_SEARCH, probs.shape[-1]), dim=-1).values  # [N, K]
    needed, reached = threshold(ranked, nucleus)
    rest = (~reached[:, 0]).nonzero().squeeze(-1)
    if rest.numel():  # flat rows: the nucleus reaches past the search window
        full = torch.sort(probs[rest], dim=-1, descending=True).values  # [n, V]
        needed[rest] = threshold(full, nucleus[rest])[0]
    return needed


def truncate(probs: torch.Tensor, support: int) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [..., V] -> (ids [..., K], probs [..., K]) of the K = min(support, V) most likely tokens,
    renormalised, most likely first (zeros at the end where fewer than K have mass). Sampling from
    the result samples from exactly the distribution it describes (design §5)."""
    top, ids = torch.topk(probs, min(support, probs.shape[-1]), dim=-1)  # [..., K]
    return ids, top / top.sum(dim=-1, keepdim=True)


# What a draw is for, so that e.g. accepting position 7 and sampling position 7 use unrelated numbers:
# - SAMPLE: the token at a position as plain sampling draws it (the per-token race noise of
#   kernels/random.py): a request's first token, a γ = 0 step, the bonus token after a fully
#   accepted run, and under coupled verification every position. The draft guesses a position
#   with the same noise, so where q is close to p its guess is the target's own sample.
# - ACCEPT: Leviathan's acceptance test of the proposal at a position (one uniform).
# - RESIDUAL: a target draw at a position the draft drew for (the residual after a rejection):
#   the draft's noise there is spent, and reusing it would bias the draw.
# (1 was the draft's own inverse-CDF uniform before the draft shared SAMPLE's noise.)
ACCEPT, SAMPLE, RESIDUAL = 2, 3, 4


_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def uniform(seed: int, position: int, purpose: int) -> float:
    """A float in [0, 1) that depends only on (seed, position, purpose): splitmix64 finalizer over
    a counter, 53 bits of mantissa. Counter-based, so no generator state is shared or carried.

    Each position's draws are used at most once in what a sequence commits: the acceptance and
    final draws of position i only in the step that settles token i, and a draft draw that was
    thrown away (its proposal came after a rejection) never influenced anything committed."""
    x = (seed * _GOLDEN + position * _MIX1 + purpose * _MIX2) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    x ^= x >> 31
    return (x >> 11) / float(1 << 53)


def uniforms(seeds: Sequence[int], starts: Sequence[int], count: int, purpose: int,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(seeds), count] float64: row b holds uniform(seeds[b], starts[b] + j, purpose) for
    j < count, computed in wrapping uint64 arithmetic for the whole table at once."""
    u64 = np.uint64
    seed = np.asarray(seeds, dtype=u64).reshape(-1, 1)  # [N, 1]
    position = np.asarray(starts, dtype=u64).reshape(-1, 1) + np.arange(count, dtype=u64)  # [N, count]
    with np.errstate(over="ignore"):  # uint64 products wrap modulo 2^64, as intended
        x = seed * u64(_GOLDEN) + position * u64(_MIX1) + u64(purpose) * u64(_MIX2)
        x = (x ^ (x >> u64(30))) * u64(_MIX1)
        x = (x ^ (x >> u64(27))) * u64(_MIX2)
        x ^= x >> u64(31)
    values = (x >> u64(11)).astype(np.float64) / float(1 << 53)  # exact: 53-bit integers
    return torch.from_numpy(values).to(device)
