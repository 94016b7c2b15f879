"""Prompt lookup (or suffix drafting) where it matches, the draft model elsewhere: chosen per
sequence, every step.

Each item goes to the model-free proposer first (draft_service/ngram.py, or draft_service/suffix.py
for "suffix+model"); the items it has no guesses for are answered by ONE `DraftProposer.propose`
call over all of them, so the model's forwards stay batched. Each Proposal's `source` says which
of the two made it ("ngram" or "suffix", or "model"). Below, "the n-gram side" is either.

The model's KV cache is brought up to date lazily. The n-gram side holds every sequence's tokens;
per sequence we remember how many leading ones the model's cache holds (`model_len`, cut to
`rollback_to` whenever the target rolls back). Steps the n-gram answers do not touch the model;
when the model is next asked, it is sent rollback_to = model_len and everything after it, so a
run of n-gram steps costs the model one catch-up prefill instead of a forward per step, and
nothing at all if the sequence ends first. When the model answers, it holds the sequence and its
guesses but the last (as DraftProposer always does); the n-gram history takes those guesses too,
so both sides hold the same tokens and the reported `length` (the history's) is true of both:
the target then re-sends only what the model rejected, exactly as with the model alone.

A feature draft (draft_service/feature.py) keeps no guesses, and it reads the target's features of
every position it catches up on: the target sends each position's feature once, with its token,
so this proposer keeps them (``features``, the bytes of positions 0..len(history)-2) and hands the
model the slice its catch-up needs. Items whose features the model cannot read are refused whole.

A constrained sequence (its first item carries ``constraint``) is looked up too, from after its
forced tokens (``ProposeItem.forced``, taken as context for the lookup and not held, since a
feature model has no features for them yet: the target sends them once committed), along its
grammar (draft_service/grammar_lookup.py): the grammar's likely tokens where it allows one text,
and elsewhere the copies (a JSON answer copies names, places and addresses from its prompt, its
words matched without their leading space) up to the first the grammar refuses. A draft model
without a tokenizer leaves the lookup none: its copies then go out unmasked, and the target cuts
them at the first token the grammar refuses (target_service/grammar_rows.py: exact, as for any
guess). Where lookup has nothing, the model guesses from its distribution masked by the
grammar (draft_service/grammar_state.py): it gets the constraint on its first item for the
sequence, and every item's forced tokens to guess on from. A penalised sequence's penalties go to
the model on its first item the same way (lookup's copies are not penalised: the target verifies
them against its penalised p, as any guess).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping

from draft_service.grammar_lookup import GrammarLookup
from draft_service.ngram import NgramIndex, NgramProposer
from draft_service.proposer import DraftProposer
from draft_service.suffix import SuffixProposer, SuffixSequence
from specstream.data.propose import SOURCE as MODEL
from specstream.data.propose import Proposal, ProposeItem, Proposer, features_expected, without_masked


class NgramPlusModelProposer(Proposer):
    def __init__(self, model: DraftProposer, max_slots: int, min_n: int = 1, max_n: int = 4,
                 lookup: NgramProposer | SuffixProposer | None = None) -> None:
        """``lookup``: the model-free side (prompt lookup of ``min_n``..``max_n``-grams when None)."""
        self.model = model
        compiler = model.grammars.compiler
        self.ngram = lookup if lookup is not None else NgramProposer(
            max_slots, model.max_len, min_n, max_n, compiler.space_free_ids if compiler is not None else None)
        self.grammar = GrammarLookup(compiler)  # constrained sequences' lookup follows their grammar
        self.model_len: dict[Hashable, int] = {}  # leading tokens of the history the model's cache holds
        self.feature_width = model.feature_width
        self.feature_layers = model.feature_layers
        self.works_ahead = model.works_ahead
        # A feature draft's: the target's features held, from position feature_base on (a first
        # item's cached_prefix, claimed, brings none before it: the model restores those itself).
        self.features: dict[Hashable, bytearray] = {}
        self.feature_base: dict[Hashable, int] = {}
        # Every sequence's first item's constraint, penalties, output_start, cache salt and claimed
        # cached prefix, for the model's first item (again whenever the model holds nothing of it).
        self.firsts: dict[Hashable, dict] = {}
        self.model_asked = False  # by the latest call: only then has the model a round to work ahead on

    @property
    def name(self) -> str:
        return f"{self.ngram.name}+{self.model.name}"

    @property
    def lookup(self) -> str:
        """The lookup asked first (Proposer.lookup): it alone answers ``lookup_only`` items."""
        return self.ngram.name

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size  # the model cannot read ids past its own vocabulary

    @property
    def prefix_cache(self) -> bool:
        return self.model.prefix_cache

    @property
    def acceptance(self) -> dict[tuple[str, bool], float]:
        """The model's card's α (lookup's rows have no card: the target starts them at its own prior)."""
        return dict(self.model.acceptance)

    @property
    def max_len(self) -> int:
        return self.ngram.max_len

    @property
    def held(self) -> int:
        return self.ngram.held

    @property
    def free_slots(self) -> int:
        return min(self.ngram.free_slots, self.model.free_slots)

    def release(self, keys: list[Hashable]) -> None:
        self.ngram.release(keys)
        self.grammar.release(keys)
        self.model.release(keys)
        for key in keys:
            self.model_len.pop(key, None)
            self.features.pop(key, None)
            self.feature_base.pop(key, None)
            self.firsts.pop(key, None)

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        out = [Proposal([], 0, source=self.ngram.name) for _ in items]
        asked: list[tuple[int, NgramIndex | SuffixSequence]] = []
        model_items: list[ProposeItem] = []
        for i, item in enumerate(items):
            if self.feature_width and (error := self.model.feature_error(item)):
                self.release([item.key])
                out[i].error = error
                continue
            sequence = self.ngram.sync(item)
            if sequence is None:
                self.release([item.key])  # refused or out of sync: the model's copy is stale too
                continue
            held = self.model_len[item.key] = min(self.model_len.get(item.key, 0), item.rollback_to)
            if self.feature_width:
                self._keep_features(item)
            if item.rollback_to == 0:  # a sequence's first item (again, on a new stream)
                self.firsts[item.key] = {"constraint": item.constraint, "penalties": item.penalties,
                                         "output_start": item.output_start, "cache_salt": item.cache_salt,
                                         "cached_prefix": item.cached_prefix}
            first = self.firsts.get(item.key, {})
            gamma = min(item.gamma, self.max_len - len(sequence) - len(item.forced))
            grammar = self.grammar.sync(item, sequence.tokens)
            if gamma > 0 and grammar is not None:  # the grammar's likely tokens and lookup's, after the forced ones
                out[i].tokens = without_masked(item, self.grammar.chain(item.key, grammar, sequence, item.forced,
                                                                        gamma), [])[0]
            elif gamma > 0:  # lookup from after the forced tokens (context for the lookup only: not held)
                sequence.extend(item.forced)
                branches = item.branches if item.sampling.greedy and first.get("constraint") is None else 0
                out[i].tokens, out[i].parents = without_masked(item, *sequence.proposal(gamma, branches))
                sequence.truncate(len(sequence) - len(item.forced))
            out[i].length = len(sequence)
            if out[i].tokens or gamma <= 0 or item.lookup_only:
                continue
            # The model's first item: its constraint, penalties, salt, and the target's claim.
            starts = first if held == 0 else {}
            catch_up = {}
            if self.feature_width:
                catch_up = self._catch_up(item.key, held, starts.get("cached_prefix", 0), len(sequence))
                if catch_up is None:  # features it no longer has: the target resends the sequence whole
                    self.release([item.key])
                    out[i] = Proposal([], 0, source=MODEL)
                    continue
            # held <= rollback_to < len(sequence): the catch-up is never empty.
            model_items.append(ProposeItem(item.key, held, sequence.tokens[held:], gamma, item.sampling,
                                           branches=item.branches, masked_ids=item.masked_ids,
                                           masked_until=item.masked_until, forced=item.forced, **starts,
                                           **catch_up))
            asked.append((i, sequence))
        self.model_asked = bool(model_items)
        if model_items:
            for (i, sequence), model_item, reply in zip(asked, model_items, self.model.propose(model_items)):
                self._take(items[i], model_item, sequence, reply)
                out[i] = reply
        return out

    def work_ahead(self, stop: Callable[[], bool] = lambda: False) -> None:
        """The model works ahead on the rows it answered in the latest call (draft_service/work_ahead.py);
        its next item for a sequence is the catch-up since what it holds, as with no work ahead."""
        if self.model_asked:
            self.model_asked = False
            self.model.work_ahead(stop)

    @property
    def ahead(self):
        return self.model.ahead

    @property
    def ahead_counts(self) -> Mapping[str, int]:
        return self.model.ahead_counts

    def prepare_outcomes(self, outcomes: int) -> None:
        self.model.prepare_outcomes(outcomes)

    def _keep_features(self, item: ProposeItem) -> None:
        """Keeps the item's features: those of positions from max(rollback_to + cached_prefix - 1, 0)
        on replace what was held there (all of it on a first item, or one resent from before what was kept)."""
        row = self.feature_width * 2
        held = self.features.setdefault(item.key, bytearray())
        start, base = max(item.rollback_to + item.cached_prefix - 1, 0), self.feature_base.get(item.key, 0)
        if item.rollback_to == 0 or start < base:
            held.clear()
            self.feature_base[item.key] = base = start
        del held[(start - base) * row:]
        held += item.features

    def _catch_up(self, key: Hashable, held: int, cached: int, length: int) -> dict | None:
        """The features of a model item from ``held`` tokens (and ``cached`` it is expected to hold
        besides) to ``length``; None when they are not all kept here."""
        row = self.feature_width * 2
        start = max(held + cached - 1, 0) - self.feature_base.get(key, 0)
        if start < 0:
            return None
        count = features_expected(held + cached, length - held - cached)
        return {"features": bytes(self.features[key][start * row:(start + count) * row]),
                "feature_width": self.feature_width}

    def _take(self, item: ProposeItem, model_item: ProposeItem, sequence: NgramIndex | SuffixSequence,
              reply: Proposal) -> None:
        """Records what the model now holds; `reply` then reports what both sides hold (what the
        model holds, where it met only part of a claimed prefix: the target sends the rest)."""
        if reply.length < model_item.cached_prefix:
            self.model_len[item.key] = reply.length
            reply.source = MODEL
            return
        # What the model holds past the history: the forced tokens and its guesses but the last (a
        # token draft), nothing (a feature draft).
        fed = reply.length - len(sequence)
        if fed > 0:
            sequence.extend([*item.forced, *reply.tokens][:fed])
            assert reply.length == len(sequence), (reply.length, len(sequence))
        # With no guesses the model holds at most the history (0: it dropped the sequence).
        self.model_len[item.key] = reply.length
        reply.length = len(sequence)
        reply.source = MODEL
