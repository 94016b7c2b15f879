"""Everything the target engine does with a draft (docs/architecture.md §4 and §4.1): deciding how many tokens each
row asks for, keeping the draft's copy of each sequence in sync, building the propose items,
checking the replies, and releasing sequences that ended.

``DraftSource`` is the one interface to a proposer, whoever runs it: ``DraftClient`` (the gRPC
draft service), ``LocalDraft`` (a proposer in this process: a draft model, the n-gram proposers,
the synthetic one). ``Drafting`` drives a source for the engine; the γ per row comes from the
controller (target_service/gamma.py) within caps only this module knows (the token budget, the
draft's context and vocabulary).

Sync: for every sequence the draft holds a prefix of the sequence's tokens (`held`), valid for one
draft stream (`epoch`; a new stream holds nothing). Each item asks the draft to roll back to what
still agrees, append the rest, and guess. After verification only the part the target accepted
stays agreed (`settle`).

A feature draft (one whose ``feature_width`` is set) also gets, with each item, the target's
features of the positions it has not seen (specstream/data/propose.py ``ProposeItem.features``),
from what the engine keeps per sequence (``Sequence.features``); a resync resends them all. A
sequence whose features were not kept from its start decodes plainly with such a draft; a (re)sync
too large for one call (``FEATURE_BYTES_PER_CALL``) goes in parts over a few steps. A draft that
refuses an item says why (``Proposal.error``): logged once per field, counted in ``refusals``,
and that sequence decodes without the draft from then on (its features are dropped).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from specstream.data.propose import NO_ACCEPTANCE, Proposal, ProposeItem, chain_length, features_expected
from specstream.data.sampling import GREEDY
from target_service import tracing
from target_service.gamma import AUTO_GAMMA, SELF_LIMITING, GammaController, RowView, pooled_source
from target_service.sequence import Sequence
from target_service.settle import Verdict, VerifyRow

log = logging.getLogger(__name__)

__all__ = ["DraftSource", "Drafting", "feature_refusal", "malformed"]

_TIMING_KEY = 0  # the start-up timing's sequence: the engine numbers requests' sequences from 1
# A feature draft's features per propose call, at most: far below the gRPC message limit (64 MiB),
# 3,640 positions of SmolLM2 (1,152 bytes each). A longer (re)sync takes several steps.
FEATURE_BYTES_PER_CALL = 4 << 20
# The most steps a row waits between lookup-only asks that find nothing (``Drafting._lookup_only``).
LOOKUP_WAIT_MAX = 16
# Forced tokens a constrained row proposes in one pass, at most (a long forced run, a schema's
# fixed text, goes over a few passes: each is one verify position).
MAX_FORCED = 16


class DraftSource(Protocol):
    """A proposer the engine can ask for guesses. A source subclasses this class, so the optional
    capabilities at the end default to "not this one".

    Contract:
    - ``propose(step, items, traceparent, item_traceparents)`` returns one ``Proposal`` per item, in
      order, or None when the source failed this time (the engine then decodes plainly for a step).
      For each item the source first keeps ``item.rollback_to`` tokens of what it holds for
      ``item.key``, appends ``item.append``, then guesses up to ``item.gamma`` tokens after
      ``item.forced`` (a constrained row's forced tokens; fewer guesses, even none, are allowed);
      ``Proposal.length`` says how many leading tokens it now holds. Sampled
      items (``item.sampling`` not greedy) come with the q each guess was drawn from, or none
      (point masses) from deterministic proposers; ``Proposal.source`` names the proposer.
    - ``epoch`` changes whenever the source's state was lost (a new stream): then it holds nothing.
    - ``release(keys)`` forgets sequences; unknown keys are ignored.
    - ``ready()`` is True when a propose can be attempted now; it must not block on a dead source.
    - ``watch(callback)``: ``callback()`` is called whenever ``connected`` changes.
    - ``vocab_size`` / ``max_context_length``: the ids and the sequence length it can take.

    Optional:
    - ``feature_layers`` / ``feature_width``: the target layers a draft that reads the target's
      features reads (the last: the final, normed hidden state) and its numbers per position (the
      hidden size per layer); () and 0 for a token draft.
    - ``acceptance``: the α its draft's card states per (Proposal.source, greedy), the γ
      controller's priors (DraftInfo.acceptance).
    - ``lookup``: the Proposal.source of a model-free lookup the draft asks before its model, which
      alone answers ``ProposeItem.lookup_only`` items (DraftInfo.lookup; "": none).
    - ``prefix_cache``: the draft keeps released sequences' state for their prefixes, so a feature
      draft is sent no features for the prefix the target's own cache served
      (``ProposeItem.cached_prefix``; DraftInfo.prefix_cache).
    - ``asks_early`` and ``start_propose``: a source whose proposals compute apart from the engine
      (another process) can be asked for the next pass before this pass's host work
      (``TargetConfig.draft_early``); ``start_propose`` returns once the request is out.
    - ``after_verify(engine_waiting)``: the engine has verified a pass and does its host work now;
      a source on the engine's own torch thread may work ahead until ``engine_waiting()``.
      ``ahead_counts``: that work's running counts (prepared, hit, miss, ...).
    """

    model_name: str
    url: str
    vocab_size: int
    max_context_length: int
    epoch: int
    connected: bool
    held_sequences: int

    feature_layers: tuple[int, ...] = ()
    feature_width: int = 0
    acceptance: Mapping[tuple[str, bool], float] = NO_ACCEPTANCE
    asks_early: bool = False
    lookup: str = ""  # the model-free lookup it asks before its model (DraftInfo.lookup)
    prefix_cache: bool = False  # it keeps released sequences' state (DraftInfo.prefix_cache)

    async def ready(self) -> bool: ...

    def watch(self, callback: Callable[[], None]) -> None: ...

    async def propose(self, step: int, items: list[ProposeItem], traceparent: str = "",
                      item_traceparents: list[str] | None = None) -> list[Proposal] | None: ...

    async def release(self, keys: list[int]) -> None: ...

    async def close(self) -> None: ...

    async def start_propose(self, step: int, items: list[ProposeItem], traceparent: str = "",
                            item_traceparents: list[str] | None = None) -> asyncio.Future:
        """``propose``, started: its answer to await (a source that ``asks_early`` returns once
        the request is out)."""
        return asyncio.ensure_future(self.propose(step, items, traceparent, item_traceparents))

    def after_verify(self, engine_waiting: Callable[[], bool]) -> None:
        """Nothing by default (see the contract)."""

    @property
    def ahead_counts(self) -> Mapping[str, int]:
        return MappingProxyType({})


def feature_refusal(layers: list[int] | tuple[int, ...], width: int, target_layers: int, target_width: int) -> str:
    """Why a draft asking for the features of ``layers`` at ``width`` numbers per position cannot
    be served by a target of ``target_layers`` layers and hidden size ``target_width`` ("" when it
    can). A target sends its final, normed hidden state (layer ``target_layers``), after the
    outputs of any earlier layers the draft names (each RMS-normalized; EAGLE-3's fusion), in
    ascending order: ``target_width`` numbers per layer."""
    layers = list(layers)
    if not layers and not width:
        return ""
    if not layers or not width:
        return (f"DraftInfo.feature_layers={layers} with DraftInfo.feature_width={width}: a draft that reads "
                "features names both")
    if layers[-1] != target_layers or layers != sorted(set(layers)) or layers[0] < 1:
        return (f"DraftInfo.feature_layers={layers}: this target sends its final, normed hidden state (layer "
                f"{target_layers}), after any of its layers 1..{target_layers - 1} in ascending order")
    if width != target_width * len(layers):
        return (f"DraftInfo.feature_width={width}: this target's features of {len(layers)} layers have "
                f"{target_width * len(layers)} numbers ({target_width} a layer)")
    return ""


_Q_SUM_TOLERANCE = 1e-3  # a q row's probabilities sum to 1 within this (float32 rounding of a softmax)


def malformed(reply: Proposal, item: ProposeItem, gamma: int, vocab_size: int, greedy: bool) -> tuple[str, str]:
    """(cause, why) when ``reply`` to ``item`` (asked for ``gamma`` guesses and up to
    ``item.branches`` more as branches) cannot be verified as it stands, else ("", ""): it names
    another sequence, has more tokens than asked, a token id outside the target's vocabulary, a held
    length past what it was sent and guessed, a tree that was not asked for or is not one (a parent
    out of range or not before its child, a path deeper than γ), or (a sampled row) a q table that
    is not one distribution per token with the token drawn in its support, or a tree whose
    siblings are not distinct draws from one q."""
    if reply.key is not None and reply.key != item.key:
        return "seq_id", f"Proposal.seq_id={reply.key!r} answers ProposeItem.seq_id={item.key!r}"
    tokens = reply.tokens
    budget = gamma + (item.branches if reply.parents else 0)
    if len(tokens) > budget:
        return "tokens", f"Proposal.token_ids has {len(tokens)} tokens for gamma={gamma}, branches={item.branches}"
    if reply.parents:
        why = _not_a_tree(reply.parents, len(tokens), gamma) if item.branches else \
            f"Proposal.parents: a tree for an item that allowed none (branches={item.branches})"
        if why:
            return "tree", why
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        return "token_id", f"Proposal.token_ids holds {bad}, outside the target's vocabulary of {vocab_size}"
    most = item.first_guess + len(tokens)
    if reply.length > most:
        return "length", (f"Proposal.length={reply.length}: more than the {most} tokens it was sent and "
                          "guessed")
    if not greedy and reply.parents and not reply.q_width:
        return "tree", "Proposal.parents: a sampled row's tree comes with q (its siblings are draws from one q)"
    if greedy or not reply.q_width or not tokens:
        return "", ""
    # Builtins over whole lists (C loops): a sampled row's table is γ × q_support entries a pass.
    width, size = reply.q_width, len(tokens) * reply.q_width
    ids, probs = reply.q_ids, reply.q_probs
    if len(ids) != size or len(probs) != size:
        return "q", (f"Proposal.q_width={width}: q_ids has {len(ids)} and q_probs {len(probs)} entries for "
                     f"{len(tokens)} tokens")
    if min(ids) < 0 or max(ids) >= vocab_size:
        return "q", f"Proposal.q_ids holds an id outside the target's vocabulary of {vocab_size}"
    if not (min(probs) >= 0.0 and max(probs) <= 1.0):
        return "q", "Proposal.q_probs holds a probability outside [0, 1]"
    for i, token in enumerate(tokens):
        at = i * width
        total = sum(probs[at:at + width])  # NaN stays NaN, and fails the test below
        if not abs(total - 1.0) <= _Q_SUM_TOLERANCE:
            return "q", f"Proposal.q row {i} sums to {total!r}, not 1 (or holds NaN)"
        try:
            drawn = ids.index(token, at, at + width)
        except ValueError:
            drawn = -1
        if drawn < 0 or not probs[drawn] > 0.0:
            return "q", f"Proposal.q row {i} gives no probability to the token it drew ({token})"
    if reply.parents and (why := _not_drawn_together(tokens, reply.parents, width, ids, probs)):
        return "tree", why
    return "", ""


def _not_a_tree(parents: list[int], count: int, gamma: int) -> str:
    """Why ``parents`` is not a tree over ``count`` tokens no deeper than ``gamma`` ("" when it is)."""
    if len(parents) != count:
        return f"Proposal.parents has {len(parents)} entries for {count} tokens"
    depth = [0]
    for i, parent in enumerate(parents):
        if not 0 <= parent <= i:
            return f"Proposal.parents[{i}]={parent}: a parent is node 0..{i} (the root or an earlier token)"
        depth.append(depth[parent] + 1)
        if depth[-1] > gamma:
            return f"Proposal.parents: token {i} is {depth[-1]} deep, past gamma={gamma}"
    return ""


def _not_drawn_together(tokens: list[int], parents: list[int], width: int, ids: list[int], probs: list[float]) -> str:
    """Why a sampled tree's siblings cannot be draws without replacement from one q ("" when they
    can): each node's children carry the same q row and distinct tokens (kernels/tree_sampling.py)."""
    first: dict[int, int] = {}
    seen: dict[int, set[int]] = {}
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        f = first.setdefault(parent, i)
        if token in seen.setdefault(parent, set()):
            return f"Proposal.parents: token {i} ({token}) repeats a sibling's token under node {parent}"
        seen[parent].add(token)
        a, b = f * width, i * width
        if ids[a:a + width] != ids[b:b + width] or probs[a:a + width] != probs[b:b + width]:
            return f"Proposal.q row {i} differs from its first sibling's (row {f}): siblings are drawn from one q"
    return ""


@dataclass
class _Plan:
    """One propose call's worth: per row its check (filled from the reply), its forced tokens and
    γ; the items sent for the rows ``sent``; the tokens they feed."""

    checks: list[VerifyRow]
    forced: list[list[int]] = field(default_factory=list)
    gammas: list[int] = field(default_factory=list)
    items: list[ProposeItem] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    fed: int = 0


@dataclass
class _Early:
    """A request sent before its step (``Drafting.propose_early``): for which rows (seq id, token
    count), over which stream, and its answer, in flight (None: nothing was asked)."""

    keys: list[tuple[int, int]]
    epoch: int
    plan: _Plan
    task: asyncio.Future | None


def _after_forced(forced: list[int], row: VerifyRow) -> VerifyRow:
    """``row`` (the draft's guesses, made after ``forced`` went into its context) with the forced
    tokens before its proposals: point masses in a sampled row's q table (probability 1, padding 0)."""
    if not forced:
        return row
    n = len(forced)
    if row.q_width:
        pad = [0] * (row.q_width - 1)
        row.q_ids = [i for t in forced for i in (t, *pad)] + list(row.q_ids)
        row.q_probs = [p for _ in forced for p in (1.0, *pad)] + list(row.q_probs)
    row.proposals = [*forced, *row.proposals]
    row.parents = [*range(n), *(p + n for p in row.parents)] if row.parents else []
    row.drafted += n
    row.forced = n
    return row


def _keys(rows: list[Sequence]) -> list[tuple[int, int]]:
    return [(s.seq_id, len(s.tokens)) for s in rows]


@dataclass
class _Held:
    length: int = 0  # leading tokens the draft holds that agree with the sequence
    epoch: int = -1  # the draft stream `length` refers to
    # Lookup-only asks (``Drafting._lookup_only``): how many in a row found nothing, and the steps
    # to let pass before the next (doubling with each miss, up to LOOKUP_WAIT_MAX).
    lookup_misses: int = 0
    lookup_wait: int = 0
    claimed: bool = False  # its cached prefix was claimed (ProposeItem.cached_prefix): once per stream


@dataclass
class Drafting:
    source: DraftSource | None
    controller: GammaController
    vocab_size: int  # the target's: proposals at or past it are cut
    tree_branches: int = 0  # the most branches a row may add to its chain (0: chains only)
    forced_tokens: bool = True  # constrained rows propose their grammar's forced tokens first
    fed: int = 0  # tokens the last propose call fed the draft before it guessed (for the cost model)
    refusals: Counter = field(default_factory=Counter)  # items the draft refused, by field
    malformed_replies: Counter = field(default_factory=Counter)  # replies refused as malformed, by cause
    on_malformed: Callable[[str], None] | None = None  # called with the cause of each (metrics)
    early: Counter = field(default_factory=Counter)  # early requests: "used" by their step, or "dropped"
    # A feature draft's prefix cache (``_cached_prefix``), in tokens: claimed (expected to be held),
    # restored (held: their features were not sent), and the feature bytes that saved.
    draft_prefix: Counter = field(default_factory=Counter)
    on_draft_prefix: Callable[[int, int, int], None] | None = None  # (claimed, restored, bytes saved) per item (metrics)
    _held: dict[int, _Held] = field(default_factory=dict)
    _early: _Early | None = None
    # Constrained rows whose likely tokens went out (``_forced``): the canonical tokens of the text
    # their grammar allowed alone and the position it started at, until the model's own tokens
    # for it are committed (``_learn_habits``).
    _watched: dict[int, tuple[list[int], int]] = field(default_factory=dict)

    @property
    def feature_width(self) -> int:
        """Numbers per position the draft reads (0: a token draft, or none)."""
        return self.source.feature_width if self.source is not None else 0

    @property
    def keep_layers(self) -> tuple[int, ...]:
        """The target layers before the last whose outputs the draft reads (``CausalLM.hidden``'s keep)."""
        return tuple(self.source.feature_layers[:-1]) if self.feature_width else ()

    @property
    def acceptance(self) -> Mapping[tuple[str, bool], float]:
        """The α the draft's card states, for the controller's priors (none without a draft)."""
        return self.source.acceptance if self.source is not None else NO_ACCEPTANCE

    @property
    def asks_early(self) -> bool:
        return self.source is not None and self.source.asks_early

    @property
    def ahead_counts(self) -> Mapping[str, int]:
        """The draft's work ahead, its running counts (empty without it)."""
        return self.source.ahead_counts if self.source is not None else MappingProxyType({})

    def after_verify(self, engine_waiting: Callable[[], bool]) -> None:
        """The engine verified a pass and does its host work: the draft may work ahead meanwhile
        (``DraftSource.after_verify``)."""
        if self.source is not None:
            self.source.after_verify(engine_waiting)

    @property
    def connected(self) -> bool:
        return bool(self.source and self.source.connected)

    @property
    def model_name(self) -> str:
        """The connected draft's model ("" while none is connected)."""
        return self.source.model_name if self.connected else ""

    @property
    def held_sequences(self) -> int:
        return self.source.held_sequences if self.source else 0

    def caps(self, rows: list[Sequence]) -> list[int]:
        """The most each row may ask for this step, whatever the controller wants: the budget left
        (the last token is always the target's own), the draft's context and vocabulary."""
        source = self.source
        if source is None:
            return [0] * len(rows)
        room = source.max_context_length
        features = self.feature_width > 0
        # Past the draft's context a sequence decodes plainly rather than resending its whole
        # context every step; a draft with a smaller vocabulary cannot read ids past its own; a
        # feature draft cannot guess for a sequence whose features were not kept.
        return [0 if seq.max_token >= source.vocab_size or (features and seq.features is None)
                else max(0, min(seq.remaining - 1, room - len(seq.tokens))) for seq in rows]

    async def propose(self, rows: list[Sequence], step: int, traceparent: str = "") -> list[VerifyRow]:
        """What each row will verify this step: the controller's γ per row, the draft's guesses
        (checked), and each row's q when it samples. Rows get no proposals when γ is 0 for them or
        the draft is unavailable. When the previous step asked for exactly these rows early
        (``propose_early``), its answer is awaited instead; otherwise that answer only updates what
        the draft holds, and this step asks afresh."""
        early, self._early = self._early, None
        if early is not None:
            replies = await early.task if early.task is not None else None
            if early.keys == _keys(rows) and self.source is not None and early.epoch == self.source.epoch:
                self.early["used"] += 1
                self.fed = early.plan.fed
                return self._take(rows, early.plan, replies)
            self.early["dropped"] += 1
            self._keep_lengths(early.plan, replies)
        plan = await self._plan(rows)
        if not plan.items:
            return self._take(rows, plan, None)
        replies = await self.source.propose(step, plan.items, traceparent,
                                            [tracing.sequence_traceparent(rows[i]) for i in plan.sent])
        return self._take(rows, plan, replies)

    async def propose_early(self, rows: list[Sequence], step: int, traceparent: str = "") -> None:
        """Asks the draft now for the pass after this one (step ``step``) of ``rows``, whose
        verification just ended: the verify result goes out before the engine's host work, and the
        draft computes meanwhile. ``propose`` of that step takes the answer if it asks for the same
        rows with the same tokens over the same stream."""
        await self.drop_early()
        plan = await self._plan(rows)
        task = None
        if plan.items:
            task = await self.source.start_propose(step, plan.items, traceparent,
                                                   [tracing.sequence_traceparent(rows[i]) for i in plan.sent])
        self._early = _Early(_keys(rows), self.source.epoch if self.source else -1, plan, task)

    async def drop_early(self) -> None:
        """Forgets an early request (its answer only updates what the draft holds)."""
        early, self._early = self._early, None
        if early is not None:
            self.early["dropped"] += 1
            if early.task is not None:
                self._keep_lengths(early.plan, await early.task)

    async def _plan(self, rows: list[Sequence]) -> _Plan:
        """The controller's γ per row and the items to send (none: nothing to ask)."""
        plan = _Plan([s.verify_row() for s in rows])
        self.fed = 0
        plan.forced = [self._forced(s) for s in rows]
        for check, forced in zip(plan.checks, plan.forced):
            check.proposals, check.forced = list(forced), len(forced)
        source = self.source
        if source is None:
            return plan
        views = [RowView(s.seq_id, s.gamma, s.max_gamma, s.sampling.greedy, self._unfed(s, source.epoch),
                         s.matcher is not None, len(forced)) for s, forced in zip(rows, plan.forced)]
        # After forced tokens the draft guesses on from them (ProposeItem.forced): they take room in
        # the cap. Where the grammar ends after them, the next token is the output's end: no guesses.
        caps = [0 if s.matcher is not None and s.matcher.ends_after(forced) else max(0, cap - len(forced))
                for s, cap, forced in zip(rows, self.caps(rows), plan.forced)]
        # A lookup with a model behind it (suffix+model) is no self-limiting proposer: the model
        # would be asked at the γ meant as the lookup's cap.
        self.controller.self_limiting = SELF_LIMITING if not source.lookup else frozenset()
        plan.gammas = self.controller.choose(views, caps)
        branches = self.controller.branches(views, plan.gammas, self.tree_branches)
        lookup_only = self._lookup_only(rows, views, plan.gammas, caps, source)
        asked = [i for i, g in enumerate(plan.gammas) if g > 0]
        if not asked or not await source.ready():
            return plan
        budget = FEATURE_BYTES_PER_CALL
        for i in asked:
            seq = rows[i]
            held = self._held.setdefault(seq.seq_id, _Held())
            if held.epoch != source.epoch:  # a fresh stream holds nothing
                held.length, held.epoch, held.claimed = 0, source.epoch, False
            cached = self._cached_prefix(seq, held, source)
            append, gamma, features = self._with_features(seq, held.length, plan.gammas[i], budget, cached)
            if not append:
                held.claimed = held.claimed and not cached  # not sent: its claim goes with the next
                continue  # a feature draft's (re)sync that does not fit this call: the next ones
            budget -= len(features.get("features", b""))
            row = plan.checks[i]  # the ids its guesses may not be, and until where (min_tokens)
            if held.length == 0:  # the draft holds nothing: its matcher and penalty counts start here
                features.update(output_start=seq.prompt_len, cache_salt=seq.cache_salt, cached_prefix=cached)
                if seq.matcher is not None:
                    features.update(constraint=seq.constraint)
                if seq.penalties is not None:
                    features.update(penalties=seq.penalties.penalties)
            # A constrained row verifies a chain (its masks follow one path): it asks for no branches.
            plan.items.append(ProposeItem(seq.seq_id, held.length, append, gamma, seq.sampling,
                                          branches=branches[i] if gamma and seq.matcher is None else 0,
                                          masked_ids=row.masked_ids, masked_until=row.masked_until,
                                          forced=plan.forced[i], lookup_only=i in lookup_only, **features))
            plan.sent.append(i)
            self.fed += len(append)
        plan.fed = self.fed
        return plan

    def _lookup_only(self, rows: list[Sequence], views: list[RowView], gammas: list[int], caps: list[int],
                     source: DraftSource) -> set[int]:
        """The rows to ask the draft's lookup alone (``ProposeItem.lookup_only``), their γ set in
        ``gammas``: under speculation=auto, given γ 0 by the controller, and not waiting
        after lookup-only asks that found nothing (each miss doubles the wait, up to LOOKUP_WAIT_MAX
        steps: a lookup that never matches costs a propose call now and then, not every step)."""
        if not source.lookup:
            return set()
        chosen = set()
        for i, (seq, view) in enumerate(zip(rows, views)):
            if gammas[i] or view.gamma != AUTO_GAMMA or not caps[i]:
                continue
            held = self._held.setdefault(seq.seq_id, _Held())
            if held.lookup_wait:
                held.lookup_wait -= 1
                continue
            gammas[i] = self.controller.lookup_gamma(views, gammas, i, source.lookup, caps[i])
            if gammas[i]:
                chosen.add(i)
        return chosen

    def _cached_prefix(self, seq: Sequence, held: _Held, source: DraftSource) -> int:
        """The tokens a feature draft that keeps prefixes is expected to hold already of a sequence
        it holds nothing of: those the target's own prefix cache served it, the first time it is sent
        on this stream (a draft that holds fewer says so; the next items send the rest). 0: none, and
        for a token draft, which has every token and restores what it holds by itself."""
        if held.length or held.claimed or not self.feature_width or not source.prefix_cache:
            return 0
        held.claimed = True
        return seq.reused if seq.reused < len(seq.tokens) else 0

    def _forced(self, seq: Sequence) -> list[int]:
        """A constrained sequence's grammar tokens, when it speculates (γ not 0): its forced tokens
        (the grammar allows nothing else there) and the likely ones on (``Matcher.likely``: where the
        text it allows alone may be tokenized more ways than one, its canonical tokenization), up to
        ``MAX_FORCED`` and its budget less the target's own last token. Point masses the target
        verifies as any guess: a likely token it refuses ends the row's proposals there."""
        if seq.matcher is None or not seq.gamma or not self.forced_tokens:
            return []
        forced, canonical = seq.matcher.forced(), seq.matcher.forced_text()
        self._learn_habits(seq, forced, canonical)
        return seq.matcher.likely(forced, canonical)[: max(0, min(MAX_FORCED, seq.remaining - 1))]

    def _learn_habits(self, seq: Sequence, forced: list[int], canonical: list[int]) -> None:
        """Teaches the grammar's ``TokenHabits`` how the model wrote the text its grammar allowed
        alone when the row's likely tokens last went out (the tokens committed since), once they
        reach that text's end; then watches the text it allows alone now (``canonical``, its
        canonical tokens), where they go past its ``forced`` ones (the guesses a habit may correct)."""
        assert seq.matcher is not None
        habits = seq.matcher.habits
        if habits is None:
            return
        watched = self._watched.get(seq.seq_id)
        if watched is not None and not habits.learn(watched[0], seq.tokens[watched[1]:]):
            return  # the model has not written that text to its end yet
        if len(canonical) > len(forced):
            self._watched[seq.seq_id] = (canonical, len(seq.tokens))
        else:
            self._watched.pop(seq.seq_id, None)

    def _unfed(self, seq: Sequence, epoch: int) -> int:
        """Tokens of ``seq`` the draft has not taken in (all of them on a fresh stream)."""
        held = self._held.get(seq.seq_id)
        return len(seq.tokens) - (held.length if held is not None and held.epoch == epoch else 0)

    def _take(self, rows: list[Sequence], plan: _Plan, replies: list[Proposal] | None) -> list[VerifyRow]:
        """The plan's checks with the draft's replies (None: none asked, or it failed: the rows
        verify their forced tokens alone, or decode plainly)."""
        answered = set(plan.sent) if replies is not None else set()
        for i, forced in enumerate(plan.forced):
            if forced and i not in answered:  # a proposal like the draft's (an answered row counts its own below)
                rows[i].draft_tokens += len(forced)
        if replies is None:
            return plan.checks
        checks = plan.checks
        for i, item, reply in zip(plan.sent, plan.items, replies):
            seq = rows[i]
            checks[i] = _after_forced(plan.forced[i], self._check(seq, reply, plan.gammas[i], item))
            # Beyond the context the draft holds its own guesses; `settle` keeps the part the target
            # agreed with. It cannot hold more than it was sent and guessed (a malformed length: 0).
            most = item.first_guess + len(reply.tokens)
            held = self._held[seq.seq_id]
            held.length = reply.length if reply.length <= most else 0
            if item.cached_prefix:
                self._count_prefix(item.cached_prefix, min(held.length, item.cached_prefix))
            if item.lookup_only and item.gamma:  # (a feature resync asks for no guesses: no miss)
                held.lookup_misses = 0 if reply.tokens else min(held.lookup_misses + 1, 5)
                held.lookup_wait = min(LOOKUP_WAIT_MAX, (1 << held.lookup_misses) - 1)
            seq.draft_tokens += checks[i].chain  # branches apart
        return checks

    def _count_prefix(self, claimed: int, restored: int) -> None:
        saved = restored * 2 * self.feature_width
        self.draft_prefix.update(claimed=claimed, restored=restored, bytes_saved=saved)
        if self.on_draft_prefix is not None:
            self.on_draft_prefix(claimed, restored, saved)

    def _keep_lengths(self, plan: _Plan, replies: list[Proposal] | None) -> None:
        """What the draft holds after an answer that is not verified, for the sequences still here:
        what the request rolled back to, so that the next one sends the same tokens again (an item
        always appends at least the sequence's newest token; the draft's guesses may be wrong)."""
        for item, reply in zip(plan.items, replies or []):
            held = self._held.get(item.key)
            if held is not None:  # (a first item's cached prefix, restored, is held)
                held.length = min(reply.length, item.rollback_to + item.cached_prefix)
                if item.cached_prefix:
                    self._count_prefix(item.cached_prefix, held.length)

    def _with_features(self, seq: Sequence, held: int, gamma: int, budget: int,
                       cached: int = 0) -> tuple[list[int], int, dict]:
        """(append, γ, the item's feature fields) for a row whose draft holds ``held`` tokens (and is
        expected to hold ``cached`` more from its prefix cache: their features are not sent). A
        feature draft gets the features of positions max(held + cached - 1, 0)..len(tokens)-2; when they do
        not fit the call's remaining ``budget`` of bytes (a long prompt, a resync after a new
        stream), the row sends the part that fits and guesses nothing this step (γ 0), so no call
        outgrows the message limit and the sync completes over a few steps; nothing fits: no item."""
        append = seq.tokens[held:]
        width = self.feature_width
        if not width:
            return append, gamma, {}
        row = 2 * width  # bfloat16
        if seq.features is None or len(seq.features) != (len(seq.tokens) - 1) * row:
            log.error("sequence %d: its kept features do not match its tokens; it decodes without the draft",
                      seq.seq_id)
            seq.features = None
            return [], 0, {}
        count, room = features_expected(held + cached, len(append) - cached), budget // row
        if count > room:
            if room == 0:
                return [], 0, {}
            count, gamma = room, 0
            append = append[:cached + count + (held + cached == 0)]
        start = max(held + cached - 1, 0)
        return append, gamma, {"features": bytes(seq.features[start * row:(start + count) * row]),
                               "feature_width": width}

    async def time_draft(self, max_depth: int, rounds: int = 2, prompt_len: int = 32) -> int:
        """Times the draft before the first request, as the engine times its verify forward: a
        throwaway sequence (key 0, which no request gets) is fed a prompt of `prompt_len` tokens,
        then asked for 1..`max_depth` guesses `rounds` times, one new token fed each call, as a row
        that drafts every step is; each call's seconds go to the controller's draft cost model
        (``CostModel.observe_draft``), so a sequence's first passes are priced from what this
        draft, over this link, costs instead of a prior. The sequence is released afterwards.
        Returns the number of calls timed (0: no draft, or it did not answer)."""
        source = self.source
        if source is None or max_depth <= 0 or not await source.ready():
            return 0
        vocab = max(1, min(self.vocab_size, source.vocab_size or self.vocab_size))
        room = source.max_context_length or prompt_len + (rounds + 1) * max_depth
        prompt_len = min(prompt_len, room // 4)  # a small draft context still leaves room for the guesses
        max_depth = min(max_depth, (room - prompt_len) // (rounds + 1))
        if prompt_len <= 0 or max_depth <= 0:
            return 0
        tokens = [(7 * i + 3) % vocab for i in range(prompt_len + max_depth * rounds)]
        held, timed = 0, 0
        for call, depth in enumerate(d for _ in range(rounds) for d in range(1, max_depth + 1)):
            upto = prompt_len + call  # the sequence so far; the draft holds `held` of it
            item = ProposeItem(_TIMING_KEY, held, tokens[held:upto], depth, GREEDY)
            if self.feature_width:  # zeros: a feature draft's compute does not depend on the values
                item.features = bytes(2 * self.feature_width * features_expected(held, upto - held))
                item.feature_width = self.feature_width
            started = time.perf_counter()
            replies = await source.propose(0, [item])
            seconds = time.perf_counter() - started
            if not replies or replies[0].length == 0:
                break
            self.controller.observe_draft_timing(depth, depth, len(item.append), seconds)
            held, timed = min(replies[0].length, upto), timed + 1
        await source.release([_TIMING_KEY])
        return timed

    def _check(self, seq: Sequence, reply: Proposal, gamma: int, item: ProposeItem) -> VerifyRow:
        """The reply as a VerifyRow to verify: its tokens, with the q table when the row samples
        (none from a model-free proposer: point masses). A reply is untrusted input: one that is
        malformed (``malformed``) is refused for this row, which then decodes plainly this pass,
        counted by cause in ``malformed_replies`` and logged once per cause. A reply in which the
        draft says it could not read what it was sent (``Proposal.error``) ends this sequence's
        drafting (its features are dropped)."""
        row = seq.verify_row(reply.source)
        if reply.error:  # the draft could not read what it was sent: this sequence decodes without it
            field_name = reply.error.split("=")[0].split(":")[0]
            if not self.refusals[field_name]:
                log.warning("draft refused sequence %d (logged once per field): %s", seq.seq_id, reply.error)
            self.refusals[field_name] += 1
            seq.features = None
            return row
        cause, why = malformed(reply, item, gamma, self.vocab_size, greedy=seq.sampling.greedy)
        # The positions it drew a guess for, kept or not: settle never races SAMPLE noise there.
        row.drafted = min(len(reply.tokens), gamma)
        if cause:
            if not self.malformed_replies[cause]:
                log.warning("draft sent a malformed reply for sequence %d, which decodes plainly this pass "
                            "(logged once per cause, counted in metrics): %s", seq.seq_id, why)
            self.malformed_replies[cause] += 1
            if self.on_malformed is not None:
                self.on_malformed(cause)
            return row
        row.proposals = list(reply.tokens)
        if reply.parents and chain_length(reply.parents, len(reply.tokens)) < len(reply.tokens):
            row.parents = list(reply.parents)
        if not seq.sampling.greedy and reply.q_width and row.proposals:
            row.q_width, row.q_ids, row.q_probs = reply.q_width, list(reply.q_ids), list(reply.q_probs)
        return row

    def settle(self, seq: Sequence, check: VerifyRow, verdict: Verdict) -> None:
        """After verification: the draft fed context + its chain but the last guess; only the part
        of the chain the target kept agrees with it. A tree's branches are scored apart: whether the
        one at the depth where the chain failed was kept (``GammaController.observe_branch``)."""
        chain, agreed = check.chain, verdict.on_chain
        held = self._held.get(seq.seq_id)
        if held is not None:
            held.length = min(held.length, check.position + agreed)
        if agreed >= check.forced:  # the controller scores the draft's guesses, not the grammar's
            self.controller.observe(seq.seq_id, pooled_source(check.source, seq.matcher is not None),
                                    seq.sampling.greedy, chain - check.forced,
                                    agreed - check.forced)
        if agreed < chain and agreed in check.parents[chain:]:  # a branch stood beside the failed guess
            self.controller.observe_branch(verdict.accepted > agreed, seq.sampling.greedy)

    async def release(self, rows: list[Sequence]) -> None:
        """Forgets sequences that ended (here, in the draft and in the controller)."""
        keys = self._forget(rows)
        if self.source is not None and keys:
            await self.source.release(keys)

    def _forget(self, rows: list[Sequence]) -> list[int]:
        epoch = self.source.epoch if self.source else None
        keys = []
        for seq in rows:
            held = self._held.pop(seq.seq_id, None)
            self._watched.pop(seq.seq_id, None)
            self.controller.forget(seq.seq_id)
            if held is not None and held.epoch == epoch:
                keys.append(seq.seq_id)
        return keys
