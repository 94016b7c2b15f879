"""Settling one target pass: which proposals stand and which token follows, per row (docs/architecture.md §7).

Greedy rows keep the longest prefix matching the target's argmax. A row may propose a tree
(``VerifyRow.parents``): the target scored every node in one forward (each node's scores are
those of the chain through it), and the row keeps the path from the root along which each node is
the token emitted after its parent (the first such child where several are), then the token
emitted after the path's last node. For a greedy row that token is the argmax: the tokens plain
greedy decoding emits. A sampled tree's node emits by recursive rejection over its children
(kernels/tree_sampling.py) under Leviathan's rule, or its plain sample under coupled
verification; the noise of the node at depth d is keyed by position + d, as a chain's. A pass without proposals
(prefill, γ = 0) is plain decoding: the argmax, or the plain sample from p: the winner of an
exponential race over p with the noise keyed by (seed, absolute position, SAMPLE) (kernels/random.py).
Sampling rows with proposals are settled one of two ways (`TargetConfig.speculative_sampling`):

- ``leviathan`` (default): Leviathan's rule against the draft's sparse q (a proposal that came
  without q, from a model-free proposer, is a point mass): accept with min(1, p/q) (an ACCEPT
  uniform per position), at the first rejection a sample from norm(max(0, p − q)), after a fully
  accepted run the bonus token from p. Where the emitted token lands on a position the draft drew
  a guess for, it is raced with RESIDUAL noise (the draft's noise there is spent); elsewhere (the
  bonus) with SAMPLE noise, the plain sample's. A tree's node tries its children in the order the
  draft drew them, the first with the ACCEPT uniform of its depth and the r-th runner-up with
  SIBLING + r (kernels/random.py).
- ``coupled``: at every position the target takes its own plain sample (SAMPLE noise) and a
  proposal is accepted iff it equals that sample (the draft guesses with the same noise, so it
  often does). Every emitted token is then exactly the token plain sampling emits, whatever γ,
  the draft, the batch or an interruption: a sampled request is reproducible like a greedy one.
  The price is acceptance: P(guess = sample) under shared Gumbel noise is at least
  (1 − TV)/(1 + TV) (Daliri, Musco & Suresh 2024, "Coupling without communication") against
  Leviathan's 1 − TV (TV the total variation between p and q); for a proposal without q (a point
  mass) both accept with p(x).

Keys depend on nothing else in the batch, so neither does a row's result. Rows that asked for
log-probabilities get them under the distribution their token came from (the processed p; the
plain softmax for greedy rows).

The target's scores come as logits [B, G+1, V] or as hidden states with the LM head (``Hidden``).
On the torch backend (CPU) the logits are built and settled here with the torch ops; on the Triton
backend (CUDA) greedy rows go through the fused 1-best verification kernel and sampling rows
through the fused speculative kernel (temperature, cuts, accept/reject and the residual sample in
one read of each row), coupled rows through the fused sampling kernel at every position, so
[rows, vocab] logits are built only for a row whose top-k/top-p cut reaches past its 64 largest
scores (cuts and log-probabilities come from a fused n-best pass). Both backends race with the same
noise for the same keys, so their samples agree except where the two computations of p round a
near-tie in the race differently.

Runs on the compute thread; all results reach the host in ONE transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

import kernels
from kernels.cuts import cut_thresholds
from kernels.lm_head import Hidden
from kernels.processing import process_logits
from kernels.random import ACCEPT, RESIDUAL, SAMPLE, SIBLING, race, row_keys, uniform, uniforms
from specstream.data.propose import chain_length
from specstream.data.sampling import SamplingParams
from specstream.text.grammar import sole_tokens, unpack
from target_service.penalties import PenaltyState, penalize


@dataclass
class VerifyRow:
    """One sequence's row of a verify pass: what it proposed (and the q it drew from), to settle."""

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
    # Positions (from `position` on) the draft drew a guess for: at least len(proposals), more when
    # guesses were cut (an id past the vocabulary, a malformed q table). The target never races
    # with SAMPLE noise there under Leviathan's rule: the draft's guess depended on it.
    drafted: int = 0
    # A tree: per proposal, its parent node, 0 being the row's last committed token and i + 1
    # proposal i (each parent before its child; a sampled row's siblings in the order drawn). Empty: a chain.
    parents: list[int] = field(default_factory=list)
    # min_tokens: these ids (the sequence's stop ids) get no probability at a node whose token
    # would land before position masked_until (prompt + min_tokens), greedy and sampled alike.
    masked_ids: frozenset[int] = frozenset()
    masked_until: int = 0
    # A constraint: per node (0 the last committed token, j proposal j - 1), the packed mask int32
    # [len(proposals) + 1, W] of the tokens its grammar allows next (bit b of word w: token 32 w + b;
    # ids past 32 W are refused); None: free text. Greedy and sampled alike never emit a refused id.
    grammar_mask: np.ndarray | None = None
    # Leading proposals that are the grammar's (target_service/drafting.py ``_forced``): its forced
    # tokens and the likely ones after them, not a model's guesses: point masses, priced by no draft.
    forced: int = 0
    # Penalties with the committed tokens' counts (target_service/penalties.py): applied at each node
    # with those and the path's proposals.
    penalties: PenaltyState | None = None

    @property
    def chain(self) -> int:
        """How many leading proposals are the draft's chain (all of them but a tree's branches)."""
        return chain_length(self.parents, len(self.proposals))

    def depths(self) -> list[int]:
        """Each node's depth (node 0 the last committed token, node i + 1 proposal i): the offset
        from ``position`` of the token emitted after it."""
        depth = [0]
        for parent in self.parents:
            depth.append(depth[parent] + 1)
        return depth if self.parents else list(range(len(self.proposals) + 1))


