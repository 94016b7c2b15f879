"""Sampled trees (kernels/tree_sampling.py, target_service/settle.py): several drafts per node,
drawn without replacement from q and settled by recursive rejection, keep the target's
distribution exactly; coupled verification of a tree emits plain sampling's tokens.

False-alarm rate: each chi-square comparison fails when p < 1e-3, so for an exact implementation
with seeds drawn at random each fails with probability 1e-3: this file makes 3 one-node + 1
three-token comparisons, at most 0.4% together (union bound). The seeds are fixed, so the outcome
is deterministic and CI never flakes. Power: the same one-node test fails on two bugs, each at
p < 1e-5 (seeds 0-3 gave 1e-6 to 1e-12 for the second): every sibling tested against p, not
the residual the earlier rejections left, and a draft that keeps the likelier under q of its two
runner-ups (a shape chosen from the runner-ups' own draws, as a greedy tree ranks them)."""

from __future__ import annotations

import functools
import random
from collections import Counter

import pytest
import torch
from tests.support.chi_square import goodness_of_fit_p_value
from tests.support.verify_oracle import tree_speculative_verify_reference

from kernels.random import SAMPLE, gumbel, race, row_keys
from kernels.tree_sampling import tree_speculative_verify
from specstream.data.sampling import SamplingParams
from target_service.settle import VerifyRow, settle, tree_path

THRESHOLD = 1e-3


def _draws(q: torch.Tensor, key: int, k: int) -> list[int]:
    """The first k finishers of the exponential race over q with `key`: draws without replacement."""
    ids = torch.arange(q.shape[0])
    score = torch.where(q > 0, torch.log(q.double()) + gumbel(torch.tensor([key]), ids)[0], float("-inf"))
    order = torch.argsort(score, descending=True, stable=True).tolist()
    return [t for t in order[:k] if score[t] > float("-inf")]


def _random_dist(gen: torch.Generator, vocab: int, zeros: int = 0) -> torch.Tensor:
    d = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 3
    if zeros:
        d[torch.randperm(vocab, generator=gen)[:zeros]] = 0.0
    return d / d.sum()


def _random_sampled_tree(rng: random.Random, gen: torch.Generator, vocab: int):
    """A random tree (depth <= 8, width <= 4) with honest draws: each node's children, in order,
    are draws without replacement from that node's own q. Returns (p [N+1, V], tokens, parents,
    q_ids [N, V], q_probs [N, V])."""
    p = [_random_dist(gen, vocab, zeros=rng.randint(0, 3))]
    q = [_random_dist(gen, vocab, zeros=rng.randint(0, 3))]
    draws, taken, depth = [_draws(q[0], rng.randrange(1 << 40), 4)], [0], [0]
    tokens, parents, rows = [], [], []
    for _ in range(rng.randint(1, 11)):
        open_ = [u for u in range(len(depth)) if depth[u] < 8 and taken[u] < len(draws[u])]
        if not open_:
            break
        u = rng.choice(open_)
        tokens.append(draws[u][taken[u]])
        parents.append(u)
        rows.append(q[u])
        taken[u] += 1
        p.append(_random_dist(gen, vocab, zeros=rng.randint(0, 3)))
        q.append(_random_dist(gen, vocab, zeros=rng.randint(0, 3)))
        draws.append(_draws(q[-1], rng.randrange(1 << 40), 4))
        taken.append(0)
        depth.append(depth[u] + 1)
    return torch.stack(p), tokens, parents, torch.arange(vocab).expand(len(rows), vocab), torch.stack(rows).float()


def test_the_kernel_is_the_walk_written_out() -> None:
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    lengths = Counter()
    for _ in range(300):
        p, tokens, parents, q_ids, q_probs = _random_sampled_tree(rng, gen, vocab=10)
        if not tokens:
            continue
        u = torch.rand(len(tokens), generator=gen, dtype=torch.float64)
        keys = torch.randint(0, 1 << 52, (len(tokens) + 1,), generator=gen)
        emitted = tree_speculative_verify(p, tokens, parents, q_ids, q_probs, u, keys).tolist()
        path = tree_path(tokens, parents, emitted)
        want_path, want_tokens = tree_speculative_verify_reference(p, tokens, parents, q_ids, q_probs, u, keys)
        assert path == want_path
        assert [emitted[n] for n in [0, *path]] == want_tokens
        lengths[len(path)] += 1
    assert len(lengths) >= 3  # paths of several lengths, none among them


