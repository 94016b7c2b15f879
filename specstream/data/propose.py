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

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Protocol

from specstream.data.constraint import Constraint
from specstream.data.penalties import Penalties
from specstream.data.sampling import GREEDY, SamplingParams

__all__ = ["FEATURE_DTYPE", "NO_ACCEPTANCE", "SOURCE", "DraftInfo", "Proposal", "ProposeItem", "Proposer",
           "chain_length", "features_expected", "with_forced_appended", "without_masked"]

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
    # min_tokens: the ids the target masks (the sequence's stop ids) at every position before
    # masked_until (prompt + min_tokens); sent only while a guess can land there. A guess of one
    # there is always refused, so proposers mask them too (``masked_at``, ``without_masked``).
    masked_ids: frozenset[int] = frozenset()
    masked_until: int = 0
    # A constrained sequence's constraint, on its items with rollback_to 0 (the draft holds nothing
    # of it): the grammar reads its tokens from position output_start (the prompt's length) on,
    # and the draft guesses from its distribution masked by it (draft_service/grammar_state.py).
    constraint: Constraint | None = None
    # A penalised sequence's penalties, on its items with rollback_to 0: the draft applies them at
    # each guess as the target does there, counting the prompt (before output_start) and the output
    # (from it on, its guesses included) (draft_service/penalty_state.py).
    penalties: Penalties | None = None
    output_start: int = 0  # on items with rollback_to 0: the position of the first output token (the prompt's length)
    # On items with rollback_to 0: the sequence's cache salt (SequenceRequest.cache_salt). A proposer
    # that drafts from other sequences' outputs (draft_service/suffix.py) uses only those of its salt.
    cache_salt: str = ""
    # Only to a proposer that asks a model-free lookup first (Proposer.lookup): guess with that
    # lookup alone, never the model (no guesses where it has none). The target asks so for a row
    # its γ controller gives nothing, priced by the model that answered it last (target_service/drafting.py).
    lookup_only: bool = False
    # On items with rollback_to 0, to a draft that keeps prefixes (DraftInfo.prefix_cache): how many
    # leading tokens of ``append`` the target expects it to hold already, from an earlier sequence
    # under the same cache salt (a multiple of specstream.data.prefix.BLOCK; the target's own prefix
    # cache had them). A feature draft gets no features for them (``feature_count``). A draft that
    # holds fewer (m) restores those, guesses nothing and answers length m; the target sends the rest
    # next time (draft_service/prefix_state.py).
    cached_prefix: int = 0
    # A constrained sequence's forced tokens after ``append``: what its grammar allows alone there,
    # proposed already by the target (not committed). The draft guesses on from them: its guesses
    # land after them and are the only tokens it sends back. It may hold them as it holds its own
    # guesses (a token draft, which takes them as context: ``with_forced_appended``), or not (a
    # feature draft, which has no target features for them and feeds them its own).
    forced: list[int] = field(default_factory=list)

    @property
    def first_guess(self) -> int:
        """The position in the sequence of the item's first guess."""
        return self.rollback_to + len(self.append) + len(self.forced)

    @property
    def feature_count(self) -> int:
        """How many features the item carries for a feature draft (``features_expected``): none for
        the ``cached_prefix`` tokens the draft is expected to hold."""
        return features_expected(self.rollback_to + self.cached_prefix, len(self.append) - self.cached_prefix)

    def masked_at(self, position: int) -> frozenset[int]:
        """The ids no guess at ``position`` may be (empty past masked_until)."""
        return self.masked_ids if position < self.masked_until else frozenset()


def with_forced_appended(item: ProposeItem) -> ProposeItem:
    """``item`` with its forced tokens appended, for a proposer that takes them in as context and
    holds them (its ``Proposal.length`` then counts them, as it counts its own guesses)."""
    if not item.forced:
        return item
    return replace(item, append=[*item.append, *item.forced], forced=[])


