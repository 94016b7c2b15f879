"""A draft model's prefix cache: a new sequence continues from the state an earlier one left.

The target's prefix cache gives a new sequence the K/V of a prefix it computed before; this gives
the draft the same. A released sequence's slot is kept with the tokens whose state it holds, and a
running sequence's prompt is indexed once its state is complete: by the same hash-chain keys over
full blocks of ``specstream.data.prefix.BLOCK`` tokens and the cache salt, in the same class
(specstream/models/prefix_cache.py). A new sequence's first item (rollback_to 0) is looked up by
its tokens and salt, and its longest cached prefix is restored: the kept slot is taken over (the
conversation's next turn, an agent's next call) or its positions are copied into a fresh slot (a
shared system prompt, ``n`` samples of one prompt: the draft's caches are small, one layer for a
feature head, so a copy costs little and nothing is ever shared or written under a reader).

What the target saves: it sends no features for the tokens it expects the draft to hold
(``ProposeItem.cached_prefix``: its own cache's hit), and the draft computes nothing for them. A
draft that holds fewer (its slot was evicted, the last pass's tokens never reached it, it
restarted) restores what it has, guesses nothing and answers that length; the target sends the
rest on its next call. Never a wrong state: a prefix is reused only where its tokens and salt
match, and the state kept is only what the target's own tokens and features made.

Kept slots are the draft's idle ones: a sequence that needs a slot evicts the least recently used
kept one, so the cache costs no memory beyond the draft's ``max_slots``.

Exactness: the draft's forwards are row-invariant as the target's are (a position's K/V is the same
bits however it was computed), so a restored state is the state a fresh prefill makes: proposals,
and so the target's draws, are the same with the draft's cache or without (tests/test_draft_prefix.py).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace
from typing import Protocol

from specstream.data.propose import ProposeItem
from specstream.models.prefix_cache import PrefixCache

__all__ = ["DraftPrefixes", "Slots", "bad_claim", "resumed"]


class Slots(Protocol):
    """A draft's per-sequence cache (specstream/models/kv_cache.py ``KVCache``, feature_head.py ``HeadCache``)."""

    def alloc(self) -> int | None: ...

    def free(self, slot: int) -> None: ...

    def has_readers(self, slot: int) -> bool: ...

    def copy_prefix(self, src: int, dst: int, n: int) -> None: ...

    @property
    def num_free(self) -> int: ...


class DraftPrefixes:
    def __init__(self, slots: Slots, capacity: int, lag: int = 0) -> None:
        """``capacity``: released sequences' slots kept at most (0: none, and nothing is looked up);
        ``lag``: how many fewer cache positions than tokens a sequence's state has (a feature head:
        one, its position t reads token t + 1)."""
        self.slots = slots
        self.cache = PrefixCache(slots, capacity) if capacity else None
        self.lag = lag
        self.tokens: dict[Hashable, list[int]] = {}  # per held sequence: the tokens its slot holds the state of
        self.salts: dict[Hashable, str] = {}
        self.prompts: dict[Hashable, int] = {}  # per held sequence whose prompt is not offered yet: its length

    @property
    def retained(self) -> int:
        return self.cache.retained if self.cache is not None else 0

    def alloc(self, keep: int | None = None) -> int | None:
        """A free slot, the least recently used kept one (but ``keep``) evicted where none is free."""
        slot = self.slots.alloc()
        while slot is None and self.cache is not None and self.cache.evict(keep):
            slot = self.slots.alloc()
        return slot

    def restore(self, item: ProposeItem) -> tuple[int | None, int]:
        """For a first item (rollback_to 0) of a sequence the draft holds no slot for: its slot (None:
        none free) and how many leading tokens of ``append`` the slot already holds the state of
        (a multiple of BLOCK, leaving at least one token to take in; its length is set to them)."""
        self.salts[item.key] = item.cache_salt
        self.tokens[item.key] = []
        self.prompts[item.key] = item.output_start
        hit = self.cache.lookup(item.append, item.cache_salt) if self.cache is not None and self.cache.entries \
            else None
        if hit is None:
            return self.alloc(), 0
        positions = hit.length - self.lag
        self.tokens[item.key] = list(item.append[:hit.length])
        if hit.take_over:
            slot = self.cache.take(hit)
            self.slots.copy_prefix(slot, slot, positions)  # sets the length (nothing copied)
        else:
            slot = self.alloc(keep=hit.slot)
            if slot is None:
                return None, 0
            self.slots.copy_prefix(hit.slot, slot, positions)
        return slot, hit.length

    def start(self, item: ProposeItem, slots: dict[Hashable, int]) -> tuple[int | None, int]:
        """``restore`` for a proposer's first item, its slot recorded in ``slots``."""
        slot, held = self.restore(item)
        if slot is not None:
            slots[item.key] = slot
        return slot, held

    def took(self, key: Hashable, slot: int, rollback_to: int, appended: list[int]) -> None:
        """The sequence's slot now holds the state of its first ``rollback_to`` tokens and then
        ``appended``. A running sequence's prompt (its first item's ``output_start`` tokens) is
        offered to others once its state is complete, in however many items it came; a prompt
        rolled back into is withdrawn (its positions are about to be rewritten)."""
        tokens = self.tokens.setdefault(key, [])
        del tokens[rollback_to:]
        tokens.extend(appended)
        if self.cache is None:
            return
        entry = self.cache.entries.get(slot)
        if entry is not None and rollback_to < len(entry.tokens):
            self.cache.drop(slot)
        elif entry is None and self.prompts.get(key, 0) and len(tokens) >= self.prompts[key]:
            self.cache.add_live(slot, tokens[:self.prompts.pop(key)], self.salts.get(key, ""), None, 0)

    def release(self, key: Hashable, slot: int | None, held: int) -> None:
        """The sequence is gone: its slot, whose state is good for its first ``held`` tokens, is
        kept for later sequences where it holds a full block, else freed."""
        tokens = self.tokens.pop(key, [])[:held]
        salt = self.salts.pop(key, "")
        self.prompts.pop(key, None)
        if slot is None:
            return
        if self.cache is None or not self.cache.retire(slot, tokens, salt, None, 0):
            if self.cache is not None:
                self.cache.drop(slot)
            self.slots.free(slot)

    def clear(self) -> None:
        if self.cache is not None:
            self.cache.clear()


def bad_claim(item: ProposeItem) -> bool:
    """A ``cached_prefix`` no item can carry: on an item that rolls back to a held position, or
    covering every token appended (at least one is always taken in)."""
    return bool(item.cached_prefix) and (item.rollback_to > 0 or item.cached_prefix >= len(item.append))


def resumed(item: ProposeItem, held: int) -> ProposeItem:
    """``item`` (rollback_to 0) as it reads for a slot that holds its first ``held`` tokens: rolled
    back to them, the rest appended. Its features are left out: a feature draft reads the last
    ``feature_count`` of those it was sent."""
    if held == 0 and not item.cached_prefix:
        return item
    return replace(item, rollback_to=held, append=item.append[held:], cached_prefix=0, features=b"")