def _one_node(p: torch.Tensor, q: torch.Tensor, k: int, trials: int, seed: int, wrong: str = "") -> Counter:
    """The token emitted at a node with k children drawn from q, over `trials` independent draws.
    `wrong`: "residual" (siblings tested against p) or "shape" (the likelier of two runner-ups kept)."""
    gen = torch.Generator().manual_seed(seed)
    vocab, out = p.shape[0], Counter()
    for t in range(trials):
        keys = torch.randint(0, 1 << 52, (3,), generator=gen)
        tokens = _draws(q, int(keys[0]), k)
        if wrong == "shape":
            tokens = _draws(q, int(keys[0]), 3)
            tokens = [tokens[0], max(tokens[1:], key=lambda x: float(q[x]))]
        u = torch.rand(len(tokens), generator=gen, dtype=torch.float64)
        if wrong == "residual":  # every sibling tested against p itself; then the residual after the first
            hit = next((x for x, ui in zip(tokens, u) if ui * q[x] < p[x]), None)
            residual = (p - q).clamp(min=0)
            out[hit if hit is not None else int(race(residual[None], keys[1:2])[0])] += 1
            continue
        q_rows = q.float().expand(len(tokens), vocab)
        emitted = tree_speculative_verify(p[None].expand(len(tokens) + 1, vocab), tokens, [0] * len(tokens),
                                          torch.arange(vocab).expand(len(tokens), vocab), q_rows, u, keys[1:2].repeat(
                                              len(tokens) + 1))
        out[int(emitted[0])] += 1
    return out


# p and q disagree a lot: q puts its mass where p has little, so rejections and residual draws abound.
P = torch.tensor([0.05, 0.10, 0.30, 0.25, 0.20, 0.10], dtype=torch.float64)
Q = torch.tensor([0.35, 0.25, 0.05, 0.10, 0.05, 0.20], dtype=torch.float64)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_several_drafts_at_a_node_keep_the_targets_distribution(k: int) -> None:
    observed = _one_node(P, Q, k, trials=6000, seed=k)
    assert goodness_of_fit_p_value(observed, P.tolist()) > THRESHOLD


@pytest.mark.parametrize("wrong", ["residual", "shape"])
def test_the_one_node_test_catches_a_wrong_residual_and_a_biased_shape(wrong: str) -> None:
    observed = _one_node(P, Q, 3, trials=6000, seed=9, wrong=wrong)
    assert goodness_of_fit_p_value(observed, P.tolist()) < THRESHOLD


# ----- whole sequences through settle: a context-dependent target and draft --------------------
VOCAB = 5


@functools.cache
def _table(context: tuple[int, ...], salt: int) -> torch.Tensor:
    """A distribution over VOCAB tokens that depends on the context (and differs between target and draft)."""
    gen = torch.Generator().manual_seed(hash((context, salt)) & 0xFFFFFFFF)
    d = torch.rand(VOCAB, generator=gen, dtype=torch.float64) ** 2 + 0.02
    return d / d.sum()


def _target(context: tuple[int, ...]) -> torch.Tensor:
    return _table(context[-2:], 1)


def _draft(context: tuple[int, ...]) -> torch.Tensor:
    return (0.5 * _table(context[-2:], 2) + 0.5 * _target(context)) ** 1.5


BRANCHES = (2, 1)  # runner-ups at depth 0 and 1


def _propose(context: tuple[int, ...], seed: int) -> tuple[list[int], list[int], list[list[float]]]:
    """A chain of 2 drafted as the real draft does (a race with the SAMPLE noise of each position),
    then BRANCHES runner-ups of the same races as branches, in the order drawn."""
    chain, rows, runners, path = [], [], [], context
    for depth in range(2):
        q = _draft(path)
        q = q / q.sum()
        drawn = _draws(q, int(row_keys([seed], [len(path)], SAMPLE)[0]), 1 + BRANCHES[depth])
        chain.append(drawn[0])
        rows.append(q.tolist())
        runners.append(drawn[1:])
        path = path + (drawn[0],)
    tokens, parents, q_rows = list(chain), [0, 1], list(rows)
    for depth, drawn in enumerate(runners):
        for x in drawn:
            tokens.append(x)
            parents.append(depth)
            q_rows.append(rows[depth])
    return tokens, parents, q_rows