def without_masked(item: ProposeItem, tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """A deterministic proposal (tokens, parents: a tree, or [] for a chain) for ``item`` less
    every guess the target is sure to refuse (an id masked at its position) and the guesses
    under it. Only for guesses that do not depend on random draws: cutting a sampled guess
    would change the distribution its row is verified against."""
    if not item.masked_ids or item.first_guess >= item.masked_until:
        return tokens, parents
    tree = parents or list(range(len(tokens)))
    kept = {0: 0}  # node -> its number among the kept (node 0: the sequence's last token)
    depth = {0: 0}
    out_tokens: list[int] = []
    out_parents: list[int] = []
    for i, (token, parent) in enumerate(zip(tokens, tree)):
        if parent not in kept or token in item.masked_at(item.first_guess + depth[parent]):
            continue
        depth[i + 1] = depth[parent] + 1
        kept[i + 1] = len(out_tokens) + 1
        out_tokens.append(token)
        out_parents.append(kept[parent])
    return out_tokens, out_parents if parents else []


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


NO_ACCEPTANCE: Mapping[tuple[str, bool], float] = MappingProxyType({})


class Proposer(Protocol):
    """What the draft servicer and an in-process draft need of a proposer. A proposer subclasses
    this class, so the optional capabilities below default to "not this one".

    `propose` answers each item with one Proposal, in order: the sequence `item.key` is cut to its
    first `rollback_to` tokens, `append` is added, then up to `gamma` tokens are guessed after
    `forced` (fewer, even none, is allowed). `Proposal.length` is how many leading tokens of the sequence the
    proposer now holds; the target sends everything after it next time. A key it holds nothing
    for, or a `rollback_to` beyond what it holds, gets length 0 and its state dropped.
    `release` forgets sequences (unknown keys are ignored).
    """

    name: str  # what GetInfo reports as the draft's model
    vocab_size: int  # the target speculates only on sequences whose ids are all below it
    max_len: int  # tokens it can hold per sequence
    held: int  # sequences it holds state for
    free_slots: int  # further sequences it can take

    # A proposer that reads the target's features: the target layers it reads (counted from 1,
    # ascending; num_hidden_layers, the final normed state, comes last; earlier ones are each
    # RMS-normalized) and its numbers per position (the hidden size per layer). () and 0: tokens only.
    feature_layers: tuple[int, ...] = ()
    feature_width: int = 0
    # Measured acceptance rates its draft's card states, {(Proposal.source, greedy): α} (DraftInfo.acceptance).
    acceptance: Mapping[tuple[str, bool], float] = NO_ACCEPTANCE
    # Whether ``work_ahead`` drafts anything (a draft model's next round: draft_service/work_ahead.py).
    works_ahead: bool = False
    # A proposer that asks a model-free lookup before its model: the lookup's Proposal.source, and
    # it answers ``ProposeItem.lookup_only`` items from the lookup alone. "": none.
    lookup: str = ""
    # Whether it keeps released sequences' state to continue their prefixes from (ProposeItem.cached_prefix).
    prefix_cache: bool = False

    def propose(self, items: list[ProposeItem]) -> list[Proposal]: ...

    def release(self, keys: list[Hashable]) -> None: ...

    def work_ahead(self, stop: Callable[[], bool]) -> None:
        """Drafts the next round of the latest call's rows until ``stop()``; nothing by default."""

    def prepare_outcomes(self, outcomes: int) -> None:
        """How many outcomes of each chain ``work_ahead`` prepares (DraftConfig.work_ahead_outcomes)."""

    @property
    def ahead_counts(self) -> Mapping[str, int]:
        """The work ahead's running counts (prepared, hit, miss, ...); empty without it."""
        return MappingProxyType({})


@dataclass
class DraftInfo:
    """What a draft service says of its proposer (``Draft.GetInfo``; the wire forms are in
    specstream/data/propose_wire.py)."""

    model_name: str = ""
    vocab_size: int = 0
    max_context_length: int = 0  # tokens it can hold per sequence
    held_sequences: int = 0
    free_slots: int = 0
    feature_layers: tuple[int, ...] = ()
    feature_width: int = 0
    acceptance: Mapping[tuple[str, bool], float] = field(default_factory=dict)
    lookup: str = ""  # Proposer.lookup
    prefix_cache: bool = False  # Proposer.prefix_cache

    @classmethod
    def of(cls, proposer: Proposer) -> DraftInfo:
        return cls(model_name=proposer.name, vocab_size=proposer.vocab_size, max_context_length=proposer.max_len,
                   held_sequences=proposer.held, free_slots=proposer.free_slots,
                   feature_layers=tuple(proposer.feature_layers), feature_width=proposer.feature_width,
                   acceptance=dict(proposer.acceptance), lookup=proposer.lookup,
                   prefix_cache=proposer.prefix_cache)
