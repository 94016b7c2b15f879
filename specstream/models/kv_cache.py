"""Slot-based KV cache: preallocated K/V for ``num_slots`` sequences of up to ``max_len`` tokens.

A sequence owns a slot from ``alloc`` to ``free``. The cache records one committed length per slot;
a forward pass writes K/V past that length but never changes it, so the caller commits accepted
tokens with ``set_length`` and a speculative rollback is ``set_length`` to an earlier value (O(1);
stale entries are simply overwritten by the next forward).

Shared prefixes (beam search): ``fork(src, dst)`` makes slot dst continue slot src without copying
any K/V. Each slot may have a *source table*: position p < len(table) is read from slot table[p]
(a block table with one position per block), positions past it from the slot itself. Forking
copies src's table (a list of slot numbers), never K/V, and K/V already written is never moved, so
hypotheses that fork and are pruned at every step share their prompt and common history. Writes go
to the slot's own positions past its table; a slot other tables still read outlives ``free`` until
the last reader lets go (reference counting), so freeing a pruned hypothesis never pulls K/V from
under its siblings.

What it does not know: which slots belong to which request, or how attention reads it
(``attention.py``). It does no locking: one forward at a time per cache.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache"]


class KVCache:
    """Preallocated per-slot K/V storage. A sequence owns a slot; rollback = set_length (O(1), no copies).

    ``set_length``, ``copy_prefix`` and ``free`` require an allocated slot (ValueError otherwise), to catch
    bookkeeping bugs early; ``forward`` only range-checks slots.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        for field, value in (
            ("num_layers", num_layers),
            ("num_slots", num_slots),
            ("num_kv_heads", num_kv_heads),
            ("max_len", max_len),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"KVCache: {field} must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.max_len = max_len
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        # Zeros, not empty: a batched read covers positions past a short row's length; they are masked out,
        # but masked weights are 0 and 0 * NaN garbage would still poison the output.
        self.k: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]  # per layer [num_slots, num_kv_heads, max_len, head_dim]
        self.v: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]  # per layer [num_slots, num_kv_heads, max_len, head_dim]
        self._lengths: list[int] = [0] * num_slots
        self._allocated: list[bool] = [False] * num_slots
        self._sources: list[list[int] | None] = [None] * num_slots  # per slot: where positions [0, len) live
        self._readers: list[set[int]] = [set() for _ in range(num_slots)]  # slots whose table names this one
        self._retired: list[bool] = [False] * num_slots  # freed, but still read by other slots
        # Stack popped from the end, so the lowest free slot is handed out first (keeps batches contiguous).
        self._free: list[int] = list(range(num_slots - 1, -1, -1))

    def _check_slot(self, slot: int, what: str = "slot") -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"KVCache: {what} {slot} out of range [0, {self.num_slots})")
        if not self._allocated[slot]:
            raise ValueError(f"KVCache: {what} {slot} is not allocated")

    def alloc(self) -> int | None:
        """A free slot with length 0, or None when all are taken."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._allocated[slot] = True
        self._lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Return the slot to the pool; its contents are left as garbage for the next owner to overwrite.
        While other slots' tables still read it, it is held back and joins the pool after the last one."""
        self._check_slot(slot)
        self._allocated[slot] = False
        self._lengths[slot] = 0
        self._set_sources(slot, None)
        if self._readers[slot]:
            self._retired[slot] = True
        else:
            self._free.append(slot)

    # -- shared prefixes ----------------------------------------------------------------------------------
    def fork(self, src: int, dst: int) -> None:
        """dst continues src: it reads src's committed positions where src reads them, K/V untouched,
        and gets src's length. dst's own positions from there on are its own to write."""
        self._check_slot(src, "src slot")
        self._check_slot(dst, "dst slot")
        if src == dst:
            return
        n = self._lengths[src]
        table = self._sources[src] or []
        self._set_sources(dst, table[:n] + [src] * (n - len(table)))
        self._lengths[dst] = n

    def sources(self, slot: int) -> list[int] | None:
        """The slot's source table (position p < len: K/V in slot table[p]); None when it reads only itself."""
        return self._sources[slot]

    def has_readers(self, slot: int) -> bool:
        """Whether other slots' tables read positions of this one."""
        return bool(self._readers[slot])

    @property
    def shared(self) -> bool:
        """Whether any slot reads positions from another (attention then gathers per position)."""
        return any(t is not None for t in self._sources)

    def _set_sources(self, slot: int, table: list[int] | None) -> None:
        old = self._sources[slot]
        table = table if table and any(s != slot for s in table) else None
        self._sources[slot] = table
        before = set(old or ()) - {slot}
        after = set(table or ()) - {slot}
        for src in after - before:
            self._readers[src].add(slot)
        for src in before - after:
            self._readers[src].discard(slot)
            if self._retired[src] and not self._readers[src]:
                self._retired[src] = False
                self._free.append(src)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_allocated(self, slot: int) -> bool:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"KVCache: slot {slot} out of range [0, {self.num_slots})")
        return self._allocated[slot]

    def length(self, slot: int) -> int:
        """Committed length; 0 for a free slot."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"KVCache: slot {slot} out of range [0, {self.num_slots})")
        return self._lengths[slot]

    def set_length(self, slot: int, n: int) -> None:
        """Commit (n > length) or roll back (n < length). Data is never touched; a rollback inside
        the source table shortens it (the positions past n will be the slot's own)."""
        self._check_slot(slot)
        if not 0 <= n <= self.max_len:
            raise ValueError(f"KVCache: length {n} for slot {slot} out of range [0, {self.max_len}]")
        self._lengths[slot] = n
        table = self._sources[slot]
        if table is not None and len(table) > n:
            self._set_sources(slot, table[:n])

    def keep_path(self, slot: int, base: int, nodes: list[int]) -> None:
        """After a tree verify (positions base, base+1, ... hold its nodes): the K/V of nodes[i]
        (offsets from base, increasing) move to base + i in every layer, so the accepted path lies
        where a chain would have put it. Nodes already in place are not copied."""
        self._check_slot(slot)
        moved = [(base + i, base + n) for i, n in enumerate(nodes) if n != i]
        if not moved:
            return
        if any(n < i for i, n in enumerate(nodes)) or base + max(nodes) >= self.max_len:
            raise ValueError(f"KVCache: keep_path nodes {nodes} from {base} (each at or after its place, "
                             f"inside max_len {self.max_len})")
        dst = torch.tensor([d for d, _ in moved], device=self.device)
        src = torch.tensor([s for _, s in moved], device=self.device)
        for layer in range(self.num_layers):
            for cache in (self.k[layer], self.v[layer]):
                cache[slot][:, dst] = cache[slot][:, src]  # [Hkv, n, D]: the gather is read before the write

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """dst gets src's first n positions (all layers) and length n; src is unchanged."""
        self._check_slot(src, "src slot")
        self._check_slot(dst, "dst slot")
        if not 0 <= n <= self._lengths[src]:
            raise ValueError(f"KVCache: copy_prefix n={n} out of range [0, length(src={src})={self._lengths[src]}]")
        if src != dst and n > 0:
            table = self._sources[src]
            if table is not None and any(s != src for s in table[:n]):
                raise ValueError(f"KVCache: copy_prefix from slot {src}, which reads other slots (use fork)")
            for layer in range(self.num_layers):
                self.k[layer][dst, :, :n].copy_(self.k[layer][src, :, :n])
                self.v[layer][dst, :, :n].copy_(self.v[layer][src, :, :n])
        self._set_sources(dst, None)
        self._lengths[dst] = n
