"""Tree verification (target_service/settle.py ``tree_path``, the engine's tree forward and KV
commit, the draft's runner-up branches): greedy output stays the target's plain greedy output,
token for token, for random trees (depth <= 8, width <= 4) in ragged batches, trees whose every
node is wrong, trees whose deepest path is right, and the real drafts' trees; sampled rows'
trees under coupled verification emit plain sampling's tokens."""

from __future__ import annotations

import random
from collections.abc import Hashable

import pytest
from tests.support.engine_harness import run_engine
from test_tree_attention import random_tree

from specstream.data.propose import Proposal, ProposeItem, Proposer
from specstream.data.sampling import SamplingParams
from target_service.settle import tree_path

MAX_NEW = 24


def _brute_path(proposals: list[int], parents: list[int], best: list[int]) -> list[int]:
    """The longest root path whose every node is the argmax after its parent, first child first."""
    def walk(node: int) -> list[int]:
        for i, parent in enumerate(parents):
            if parent == node and proposals[i] == best[node]:
                return [i + 1, *walk(i + 1)]
        return []
    return walk(0)


def test_tree_path_keeps_the_first_matching_child_at_every_node() -> None:
    rng = random.Random(1)
    kept = set()
    for _ in range(500):
        n = rng.randint(1, 20)
        parents = random_tree(rng, n + 1)[1:]
        proposals = [rng.randrange(3) for _ in range(n)]
        best = [rng.randrange(3) for _ in range(n + 1)]
        path = tree_path(proposals, parents, best)
        assert path == _brute_path(proposals, parents, best)
        for depth, node in enumerate(path):  # each kept node is the argmax after the one before
            assert proposals[node - 1] == best[([0, *path])[depth]]
        kept.add(len(path))
    assert {0, 1, 2, 3} <= kept  # paths of several lengths, none among them


class RandomTrees(Proposer):
    """A test proposer: random tree shapes over the target's true continuation (``oracle``: prompt
    + plain greedy output), each node right with probability ``right`` when its path so far is."""

    def __init__(self, oracle: list[list[int]], vocab_size: int, right: float, seed: int) -> None:
        self.oracle, self.vocab_size, self.right = oracle, vocab_size, right
        self.rng = random.Random(seed)
        self.name, self.max_len, self.held, self.free_slots = "random-trees", 1 << 16, 0, 1 << 16
        self.context: dict[Hashable, list[int]] = {}
        self.trees = self.deepest_right = 0

    def release(self, keys: list[Hashable]) -> None:
        for key in keys:
            self.context.pop(key, None)

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        return [self._one(item) for item in items]

    def _one(self, item: ProposeItem) -> Proposal:
        context = self.context.setdefault(item.key, [])
        if item.rollback_to > len(context):
            self.release([item.key])
            return Proposal([], 0)
        del context[item.rollback_to:]
        context.extend(item.append)
        truth = next(seq for seq in self.oracle if seq[:len(context)] == context)[len(context):]
        nodes = self.rng.randint(1, item.gamma + item.branches)
        parents = random_tree(self.rng, nodes + 1, max_depth=min(8, item.gamma))[1:]
        tokens, right_at = [], {0: True}
        for i, parent in enumerate(parents):
            depth = _depth(parents, i + 1)
            can = right_at[parent] and depth - 1 < len(truth)
            good = can and self.rng.random() < self.right
            token = truth[depth - 1] if good else self._wrong(truth[depth - 1] if can else -1)
            tokens.append(token)
            right_at[i + 1] = good
        self.trees += 1
        self.deepest_right += any(right_at[n] and _depth(parents, n) == item.gamma for n in right_at if n)
        return Proposal(tokens, len(context), parents=parents if len(tokens) > 1 else [])

    def _wrong(self, token: int) -> int:
        return (max(token, 0) + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size


def _depth(parents: list[int], node: int) -> int:
    depth = 0
    while node:
        node, depth = parents[node - 1], depth + 1
    return depth


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(300) for _ in range(rng.randint(1, 30))] for _ in range(12)]


@pytest.fixture(scope="module")
def plain(model_zoo, prompts):
    return run_engine(model_zoo["target"], None, prompts, gamma=0, max_new_tokens=MAX_NEW)[0]


@pytest.mark.parametrize("right", [0.0, 0.6, 1.0], ids=["every-node-wrong", "mixed", "deepest-path-right"])
def test_random_trees_in_ragged_batches_equal_plain_decoding(model_zoo, prompts, plain, right) -> None:
    oracle = [p + out for p, out in zip(prompts, plain)]
    proposer = RandomTrees(oracle, 300, right, seed=int(right * 10))
    tokens, finals = run_engine(model_zoo["target"], None, prompts, gamma=8, max_new_tokens=MAX_NEW,
                                proposer=proposer,
                                config={"tree_branches": 8, "gamma_policy": "fixed", "max_gamma": 16})
    assert tokens == plain
    accepted = sum(f.stats.accepted_tokens for f in finals)
    trees = sum(sum(f.stats.branch_histogram[1:]) for f in finals)
    assert trees > 0 and proposer.trees > 0
    if right == 0.0:
        assert accepted == 0
    elif right == 1.0:
        assert proposer.deepest_right > 0 and accepted > 0
    else:
        assert accepted > 0 and sum(f.stats.branch_tokens for f in finals) > 0


