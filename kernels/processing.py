"""Logits processing: temperature, top-k and top-p, as every sampler of both services applies it.

The torch reference of the cuts the fused sampling ops make (kernels/sample.py reads its cut off
an n-best pass): logits -> probabilities, one ``SamplingParams`` per row. The target's p and the
draft's q must come from this same processing (docs/architecture.md §7.1). ``truncate`` cuts a distribution to its
K most likely tokens, renormalised: the sparse q a draft sends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specstream.data.sampling import SamplingParams

__all__ = ["process_logits", "truncate"]


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


# Top-p looks among this many most likely tokens first (a full sort is much slower: docs/benchmarks.md).
_NUCLEUS_SEARCH = 256


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
    the result samples from exactly the distribution it describes (docs/architecture.md §7.1)."""
    top, ids = torch.topk(probs, min(support, probs.shape[-1]), dim=-1)  # [..., K]
    return ids, top / top.sum(dim=-1, keepdim=True)
