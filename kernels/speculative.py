"""Speculative sampling verification (Leviathan et al. 2023, Algorithm 1), with a sparse draft q.

Row b proposed `num_draft[b]` tokens x_1..x_γ, each sampled from the draft's processed
distribution q_i, which travels sparsely as (ids, probs) (the draft may truncate q to its top-k
and renormalise: q is then exactly what it sampled from). With the target's processed
distributions p_1..p_{γ+1} (same processing as q), accept x_i with probability min(1, p_i(x)/q_i(x)),
in order; at the first rejection emit a sample from norm(max(0, p_i − q_i)); if all are accepted,
emit a sample from p_{γ+1}. The emitted tokens are then distributed exactly as p.

Randomness comes in as uniforms (one per proposal for acceptance, one for the final sample), so a
request's result depends only on its own counter-based stream (specstream.sampling).
"""

from __future__ import annotations

import torch

from specstream.sampling import sample


def speculative_verify(p: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor, draft: torch.Tensor,
                       num_draft: torch.Tensor, u_accept: torch.Tensor, u_sample: torch.Tensor
                       ) -> tuple[list[int], list[int]]:
    """p [B, G+1, V] target probabilities; q_ids, q_probs [B, G, K] sparse draft distributions
    (unused slots: prob 0); draft [B, G] proposals; num_draft [B]; u_accept [B, G]; u_sample [B].
    Uniforms must be float64 in [0, 1): in float32 a draw just below 1 rounds to 1.0, which would
    reject a proposal with p == q that must always be accepted. Returns (accepted count per row, the token emitted after the accepted run per row)."""
    return speculative_verify_reference(p, q_ids, q_probs, draft, num_draft, u_accept, u_sample)


def speculative_verify_reference(p, q_ids, q_probs, draft, num_draft, u_accept, u_sample):
    assert u_accept.dtype == torch.float64 and u_sample.dtype == torch.float64, "uniforms must be float64"
    batch, positions, vocab = p.shape
    q = torch.zeros(batch, max(positions - 1, 0), vocab, dtype=torch.float64)  # [B, G, V] dense draft q
    if positions > 1:
        q.scatter_add_(2, q_ids.long(), q_probs.double())
    p = p.double()
    accepted, emitted = [], []
    for b in range(batch):
        n = int(num_draft[b])
        k = 0
        while k < n:
            x = int(draft[b, k])
            p_x, q_x = float(p[b, k, x]), float(q[b, k, x])
            # Leviathan Alg. 1: accept with min(1, p/q); u < p/q written as u * q < p, and a proposal
            # the draft gave no mass (q = 0) is invalid, so it is rejected.
            if q_x > 0.0 and float(u_accept[b, k]) * q_x < p_x:
                k += 1
                continue
            break
        if k < n:
            residual = (p[b, k] - q[b, k]).clamp(min=0.0)  # [V]
            # p == q (to rounding) leaves no residual mass; rejection then had ~zero probability
            # and p itself is the right fallback.
            dist = residual if float(residual.sum()) > 1e-12 else p[b, k]
        else:
            dist = p[b, n]  # every proposal accepted: the bonus token from p_{γ+1}
        accepted.append(k)
        emitted.append(sample(dist, float(u_sample[b])))
    return accepted, emitted
