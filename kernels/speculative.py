"""Speculative sampling verification (Leviathan et al. 2023, Algorithm 1), with a sparse draft q.

Row b proposed `num_draft[b]` tokens x_1..x_γ, each sampled from the draft's processed
distribution q_i, which travels sparsely as (ids, probs) (the draft may truncate q to its top-k
and renormalise: q is then exactly what it sampled from). With the target's processed
distributions p_1..p_{γ+1} (same processing as q), accept x_i with probability min(1, p_i(x)/q_i(x)),
in order; at the first rejection emit a sample from norm(max(0, p_i − q_i)); if all are accepted,
emit a sample from p_{γ+1}. The emitted tokens are then distributed exactly as p. With no
proposals (γ = 0) this is plain sampling from p_1.

A proposal its own q gives no mass cannot have been drawn from q (a draft bug); that position is
verified as a point mass δ_x instead — accept with p(x), else sample p without x — which is
exact for a proposal drawn any way at all, independently of the target's draws.

Randomness comes in as one uniform per proposal for acceptance and one race key per position for
the emitted token (kernels/random.py: the token is the winner of an exponential race over its
distribution, with noise keyed by (key, token id)), so a row's result depends only on its own
counter-based stream (kernels/random.py); the caller picks each position's key (a residual must
not reuse noise the draft drew with, target_service/settle.py). Acceptance uniforms must be
float64 in [0, 1): in float32 a draw just below 1 rounds to 1.0, which would reject a proposal with
p == q that must always be accepted.

Two implementations of the same rule:
- ``speculative_verify`` takes the processed probabilities p [B, G+1, V] and races over the one
  distribution each row emits from (the torch path, what the engine runs on CPU);
  ``speculative_accept`` is its first half, the accepted count and that distribution;
- ``speculative_verify_fused`` reads the target's scores (logits, or hidden states with the LM head)
  once per row in the fused row pass (kernels/row_pass.py, ``row_partials``): per row the log-sum-exp of the
  processed scores and an exponential race over the tokens outside q's support; the accept/reject
  decisions and the residual max(0, p - q), which differs from p only on q's K support ids, are then
  settled over [B, G+1, K] numbers (``_settle``), so no [rows, vocab] probabilities are written.
  The race's winner among non-support tokens is also the residual's, since there the residual is
  p; the support ids race with their residual mass and the same uniforms. Its reference,
  ``speculative_verify_fused_reference``, does the same over materialised logits.
"""

from __future__ import annotations

import torch

from kernels.dispatch import backend
from kernels.lm_head import Hidden, Scores, scores_at, scores_reference
from kernels.random import race, uniform_table
from kernels.row_pass import row_partials, row_pass_reference

# A residual with less mass than this is rounding noise around p == q: rejecting there had
# ~zero probability, and p itself is the right distribution to fall back on.
_EMPTY_RESIDUAL = 1e-12