@dataclass
class Verdict:
    accepted: int  # proposals kept
    tokens: list[int]  # the kept proposals, then the target's own token
    # A tree row: the nodes of the kept proposals (proposal i is node i + 1), root to leaf.
    path: list[int] | None = None

    @property
    def on_chain(self) -> int:
        """How many kept proposals are the chain's: all of them, unless a tree's path left the
        chain for a branch where a chain guess failed."""
        if self.path is None:
            return self.accepted
        return next((i for i, node in enumerate(self.path) if node != i + 1), len(self.path))
    # Per token: (its log-probability, [(alternative id, log-probability), ...]); None unless asked.
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


def settle(target: torch.Tensor | Hidden, rows: list[VerifyRow], coupled: bool = False) -> list[Verdict]:
    """target: logits [B, G+1, V], or Hidden over the B*(G+1) rows (sequence-major): position j
    scores the token after proposal j (0: after the row's last committed token). `coupled`: settle
    sampling rows by coupled verification instead of Leviathan's rule (module docstring). Returns
    one Verdict per row."""
    batch = len(rows)
    if isinstance(target, Hidden):
        positions = target.states.shape[0] // batch
        masked = _masked(rows, positions)
        if kernels.backend(target.states) == "torch" or masked or _processed(rows):  # a mask needs the logits
            target = _mask(_logits(target, rows, positions).view(batch, positions, -1), masked, rows)  # [B, G+1, V]
    else:
        positions = target.shape[1]
        masked = _masked(rows, positions)
        if masked or _processed(rows):
            target = _mask(target.clone(), masked, rows)
    gamma = positions - 1
    device = target.states.device if isinstance(target, Hidden) else target.device
    draft = torch.tensor([r.proposals + [-1] * (gamma - len(r.proposals)) for r in rows],
                         dtype=torch.int64).view(batch, gamma).to(device)  # [B, G], padded with -1
    num_draft = torch.tensor([len(r.proposals) for r in rows], dtype=torch.int64).to(device)  # [B]
    wanted = [b for b, r in enumerate(rows) if r.logprobs is not None]
    top_n = max((rows[b].logprobs for b in wanted), default=0)
    if isinstance(target, Hidden):
        num_accepted, tokens = _settle_fused(target, rows, draft, num_draft, positions, coupled)
    else:
        num_accepted, tokens = kernels.greedy_verify(draft, num_draft, target)  # [B], [B, G+1]
        sampled = [b for b, r in enumerate(rows) if not r.params.greedy]
        if sampled and coupled:
            chosen = [rows[b] for b in sampled]
            p = process_logits(target[sampled], [r.params for r in chosen])  # [S, G+1, V]
            live = _live(chosen, positions, device)  # [L] flat (row, position) indices a token can come from
            samples = torch.full((len(sampled) * positions,), -1, dtype=torch.int64, device=device)
            samples[live] = race(p.flatten(0, 1)[live], _keys(chosen, positions, coupled, device).flatten()[live])
            num_accepted[sampled], tokens[sampled] = _match(draft[sampled], num_draft[sampled],
                                                            samples.view(len(sampled), positions))
        elif sampled:
            chains = [b for b in sampled if not rows[b].parents]
            if chains:
                k, emitted = _verify_sampled(target[chains], [rows[b] for b in chains], draft[chains],
                                             num_draft[chains])
                num_accepted[chains] = k
                tokens[chains] = _emitted_tokens(draft[chains], k, emitted)
            for b in sampled:
                if rows[b].parents:
                    tokens[b] = _verify_sampled_tree(target[b], rows[b])
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


