"""Draft proposals with a per-sequence KV cache: greedy guesses, or samples x ~ q with q sent back.

Each item says: keep the first `rollback_to` tokens of the sequence (an O(1) length reset), append
the tokens the target committed since, then guess `gamma` tokens. The guesses are fed back into
the cache as they are made, so the next call only rolls back what the target rejected.

Greedy items (temperature 0) guess the argmax; one that allows branches (``ProposeItem.branches``)
also gets its runner-up guesses as a tree: beside the chain, the ``branches`` alternatives whose
paths the draft finds likeliest (the chain's log-probabilities up to a depth plus the
alternative's there), each a child of the chain token before it (``Proposal.parents``). A sampling
item's runner-ups at a depth are the next finishers of the race that drew its guess there: draws
without replacement from q, in the order drawn, each sent with q (kernels/tree_sampling.py). Which
depths get how many is chosen from the chain alone (the likelihood of reaching the depth times the
chance its guess is refused, ``_Picker.tree``), never from the runner-ups' own draws, which would
bias them. Sampling items process the logits exactly as the
target does (kernels/processing.py), cut q to its `q_support` most likely tokens, renormalise, and
draw x ~ q by an exponential race with the noise the target's own plain sample at that position
uses (key (seed, absolute position, SAMPLE), kernels/random.py): x is an exact sample from q, and
where q is close to p it is the very token the target would sample (what coupled verification
accepts). The cut q is returned with each guess, so the target verifies against exactly the
distribution that was sampled (docs/architecture.md §7.1).
A draft that predicts over a subset of the vocabulary (``model.output_token_ids``) has its
columns mapped back to token ids before anything leaves here.
A constrained sequence's guesses are drawn from the logits its grammar masks, greedy and sampled
alike (its matcher: draft_service/grammar_state.py); such rows are never drafted ahead.
Knows nothing about gRPC or about the target: keys are opaque.

What every proposer speaks (`ProposeItem` in, `Proposal` out, the `Proposer` protocol) is plain
data of its own, specstream/data/propose.py, which the target speaks too.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Hashable
from typing import NamedTuple

import numpy as np
import torch

import kernels
from draft_service.grammar_state import DraftGrammars, GrammarRow, allowed_rows
from draft_service.penalty_state import DraftPenalties, PenaltyRow
from draft_service.prefix_state import DraftPrefixes, bad_claim, resumed
from draft_service.work_ahead import Ahead, Prepared
from kernels.lm_head import Hidden
from kernels.nbest import MAX_K, top_scores
from kernels.processing import process_logits, truncate
from kernels.random import SAMPLE, gumbel, race, row_keys
from specstream.data.propose import SOURCE, Proposal, ProposeItem, Proposer, chain_length, with_forced_appended
from specstream.data.sampling import SamplingParams
from specstream.models.base import CausalLM
from specstream.text.grammar import GrammarCompiler

GREEDY = SamplingParams()


class DraftProposer(Proposer):

    works_ahead = True

    @property
    def ahead_counts(self) -> dict[str, int]:
        return self.ahead.counts

    def prepare_outcomes(self, outcomes: int) -> None:
        self.ahead.outcomes = outcomes

    def __init__(self, model: CausalLM, max_slots: int, max_seq_len: int, q_support: int = 256,
                 grammars: GrammarCompiler | None = None, prefix_slots: int = -1) -> None:
        """``prefix_slots``: released sequences' slots kept for their prefixes (draft_service/prefix_state.py),
        at most; -1: all of ``max_slots`` that are idle, 0: none."""
        if q_support < 1:
            raise ValueError(f"q_support={q_support!r}: must be >= 1")
        self.model = model
        self.grammars = DraftGrammars(grammars)  # constrained sequences' matchers (None compiler: unmasked)
        self.penalties = DraftPenalties()  # penalised sequences' counts
        self.q_support = q_support  # bounds the size of each q on the wire, whatever the vocabulary
        self.max_len = min(max_seq_len, model.config.max_position_embeddings)
        self.cache = model.new_cache(max_slots, self.max_len)
        self.prefixes = DraftPrefixes(self.cache, max_slots if prefix_slots < 0 else prefix_slots)
        self.slots: dict[Hashable, int] = {}
        # Working ahead (draft_service/work_ahead.py): the chains of the latest call, as
        # (reported length, γ, the chain, its runner-up per guess) per sequence; the next rounds
        # drafted from them.
        self.plans: dict[Hashable, _Plan] = {}
        self.ahead = Ahead()
        # Sequences whose chain positions the other outcomes' work wrote over: (where the chain
        # starts, the chain's tokens the cache held there). Their next item feeds them again.
        self.rewritten: dict[Hashable, tuple[int, list[int]]] = {}

    @property
    def held(self) -> int:
        return len(self.slots)

    @property
    def name(self) -> str:
        return self.model.config.name

    @property
    def acceptance(self) -> dict[tuple[str, bool], float]:
        """Its card's measured α per (source, greedy) (DraftInfo.acceptance)."""
        return {(SOURCE, greedy): alpha for greedy, alpha in self.model.config.acceptance}

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def free_slots(self) -> int:
        return self.cache.num_free + self.prefixes.retained  # kept slots are evicted when needed

    @property
    def prefix_cache(self) -> bool:
        return self.prefixes.cache is not None

    def release(self, keys: list[Hashable]) -> None:
        for key in keys:
            slot = self.slots.pop(key, None)
            self.plans.pop(key, None)
            self.ahead.forget(key)
            rewritten = self.rewritten.pop(key, None)
            self.grammars.release([key])
            self.penalties.release([key])
            # The cache holds the tokens the target sent, as far as it was fed and not written over.
            held = 0 if slot is None else min(len(self.prefixes.tokens.get(key, ())), self.cache.length(slot),
                                              rewritten[0] if rewritten is not None else self.max_len)
            self.prefixes.release(key, slot, held)

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        out = [Proposal([], 0) for _ in items]
        rows, gammas, grammars, penalties = [], [], [], []
        self.plans = {}
        # A constrained row's forced tokens go into the context, held as the appended tokens are.
        items = [with_forced_appended(item) for item in items]
        for i, item in enumerate(items):
            rewritten = self.rewritten.pop(item.key, None)
            if self._answer_prepared(item, out[i], rewritten):
                continue
            if rewritten is not None and rewritten[0] < item.rollback_to <= rewritten[0] + len(rewritten[1]):
                start, held = rewritten  # feed the chain's kept tokens again, then the item's
                item = dataclasses.replace(item, rollback_to=start,
                                           append=[*held[: item.rollback_to - start], *item.append])
            slot, held = self._sync(item)
            if slot is None:
                continue
            grammar = self.grammars.sync(item)
            penalty = self.penalties.sync(item)
            if held < item.rollback_to + item.cached_prefix:  # fewer cached than the target expects
                if held == 0:
                    self.release([item.key])  # the target resends it whole
                    continue
                out[i].length = held  # kept; the target sends the rest next time
                self.prefixes.took(item.key, slot, 0, item.append[:held])
                continue
            if item.rollback_to == 0:  # a first item: from the cached prefix it continues, if any
                item = resumed(item, held)
            out[i].length = item.rollback_to  # the appended tokens are only fed when guessing
            self.prefixes.took(item.key, slot, item.rollback_to, [])
            gamma = min(item.gamma, self.max_len - item.rollback_to - len(item.append))
            if gamma > 0:
                rows.append((i, item, slot))
                gammas.append(gamma)
                grammars.append(grammar)
                penalties.append(penalty)
        if not rows:
            self._hold_grammars(items, out)
            return out
        guesses, picker = self._guess(rows, gammas, second=self.ahead.outcomes > 1, grammars=grammars,
                                      penalties=penalties)
        width, q_ids, q_probs = picker.tables()
        for b, ((i, item, slot), gamma, tokens) in enumerate(zip(rows, gammas, guesses)):
            out[i].tokens, out[i].parents = picker.tree(b, tokens[:gamma])
            if q_ids[b]:
                out[i].q_width = width
                out[i].q_ids, out[i].q_probs = node_tables(q_ids[b], q_probs[b], width, out[i].tokens,
                                                            out[i].parents)
            # Holds the appended tokens and every guess but the last (which was never fed).
            out[i].length = item.rollback_to + len(item.append) + gamma - 1
            self.cache.set_length(slot, out[i].length)
            # What the cache holds, its own guesses included: a position's K/V is its tokens' whoever chose them.
            self.prefixes.took(item.key, slot, item.rollback_to, [*item.append, *tokens[:gamma - 1]])
            seconds = picker.seconds(b)[:gamma] if item.sampling.greedy else []
            # Rounds drafted ahead mask and penalise nothing: min_tokens' first tokens, constrained
            # and penalised rows draft afresh.
            if not item.masked_ids and grammars[b] is None and penalties[b] is None:
                self.plans[item.key] = _Plan(out[i].length, gamma, tokens[:gamma], seconds, item.sampling)
        self._hold_grammars(items, out)
        return out

    def _hold_grammars(self, items: list[ProposeItem], out: list[Proposal]) -> None:
        """The constrained sequences' matchers and the penalised ones' counts rolled back to the
        tokens the draft holds."""
        for item, reply in zip(items, out):
            self.grammars.hold(item.key, reply.length)
            self.penalties.hold(item.key, reply.length)

    def _answer_prepared(self, item: ProposeItem, out: Proposal,
                         rewritten: tuple[int, list[int]] | None) -> bool:
        """Answers ``item`` from the round drafted ahead for it, if it is exactly the one assumed.
        A round another outcome's work wrote over (``rewritten``: where the chain starts, the
        chain's tokens held there) has its tokens fed again first, in one forward."""
        ready = self.ahead.answer(item, self.max_len)
        if ready is None:
            return False
        slot = self.slots[item.key]
        out.tokens = ready.tail
        if ready.q is not None:
            out.q_width, out.q_ids, out.q_probs = ready.q
        # Held then: the appended tokens and every prepared guess but the last.
        out.length = item.rollback_to + len(item.append) + len(ready.tail) - 1
        self.prefixes.took(item.key, slot, item.rollback_to, [*item.append, *ready.tail[:-1]])
        if not ready.cached:
            if rewritten is None or rewritten[0] != ready.intact:  # nothing to feed it from: hold the chain's start
                out.length = ready.intact
                self.cache.set_length(slot, out.length)
                self.prefixes.took(item.key, slot, out.length, [])
                return True
            start, held = rewritten
            tokens = [*held[: item.rollback_to - start], *item.append, *ready.tail[:-1]]
            self.model.hidden(torch.tensor([tokens], dtype=torch.int64), self.cache, torch.tensor([slot]),
                              torch.tensor([start]), last_only=True)
        self.cache.set_length(slot, out.length)
        self.plans[item.key] = _Plan(out.length, len(ready.tail), ready.tail, ready.seconds, item.sampling)
        return True

    @torch.inference_mode()
    def work_ahead(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Drafts the next round of every chain of the latest call (draft_service/work_ahead.py):
        from its reported length, its last guess fed, the bonus guess, then as many guesses as the row
        asked for this round (a sampling row's draws, at the positions and with the keys a fresh
        round would use, and their q). Then, for greedy rows, as ``ahead.outcomes`` asks, the round
        after each shorter kept part of the chain c_1..c_k and the draft's runner-up r_{k+1} where
        it stops, one batched call per k, the largest k first: each writes from its own position on,
        so each reads only positions no other outcome's work wrote. ``stop()`` is read before each
        forward after the first."""
        plans, self.plans = self.plans, {}
        live = {key: plan for key, plan in plans.items()
                if (slot := self.slots.get(key)) is not None and self.cache.length(slot) == plan.length}
        for outcome in [None, *reversed(range(self.ahead.outcomes - 1))]:  # None: the whole chain
            rows, steps = [], []
            for key, (length, gamma, chain, seconds, sampling) in live.items():
                start = length - gamma + 1  # where the chain's first guess sits
                if outcome is None:  # its last guess fed, then the bonus guess and the next round
                    item, n = ProposeItem(key, length, [chain[-1]], gamma + 1, sampling), gamma + 1
                elif outcome < len(seconds):  # chain[:outcome] kept, the runner-up after it (greedy rows)
                    item, n = ProposeItem(key, start + outcome, [seconds[outcome]], gamma, GREEDY), gamma
                else:
                    continue
                if item.rollback_to + 1 + n <= self.max_len:
                    rows.append((key, item, self.slots[key]))
                    steps.append(n)
            if not rows:  # no chain reaches this guess: the next outcome's may
                continue
            if stop():
                return
            guesses, picker = self._guess(rows, steps, stop, second=self.ahead.outcomes > 1)
            tables = picker.tables()
            for b, ((key, item, _), n, tokens) in enumerate(zip(rows, steps, guesses)):
                plan = live[key]
                start = plan.length - plan.gamma + 1
                tokens, seconds = tokens[:n], picker.seconds(b)[:n]
                if outcome is None:  # the bonus guess is appended; the rest is the tail
                    # The bonus guess's q row is not sent: the target samples there.
                    ready = Prepared(item.rollback_to, [*item.append, tokens[0]], tokens[1:], intact=start,
                                     seconds=seconds[1:], sampling=item.sampling, q=q_rows(tables, b, 1, len(tokens)))
                else:
                    ready = Prepared(item.rollback_to, item.append, tokens, whole=False, intact=start, seconds=seconds)
                    self.rewritten[key] = (start, plan.chain[: plan.gamma - 1])
                if ready.tail:
                    self.ahead.keep(key, ready)

    def _sync(self, item: ProposeItem) -> tuple[int | None, int]:
        """The sequence's slot rolled back to ``rollback_to``, and how many of its tokens the slot
        holds now (a first item: those of a cached prefix restored, draft_service/prefix_state.py);
        (None, 0) when its state is gone, the item cannot be held, or no slot is free."""
        if not item.append or item.rollback_to + len(item.append) > self.max_len \
                or max(item.append) >= self.model.config.vocab_size \
                or bad_claim(item):
            self.release([item.key])
            return None, 0
        if item.rollback_to == 0:  # a (re)start: what it held is kept for what it shares
            self.release([item.key])
            return self.prefixes.start(item, self.slots)
        slot = self.slots.get(item.key)
        if slot is None or item.rollback_to > self.cache.length(slot):
            self.release([item.key])
            return None, 0
        self.cache.set_length(slot, item.rollback_to)
        return slot, item.rollback_to

    def _guess(self, rows: list[tuple[Hashable, ProposeItem, int]], gammas: list[int],
               stop: Callable[[], bool] | None = None, second: bool = False,
               grammars: list[GrammarRow | None] | None = None,
               penalties: list[PenaltyRow | None] | None = None) -> tuple[list[list[int]], _Picker]:
        """Appends each row's tokens, then decodes max(gammas) tokens for all rows at once;
        returns each row's guesses and the picker that chose them (the q tables of sampling rows,
        the runner-ups of rows that may branch). When ``stop()`` turns true, fewer: the guesses
        made before it. ``grammars``: per row its matcher (constrained rows guess masked);
        ``penalties``: per row its counts (penalised rows guess from penalised logits)."""
        batch, steps = len(rows), max(gammas)
        device = self.model.device
        picker = _Picker([item for _, item, _ in rows], steps, self.q_support, device, self.model.output_token_ids,
                         second)
        if grammars is not None:
            picker.grammars = list(grammars)
        if penalties is not None:
            picker.penalties, picker.vocab = list(penalties), self.vocab_size
        head = self.model.output_head
        first = torch.empty(batch, dtype=torch.int64, device=device)  # [B]
        by_len: dict[int, list[int]] = defaultdict(list)
        for b, (_, item, _) in enumerate(rows):
            by_len[len(item.append)].append(b)
        for length, members in by_len.items():  # rows appending equally many tokens share a forward
            ids = torch.tensor([rows[b][1].append for b in members], dtype=torch.int64)  # [b, length]
            slots = torch.tensor([rows[b][2] for b in members], dtype=torch.int64)
            start = torch.tensor([rows[b][1].rollback_to for b in members], dtype=torch.int64)
            hidden = self.model.hidden(ids, self.cache, slots, start, last_only=True)  # [b, 1, H]
            first[members] = picker.pick(Hidden(hidden[:, -1], head), members, 0)
        slots = torch.tensor([slot for _, _, slot in rows], dtype=torch.int64)  # [B]
        pos = torch.tensor([item.rollback_to + len(item.append) for _, item, _ in rows], dtype=torch.int64)
        guesses = [first]
        everyone = list(range(batch))
        # Tokens stay on the device between draft steps; one host transfer at the end. A row whose
        # γ is smaller than the batch's keeps being fed; its extra positions lie past its length
        # (clamped to the last cache position, which that row never counts as valid).
        for step in range(1, steps):
            if stop is not None and stop():
                break
            hidden = self.model.hidden(guesses[-1][:, None], self.cache, slots, pos.clamp(max=self.max_len - 1))
            guesses.append(picker.pick(Hidden(hidden[:, -1], head), everyone, step))  # [B]
            pos = pos + 1
        return torch.stack(guesses, dim=1).tolist(), picker  # [B, max gamma]


class _Plan(NamedTuple):
    """A row of the latest call, to draft ahead from: the length it reported (the appended
    tokens and every guess but the last), its γ, the chain it proposed, the draft's runner-up
    at each of its guesses (greedy rows), and its sampling settings."""

    length: int
    gamma: int
    chain: list[int]
    seconds: list[int]
    sampling: SamplingParams = GREEDY


def _truncated_q(scores: Hidden, params: list[SamplingParams], support: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, q) [s, K] as ``truncate(process_logits(...), support)`` gives them, from the fused
    kernels: the cut thresholds and the K largest scores (kernels/nbest.py), no logits built. The
    truncated q renormalises, so it is softmax(score / T) over the kept ones among those K."""
    width = min(support, scores.head.vocab)
    threshold = kernels.cut_thresholds(scores, params)  # [s]
    values, ids, _ = top_scores(scores, width)  # [s, K] raw scores, best first
    inv_t = torch.tensor([1.0 / p.temperature for p in params], dtype=torch.float32, device=values.device)
    scaled = torch.where(values >= threshold[:, None], values * inv_t[:, None], float("-inf"))  # [s, K]
    return ids, torch.softmax(scaled, dim=-1)


