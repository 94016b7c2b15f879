"""A prefix cache: a new sequence starts from K/V already computed for the same prefix.

The target keeps one over its KV cache (specstream/models/kv_cache.py), and each draft model one
over its own (draft_service/prefix_state.py: a token draft's KV cache, a feature head's cache,
whose slots are never read by another, so a draft copies a prefix where the target forks it).

What is cached: the slots of finished sequences (``retire``), kept with the tokens whose K/V they
hold, and the prompts of running ones (``add_live``, once their prefill is done). What is shared:
full blocks of ``specstream.data.prefix.BLOCK`` tokens, found by their hash-chain keys (which
start from the request's cache salt) and checked token for token before use; a prompt's last
token is always computed, since its logits give the first generated token.

How a hit is served, by the KV cache's own means (specstream/models/kv_cache.py):

- **take over**: a finished sequence's slot that the new prompt continues to within a block (the
  next turn of a conversation, an agent's next call) becomes the new sequence's slot: no copy,
  its length set back to the match, everything past it rewritten by the prefill;
- **fork**: otherwise (a shared system prompt, a running sequence's prompt) the new slot reads the
  matched positions from the slot that holds them through its source table, as beams share their
  prompt. Nothing is ever written where another sequence reads: writes go past a slot's table,
  and a slot still read by others is held until the last reader lets go (reference counts).

So a block is never copied and never written while shared ("full blocks only": a partial last
block is recomputed). Finished slots are kept up to ``capacity``; the least recently used is
evicted when a new one is kept or a slot is needed, those read by no one first. A feature draft
needs the target's features of every position it catches up on: an entry keeps the features its
sequence kept, and a sequence that will draft with such a draft only reuses an entry that has them
(else it is a miss: the prefix is recomputed, never decoded without its features).

Exactness: our forwards are row-invariant (a position's K/V and features are the same bits in a
prefill chunk, a decode step or a verify window), so a sequence served from the cache gives the
tokens and draws it gives with the cache off (tests/test_prefix_cache.py).

What it does not know: sequences, requests, or whose cache it is. The target's engine
(target_service/engine.py) calls it at admission, after a prefill and at retirement, on its event
loop between forwards; a draft calls it from its proposer, between its forwards. ``kv`` needs only
``has_readers(slot)`` and ``free(slot)``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from specstream.data.prefix import BLOCK, block_keys, reusable_blocks
from specstream.models.kv_cache import KVCache

__all__ = ["Hit", "PrefixCache", "capacity_for"]

MEMORY_SHARE = 0.25  # of the memory available at start-up, at most, for the kept slots (by default)


def capacity_for(asked: int, max_slots: int, model, max_len: int) -> int:
    """Slots to keep finished sequences in: ``asked`` (TargetConfig.prefix_cache_slots) unless -1,
    which is ``max_slots`` where a quarter of the memory available now holds them (fewer where not)."""
    if asked >= 0:
        return asked
    c = model.config
    slot_bytes = 2 * c.num_layers * c.num_kv_heads * max_len * c.head_dim * model.dtype.itemsize  # K and V
    return max(0, min(max_slots, int(MEMORY_SHARE * _available_bytes(model.device) // slot_bytes)))


def _available_bytes(device) -> int:
    """Memory available for new allocations on ``device``: the GPU's free memory, or the host's
    MemAvailable (the free pages where /proc/meminfo cannot be read)."""
    import os

    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(eq=False)
class _Entry:
    slot: int
    tokens: list[int]  # the tokens whose K/V the slot holds at positions 0..len-1: full blocks
    salt: str
    keys: list[bytes]  # one per block of ``tokens``
    features: bytes | None  # a feature draft's features of positions 0..len-1; None: not kept
    row: int  # bytes per position of ``features``
    live: bool  # a running sequence's prompt: its owner's slot, never evicted
    used: int = 0  # when last matched or kept (the LRU order)


@dataclass
class Hit:
    slot: int  # the slot holding the prefix
    length: int  # tokens reused: a multiple of BLOCK
    take_over: bool  # the slot becomes the new sequence's (else it is forked)
    features: bytes  # the prefix's features (b"" when not needed)


class PrefixCache:
    def __init__(self, kv: KVCache, capacity: int) -> None:
        """``capacity``: finished sequences' slots kept at most."""
        self.kv = kv
        self.capacity = capacity
        self.entries: dict[int, _Entry] = {}  # by slot
        self.index: dict[bytes, dict[int, None]] = {}  # block key -> slots holding that prefix (in order)
        self._clock = itertools.count(1)
        # Counters (the engine exports them): prompts looked up and their reusable tokens, hits and
        # the tokens they reused.
        self.queries = self.query_tokens = self.hits = self.hit_tokens = 0

    # ----- lookup -----------------------------------------------------------------------------
    def lookup(self, prompt: list[int], salt: str, feature_row: int = 0) -> Hit | None:
        """The longest cached prefix of ``prompt`` under ``salt`` (None: a miss), with its features
        when ``feature_row`` (bytes per position) is not 0. Counted."""
        blocks = reusable_blocks(len(prompt))
        self.queries += 1
        self.query_tokens += blocks * BLOCK
        keys = block_keys(prompt, salt, blocks) if blocks and self.entries else []
        found = 0
        while found < len(keys) and keys[found] in self.index:
            found += 1
        for n in range(found, 0, -1):  # the longest block whose holder checks out
            for slot in reversed(self.index[keys[n - 1]]):
                entry = self.entries[slot]
                length = n * BLOCK
                if (entry.salt != salt or entry.tokens[:length] != prompt[:length]
                        or (feature_row and (entry.features is None or entry.row != feature_row))):
                    continue
                entry.used = next(self._clock)
                self.hits += 1
                self.hit_tokens += length
                take_over = not entry.live and not self.kv.has_readers(slot) and length + BLOCK >= len(entry.tokens)
                features = entry.features[:length * feature_row] if feature_row and entry.features else b""
                return Hit(slot, length, take_over, features)
        return None

    def take(self, hit: Hit) -> int:
        """A take-over hit's slot, now the caller's (out of the cache)."""
        self._remove(self.entries[hit.slot])
        return hit.slot

    # ----- what is cached -------------------------------------------------------------------
    def add_live(self, slot: int, tokens: list[int], salt: str, features: bytearray | None, row: int) -> None:
        """A running sequence's prompt, whose K/V is complete: others may fork it from now on
        (its positions before its length are never rewritten)."""
        self._add(slot, tokens, salt, features, row, live=True)

    def retire(self, slot: int, tokens: list[int], salt: str, features: bytearray | None, row: int) -> bool:
        """A finished sequence's slot, holding the K/V of ``tokens`` (its committed length), with
        the features of ``row`` bytes a position it kept: kept (True) or not (False: the caller
        frees it)."""
        self.drop(slot)
        if self.capacity == 0 or len(tokens) < BLOCK:
            return False
        while self.retained >= self.capacity and self.evict():
            pass
        return self._add(slot, tokens, salt, features, row, live=False)

    def drop(self, slot: int) -> None:
        """The slot's entry, if any, is gone (its sequence failed, or it is freed by its owner)."""
        entry = self.entries.pop(slot, None)
        if entry is not None:
            self._unindex(entry)

    def can_take(self, slot: int) -> bool:
        """Whether a hit on ``slot`` may take it over: a finished sequence's, read by no other slot."""
        entry = self.entries.get(slot)
        return entry is not None and not entry.live and not self.kv.has_readers(slot)

    def evict(self, keep: int | None = None) -> bool:
        """Frees the least recently used finished slot (but ``keep``), one read by no other first;
        False when there is none."""
        kept = [e for e in self.entries.values() if not e.live and e.slot != keep]
        if not kept:
            return False
        victim = min(kept, key=lambda e: (self.kv.has_readers(e.slot), e.used))
        self._remove(victim)
        self.kv.free(victim.slot)  # held back by the KV cache while other slots still read it
        return True

    @property
    def retained(self) -> int:
        return sum(not e.live for e in self.entries.values())

    def freeable(self, pinned: set[int]) -> int:
        """Slots that evicting would free now: kept ones that no running sequence reads (``pinned``)."""
        return sum(not e.live and e.slot not in pinned for e in self.entries.values())

    def clear(self) -> None:
        """Frees every kept slot and forgets the running ones (their owners free them)."""
        for entry in list(self.entries.values()):
            self._remove(entry)
            if not entry.live:
                self.kv.free(entry.slot)

    # ----- internals ------------------------------------------------------------------------
    def _add(self, slot: int, tokens: list[int], salt: str, features: bytearray | None, row: int,
             live: bool) -> bool:
        self.drop(slot)
        length = len(tokens)
        if features is not None and row:
            length = min(length, len(features) // row)  # positions whose features are kept
        length -= length % BLOCK
        if length == 0:
            return False
        kept = bytes(features[:length * row]) if features is not None and row else None
        entry = _Entry(slot, list(tokens[:length]), salt, block_keys(tokens, salt, length // BLOCK), kept,
                       row if kept is not None else 0, live, next(self._clock))
        self.entries[slot] = entry
        for key in entry.keys:
            self.index.setdefault(key, {})[slot] = None
        return True

    def _remove(self, entry: _Entry) -> None:
        self.entries.pop(entry.slot, None)
        self._unindex(entry)

    def _unindex(self, entry: _Entry) -> None:
        for key in entry.keys:
            slots = self.index.get(key)
            if slots is not None:
                slots.pop(entry.slot, None)
                if not slots:
                    del self.index[key]