def _logits(target: Hidden, rows: list[VerifyRow], positions: int) -> torch.Tensor:
    """The pass's logits [B*(G+1), V]. A node whose grammar mask allows one token only (a forced
    JSON brace, key or quote) is not scored by the output layer: its logits are 0 for that token
    and −inf elsewhere. That is what its masked logits give every rule here: the argmax is the
    token, p is a point mass on it whatever the temperature, cuts, penalties or bias, and its
    log-probability is 0 with every alternative at −inf. The nodes the layer scores get the bits
    they get in any batch (the kernels are batch-invariant)."""
    if target.head.output_ids is not None:  # a head over a vocabulary subset: its columns are not ids
        return target.logits()
    vocab = target.head.vocab
    sure = [(b * positions + j, token) for b, row in enumerate(rows) if row.grammar_mask is not None
            for j, token in enumerate(sole_tokens(row.grammar_mask)) if token is not None and token < vocab]
    if not sure:
        return target.logits()
    states = target.states
    skipped = torch.zeros(states.shape[0], dtype=torch.bool)
    skipped[[i for i, _ in sure]] = True
    logits = torch.full((states.shape[0], vocab), float("-inf"), device=states.device)
    scored = (~skipped).nonzero().flatten().to(states.device)
    if scored.numel():
        logits[scored] = Hidden(states[scored], target.head).logits()
    logits[[i for i, _ in sure], [token for _, token in sure]] = 0.0
    return logits


def _processed(rows: list[VerifyRow]) -> bool:
    """Whether a row's logits change before settling: a grammar's mask, or penalties."""
    return any(r.grammar_mask is not None or r.penalties is not None for r in rows)


def _masked(rows: list[VerifyRow], positions: int) -> list[tuple[int, int, int]]:
    """(row, node, token id) for every id a row masks at a node (``VerifyRow.masked_ids``): the
    node's emitted token lands at position + its depth, masked there while before masked_until."""
    return [(b, j, token) for b, row in enumerate(rows) if row.masked_ids and row.position < row.masked_until
            for j, depth in enumerate(_offsets(row, positions)) if row.position + depth < row.masked_until
            for token in sorted(row.masked_ids)]


def _mask(logits: torch.Tensor, masked: list[tuple[int, int, int]], rows: list[VerifyRow]) -> torch.Tensor:
    """logits [B, G+1, V], in place, with each masked (row, node, id) at -inf, and every id a row's
    grammar refuses at a node: the argmax and the processed p alike never give it there
    (min_tokens, constraints; Leviathan's rule against q stays exact for any q, and p is the
    target's own processed distribution under the same request). Penalties first, at every node
    (target_service/penalties.py)."""
    penalize(logits, rows)
    if masked:
        index = torch.tensor(masked, dtype=torch.int64, device=logits.device)  # [M, 3]
        logits[index[:, 0], index[:, 1], index[:, 2]] = float("-inf")
    vocab = logits.shape[-1]
    for b, row in enumerate(rows):
        if row.grammar_mask is not None:
            nodes = row.grammar_mask.shape[0]
            refused = ~unpack(row.grammar_mask, vocab)  # [nodes, V]
            if logits.device.type == "cpu":  # numpy's one thread: torch's would wake its pool for 49k floats
                np.copyto(logits[b, :nodes].numpy(), -np.inf, where=refused)
            else:
                logits[b, :nodes].masked_fill_(torch.from_numpy(refused).to(logits.device), float("-inf"))
    return logits


