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

Randomness comes in as uniforms (one per proposal for acceptance, one per position for the final
sample), so a row's result depends only on its own counter-based stream (specstream.sampling).
Uniforms must be float64 in [0, 1): in float32 a draw just below 1 rounds to 1.0, which would
reject a proposal with p == q that must always be accepted.
"""

from __future__ import annotations

import torch

from specstream.sampling import sample, sample_rows

# A residual with less mass than this is rounding noise around p == q: rejecting there had
# ~zero probability, and p itself is the right distribution to fall back on.
_EMPTY_RESIDUAL = 1e-12


def speculative_verify(p: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor, draft: torch.Tensor,
                       num_draft: torch.Tensor, u_accept: torch.Tensor, u_sample: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """p [B, G+1, V] target probabilities; q_ids, q_probs [B, G, K] sparse draft distributions
    (unused slots: prob 0); draft [B, G] proposals; num_draft [B]; u_accept [B, G] and u_sample
    [B, G+1] float64 (u_sample[b, j] is used if the emitted token lands at position j).
    Returns (num_accepted [B], emitted [B]) int64 on p's device; no host sync."""
    assert u_accept.dtype == torch.float64 and u_sample.dtype == torch.float64, "uniforms must be float64"
    batch, positions, _ = p.shape
    gamma = positions - 1
    rows = torch.arange(batch, device=p.device)
    if gamma == 0:
        return torch.zeros(batch, dtype=torch.int64, device=p.device), sample_rows(p[:, 0], u_sample[:, 0])
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
    p_k = p[rows, num_accepted].double()  # [B, V]: the target's distribution where the emitted token goes
    at = num_accepted.clamp(max=gamma - 1)
    q_k = torch.zeros_like(p_k).scatter_add_(1, ids[rows, at], q_probs[rows, at])  # [B, V]
    delta = torch.zeros_like(p_k).scatter_(1, draft[rows, at].clamp(min=0)[:, None], 1.0)  # [B, V]
    q_k = torch.where(point[rows, at][:, None], delta, q_k)
    residual = (p_k - q_k).clamp(min=0.0)  # [B, V]
    rejected = num_accepted < num_draft  # [B]
    use_residual = rejected & (residual.sum(dim=-1) > _EMPTY_RESIDUAL)
    # Rejected: norm(max(0, p - q)) at the rejected position; all accepted: the bonus from p_{γ+1}.
    dist = torch.where(use_residual[:, None], residual, p_k)  # [B, V]
    return num_accepted, sample_rows(dist, u_sample[rows, num_accepted])


def _normalise(q_probs: torch.Tensor) -> torch.Tensor:
    """Each position's sparse q in float64, summing to exactly what the draft sampled from."""
    q = q_probs.double()
    total = q.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, q / total.clamp(min=1e-300), q)


def speculative_verify_reference(p, q_ids, q_probs, draft, num_draft, u_accept, u_sample):
    """Algorithm 1 written out row by row and token by token; `speculative_verify` must match it
    token for token given the same uniforms."""
    assert u_accept.dtype == torch.float64 and u_sample.dtype == torch.float64, "uniforms must be float64"
    batch, positions, vocab = p.shape
    q = torch.zeros(batch, max(positions - 1, 0), vocab, dtype=torch.float64, device=p.device)  # [B, G, V]
    if positions > 1:
        q.scatter_add_(2, q_ids.long(), _normalise(q_probs))
    p = p.double()
    accepted, emitted = [], []
    for b in range(batch):
        n = int(num_draft[b])
        k = 0
        while k < n:
            x = int(draft[b, k])
            p_x, q_x = float(p[b, k, x]), float(q[b, k, x])
            if q_x <= 0.0:  # q rules its own proposal out: verify it as a point mass
                q[b, k] = 0.0
                q[b, k, x] = q_x = 1.0
            if float(u_accept[b, k]) * q_x < p_x:
                k += 1
                continue
            break
        if k < n:
            residual = (p[b, k] - q[b, k]).clamp(min=0.0)  # [V]
            dist = residual if float(residual.sum()) > _EMPTY_RESIDUAL else p[b, k]
        else:
            dist = p[b, n]  # every proposal accepted: the bonus token from p_{γ+1}
        accepted.append(k)
        emitted.append(sample(dist, float(u_sample[b, k])))
    return torch.tensor(accepted, dtype=torch.int64), torch.tensor(emitted, dtype=torch.int64)
