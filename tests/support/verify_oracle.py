"""Speculative verification written out as the algorithms read, row by row and node by node with
Python floats: the oracles that kernels/speculative.py's `speculative_verify` (Leviathan et al. 2023,
Algorithm 1) and kernels/tree_sampling.py's `tree_speculative_verify` (recursive rejection over a
tree) must match token for token, given the same uniforms and race keys. Slow on purpose; tests only.
"""

from __future__ import annotations

import torch

from kernels import speculative, tree_sampling
from kernels.random import race


def speculative_verify_reference(p, q_ids, q_probs, draft, num_draft, u_accept, keys):
    """Algorithm 1 written out row by row and token by token; `speculative_verify` must match it
    token for token given the same uniforms and keys."""
    assert u_accept.dtype == torch.float64, "uniforms must be float64"
    batch, positions, vocab = p.shape
    q = torch.zeros(batch, max(positions - 1, 0), vocab, dtype=torch.float64, device=p.device)  # [B, G, V]
    if positions > 1:
        q.scatter_add_(2, q_ids.long(), speculative._normalise(q_probs))
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
            dist = residual if float(residual.sum()) > speculative._EMPTY_RESIDUAL else p[b, k]
        else:
            dist = p[b, n]  # every proposal accepted: the bonus token from p_{γ+1}
        accepted.append(k)
        emitted.append(int(race(dist[None], keys[b, k : k + 1])[0]))
    return torch.tensor(accepted, dtype=torch.int64), torch.tensor(emitted, dtype=torch.int64)


def tree_speculative_verify_reference(p: torch.Tensor, tokens: list[int], parents: list[int], q_ids: torch.Tensor,
                                      q_probs: torch.Tensor, u_accept: torch.Tensor, keys: torch.Tensor
                                      ) -> tuple[list[int], list[int]]:
    """The algorithm walked node by node (kernels/tree_sampling.py's docstring): (the kept path's
    nodes, the tokens emitted). ``tree_speculative_verify`` must give the same tokens along the same
    path."""
    children: list[list[int]] = [[] for _ in range(p.shape[0])]
    for i, parent in enumerate(parents):
        children[parent].append(i)
    q = _dense_q(q_ids, q_probs, p.shape[-1])
    path, emitted, node = [], [], 0
    while True:
        p_i, q_i = p[node].double().clone(), q[children[node][0]].clone() if children[node] else None
        for i in children[node]:
            x = tokens[i]
            if float(u_accept[i]) * float(q_i[x]) < float(p_i[x]):
                path.append(i + 1)
                emitted.append(x)
                node = i + 1
                break
            residual = (p_i - q_i).clamp(min=0.0)
            if float(residual.sum()) > tree_sampling._EMPTY_RESIDUAL:
                p_i = residual / residual.sum()
            q_i[x] = 0.0
            q_i = q_i / max(float(q_i.sum()), 1e-300)
        else:
            emitted.append(int(race(p_i[None], keys[node : node + 1])[0]))
            return path, emitted


def _dense_q(q_ids: torch.Tensor, q_probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, V] float64: each sparse q row scattered and normalised to what the draft sampled from."""
    q = q_probs.double()
    q = q / q.sum(dim=-1, keepdim=True).clamp(min=1e-300)
    return torch.zeros(q.shape[0], vocab, dtype=torch.float64, device=q.device).scatter_add_(1, q_ids.long(), q)
