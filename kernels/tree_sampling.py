"""Speculative sampling over a tree: several drafts per node, settled by recursive rejection
(SpecInfer's multi-step speculative sampling, with the drafts drawn without replacement as in
Jeon et al. 2024, "Recursive Speculative Decoding").

A sampled row may propose a tree. At a node u (0: the row's last committed token) its children
x_1..x_k, in the order the draft drew them, are draws WITHOUT replacement from the draft's q(.|u):
the first k finishers of one exponential race over q (the chain's guess, then its runner-ups),
each child carrying the same q row. With p(.|u) the target's processed distribution after u:

    p_1 = p(.|u),  q_1 = q(.|u)
    for i = 1..k:  accept x_i with probability min(1, p_i(x_i) / q_i(x_i))   (uniform u_i)
                   else  p_{i+1} = norm(max(0, p_i - q_i)),  q_{i+1} = norm(q_i without x_i)
    none accepted: the token is a sample from p_{k+1}.

The token is distributed exactly as p(.|u). By induction over k: x_1 ~ q_1, so the accepted mass
is min(p_1, q_1) and a rejection happens with probability 1 - sum(min(p_1, q_1)), after which the
rest outputs p_2 whatever x_1 was (p_2 does not depend on x_1; q_2 may, and the claim holds for
any q_2); min(p_1, q_1) + max(0, p_1 - q_1) = p_1; k = 0 is plain sampling. When the token is a
child's, verification goes on in that child's subtree, whose children were drawn from q given
that token with noise no earlier decision read; otherwise the row stops there. How many children a
node has may depend on its first child (the chain's guess) and on anything drawn elsewhere, never
on the runner-ups' own draws: a runner-up kept because of its value is a biased draw (the draft
chooses the shape from the chain alone, draft_service/proposer.py).

A rejected child never gets mass again (a rejection needs p_i(x_i) < q_i(x_i), so
p_{i+1}(x_i) = 0, and q_j(x_i) = 0 after that keeps it 0), so the child whose token a node emits is
the one it accepted. A row's result is therefore, per node of the kept path, the token emitted
after it (``tree_speculative_verify``); the walk from the root follows the children equal to it
(target_service/settle.py ``tree_path``), as a greedy tree follows the argmax. Only the nodes on
that path are settled, and only the one where it stops draws from its residual, so a tree races
one row, as a chain does.

Randomness: one acceptance uniform per child (float64, as in kernels/speculative.py) and one race
key per node for the token drawn there when no child is accepted; the caller keys both
(target_service/settle.py). The torch path is the only one: trees run where the target's forward
is the native CPU one (target_service/engine.py). The tests' oracle (tests/support/verify_oracle.py)
walks the tree as the algorithm reads, node by node with Python floats; the two agree token for token.
"""

from __future__ import annotations

import torch

from kernels.random import race

# A residual with less mass than this is rounding noise around p == q (kernels/speculative.py).
_EMPTY_RESIDUAL = 1e-12


def tree_speculative_verify(p: torch.Tensor, tokens: list[int], parents: list[int], q_ids: torch.Tensor,
                            q_probs: torch.Tensor, u_accept: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One sampled tree. p [N+1, V] the target's processed distributions after each node (node 0
    the root, node i + 1 proposal i); tokens, parents [N] (each parent before its child); q_ids,
    q_probs [N, K] the q row each proposal was drawn from (siblings share theirs); u_accept [N]
    float64 each proposal's acceptance uniform; keys [N+1] int64 each node's race key. Returns
    [N+1] int64: per node on the kept path, the token the row emits after it (the accepted child's;
    where the path stops, a sample from what the refusals left); -1 elsewhere (the walk never
    reads those nodes).

    Walks the kept path only, deciding on the host (trees run on the CPU, where reading a number
    costs nothing). The recursion runs over q's support S (K numbers, not V): off S, q is 0, so
    every p_i is p times one scale there, and p_i is (that scale, its values on S)."""
    children: list[list[int]] = [[] for _ in range(p.shape[0])]
    for i, parent in enumerate(parents):
        children[parent].append(i)
    emitted, node = [-1] * p.shape[0], 0
    while True:
        dist = p[node].double()  # [V]
        kids, accepted = children[node], None
        if kids:
            support, q_i = _support(q_ids[kids[0]], q_probs[kids[0]])  # [S] sorted ids, [S] float64
            p_i = dist[support]  # [S]
            outside = max(float(dist.sum() - p_i.sum()), 0.0)  # p's mass off S
            scale = 1.0
            for i in kids:
                x = tokens[i]
                at = min(int(torch.searchsorted(support, torch.tensor([x], device=p.device))), support.numel() - 1)
                drawn = int(support[at]) == x  # x in q's support (always, for a tree the engine accepted)
                q_x = float(q_i[at]) if drawn else 0.0
                p_x = float(p_i[at]) if drawn else scale * float(dist[x])
                if float(u_accept[i]) * q_x < p_x:
                    accepted = i
                    break
                residual = (p_i - q_i).clamp(min=0.0)  # [S]; off S the residual is p_i itself
                total = float(residual.sum()) + scale * outside
                if total > _EMPTY_RESIDUAL:
                    p_i, scale = residual / total, scale / total
                if drawn:
                    q_i[at] = 0.0
                    q_i = q_i / max(float(q_i.sum()), 1e-300)
        if accepted is not None:
            emitted[node], node = tokens[accepted], accepted + 1
            continue
        if kids:
            dist = (dist * scale).index_copy(0, support, p_i)
        emitted[node] = int(race(dist[None], keys.to(p.device)[node : node + 1])[0])
        return torch.tensor(emitted, dtype=torch.int64, device=p.device)


def _support(ids: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse q row as (its distinct ids with mass [S], sorted; their probabilities [S] float64,
    normalised to what the draft sampled from; an id listed twice has the sum)."""
    probs = probs.double()
    mass = probs > 0
    support, inverse = torch.unique(ids.long()[mass], return_inverse=True)
    q = torch.zeros(support.numel(), dtype=torch.float64, device=probs.device).scatter_add_(0, inverse, probs[mass])
    return support, q / q.sum().clamp(min=1e-300)
