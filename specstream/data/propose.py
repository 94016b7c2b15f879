"""The propose protocol as plain data: what the target asks of a proposer and what it answers.

`ProposeItem` in (a sequence's rollback point, the tokens to append, γ and the sampling settings),
`Proposal` out (the guesses, what the proposer now holds, and for sampled guesses the sparse q
they were drawn from), and the `Proposer` protocol every proposer implements: the draft model
(draft_service/proposer.py), prompt lookup (ngram.py), their combination and the synthetic one.
The target's drafting (target_service/drafting.py) speaks it whether the proposer runs behind
gRPC (`draft_service/wire.py` writes these as protobuf) or in the target's own process.
Plain data: no torch.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

from specstream.data.sampling import GREEDY, SamplingParams

__all__ = ["FEATURE_DTYPE", "SOURCE", "Proposal", "ProposeItem", "Proposer", "chain_length", "features_expected"]

FEATURE_DTYPE = "bfloat16"  # how features travel: 2 bytes a number (the only encoding)


@dataclass
class ProposeItem:
    key: Hashable
    rollback_to: int
    append: list[int]
    gamma: int
    sampling: SamplingParams = GREEDY
    # For a draft that reads the target's features (Proposer.feature_width > 0): those of positions
    # rollback_to - 1 .. rollback_to + len(append) - 2 (from 0 when rollback_to is 0), raw bytes of
    # feature_width numbers each in feature_dtype (see features_expected). Empty for token drafts.
    features: bytes = b""
    feature_width: int = 0
    feature_dtype: str = FEATURE_DTYPE
    # Greedy items: up to this many more guesses as branches beside the chain (Proposal.parents).
    branches: int = 0


def chain_length(parents: list[int], count: int) -> int:
    """How many of a proposal's ``count`` tokens form the chain the draft holds: the leading run
    whose parent is the token before (all of them when ``parents`` is empty: a chain)."""
    if not parents:
        return count
    return next((i for i, parent in enumerate(parents) if parent != i), count)


def features_expected(rollback_to: int, appended: int) -> int:
    """How many features an item carries: one per appended token, whose predecessor's feature the
    draft had not seen, less one from position 0 (the newest token's feature does not exist yet)."""
    return max(appended - (rollback_to == 0), 0)


SOURCE = "model"  # Proposal.source of a draft model's guesses (draft_service/proposer.py)


@dataclass
class Proposal:
    tokens: list[int]
    length: int  # tokens the cache now holds for the sequence (0: state lost or refused)
    # Sampling items: the sparse q each token was drawn from, as a [len(tokens), q_width] table
    # flattened row-major (padding has probability 0). q_width 0: deterministic guesses (greedy,
    # or model-free), which the target verifies as point masses.
    q_width: int = 0
    q_ids: list[int] = field(default_factory=list)
    q_probs: list[float] = field(default_factory=list)
    # Which proposer made `tokens` ("model", "ngram", "synthetic"), so the target can keep its
    # acceptance statistics per proposer when one draft service combines several.
    source: str = SOURCE
    # Non-empty when the proposer refused the item (its features of the wrong dtype, width or
    # count): names the field and the value; then tokens is empty and length 0.
    error: str = ""
    # The sequence the reply names, where it crossed a wire (the target checks it is the item's); None in process.
    key: Hashable | None = None
    # A tree: per token, its parent node (0: the sequence's last token, i + 1: token i); the
    # leading run whose parent is the token before is the draft's chain. Empty: a chain.
    parents: list[int] = field(default_factory=list)


class Proposer(Protocol):
    """What the draft servicer and an in-process draft need of a proposer.

    `propose` answers each item with one Proposal, in order: the sequence `item.key` is cut to its
    first `rollback_to` tokens, `append` is added, then up to `gamma` tokens are guessed (fewer,
    even none, is allowed). `Proposal.length` is how many leading tokens of the sequence the
    proposer now holds; the target sends everything after it next time. A key it holds nothing
    for, or a `rollback_to` beyond what it holds, gets length 0 and its state dropped.
    `release` forgets sequences (unknown keys are ignored).
    """

    @property
    def name(self) -> str: ...  # what GetInfo reports as the draft's model

    @property
    def vocab_size(self) -> int: ...  # the target speculates only on sequences whose ids are all below it

    @property
    def max_len(self) -> int: ...  # tokens it can hold per sequence

    @property
    def held(self) -> int: ...  # sequences it holds state for

    @property
    def free_slots(self) -> int: ...  # further sequences it can take

    # A proposer that reads the target's features sets ``feature_layers`` (target layers, counted
    # from 1, ascending; num_hidden_layers, the final normed state, comes last; earlier ones are
    # each RMS-normalized) and ``feature_width`` (numbers per position: the hidden size per layer);
    # a token proposer has neither (read with getattr, default () and 0).
    # A proposer whose draft's card states measured acceptance rates sets ``acceptance``:
    # {(Proposal.source, greedy): α} (read with getattr, default {}; DraftInfo.acceptance).

    def propose(self, items: list[ProposeItem]) -> list[Proposal]: ...

    def release(self, keys: list[Hashable]) -> None: ...