def q_rows(tables: tuple[int, list[list[int]], list[list[float]]], b: int, first: int, stop: int
           ) -> tuple[int, list[int], list[float]] | None:
    """Row b's q rows of guesses first..stop-1 as (width, ids, probs), from ``_Picker.tables()``;
    None for a greedy row."""
    width, ids, probs = tables
    if not ids[b]:
        return None
    return width, ids[b][first * width : stop * width], probs[b][first * width : stop * width]


def node_tables(ids: list[int], probs: list[float], width: int, tokens: list[int], parents: list[int]
                ) -> tuple[list[int], list[float]]:
    """A sampling row's q rows (of ``width``) per token sent: its chain's, then per branch the row
    of the depth it was drawn at (its parent's: it is a sibling of the chain token there)."""
    chain = chain_length(parents, len(tokens))
    out_ids, out_probs = ids[: chain * width], probs[: chain * width]  # copies
    for parent in parents[chain:]:
        out_ids += ids[parent * width : (parent + 1) * width]
        out_probs += probs[parent * width : (parent + 1) * width]
    return out_ids, out_probs


class _Picker:
    """Chooses each guess: argmax for greedy rows, x ~ truncated q for sampling rows (keeping q)."""

    def __init__(self, items: list[ProposeItem], steps: int, support: int, device: torch.device,
                 output_ids: torch.Tensor | None = None, second: bool = False) -> None:
        self.params = [item.sampling for item in items]
        # A draft over a vocabulary subset picks logit columns; output_ids [N] maps them to token ids.
        self.output_ids = output_ids
        self.sampling = [b for b, p in enumerate(self.params) if not p.greedy]
        self.support = support
        # Rows that may branch: per row, per guess, (values, ids) of its best few (greedy: their
        # log-probabilities; sampling: the guess's log q, then the runner-ups' race scores).
        self.branches = [item.branches for item in items]
        # ``second``: greedy rows keep at least their runner-up per guess, branching or not (working
        # ahead on the other outcomes, draft_service/work_ahead.py).
        self.keep = [max(item.branches, int(second)) if item.sampling.greedy else item.branches for item in items]
        self.runners_up: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in items]
        # Guess j of a row lands at position rollback_to + len(append) + j of its sequence.
        self.starts = [item.first_guess for item in items]
        # min_tokens: the ids each row masks where its guesses land before the item's masked_until.
        self.masks = [(item.masked_ids, item.masked_until) for item in items]
        # Constrained rows: the draft's matcher of each (draft_service/grammar_state.py), which masks
        # its guesses and takes each one it picks; None: free text.
        self.grammars: list[GrammarRow | None] = [None] * len(items)
        # Penalised rows: the draft's count of each (draft_service/penalty_state.py), which penalises
        # its logits as the target's are there and takes each guess it picks; None: no penalties.
        # ``vocab``: the tokenizer's ids, over which the counts are kept.
        self.penalties: list[PenaltyRow | None] = [None] * len(items)
        self.vocab = 0
        self._columns: dict[int, int] | None = None  # token id -> logit column (a subset head's)
        if not self.sampling:
            return
        self.q_ids = torch.zeros(len(items), steps, support, dtype=torch.int64, device=device)  # [B, G, K]
        self.q_probs = torch.zeros(len(items), steps, support, dtype=torch.float32, device=device)  # [B, G, K]

    def pick(self, scores: Hidden, members: list[int], step: int) -> torch.Tensor:
        """The final hidden states [b, H] (with the head) of the rows `members` at guess `step` ->
        tokens [b]. On the Triton backend greedy rows take the fused 1-best and sampling rows their
        truncated q from the fused n-best (a support wider than its 64 builds their logits); on the
        torch backend every row's logits are built."""
        masked = self._masked(members, step)  # [(i, columns)]: rows that may not guess some ids here
        constrained = any(self.grammars[b] is not None for b in members)
        penalised = [(i, self.penalties[b]) for i, b in enumerate(members) if self.penalties[b] is not None]
        if kernels.backend(scores.states) == "torch" or masked or constrained or penalised:
            logits = scores.logits()  # [b, V or N]
            for i, row in penalised:  # first, as the target's settle: then min_tokens' and the grammar's masks
                row.apply(logits[i], self.vocab, self.output_ids)
            for i, columns in masked:  # processed as the target processes its own: those ids get no mass
                logits[i, columns] = float("-inf")
            refused = self._refused(members, logits.shape[-1]) if constrained else None  # [b, V or N] or None
            if refused is not None:
                logits.masked_fill_(refused.to(logits.device), float("-inf"))
            tokens = kernels.argmax(logits)  # [b] logit columns
        else:
            logits = None
            tokens = kernels.best_token(scores)[0]  # [b] logit columns, no logits built
        if self.output_ids is not None:
            tokens = self.output_ids[tokens]  # [b] token ids
        self._keep_runners_up(scores, logits, members)
        local = [i for i, b in enumerate(members) if not self.params[b].greedy]
        if not local:
            return self._feed(members, tokens)
        rows = [members[i] for i in local]
        # q lives on the draft's columns (a subset of the vocabulary is fine: the target verifies
        # against exactly the q that was sampled from, whatever its support).
        params = [self.params[b] for b in rows]
        if logits is None and self.support <= MAX_K:
            ids, q = _truncated_q(Hidden(scores.states[local], scores.head), params, self.support)  # [s, K]
        else:
            picked = logits[local] if logits is not None else scores.head.logits(scores.states[local])  # [s, V or N]
            ids, q = truncate(process_logits(picked, params), self.support)  # [s, K]: exactly what is sampled from and sent
        if self.output_ids is not None:
            ids = self.output_ids[ids]  # [s, K] token ids
        keys = row_keys([p.seed for p in params], [self.starts[b] + step for b in rows], SAMPLE, ids.device)  # [s]
        won = race(q, keys, ids)  # [s] columns
        tokens[local] = ids.gather(1, won[:, None]).squeeze(1)
        self._keep_next_draws(rows, ids, q, keys, won)
        width = ids.shape[1]
        self.q_ids[rows, step, :width] = ids
        self.q_probs[rows, step, :width] = q
        return self._feed(members, tokens)

    def _refused(self, members: list[int], width: int) -> torch.Tensor | None:
        """bool [b, width] (logit columns): what the grammars of the constrained rows among
        ``members`` refuse at their next guess; None when no row is masked here."""
        chosen = [(i, self.grammars[b]) for i, b in enumerate(members) if self.grammars[b] is not None]
        if not chosen:
            return None
        allowed = allowed_rows([row for _, row in chosen])
        if all(a is None for a in allowed):
            return None
        refused = np.zeros((len(members), width), dtype=bool)
        ids = self.output_ids.cpu().numpy() if self.output_ids is not None else np.arange(width)  # column -> token id
        for (i, _), ok in zip(chosen, allowed):
            if ok is None:
                continue
            row = ~(ok[np.minimum(ids, len(ok) - 1)] & (ids < len(ok)))
            if not row.all():  # a subset head that holds none of the allowed ids guesses unmasked
                refused[i] = row
        return torch.from_numpy(refused) if refused.any() else None

    def _feed(self, members: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """The constrained rows' matchers and the penalised rows' counts take the guesses just
        picked (``tokens`` [b], returned)."""
        fed = [(i, self.grammars[b]) for i, b in enumerate(members) if self.grammars[b] is not None]
        counted = [(i, self.penalties[b]) for i, b in enumerate(members) if self.penalties[b] is not None]
        if fed or counted:
            picked = tokens.tolist()
            for i, row in fed:
                if row.live:
                    row.take([picked[i]])
            for i, row in counted:
                row.take([picked[i]])
        return tokens

    def _masked(self, members: list[int], step: int) -> list[tuple[int, list[int]]]:
        """(i, logit columns) for each row members[i] whose guess ``step`` lands where the target
        masks some ids (ProposeItem.masked_at); ids a subset head cannot guess need no column."""
        out = []
        for i, b in enumerate(members):
            ids, until = self.masks[b]
            if ids and self.starts[b] + step < until:
                if self.output_ids is None:
                    out.append((i, sorted(ids)))
                    continue
                if self._columns is None:
                    self._columns = {int(t): c for c, t in enumerate(self.output_ids.tolist())}
                out.append((i, sorted(self._columns[t] for t in ids if t in self._columns)))
        return out

    def _keep_runners_up(self, scores: Hidden, logits: torch.Tensor | None, members: list[int]) -> None:
        """For the rows that may branch: this guess's best branches + 1 tokens and log-probabilities."""
        local = [i for i, b in enumerate(members) if self.keep[b] > 0 and self.params[b].greedy]
        if not local:
            return
        picked = logits[local] if logits is not None else scores.head.logits(scores.states[local])  # [r, V or N]
        k = min(max(self.keep[members[i]] for i in local) + 1, picked.shape[-1])
        values, ids = torch.topk(torch.log_softmax(picked.float(), dim=-1), k)  # [r, k] best first
        if self.output_ids is not None:
            ids = self.output_ids[ids]  # [r, k] token ids
        for row, i in enumerate(local):
            b = members[i]  # its own branches + 1, whichever rows shared this call: the same width every guess
            self.runners_up[b].append((values[row, : self.keep[b] + 1], ids[row, : self.keep[b] + 1]))

    def _keep_next_draws(self, rows: list[int], ids: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
                         won: torch.Tensor) -> None:
        """For the sampling rows that may branch: the race that drew this guess (ids, q [s, K], keys
        [s], its winning columns won [s]) run on: the next finishers, draws without replacement
        from q. Kept as (log q of the guess, then the runner-ups' race scores (-inf: q has no more
        tokens)), (the guess, then the runner-ups), in the order drawn."""
        local = [i for i, b in enumerate(rows) if self.branches[b] > 0]
        if not local:
            return
        # The race's own scores (kernels/random.py ``race``): log q + the noise of each (key, id).
        score = torch.where(q > 0, torch.log(q.double()) + gumbel(keys, ids), float("-inf"))  # [s, K]
        at = won[:, None]
        guess_logq = torch.log(q.double().gather(1, at))  # [s, 1]
        k = min(max(self.branches[rows[i]] for i in local), score.shape[1] - 1)
        values, columns = torch.topk(score.scatter(1, at, float("-inf")), k)  # [s, k] in race order
        values = torch.cat([guess_logq, values], dim=1)  # [s, k + 1]
        drawn = torch.cat([ids.gather(1, at), ids.gather(1, columns)], dim=1)  # [s, k + 1] token ids
        for i in local:
            b = rows[i]
            self.runners_up[b].append((values[i, : self.branches[b] + 1], drawn[i, : self.branches[b] + 1]))

    def seconds(self, b: int) -> list[int]:
        """Greedy row b's runner-up per guess so far (its best token after the guess; a picker
        built with ``second``), [] when none were kept."""
        kept = self.runners_up[b]
        if not kept or kept[0][1].numel() < 2:
            return []
        return torch.stack([ids[1] for _, ids in kept]).tolist()

    def tree(self, b: int, chain: list[int]) -> tuple[list[int], list[int]]:
        """Row b's proposal: (tokens, parents), its chain then its best branches (``parents`` empty:
        a chain). A branch at depth j is a runner-up to chain[j], child of node j (0: the root)."""
        budget, kept = self.branches[b], self.runners_up[b][: len(chain)]
        if budget <= 0 or not kept:
            return chain, []
        if not self.params[b].greedy:
            return self._sampled_tree(chain, budget, kept)
        # [depth, k] each: one host transfer for the row, not one per guess
        all_logp = torch.stack([values for values, _ in kept]).tolist()
        all_ids = torch.stack([ids for _, ids in kept]).tolist()
        options, prefix = [], 0.0
        for j, (logp, tokens) in enumerate(zip(all_logp, all_ids)):
            for value, token in zip(logp, tokens):
                if token != chain[j]:
                    options.append((prefix + value, j, token))
            prefix += logp[tokens.index(chain[j])] if chain[j] in tokens else logp[0]
        chosen = sorted(sorted(options, reverse=True)[:budget], key=lambda o: (o[1], -o[0]))
        return chain + [token for _, _, token in chosen], list(range(len(chain))) + [j for _, j, _ in chosen]

    @staticmethod
    def _sampled_tree(chain: list[int], budget: int, kept: list[tuple[torch.Tensor, torch.Tensor]]
                      ) -> tuple[list[int], list[int]]:
        """A sampling row's tree: at depth j its runner-ups in the order drawn, as many as the
        budget gives depth j when each depth's next runner-up is worth the chance of reaching j
        (the chain's q up to it) times the chance the guess there is refused (1 − q(guess)),
        halved per runner-up already taken there. Values read the chain only, so the number of
        runner-ups at a depth does not depend on which tokens they are."""
        all_values = torch.stack([values for values, _ in kept]).tolist()  # [depth, k + 1]
        all_ids = torch.stack([ids for _, ids in kept]).tolist()
        options, prefix = [], 0.0
        for j, (values, tokens) in enumerate(zip(all_values, all_ids)):
            refused = prefix + math.log1p(-min(math.exp(values[0]), 1.0 - 1e-9))
            for rank in range(1, len(values)):
                if values[rank] == float("-inf"):  # q has no more tokens here
                    break
                options.append((refused - rank * math.log(2.0), j, rank, tokens[rank]))
            prefix += values[0]
        chosen = sorted(sorted(options, reverse=True)[:budget], key=lambda o: (o[1], o[2]))
        return chain + [token for *_, token in chosen], list(range(len(chain))) + [j for _, j, _, _ in chosen]

    def tables(self) -> tuple[int, list[list[int]], list[list[float]]]:
        """(width, ids, probs): per row, its [G, width] q table flattened row-major; width is the
        largest support of any guess in the batch (tokens past it have no mass); [] for greedy rows."""
        empty: list[list] = [[] for _ in self.params]
        if not self.sampling:
            return 0, empty, empty
        rows = torch.tensor(self.sampling)
        probs = self.q_probs[rows]  # [s, G, K]
        width = int((probs > 0).sum(dim=-1).max())
        ids, probs = self.q_ids[rows, :, :width].flatten(1).tolist(), probs[:, :, :width].flatten(1).tolist()
        out_ids, out_probs = list(empty), list(empty)
        for i, b in enumerate(self.sampling):
            out_ids[b], out_probs[b] = ids[i], probs[i]
        return width, out_ids, out_probs