def _keys(rows: list[VerifyRow], positions: int, coupled: bool, device: torch.device | str) -> torch.Tensor:
    """[S, G+1] int64 race keys: row b's draw after node j, at position `rows[b].position + d` (d
    the node's depth: j for a chain), with SAMPLE noise, or (Leviathan) RESIDUAL noise where the
    draft drew a guess (d < drafted)."""
    seeds = [r.params.seed for r in rows for _ in range(positions)]  # [S*(G+1)], row-major
    offsets = [_offsets(r, positions) for r in rows]  # [S][G+1]
    at = [r.position + d for r, row_offsets in zip(rows, offsets) for d in row_offsets]  # [S*(G+1)]
    sample = row_keys(seeds, at, SAMPLE, device).view(len(rows), positions)  # [S, G+1]
    if coupled:
        return sample
    residual = row_keys(seeds, at, RESIDUAL, device).view(len(rows), positions)
    drafted = torch.tensor([[d < r.drafted for d in offsets[b]] for b, r in enumerate(rows)], device=device)
    return torch.where(drafted, residual, sample)  # [S, G+1]


def _offsets(row: VerifyRow, positions: int) -> list[int]:
    """Per node j < positions, its depth (padding past the proposals: j)."""
    depths = row.depths()
    return depths + list(range(len(depths), positions))


def _verify_sampled_tree(logits: torch.Tensor, row: VerifyRow) -> torch.Tensor:
    """Leviathan's rule over a sampled tree (kernels/tree_sampling.py): logits [G+1, V] -> [G+1],
    per node the token emitted after it (-1 past the row's nodes)."""
    positions, nodes = logits.shape[0], len(row.proposals) + 1
    p = process_logits(logits[None, :nodes], [row.params])[0]  # [N+1, V]
    q_ids, q_probs = _sparse_q([row], nodes - 1)  # [1, N, K] each
    depths, rank, seen = row.depths(), [], {}
    for parent in row.parents:  # the r-th child of a node: r earlier siblings were tried before it
        rank.append(seen.get(parent, 0))
        seen[parent] = rank[-1] + 1
    u_accept = torch.tensor([uniform(row.params.seed, row.position + depths[parent], ACCEPT if r == 0 else SIBLING + r)
                             for parent, r in zip(row.parents, rank)], dtype=torch.float64)  # [N]
    keys = _keys([row], nodes, False, logits.device)[0]  # [N+1]
    emitted = kernels.tree_speculative_verify(p, row.proposals, row.parents, q_ids[0].to(logits.device),
                                              q_probs[0].to(logits.device), u_accept.to(logits.device), keys)
    return torch.cat([emitted, emitted.new_full((positions - nodes,), -1)])


def _live(rows: list[VerifyRow], positions: int, device: torch.device | str) -> torch.Tensor:
    """Flat indices b * positions + j of the positions a row can emit from (j <= its proposals):
    a coupled pass samples only those."""
    return torch.tensor([b * positions + j for b, r in enumerate(rows) for j in range(len(r.proposals) + 1)],
                        dtype=torch.int64, device=device)