@pytest.mark.parametrize("gamma", [1, 2, 4])
@pytest.mark.parametrize("draft", ["partial", "unrelated", "same"])
def test_the_drafts_own_trees_equal_plain_decoding(model_zoo, prompts, plain, draft, gamma) -> None:
    tokens, finals = run_engine(model_zoo["target"], model_zoo[draft], prompts, gamma=gamma,
                                max_new_tokens=MAX_NEW, config={"tree_branches": 3, "gamma_policy": "fixed"})
    assert tokens == plain
    histogram = [sum(h) for h in zip(*(f.stats.branch_histogram + [0] * (4 - len(f.stats.branch_histogram))
                                       for f in finals))]
    assert sum(histogram[1:]) > 0  # trees were verified
    if draft == "partial":  # its runner-ups are often the target's token
        assert sum(f.stats.branch_tokens for f in finals) > 0


def test_a_tree_saves_passes_over_its_chain(model_zoo, prompts, plain) -> None:
    """The same draft and γ, branches on and off: the same output, fewer target passes with trees."""
    runs = {b: run_engine(model_zoo["target"], model_zoo["partial"], prompts, gamma=2, max_new_tokens=MAX_NEW,
                          config={"tree_branches": b, "gamma_policy": "fixed"}) for b in (0, 3)}
    passes = {b: sum(f.stats.target_passes for f in finals) for b, (_, finals) in runs.items()}
    assert runs[0][0] == runs[3][0] == plain
    assert passes[3] < passes[0], passes


def test_sampled_rows_verify_trees_beside_greedy_trees(model_zoo, prompts, plain) -> None:
    """Sampled rows propose trees too (the draft's next draws as branches). Under coupled
    verification a sampled row emits exactly plain sampling's tokens whatever the tree; greedy
    rows emit plain greedy's. (Leviathan's rule over trees: tests/test_tree_sampling.py and
    tests/test_sampling_exact.py.)"""
    sampling = [SamplingParams(temperature=0.8, seed=i) if i % 2 else SamplingParams() for i in range(len(prompts))]
    tokens, finals = run_engine(model_zoo["target"], model_zoo["partial"], prompts, gamma=2, max_new_tokens=MAX_NEW,
                                sampling=sampling, config={"tree_branches": 3, "gamma_policy": "fixed",
                                                           "speculative_sampling": "coupled"})
    alone, _ = run_engine(model_zoo["target"], None, prompts, gamma=0, max_new_tokens=MAX_NEW, sampling=sampling)
    for i in range(len(prompts)):
        assert tokens[i] == (alone[i] if i % 2 else plain[i])
    sampled = [f for i, f in enumerate(finals) if i % 2]
    assert sum(sum(f.stats.branch_histogram[1:]) for f in sampled) > 0  # sampled rows proposed trees
    assert sum(f.stats.branch_tokens for f in sampled) > 0  # and kept tokens off their chains


def test_a_rows_chain_and_branches_stay_within_max_gamma(model_zoo, prompts, plain) -> None:
    """Every slot keeps max_gamma positions of headroom past its budget, and a verify window (padded
    to the widest row) must fit in it: a row's chain and branches together never exceed max_gamma,
    here 4 in slots of 64 that the longest prompts nearly fill."""
    from draft_service.proposer import DraftProposer
    from specstream.models.loader import load_model

    asked: list[tuple[int, int]] = []

    class Recording(DraftProposer):
        def propose(self, items):
            asked.extend((item.gamma, item.branches) for item in items)
            return super().propose(items)

    proposer = Recording(load_model(model_zoo["partial"]), max_slots=16, max_seq_len=64)
    tokens, _ = run_engine(model_zoo["target"], None, prompts, gamma=3, max_new_tokens=MAX_NEW, proposer=proposer,
                           config={"tree_branches": 8, "gamma_policy": "fixed", "max_gamma": 4}, max_seq_len=64)
    assert tokens == plain
    assert asked and all(g + b <= 4 for g, b in asked) and (3, 1) in asked and any(b > 1 for _, b in asked)


def test_log_probabilities_of_a_tree_row_are_those_of_plain_decoding(model_zoo, prompts) -> None:
    """A row that asked for log-probabilities gets, for each token a tree pass emits, the target's
    distribution at that token's node (the path's, not the proposal order's)."""
    plain, plain_finals = run_engine(model_zoo["target"], None, prompts[:6], gamma=0, max_new_tokens=MAX_NEW,
                                     logprobs=2)
    tree, tree_finals = run_engine(model_zoo["target"], model_zoo["partial"], prompts[:6], gamma=2,
                                   max_new_tokens=MAX_NEW, logprobs=2,
                                   config={"tree_branches": 3, "gamma_policy": "fixed"})
    assert tree == plain
    assert sum(f.stats.branch_tokens for f in tree_finals) > 0  # some tokens came off the chain
    for want, got in zip(plain_finals, tree_finals):
        assert len(got.logprobs) == len(want.logprobs)
        for a, b in zip(want.logprobs, got.logprobs):
            assert b.token_id == a.token_id and abs(b.logprob - a.logprob) < 1e-4
            assert [t for t, _ in b.top] == [t for t, _ in a.top]
