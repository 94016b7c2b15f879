"""Settling one target pass: which proposals stand and which token follows, per row (design §5).

Greedy rows keep the longest prefix matching the target's argmax. Sampling rows are verified by
Leviathan's rule against their sparse q (a proposal that came without q, from a model-free
proposer, is a point mass), with uniforms keyed by (seed, position) so a row's result depends on
nothing else in the batch. A pass without proposals (prefill, γ = 0) is plain decoding: argmax, or
a sample from p. Rows that asked for log-probabilities get them under the distribution their token
came from (the processed p; the plain softmax for greedy rows).

The target's scores come as logits [B, G+1, V] or as hidden states with the LM head (``Hidden``).
On the torch backend (CPU) the logits are built and settled here with the torch ops; on the Triton
backend (CUDA) greedy rows go through the fused 1-best verification kernel and sampling rows
through the fused speculative kernel (temperature, cuts, accept/reject and the residual sample in
one read of each row, an exponential race instead of an inverse CDF), so [rows, vocab] logits are
built only for a row whose top-k/top-p cut reaches past its 64 largest scores (cuts and
log-probabilities come from a fused n-best pass). Both draw with the same
(seed, position) keys, so a row's result never depends on its batch; the two backends' samples
are equally distributed, not equal.

Runs on the compute thread; all results reach the host in ONE transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import kernels
from kernels.lm_head import Hidden
from kernels.random import row_keys
from kernels.sample import cut_thresholds
from specstream.sampling import ACCEPT, TARGET_SAMPLE, SamplingParams, process_logits, uniforms

@dataclass
class Row:
    params: SamplingParams
    position: int  # position in the sequence of the first token this pass can emit
    proposals: list[int] = field(default_factory=list)
    # The sparse q of each proposal as a [len(proposals), q_width] table, flattened row-major
    # (padding: probability 0). q_width 0: point masses (a model-free proposer's guesses).
    q_width: int = 0
    q_ids: Sequence[int] = ()
    q_probs: Sequence[float] = ()
    logprobs: int | None = None  # None: not requested; n: with the n most likely alternatives
    source: str = "model"  # the proposer that made the proposals (the γ controller's statistics are per proposer)


@dataclass
class Verdict:
    accepted: int  # proposals kept
    tokens: list[int]  # the kept proposals, then the target's own token
    # Per token: (its log-probability, [(alternative id, log-probability), ...]); None unless asked.
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


def settle(target: torch.Tensor | Hidden, rows: list[Row]) -> list[Verdict]:
    """target: logits [B, G+1, V], or Hidden over the B*(G+1) rows (sequence-major): position j
    scores the token after proposal j (0: after the row's last committed token). Returns one
    Verdict per row."""
    batch = len(rows)
    if isinstance(target, Hidden):
        positions = target.states.shape[0] // batch
        if kernels.backend(target.states) == "torch":
            target = target.logits().view(batch, positions, -1)  # [B, G+1, V]
    else:
        positions = target.shape[1]
    gamma = positions - 1
    device = target.states.device if isinstance(target, Hidden) else target.device
    draft = torch.tensor([r.proposals + [-1] * (gamma - len(r.proposals)) for r in rows],
                         dtype=torch.int64).view(batch, gamma).to(device)  # [B, G], padded with -1
    num_draft = torch.tensor([len(r.proposals) for r in rows], dtype=torch.int64).to(device)  # [B]
    wanted = [b for b, r in enumerate(rows) if r.logprobs is not None]
    top_n = max((rows[b].logprobs for b in wanted), default=0)
    if isinstance(target, Hidden):
        num_accepted, tokens = _settle_fused(target, rows, draft, num_draft, positions)
    else:
        num_accepted, tokens = kernels.greedy_verify(draft, num_draft, target)  # [B], [B, G+1]
        sampled = [b for b, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            k, emitted = _verify_sampled(target[sampled], [rows[b] for b in sampled], draft[sampled],
                                         num_draft[sampled])
            num_accepted[sampled] = k
            tokens[sampled] = _emitted_tokens(draft[sampled], k, emitted)
    parts = [num_accepted[:, None], tokens]  # [B, 1], [B, G+1]
    if wanted and isinstance(target, Hidden):  # from the fused n-best pass, no logits built
        states = target.states.view(batch, positions, -1)[wanted].reshape(-1, target.states.shape[-1])
        chosen, top_ids, top_values = kernels.token_logprobs(
            Hidden(states, target.head), tokens[wanted].flatten(),
            [rows[b].params for b in wanted for _ in range(positions)], top_n)  # [W*(G+1)], [W*(G+1), n] x2
        parts += [chosen, top_ids, top_values]
    elif wanted:
        logp = process_logits(target[wanted], [rows[b].params for b in wanted]).log()  # [W, G+1, V]
        parts.append(logp.gather(-1, tokens[wanted][..., None].clamp(min=0)).squeeze(-1))  # [W, G+1]
        top = torch.topk(logp, top_n, dim=-1)  # [W, G+1, n]
        parts += [top.indices, top.values]
    # The pass's one host sync: every result in one flat transfer.
    flat = torch.cat([t.double().flatten() for t in parts]).tolist()
    return _unpack(flat, rows, wanted, positions, top_n)


def _emitted_tokens(draft: torch.Tensor, k: torch.Tensor, emitted: torch.Tensor) -> torch.Tensor:
    """[S, G+1]: the proposals, with the emitted token at position k (what a row commits is the
    first k + 1)."""
    row_tokens = torch.cat([draft, draft.new_full((draft.shape[0], 1), -1)], dim=1)  # [S, G+1]
    return row_tokens.scatter(1, k[:, None], emitted[:, None])


def _settle_fused(target: Hidden, rows: list[Row], draft: torch.Tensor, num_draft: torch.Tensor, positions: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_accepted [B], tokens [B, G+1]) through the fused kernels (kernels/verify.py, speculative.py)."""
    batch, gamma = draft.shape
    device = draft.device
    states = target.states.view(batch, positions, -1)  # [B, G+1, H]
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    tokens = torch.zeros(batch, positions, dtype=torch.int64, device=device)
    greedy = [b for b, r in enumerate(rows) if r.params.greedy]
    sampled = [b for b, r in enumerate(rows) if not r.params.greedy]
    if greedy:
        part = Hidden(states[greedy].reshape(-1, states.shape[-1]), target.head)
        num_accepted[greedy], tokens[greedy] = kernels.greedy_verify(draft[greedy], num_draft[greedy], part)
    if sampled:
        chosen = [rows[b] for b in sampled]
        params = [r.params for r in chosen]
        part = Hidden(states[sampled].reshape(-1, states.shape[-1]), target.head)  # [S*(G+1), H]
        # Top-k/top-p cuts: one threshold per row, from a fused n-best pass over the rows with cuts.
        threshold = cut_thresholds(part, [p for p in params for _ in range(positions)]).view(len(sampled), positions)
        seeds = [p.seed for p in params]
        starts = [r.position for r in chosen]
        keys = torch.stack([row_keys(seeds, [s + j for s in starts], TARGET_SAMPLE, device)
                            for j in range(positions)], dim=1)  # [S, G+1]
        u_accept = uniforms(seeds, starts, gamma, ACCEPT, device)  # [S, G]
        q_ids, q_probs = _sparse_q(chosen, gamma)
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        k, emitted = kernels.speculative_verify_fused(part, q_ids.to(device), q_probs.to(device), draft[sampled],
                                                      num_draft[sampled], temperature, threshold, keys, u_accept)
        num_accepted[sampled] = k
        tokens[sampled] = _emitted_tokens(draft[sampled], k, emitted)
    return num_accepted, tokens


def _verify_sampled(logits: torch.Tensor, rows: list[Row], draft: torch.Tensor, num_draft: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan verification of the sampling rows: logits [S, G+1, V] -> (accepted [S], emitted [S])."""
    device, gamma = logits.device, logits.shape[1] - 1
    p = process_logits(logits, [r.params for r in rows])  # [S, G+1, V]
    q_ids, q_probs = _sparse_q(rows, gamma)
    seeds = [r.params.seed for r in rows]
    starts = [r.position for r in rows]
    u_accept = uniforms(seeds, starts, gamma, ACCEPT, device)  # [S, G]
    u_sample = uniforms(seeds, starts, gamma + 1, TARGET_SAMPLE, device)  # [S, G+1]
    return kernels.speculative_verify(p, q_ids.to(device), q_probs.to(device), draft, num_draft, u_accept, u_sample)


def _sparse_q(rows: list[Row], gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' q as (ids, probs) [S, G, K], K the widest table; a proposal without q is a point
    mass on itself (what a deterministic proposer samples from). Built from flat lists, one
    tensor each: thousands of rows must not mean thousands of small tensors."""
    width = max(max(r.q_width for r in rows), 1)
    flat_ids: list[int] = []
    flat_probs: list[float] = []
    for row in rows:
        n = len(row.proposals)
        if row.q_width == width:
            flat_ids += row.q_ids
            flat_probs += row.q_probs
        elif row.q_width:  # a narrower table: pad each of its rows
            for j in range(n):
                pad = [0] * (width - row.q_width)
                flat_ids += [*row.q_ids[j * row.q_width : (j + 1) * row.q_width], *pad]
                flat_probs += [*row.q_probs[j * row.q_width : (j + 1) * row.q_width], *pad]
        else:
            pad = [0] * (width - 1)
            for x in row.proposals:
                flat_ids += [x, *pad]
                flat_probs += [1.0, *pad]
        pad = [0] * (width * (gamma - n))
        flat_ids += pad
        flat_probs += pad
    q_ids = torch.tensor(flat_ids, dtype=torch.int64).view(len(rows), gamma, width)  # [S, G, K]
    q_probs = torch.tensor(flat_probs, dtype=torch.float32).view(len(rows), gamma, width)  # [S, G, K]
    return q_ids, q_probs


def _unpack(flat: list[float], rows: list[Row], wanted: list[int], positions: int, top_n: int) -> list[Verdict]:
    batch = len(rows)
    at = 0

    def take(count: int) -> list[float]:
        nonlocal at
        at += count
        return flat[at - count : at]

    accepted = [int(v) for v in take(batch)]
    tokens = take(batch * positions)
    verdicts = [Verdict(accepted[b], [int(t) for t in tokens[b * positions : b * positions + accepted[b] + 1]])
                for b in range(batch)]
    chosen = take(len(wanted) * positions)
    top_ids = take(len(wanted) * positions * top_n)
    top_vals = take(len(wanted) * positions * top_n)
    for w, b in enumerate(wanted):
        n, out = rows[b].logprobs, []
        for j in range(len(verdicts[b].tokens)):
            base = (w * positions + j) * top_n
            alternatives = [(int(top_ids[base + i]), top_vals[base + i]) for i in range(n)
                            if top_vals[base + i] > float("-inf")]  # tokens the cuts removed are no alternative
            out.append((chosen[w * positions + j], alternatives))
        verdicts[b].logprobs = out
    return verdicts