def _match(draft: torch.Tensor, num_draft: torch.Tensor, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Coupled verification: (num_accepted [S], tokens [S, G+1]): the longest prefix of the proposals
    equal to the target's own samples; the samples are what the row emits."""
    gamma = draft.shape[1]
    proposed = torch.arange(gamma, device=draft.device) < num_draft[:, None]  # [S, G]
    same = proposed & (draft == samples[:, :gamma])  # [S, G]
    return same.to(torch.int64).cumprod(dim=1).sum(dim=1), samples


def _emitted_tokens(draft: torch.Tensor, k: torch.Tensor, emitted: torch.Tensor) -> torch.Tensor:
    """[S, G+1]: the proposals, with the emitted token at position k (what a row commits is the
    first k + 1)."""
    row_tokens = torch.cat([draft, draft.new_full((draft.shape[0], 1), -1)], dim=1)  # [S, G+1]
    return row_tokens.scatter(1, k[:, None], emitted[:, None])


def _settle_fused(target: Hidden, rows: list[VerifyRow], draft: torch.Tensor, num_draft: torch.Tensor, positions: int,
                  coupled: bool) -> tuple[torch.Tensor, torch.Tensor]:
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
    if any(rows[b].parents for b in sampled):
        raise ValueError("settle: sampled trees verify on the torch path (the native CPU forward) only")
    if sampled:
        chosen = [rows[b] for b in sampled]
        params = [r.params for r in chosen]
        part = Hidden(states[sampled].reshape(-1, states.shape[-1]), target.head)  # [S*(G+1), H]
        # Top-k/top-p cuts: one threshold per row, from a fused n-best pass over the rows with cuts.
        threshold = cut_thresholds(part, [p for p in params for _ in range(positions)]).view(len(sampled), positions)
        keys = _keys(chosen, positions, coupled, device)  # [S, G+1]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        if coupled:  # the target's own sample at every position, one fused read per row
            live = _live(chosen, positions, device)  # [L]
            samples = torch.full((len(sampled) * positions,), -1, dtype=torch.int64, device=device)
            samples[live] = kernels.sample(Hidden(part.states[live], part.head),
                                           temperature.repeat_interleave(positions)[live], keys.flatten()[live],
                                           threshold.flatten()[live])
            num_accepted[sampled], tokens[sampled] = _match(draft[sampled], num_draft[sampled],
                                                            samples.view(len(sampled), positions))
            return num_accepted, tokens
        u_accept = uniforms([p.seed for p in params], [r.position for r in chosen], gamma, ACCEPT, device)  # [S, G]
        q_ids, q_probs = _sparse_q(chosen, gamma)
        k, emitted = kernels.speculative_verify_fused(part, q_ids.to(device), q_probs.to(device), draft[sampled],
                                                      num_draft[sampled], temperature, threshold, keys, u_accept)
        num_accepted[sampled] = k
        tokens[sampled] = _emitted_tokens(draft[sampled], k, emitted)
    return num_accepted, tokens


def _verify_sampled(logits: torch.Tensor, rows: list[VerifyRow], draft: torch.Tensor, num_draft: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan verification of the sampling rows: logits [S, G+1, V] -> (accepted [S], emitted [S])."""
    device, gamma = logits.device, logits.shape[1] - 1
    p = process_logits(logits, [r.params for r in rows])  # [S, G+1, V]
    if gamma == 0:  # plain sampling: nothing to accept, the race over p (float32: its log is taken in float64)
        return (torch.zeros(len(rows), dtype=torch.int64, device=device),
                race(p[:, 0], _keys(rows, 1, False, device)[:, 0]))
    q_ids, q_probs = _sparse_q(rows, gamma)
    u_accept = uniforms([r.params.seed for r in rows], [r.position for r in rows], gamma, ACCEPT, device)  # [S, G]
    keys = _keys(rows, gamma + 1, False, device)  # [S, G+1]
    return kernels.speculative_verify(p, q_ids.to(device), q_probs.to(device), draft, num_draft, u_accept, keys)


def _sparse_q(rows: list[VerifyRow], gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def tree_path(proposals: list[int], parents: list[int], emitted: list[int]) -> list[int]:
    """The accepted path of a tree: from the root (node 0), repeatedly the first child whose token
    is the one the row emits after the current node (``emitted[node]``: the argmax for a greedy
    row). Returns its nodes."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i + 1)
    path, node = [], 0
    while True:
        node = next((c for c in children.get(node, ()) if proposals[c - 1] == emitted[node]), -1)
        if node < 0:
            return path
        path.append(node)


def _unpack(flat: list[float], rows: list[VerifyRow], wanted: list[int], positions: int, top_n: int) -> list[Verdict]:
    batch = len(rows)
    at = 0

    def take(count: int) -> list[float]:
        nonlocal at
        at += count
        return flat[at - count : at]

    accepted = [int(v) for v in take(batch)]
    tokens = take(batch * positions)
    verdicts = []
    for b, row in enumerate(rows):
        best = [int(t) for t in tokens[b * positions : (b + 1) * positions]]  # the token emitted after each node
        if row.parents:
            path = tree_path(row.proposals, row.parents, best)
            verdicts.append(Verdict(len(path), [best[n] for n in [0, *path]], path))
        else:
            verdicts.append(Verdict(accepted[b], best[: accepted[b] + 1]))
    chosen = take(len(wanted) * positions)
    top_ids = take(len(wanted) * positions * top_n)
    top_vals = take(len(wanted) * positions * top_n)
    for w, b in enumerate(wanted):
        n, out = rows[b].logprobs, []
        nodes = [0, *verdicts[b].path] if verdicts[b].path is not None else range(len(verdicts[b].tokens))
        for j in nodes:
            base = (w * positions + j) * top_n
            alternatives = [(int(top_ids[base + i]), top_vals[base + i]) for i in range(n)
                            if top_vals[base + i] > float("-inf")]  # tokens the cuts removed are no alternative
            out.append((chosen[w * positions + j], alternatives))
        verdicts[b].logprobs = out
    return verdicts