def speculative_verify(p: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor, draft: torch.Tensor,
                       num_draft: torch.Tensor, u_accept: torch.Tensor, keys: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """p [B, G+1, V] target probabilities; q_ids, q_probs [B, G, K] sparse draft distributions
    (unused slots: prob 0); draft [B, G] proposals; num_draft [B]; u_accept [B, G] float64; keys
    [B, G+1] int64 race keys (keys[b, j] draws the emitted token if it lands at position j).
    Returns (num_accepted [B], emitted [B]) int64 on p's device; no host sync."""
    num_accepted, dist = speculative_accept(p, q_ids, q_probs, draft, num_draft, u_accept)
    rows = torch.arange(p.shape[0], device=p.device)
    return num_accepted, race(dist, keys.to(p.device)[rows, num_accepted])


def speculative_accept(p: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor, draft: torch.Tensor,
                       num_draft: torch.Tensor, u_accept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance half of ``speculative_verify``: (num_accepted [B], dist [B, V] float64), dist
    the distribution the emitted token is drawn from (the residual after a rejection, else p at
    the emitted position; not normalised)."""
    assert u_accept.dtype == torch.float64, "uniforms must be float64"
    batch, positions, _ = p.shape
    gamma = positions - 1
    rows = torch.arange(batch, device=p.device)
    if gamma == 0:
        return torch.zeros(batch, dtype=torch.int64, device=p.device), p[:, 0].double()
    q_probs = _normalise(q_probs)  # [B, G, K]
    ids = q_ids.long()
    # q(x_i): the mass the draft gave its own proposal (0 if it is not in q's support).
    q_x = (q_probs * (ids == draft[..., None])).sum(dim=-1)  # [B, G]
    p_x = p[:, :gamma].gather(-1, draft.clamp(min=0)[..., None]).squeeze(-1).double()  # [B, G]
    proposed = torch.arange(gamma, device=p.device) < num_draft[:, None]  # [B, G]
    point = q_x <= 0  # q rules its own proposal out: verify as a point mass (q(x) = 1)
    # Leviathan Alg. 1: accept with min(1, p/q), written u * q < p.
    accept = proposed & (u_accept * torch.where(point, 1.0, q_x) < p_x)  # [B, G]
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    # The residual max(0, p - q) differs from p only at q's support: the table is p_k, overwritten
    # there (no vocabulary-sized q). A point mass is q = 1 at the proposal.
    at = num_accepted.clamp(max=gamma - 1)
    ids_k = torch.where(point[rows, at][:, None], draft[rows, at].clamp(min=0)[:, None], ids[rows, at])  # [B, K]
    q_k = torch.where(point[rows, at][:, None], (torch.arange(ids.shape[-1], device=p.device) == 0).double(),
                      q_probs[rows, at])  # [B, K]
    # q at each support id: its slots summed in slot order (a repeated id holds their sum, as a dense
    # scatter-add would make it). A stable sort groups a row's repeated ids, keeping slot order
    # within each group; no host sync (torch.unique would need one).
    sorted_ids, order = torch.sort(ids_k, dim=1, stable=True)  # [B, K] each
    new_id = torch.ones_like(sorted_ids, dtype=torch.bool)
    new_id[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    group = new_id.long().cumsum(dim=1) - 1  # [B, K] each sorted slot's group
    sums = torch.zeros_like(q_k).scatter_add_(1, group, q_k.gather(1, order))  # [B, K] per group
    q_at = torch.empty_like(q_k).scatter_(1, order, sums.gather(1, group))  # [B, K] back in slot order
    dist = p[rows, num_accepted].double()  # [B, V]: the target's distribution where the emitted token goes
    p_at = dist.gather(1, ids_k)  # [B, K]
    rejected = (num_accepted < num_draft)[:, None]  # [B, 1]
    residual_at = torch.where(rejected, (p_at - q_at).clamp(min=0.0), p_at)  # [B, K]
    dist.scatter_(1, ids_k, residual_at)
    # Rejected: norm(max(0, p - q)) at the rejected position, unless that holds no mass (p == q up to
    # rounding: p itself); all accepted: the bonus from p_{γ+1}.
    empty = rejected & (dist.sum(dim=-1, keepdim=True) <= _EMPTY_RESIDUAL)  # [B, 1]
    dist.scatter_(1, ids_k, torch.where(empty, p_at, residual_at))
    return num_accepted, dist  # [B], [B, V]


def _normalise(q_probs: torch.Tensor) -> torch.Tensor:
    """Each position's sparse q in float64, summing to exactly what the draft sampled from."""
    q = q_probs.double()
    total = q.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, q / total.clamp(min=1e-300), q)


def speculative_verify_fused(target: Scores, q_ids: torch.Tensor, q_probs: torch.Tensor, draft: torch.Tensor,
                             num_draft: torch.Tensor, temperature: torch.Tensor, threshold: torch.Tensor,
                             keys: torch.Tensor, u_accept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target: logits [B, G+1, V] or Hidden over the B*(G+1) rows (sequence-major); q_ids, q_probs
    [B, G, K]; draft [B, G]; num_draft [B]; temperature [B] (> 0); threshold [B, G+1] raw-score cuts
    (-inf: none; kernels.sample.cut_thresholds); keys [B, G+1] int64 race keys of the positions
    (kernels.random.row_keys); u_accept [B, G] float64. Returns (num_accepted [B], emitted [B])."""
    states = target.states if isinstance(target, Hidden) else target
    if backend(states) == "torch":
        return speculative_verify_fused_reference(target, q_ids, q_probs, draft, num_draft, temperature,
                                                  threshold, keys, u_accept)
    batch, gamma = draft.shape
    device = states.device
    scores = target if isinstance(target, Hidden) else target.reshape(batch * (gamma + 1), -1)
    q, exclude, point = _support(q_ids.to(device), q_probs.to(device), draft.to(device), num_draft.to(device))
    width = exclude.shape[-1]
    inv_t = temperature.to(device, torch.float32).reciprocal().repeat_interleave(gamma + 1)  # [B*(G+1)]
    _, _, lse, race, race_key = row_partials(scores, inv_t, threshold.to(device).reshape(-1),
                                             keys.to(device).reshape(-1), exclude.reshape(batch * (gamma + 1), width),
                                             best=False, lse=True, race=True)
    view = (batch, gamma + 1)
    lse, race, race_key = lse.view(view), race.view(view), race_key.view(view)
    gathered = _scores_at(scores, exclude, draft.to(device), batch, gamma)
    return _settle(lse, race, race_key, gathered, q, exclude, point, draft.to(device), num_draft.to(device),
                   temperature.to(device), threshold.to(device), keys.to(device), u_accept.to(device))


def speculative_verify_fused_reference(target: Scores, q_ids, q_probs, draft, num_draft, temperature, threshold,
                                       keys, u_accept) -> tuple[torch.Tensor, torch.Tensor]:
    batch, gamma = draft.shape
    logits = scores_reference(target).reshape(batch * (gamma + 1), -1)  # [B*(G+1), V]
    q, exclude, point = _support(q_ids, q_probs, draft, num_draft)
    inv_t = temperature.float().reciprocal().repeat_interleave(gamma + 1)  # [B*(G+1)]
    _, _, lse, race, race_key = row_pass_reference(logits, inv_t, threshold.reshape(-1).float(), keys.reshape(-1),
                                                   exclude.reshape(batch * (gamma + 1), -1))
    view = (batch, gamma + 1)
    gathered = _scores_at(logits, exclude, draft, batch, gamma)
    return _settle(lse.view(view), race.view(view), race_key.view(view), gathered, q, exclude, point, draft,
                   num_draft, temperature, threshold, keys, u_accept)


def _support(q_ids: torch.Tensor, q_probs: torch.Tensor, draft: torch.Tensor, num_draft: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [B, G+1, K] float64, exclude [B, G+1, K] ids with mass (-1: none), point [B, G]): each
    proposed row's q normalised, or the point mass on its proposal where q gives it none; rows
    past the proposals (and the last) have no support."""
    batch, gamma = draft.shape
    width = max(q_ids.shape[-1] if q_ids.dim() == 3 else 0, 1)
    q = torch.zeros(batch, gamma + 1, width, dtype=torch.float64, device=draft.device)
    ids = torch.full((batch, gamma + 1, width), -1, dtype=torch.int64, device=draft.device)
    if gamma == 0:
        return q, ids, torch.zeros(batch, 0, dtype=torch.bool, device=draft.device)
    qn = _normalise(q_probs)  # [B, G, K]
    q_x = (qn * (q_ids.long() == draft[..., None])).sum(dim=-1)  # [B, G]
    proposed = torch.arange(gamma, device=draft.device) < num_draft[:, None]  # [B, G]
    point = (q_x <= 0) & proposed
    point_q = torch.zeros_like(qn)
    point_q[..., 0] = 1.0
    point_ids = torch.full_like(q_ids.long(), -1)
    point_ids[..., 0] = draft
    qn = torch.where(point[..., None], point_q, qn) * proposed[..., None]
    id_table = torch.where(point[..., None], point_ids, q_ids.long())
    q[:, :gamma] = qn
    ids[:, :gamma] = torch.where(qn > 0, id_table, -1)
    return q, ids, point


def _scores_at(scores: Scores | torch.Tensor, exclude: torch.Tensor, draft: torch.Tensor, batch: int, gamma: int
               ) -> torch.Tensor:
    """Raw scores [B, G+1, K+1] of each row at its support ids (the last column: at its proposal;
    -inf where there is none)."""
    ids = torch.cat([exclude, torch.cat([draft, draft.new_full((batch, 1), -1)], dim=1)[..., None]], dim=-1)
    flat = ids.view(batch * (gamma + 1), -1)  # [R, K+1]
    picked = scores_at(scores, flat.clamp(min=0))  # [R, K+1]
    return torch.where(flat >= 0, picked, float("-inf")).view(batch, gamma + 1, -1)


def _settle(lse, race, race_key, gathered, q, exclude, point, draft, num_draft, temperature, threshold, keys, u_accept
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan's rule over the per-row pass results: O(B·G·K) work, no vocabulary-sized tensor."""
    batch, positions = lse.shape
    gamma = positions - 1
    rows = torch.arange(batch, device=lse.device)
    inv_t = temperature.float().reciprocal()[:, None, None]  # [B, 1, 1]
    kept = gathered >= threshold[..., None]  # [B, G+1, K+1]
    p = torch.where(kept, torch.exp(gathered * inv_t - lse[..., None]), 0.0).double()  # [B, G+1, K+1]
    p_support, p_x = p[..., :-1], p[:, :gamma, -1]  # [B, G+1, K], [B, G]
    q_x = (q[:, :gamma] * (exclude[:, :gamma] == draft[..., None])).sum(dim=-1)  # [B, G]
    proposed = torch.arange(gamma, device=lse.device) < num_draft[:, None]
    accept = proposed & (u_accept * q_x < p_x)  # [B, G] (a point mass has q_x = 1)
    k = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    # The row where the emitted token goes: its race over non-support tokens, and its support ids.
    lse_k, race_k, key_k = lse[rows, k], race[rows, k], race_key[rows, k]  # [B]
    ids_k, q_k, p_k = exclude[rows, k], q[rows, k], p_support[rows, k]  # [B, K]
    log_e = torch.log(-torch.log(uniform_table(keys[rows, k], ids_k.clamp(min=0)))).double()  # [B, K]
    # log p_i - log E_i of the best non-support token (-inf: none with mass)
    outside = torch.where(key_k == float("-inf"), float("-inf"), key_k - lse_k).double()
    residual = (p_k - q_k).clamp(min=0.0)  # [B, K]
    mass = residual.sum(dim=-1) + (1.0 - p_k.sum(dim=-1))  # the residual's total (non-support mass is p's)
    use_residual = (k < num_draft) & (mass > _EMPTY_RESIDUAL)
    weight = torch.where(use_residual[:, None], residual, p_k)  # [B, K]
    support_key = torch.where((ids_k >= 0) & (weight > 0), torch.log(weight) - log_e, float("-inf"))
    best_support, at = support_key.max(dim=-1)
    emitted = torch.where(best_support > outside, ids_k.gather(1, at[:, None]).squeeze(1), race_k)
    return k, emitted