def _generate(seed: int, coupled: bool, length: int = 3,
              off_chain: Counter | None = None) -> list[int]:
    """Samples `length` tokens after a fixed prompt by passes of tree drafts settled by settle();
    counts in `off_chain` the passes whose kept path left the chain."""
    context = (1, 3)
    params = SamplingParams(temperature=1.0, seed=seed)
    out: list[int] = []
    while len(out) < length:
        tokens, parents, q_rows = _propose(context, seed)
        # The target's scores after every node: node 0 the context, node i + 1 proposal i.
        nodes = [context]
        for token, parent in zip(tokens, parents):
            nodes.append(nodes[parent] + (token,))
        logits = torch.stack([torch.log(_target(n)) for n in nodes]).float()[None]  # [1, N+1, V]
        row = VerifyRow(params, len(context), proposals=tokens, q_width=VOCAB, q_ids=list(range(VOCAB)) * len(tokens),
                        q_probs=[x for r in q_rows for x in r], drafted=2, parents=parents)
        verdict = settle(logits, [row], coupled=coupled)[0]
        if off_chain is not None:
            off_chain[verdict.on_chain < verdict.accepted] += 1
        out += verdict.tokens
        context = context + tuple(verdict.tokens)
    return out[:length]


def _plain(seed: int, length: int = 3) -> list[int]:
    context, out = (1, 3), []
    for _ in range(length):
        key = row_keys([seed], [len(context)], SAMPLE)
        token = int(race(_target(context)[None], key)[0])
        out.append(token)
        context = context + (token,)
    return out


def _joint() -> list[float]:
    """The exact probability of every 3-token continuation, indexed a * V^2 + b * V + c."""
    probs = []
    for a in range(VOCAB):
        for b in range(VOCAB):
            for c in range(VOCAB):
                ctx = (1, 3)
                probs.append(float(_target(ctx)[a] * _target(ctx + (a,))[b] * _target(ctx + (a, b))[c]))
    return probs


def test_three_token_sequences_keep_the_targets_joint_distribution() -> None:
    """Whole continuations t1 t2 t3, over passes whose trees are settled by settle() (the keys,
    uniforms and ranks the engine uses), against the product of the target's conditionals."""
    off_chain = Counter()
    sequences = Counter(a * VOCAB * VOCAB + b * VOCAB + c
                        for a, b, c in (_generate(seed, False, off_chain=off_chain) for seed in range(3000)))
    assert goodness_of_fit_p_value(sequences, _joint()) > THRESHOLD
    assert off_chain[True] > 150  # branches were kept in many passes

def test_coupled_trees_emit_exactly_plain_samplings_tokens() -> None:
    off_chain = Counter()
    for seed in range(300):
        assert _generate(seed, True, length=6, off_chain=off_chain) == _plain(seed, 6)
    assert off_chain[True] > 0 and off_chain[False] > 0  # branches were kept, and chains too


def test_the_drafts_branches_are_its_races_next_finishers(model_zoo) -> None:
    """The real draft's sampled tree: at each depth, the chain's guess and then its branches, in
    order, are the first finishers of the race over the q row sent (SAMPLE noise of that position),
    and every branch carries its depth's q row."""
    from draft_service.proposer import DraftProposer
    from specstream.data.propose import ProposeItem, chain_length
    from specstream.models.loader import load_model

    proposer = DraftProposer(load_model(model_zoo["partial"]), max_slots=4, max_seq_len=64)
    prompt, branches = [5, 9, 17, 3, 22], 0
    for seed in range(20):
        item = ProposeItem(seed, 0, prompt, 3, SamplingParams(temperature=1.0, seed=seed), branches=3)
        reply = proposer.propose([item])[0]
        proposer.release([seed])
        width, chain = reply.q_width, chain_length(reply.parents, len(reply.tokens))
        rows = [(reply.q_ids[i * width:(i + 1) * width], reply.q_probs[i * width:(i + 1) * width])
                for i in range(len(reply.tokens))]
        for j in range(chain):
            ids, q = torch.tensor(rows[j][0]), torch.tensor(rows[j][1])
            key = row_keys([seed], [len(prompt) + j], SAMPLE)
            score = torch.where(q > 0, torch.log(q.double()) + gumbel(key, ids)[0], float("-inf"))
            order = ids[torch.argsort(score, descending=True)].tolist()
            at_j = [i for i in range(chain, len(reply.tokens)) if reply.parents[i] == j]
            assert [reply.tokens[j], *(reply.tokens[i] for i in at_j)] == order[: 1 + len(at_j)]
            assert all(rows[i] == rows[j] for i in at_j)
            branches += len(at_j)
    assert branches > 0
