"""Slot-based KV cache: preallocated K/V for ``num_slots`` sequences of up to ``max_len`` tokens.

A sequence owns a slot from ``alloc`` to ``free``. The cache records one committed length per slot;
a forward pass writes K/V past that length but never changes it, so the caller commits accepted
tokens with ``set_length`` and a speculative rollback is ``set_length`` to an earlier value (O(1);
stale entries are simply overwritten by the next forward).

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
        """Return the slot to the pool; its contents are left as garbage for the next owner to overwrite."""
        self._check_slot(slot)
        self._allocated[slot] = False
        self._lengths[slot] = 0
        self._free.append(slot)

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
        """Commit (n > length) or roll back (n < length). Data is never touched."""
        self._check_slot(slot)
        if not 0 <= n <= self.max_len:
            raise ValueError(f"KVCache: length {n} for slot {slot} out of range [0, {self.max_len}]")
        self._lengths[slot] = n

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """dst gets src's first n positions (all layers) and length n; src is unchanged."""
        self._check_slot(src, "src slot")
        self._check_slot(dst, "dst slot")
        if not 0 <= n <= self._lengths[src]:
            raise ValueError(f"KVCache: copy_prefix n={n} out of range [0, length(src={src})={self._lengths[src]}]")
        if src != dst and n > 0:
            for layer in range(self.num_layers):
                self.k[layer][dst, :, :n].copy_(self.k[layer][src, :, :n])
                self.v[layer][dst, :, :n].copy_(self.v[layer][src, :, :n])
        self._lengths[dst] = n

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
