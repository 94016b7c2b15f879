"""Proposals from a feature draft: an EAGLE-style head that reads the target's own features.

Each item carries, with the tokens the target committed, the target's features of the positions
the draft has not seen (``ProposeItem.features``: see specstream/data/propose.py). The head's cache
position t holds its input (f_t, the embedding of x_{t+1}), so a sequence the draft holds to m
tokens has positions 0..m-2; an item that rolls back to r and appends x_r..x_{n-1} brings features
f_{r-1}..f_{n-2} (f_0.. from 0) and the head extends positions r-1..n-2 (``FeatureHead.extend``).
Its last output predicts f_{n-1}, whose scores give the first guess; further guesses feed the head
its own predicted features (``FeatureHead.draft``). Guesses are never kept: their positions used
predicted features, and the next item brings the true ones, so ``Proposal.length`` is
rollback_to + len(append) and the target resends the tokens it accepts with their features.
A constrained item's forced tokens (``ProposeItem.forced``: what its grammar allows alone next)
go in the same way, ahead of the guesses: the head feeds them its own predicted features, as if
they were guesses it had made, and drafts on from them; they are not kept either.

Greedy items guess the argmax and sampling items draw x ~ q, with q the head's distribution
processed and cut exactly as the token draft's is (draft_service/proposer.py ``_Picker``), q sent
back; allowed branches, either adds its runner-ups (a sampling item's: its next draws) as a tree,
as the token draft does.

Features are input from another process: a wrong dtype, width or count, or numbers that are not
finite, are refused for that item with an error naming the field (``Proposal.error``), the
sequence's state is dropped (length 0: the next item resends it whole, features included), and
other items are unaffected. Nothing is padded or cut to fit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np
import torch

from draft_service.grammar_state import DraftGrammars
from draft_service.penalty_state import DraftPenalties
from draft_service.prefix_state import DraftPrefixes, bad_claim, resumed
from draft_service.proposer import GREEDY, _Picker, node_tables, q_rows
from draft_service.work_ahead import Ahead, Prepared
from kernels.lm_head import Hidden
from specstream.data.propose import FEATURE_DTYPE, Proposal, ProposeItem, Proposer
from specstream.data.sampling import SamplingParams
from specstream.models.feature_draft import FeatureDraft
from specstream.models.feature_head import HeadCache
from specstream.text.grammar import GrammarCompiler

SOURCE = "model"  # statistics are per draft service: one model answers, whatever its kind


class FeatureProposer(Proposer):

    works_ahead = True

    @property
    def ahead_counts(self) -> dict[str, int]:
        return self.ahead.counts

    def prepare_outcomes(self, outcomes: int) -> None:
        self.ahead.outcomes = outcomes

    def __init__(self, draft: FeatureDraft, max_slots: int, max_seq_len: int, q_support: int = 256,
                 grammars: GrammarCompiler | None = None, prefix_slots: int = -1) -> None:
        """``prefix_slots``: released sequences' slots kept for their prefixes (draft_service/prefix_state.py),
        at most; -1: all of ``max_slots`` that are idle, 0: none."""
        if q_support < 1:
            raise ValueError(f"q_support={q_support!r}: must be >= 1")
        self.draft = draft
        self.grammars = DraftGrammars(grammars)  # constrained sequences' matchers (None compiler: unmasked)
        self.penalties = DraftPenalties()  # penalised sequences' counts
        self.q_support = q_support
        self.max_len = max_seq_len
        self.width = draft.head.spec.input_width  # H per target layer it reads
        self.cache = HeadCache(draft.head.spec, max_slots, max_seq_len, dtype=draft.dtype)
        self.prefixes = DraftPrefixes(self.cache, max_slots if prefix_slots < 0 else prefix_slots, lag=1)
        self.slots: dict[Hashable, int] = {}
        self.lengths: dict[Hashable, int] = {}  # tokens held per sequence (head positions: one fewer)
        self.output = draft.output
        # Working ahead (draft_service/work_ahead.py): the chains of the latest call, the
        # next rounds drafted from them, and per sequence answered from one the target's features
        # it brought, read when the work next runs (or the sequence's next item needs them).
        self.plans: dict[Hashable, _Plan] = {}
        self.unread: dict[Hashable, tuple[ProposeItem, torch.Tensor]] = {}
        self.ahead = Ahead()

    # ----- what GetInfo reports ----------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.draft.name

    @property
    def vocab_size(self) -> int:
        return self.draft.vocab_size

    @property
    def acceptance(self) -> dict[tuple[str, bool], float]:
        """Its card's measured α per (source, greedy) (DraftInfo.acceptance)."""
        return {(SOURCE, greedy): alpha for greedy, alpha in self.draft.acceptance}

    @property
    def held(self) -> int:
        return len(self.slots)

    @property
    def free_slots(self) -> int:
        return self.cache.num_free + self.prefixes.retained  # kept slots are evicted when needed

    @property
    def prefix_cache(self) -> bool:
        return self.prefixes.cache is not None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.draft.target_layers

    @property
    def feature_width(self) -> int:
        return self.width

    def release(self, keys: list[Hashable]) -> None:
        for key in keys:
            slot = self.slots.pop(key, None)
            unread = self.unread.pop(key, None)
            # The head holds the target's features up to the tokens it was sent, but where an answer
            # from a prepared round left them unread (its own predicted ones stand there).
            held = unread[0].rollback_to if unread is not None else self.lengths.get(key, 0)
            self.lengths.pop(key, None)
            self.plans.pop(key, None)
            self.ahead.forget(key)
            self.grammars.release([key])
            self.penalties.release([key])
            self.prefixes.release(key, slot, held)

    # ----- proposing -------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        out = [Proposal([], 0, source=SOURCE) for _ in items]
        picker = _Picker(items, max((item.gamma for item in items), default=0), self.q_support,
                         self.draft.rows.device, self.draft.head.output_ids, second=self.ahead.outcomes > 1)
        picker.vocab = self.vocab_size
        guessed = []
        self.plans = {}
        for b, item in enumerate(items):
            features, error = self.read_features(item)
            if error:
                self.release([item.key])
                out[b].error = error
                continue
            if self._answer_prepared(item, features, out[b]):
                continue
            self._read_unread(item.key, item.rollback_to)
            slot, held = self._sync(item)
            if slot is None:
                continue
            if held < item.rollback_to + item.cached_prefix:  # fewer cached than the target expects
                self._restored_in_part(item, slot, held, out[b])
                continue
            n = item.rollback_to + len(item.append)
            self.lengths[item.key] = out[b].length = n
            if item.rollback_to == 0:  # a first item: from the cached prefix it continues, if any
                item_held = resumed(item, held)
                features = features[features.shape[0] - item_held.feature_count:]
            last = self._extend(item_held if item.rollback_to == 0 else item, slot, features)
            self.prefixes.took(item.key, slot, item.rollback_to, item.append)
            grammar = picker.grammars[b] = self.grammars.sync(item)
            penalty = picker.penalties[b] = self.penalties.sync(item)
            lead = item.forced  # fed with the head's own features, as its guesses are: not held
            gamma = min(item.gamma, self.max_len - n - len(lead))
            if last is None or gamma <= 0:
                self.grammars.hold(item.key, n)
                self.penalties.hold(item.key, n)
                continue
            if grammar is not None:
                grammar.take(lead)  # a refused one: this round guesses unmasked
            if penalty is not None:
                penalty.take(lead)

            def choose(g: torch.Tensor, step: int, b: int = b, skip: int = len(lead)) -> int:
                return int(picker.pick(Hidden(g[None], self.output), [b], step - skip)[0])

            chain = self.draft.head.draft(self.cache, slot, last, len(lead) + gamma, self.draft.embed,
                                          self.draft.rows, choose, forced=lead)[len(lead):]
            out[b].tokens, out[b].parents = picker.tree(b, chain)
            self.grammars.hold(item.key, n)  # the head holds the appended tokens, not its guesses
            self.penalties.hold(item.key, n)
            guessed.append((b, gamma))
            seconds = picker.seconds(b)[: len(chain)] if item.sampling.greedy else []
            # Rounds drafted ahead mask and penalise nothing: min_tokens' first tokens, constrained
            # and penalised rows draft afresh.
            if not item.masked_ids and grammar is None and penalty is None and not lead:
                self.plans[item.key] = _Plan(n, chain, gamma, last, seconds, item.sampling)
        width, q_ids, q_probs = picker.tables()
        for b, gamma in guessed:
            if q_ids[b]:
                out[b].q_width = width
                out[b].q_ids, out[b].q_probs = node_tables(q_ids[b], q_probs[b], width, out[b].tokens, out[b].parents)
        return out

    def _restored_in_part(self, item: ProposeItem, slot: int, held: int, out: Proposal) -> None:
        """A first item whose ``cached_prefix`` the draft holds only ``held`` tokens of: it keeps
        those and guesses nothing (the target sends the rest, with its features, next time), or,
        holding none of it, drops the sequence (the target resends it whole)."""
        if held == 0:
            self.release([item.key])
            return
        self.lengths[item.key] = out.length = held
        self.prefixes.took(item.key, slot, 0, item.append[:held])
        for state in (self.grammars, self.penalties):
            state.sync(item)
            state.hold(item.key, held)

    def _answer_prepared(self, item: ProposeItem, features: torch.Tensor, out: Proposal) -> bool:
        """Answers ``item`` from the round drafted ahead for it, if it is exactly the one assumed;
        its features are kept unread until the work (or the sequence's next item) reads them."""
        ready = self.ahead.answer(item, self.max_len)
        if ready is None:
            return False
        self.unread[item.key] = (item, features)
        self.lengths[item.key] = out.length = item.rollback_to + len(item.append)
        self.prefixes.took(item.key, self.slots[item.key], item.rollback_to, item.append)
        out.tokens = ready.tail
        if ready.q is not None:
            out.q_width, out.q_ids, out.q_probs = ready.q
        self.plans[item.key] = _Plan(out.length, out.tokens, item.gamma, seconds=ready.seconds, sampling=item.sampling)
        return True

    def _read_unread(self, key: Hashable, rollback_to: int) -> torch.Tensor | None:
        """Extends the head with the features an answer from a prepared round kept unread (those a
        roll back to ``rollback_to`` keeps); the head's last output, or None."""
        unread = self.unread.pop(key, None)
        if unread is None or rollback_to <= unread[0].rollback_to:
            if unread is not None:  # its positions past the roll back hold the head's own predictions
                self.lengths[key] = min(self.lengths.get(key, 0), unread[0].rollback_to)
            return None  # nothing held, or every unread position is rolled back anyway
        item, features = unread
        slot = self.slots[key]
        self.cache.length[slot] = max(item.rollback_to - 1, 0)
        return self._extend(item, slot, features)

    @torch.inference_mode()
    def work_ahead(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Drafts the next round of every chain of the latest call (draft_service/work_ahead.py):
        the chain's tokens fed with the head's own predicted features (the target's come with the next
        item), the bonus guess, then as many guesses as the row asked for this round (a sampling
        row's draws at their own positions' keys, with their q); then, for greedy rows, as
        ``ahead.outcomes`` asks, the round after each shorter kept part of the chain c_1..c_k and the
        draft's runner-up r_{k+1} where it stops, k = 0, 1, ... Every round writes only past what
        the head holds. ``stop()`` is read before each head forward."""
        plans, self.plans = self.plans, {}
        second = self.ahead.outcomes > 1
        lasts: dict[Hashable, torch.Tensor] = {}
        for outcome in [None, *range(self.ahead.outcomes - 1)]:  # None: the whole chain
            for key, plan in plans.items():
                if stop():
                    return
                forced = plan.chain if outcome is None else \
                    [*plan.chain[:outcome], plan.seconds[outcome]] if outcome < len(plan.seconds) else None
                slot = self.slots.get(key)
                if forced is None or slot is None or self.lengths.get(key) != plan.length \
                        or plan.length + len(forced) + 1 + plan.gamma > self.max_len:
                    continue
                if key not in lasts:
                    lasts[key] = plan.last if plan.last is not None else self._read_unread(key, plan.length + 1)
                if lasts[key] is None:
                    continue
                # The whole chain: then the bonus guess (appended) and the tail; another outcome:
                # the runner-up is the last appended token, then the tail.
                appended = len(forced) + 1 if outcome is None else len(forced)
                steps = appended + plan.gamma
                # Step j of this draft lands at position plan.length + j, as in a fresh round's.
                picker = _Picker([ProposeItem(key, plan.length - 1, [0], steps, plan.sampling)], steps,
                                 self.q_support, self.draft.rows.device, self.draft.head.output_ids, second)

                def choose(g: torch.Tensor, step: int, picker: _Picker = picker) -> int:
                    return int(picker.pick(Hidden(g[None], self.output), [0], step)[0])

                tokens = self.draft.head.draft(self.cache, slot, lasts[key], steps, self.draft.embed,
                                               self.draft.rows, choose, forced=forced, stop=stop)
                if len(tokens) > appended:
                    seconds = picker.seconds(0)[appended - len(forced):]  # chosen guesses only
                    self.ahead.keep(key, Prepared(plan.length, tokens[:appended], tokens[appended:],
                                                  whole=outcome is None, seconds=seconds, sampling=plan.sampling,
                                                  q=q_rows(picker.tables(), 0, appended, len(tokens))))

    def read_features(self, item: ProposeItem) -> tuple[torch.Tensor | None, str]:
        """The item's features [count, input_width] bfloat16, or why they cannot be read: the field and its value."""
        error = self.feature_error(item)
        if error:
            return None, error
        count = item.feature_count
        features = torch.frombuffer(bytearray(item.features), dtype=torch.bfloat16).view(count, self.width) \
            if count else torch.empty(0, self.width, dtype=torch.bfloat16)
        return features, ""

    def feature_error(self, item: ProposeItem) -> str:
        """Why the item's features cannot be read ("" when they can): their dtype, width or count, or
        numbers that are not finite (a bfloat16 whose exponent bits are all ones: inf or NaN, checked
        on the bytes: a few times cheaper than building the tensor and asking torch)."""
        if item.feature_dtype != FEATURE_DTYPE:
            return f"ProposeItem.feature_dtype={item.feature_dtype!r}: this draft reads {FEATURE_DTYPE!r} features"
        if item.feature_width != self.width:
            return (f"ProposeItem.feature_width={item.feature_width}: this draft reads features of {self.width} "
                    "numbers (the target's hidden size per layer it reads)")
        count = item.feature_count
        if len(item.features) != count * self.width * 2:
            return (f"ProposeItem.features: {len(item.features)} bytes for sequence {item.key} (rollback_to="
                    f"{item.rollback_to}, {len(item.append)} tokens appended, cached_prefix={item.cached_prefix}); "
                    f"expected {count} features of "
                    f"{self.width} bfloat16 numbers = {count * self.width * 2} bytes")
        if ((np.frombuffer(item.features, dtype=np.uint16) & _EXPONENT) == _EXPONENT).any():
            return f"ProposeItem.features: sequence {item.key} has numbers that are not finite (NaN or inf)"
        return ""

    def _sync(self, item: ProposeItem) -> tuple[int | None, int]:
        """The sequence's slot rolled back to ``rollback_to``, and how many of its tokens the slot
        holds now (a first item: those of a cached prefix restored, draft_service/prefix_state.py);
        (None, 0) when its state is gone, the item cannot be held, or no slot is free (the target
        then resends it whole)."""
        if not item.append or item.rollback_to + len(item.append) > self.max_len \
                or max(item.append) >= self.vocab_size or max(item.forced, default=0) >= self.vocab_size \
                or bad_claim(item):
            self.release([item.key])
            return None, 0
        if item.rollback_to == 0:  # a (re)start: what it held is kept for what it shares
            self.release([item.key])
            return self.prefixes.start(item, self.slots)
        slot = self.slots.get(item.key)
        if slot is None or item.rollback_to > self.lengths.get(item.key, 0):
            self.release([item.key])
            return None, 0
        self.cache.length[slot] = item.rollback_to - 1
        return slot, item.rollback_to

    def _extend(self, item: ProposeItem, slot: int, features: torch.Tensor) -> torch.Tensor | None:
        """The head's positions for the item's features [count, H]; its last output [H] (None: no
        feature yet, a one-token sequence)."""
        count = features.shape[0]
        if count == 0:
            return None
        tokens = torch.tensor(item.append[-count:], dtype=torch.int64)  # x_{t+1} for each feature f_t
        start = max(item.rollback_to - 1, 0)
        dtype = self.draft.dtype
        out = self.draft.head.extend(self.cache, slot, start, features.to(dtype), self.draft.embed[tokens].to(dtype))
        return out[-1]


_EXPONENT = 0x7F80  # a bfloat16's exponent bits: all ones for inf and NaN


@dataclass
class _Plan:
    """A row of the latest call, to draft ahead from: the length it reported, the chain it
    proposed (the next item appends it and the bonus token), its γ, the head's output at its last
    held position (None: an answer from a prepared round, whose features are still unread), the
    draft's runner-up at each chain guess (greedy rows: working ahead on the other outcomes), and
    its sampling settings."""

    length: int
    chain: list[int]
    gamma: int
    last: torch.Tensor | None = None
    seconds: list[int] = field(default_factory=list)  # the draft's runner-up per chain guess
    sampling: SamplingParams = GREEDY
