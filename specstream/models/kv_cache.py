"""Slot-based KV cache, the attention that reads it, and the ``CausalLM`` contract built on both.

(It also holds the few numeric helpers every architecture shares: ``ACTIVATIONS`` and ``rms_norm``.)

Contract:
- ``KVCache`` preallocates K/V for ``num_slots`` sequences of up to ``max_len`` tokens. A sequence owns a
  slot from ``alloc`` to ``free``. The cache records one committed length per slot; a forward pass writes
  K/V past that length but never changes it, so the caller commits accepted tokens with ``set_length`` and
  a speculative rollback is ``set_length`` to an earlier value (O(1), stale entries are simply
  overwritten by the next forward).
- ``CacheBatch`` is built once per forward from (cache, slots, start_pos, T): it validates the request,
  decides how each layer writes and reads the cache (slice views when possible, gathers otherwise) and
  builds the boolean attention masks once, so layers only do tensor work.
- ``CausalLM`` is the base of every model: ``new_cache`` and ``forward(input_ids, cache, slots, start_pos)``.

What it does not know: which slots belong to which request, what a committed length means for sampling,
or anything about checkpoints and weight names (models and ``loader.py`` do that). It does no locking:
one forward at a time per cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from specstream.models.config import SUPPORTED_ACTIVATIONS, ModelConfig

__all__ = ["KVCache", "CacheBatch", "CausalLM", "TensorSource", "ACTIVATIONS", "rms_norm"]

# config.json activation name -> function; the same names transformers' ACT2FN uses.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
assert set(ACTIVATIONS) == SUPPORTED_ACTIVATIONS, "config.py validates against this list"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with transformers' rounding: normalise in float32, round to x's dtype, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op on the fp32 path
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


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


@dataclass(frozen=True)
class _WindowPlan:
    """How every layer with one sliding-window size reads the cache in this forward."""

    lo: int  # first absolute key position read; keys are [lo, kv_len)
    mask: torch.Tensor | None  # [B or 1, 1, n_rep*T, kv_len-lo] bool (True = attend), query rows folded per kv head
    causal: bool  # use SDPA's is_causal instead of a mask (all rows start at 0, keys == queries)


class CacheBatch:
    """One forward's view of the cache: validated slots/positions, write strategy and masks for all layers.

    Row b's T tokens sit at positions start_pos[b] .. start_pos[b]+T-1 of slot slots[b]; each attends to its
    slot's keys [0, position] (or the last ``window`` of them).
    """

    def __init__(
        self,
        cache: KVCache,
        slots: torch.Tensor,
        start_pos: torch.Tensor,
        num_tokens: int,
        num_kv_groups: int,
        max_positions: int,
    ) -> None:
        B = slots.shape[0] if slots.dim() == 1 else -1
        if slots.dim() != 1 or start_pos.shape != slots.shape or B < 1:
            raise ValueError(
                f"forward: slots and start_pos must both have shape [B] with B >= 1, "
                f"got {tuple(slots.shape)} and {tuple(start_pos.shape)}"
            )
        if num_tokens < 1:
            raise ValueError(f"forward: input_ids must have at least one token per row, got T={num_tokens}")
        # The only host reads of a forward: everything below is planned from these Python ints.
        slot_list: list[int] = slots.tolist()
        start_list: list[int] = start_pos.tolist()
        if len(set(slot_list)) != B:
            raise ValueError(f"forward: slots must be distinct within a batch, got {slot_list}")
        for s, p in zip(slot_list, start_list):
            if not 0 <= s < cache.num_slots:
                raise ValueError(f"forward: slot {s} out of range [0, {cache.num_slots})")
            if p < 0 or p + num_tokens > cache.max_len:
                raise ValueError(
                    f"forward: slot {s} positions [{p}, {p + num_tokens}) exceed the cache max_len {cache.max_len}"
                )
            if p + num_tokens > max_positions:
                raise ValueError(
                    f"forward: slot {s} positions [{p}, {p + num_tokens}) exceed "
                    f"max_position_embeddings {max_positions}"
                )

        device = cache.device
        self.cache = cache
        self.B = B
        self.T = num_tokens
        self.n_rep = num_kv_groups
        self.kv_len = max(start_list) + num_tokens  # L_max: keys past it are never read
        self.uniform = all(p == start_list[0] for p in start_list)
        self.start0 = start_list[0]
        self.min_start = min(start_list)
        # A run of consecutive slots can be addressed with a slice view: no gather, no index_put.
        self.slot0 = slot_list[0]
        self.contiguous = slot_list == list(range(self.slot0, self.slot0 + B))
        arange_t = torch.arange(num_tokens, dtype=torch.int64)  # [T]
        positions_cpu = torch.tensor(start_list, dtype=torch.int64)[:, None] + arange_t  # [B, T]
        self._positions_cpu = positions_cpu  # [B, T]; masks are built host-side, then copied once
        self.positions = positions_cpu.to(device)  # [B, T]
        self._slot_index = slots.to(device=device, dtype=torch.int64)  # [B]
        self._windows: dict[int | None, _WindowPlan] = {}

    # -- writes ---------------------------------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this forward's K/V ([B, Hkv, T, D], already position-encoded) at each row's positions."""
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        if self.uniform:
            p0, p1 = self.start0, self.start0 + self.T
            if self.contiguous:
                kc[self.slot0 : self.slot0 + self.B, :, p0:p1] = k
                vc[self.slot0 : self.slot0 + self.B, :, p0:p1] = v
            else:
                kc[self._slot_index, :, p0:p1] = k
                vc[self._slot_index, :, p0:p1] = v
        else:
            # Advanced indices [B, 1] and [B, T] around a slice put the index dims first: [B, T, Hkv, D].
            rows = self._slot_index[:, None]  # [B, 1]
            kc[rows, :, self.positions] = k.transpose(1, 2)
            vc[rows, :, self.positions] = v.transpose(1, 2)

    # -- reads ----------------------------------------------------------------------------------------------
    def _plan(self, window: int | None) -> _WindowPlan:
        plan = self._windows.get(window)
        if plan is None:
            plan = self._build_plan(window)
            self._windows[window] = plan
        return plan

    def _build_plan(self, window: int | None) -> _WindowPlan:
        T, L = self.T, self.kv_len
        # Keys before the earliest query's window are never attended: skip them instead of masking.
        lo = 0 if window is None else max(0, self.min_start - window + 1)
        if self.uniform:
            if T == 1:
                # One query per row at the last key: [lo, L) is exactly its causal (windowed) range.
                return _WindowPlan(lo, None, False)
            if self.start0 == 0 and (window is None or window >= T):
                return _WindowPlan(0, None, True)
            q_pos = (self.start0 + torch.arange(T, dtype=torch.int64))[None, :]  # [1, T]
        else:
            q_pos = self._positions_cpu  # [B, T]
        key_pos = torch.arange(lo, L, dtype=torch.int64)  # [L-lo]
        mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [B or 1, T, L-lo]
        if window is not None:
            mask &= key_pos[None, None, :] > q_pos[:, :, None] - window
        if self.n_rep > 1:
            # Query rows are folded as (group member, t): repeat the per-t mask once per group member.
            mask = mask.repeat(1, self.n_rep, 1)  # [B or 1, n_rep*T, L-lo]
        mask = mask[:, None].to(self.cache.device)  # [B or 1, 1, n_rep*T, L-lo]
        return _WindowPlan(lo, mask, False)

    def attend(self, layer: int, q: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
        """Attention of q [B, H, T, D] over the cached keys (this forward's already written). Returns [B, T, H*D]."""
        plan = self._plan(window)
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        lo, L = plan.lo, self.kv_len
        if self.contiguous:
            keys = kc[self.slot0 : self.slot0 + self.B, :, lo:L]  # [B, Hkv, L-lo, D] view
            values = vc[self.slot0 : self.slot0 + self.B, :, lo:L]  # [B, Hkv, L-lo, D] view
        else:
            # Narrow first so the gather copies L-lo positions, not max_len.
            keys = kc[:, :, lo:L][self._slot_index]  # [B, Hkv, L-lo, D]
            values = vc[:, :, lo:L][self._slot_index]  # [B, Hkv, L-lo, D]
        B, H, T, D = q.shape
        if plan.causal:
            out = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=scale, enable_gqa=self.n_rep > 1
            )  # [B, H, T, D]
        else:
            # GQA without repeating K/V: the n_rep query heads sharing a kv head become extra query rows.
            hkv = H // self.n_rep
            qf = q.reshape(B, hkv, self.n_rep * T, D)  # [B, Hkv, n_rep*T, D]
            out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=plan.mask, scale=scale)
            # reshape, not view: some SDPA backends return a [B, T, H, D]-strided result.
            out = out.reshape(B, H, T, D)  # [B, H, T, D]
        return out.transpose(1, 2).reshape(B, T, H * D)  # [B, T, H*D]


class TensorSource(Protocol):
    """What a model needs from a checkpoint: tensors by their checkpoint name, already in model dtype/device."""

    def has(self, name: str) -> bool: ...

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor, checked against ``shape``; raises ModelLoadError naming the file and tensor."""
        ...


class CausalLM(torch.nn.Module):
    """Base of every model: a decoder that reads and writes a slot KVCache.

    Subclasses allocate uninitialised parameters in ``__init__`` and fill them in ``load_weights``.
    """

    config: ModelConfig

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def load_weights(self, source: TensorSource) -> None:
        raise NotImplementedError

    def _prepare_positions(self, max_len: int) -> None:
        """Hook for per-position tables (RoPE) sized to the longest cache; called by new_cache."""

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        """A cache in the model's dtype and device; ValueError if max_len > max_position_embeddings."""
        cfg = self.config
        if max_len > cfg.max_position_embeddings:
            raise ValueError(
                f"new_cache: max_len {max_len} exceeds {cfg.name} max_position_embeddings {cfg.max_position_embeddings}"
            )
        self._prepare_positions(max_len)
        return KVCache(cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim, self.dtype, self.device)

    def _cache_batch(
        self, input_ids: torch.Tensor, cache: KVCache, slots: torch.Tensor, start_pos: torch.Tensor
    ) -> CacheBatch:
        cfg = self.config
        if input_ids.dim() != 2:
            raise ValueError(f"forward: input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if (cache.num_layers, cache.num_kv_heads, cache.head_dim) != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise ValueError(
                f"forward: cache layout (layers={cache.num_layers}, kv_heads={cache.num_kv_heads}, "
                f"head_dim={cache.head_dim}) does not match {cfg.name} "
                f"({cfg.num_layers}, {cfg.num_kv_heads}, {cfg.head_dim})"
            )
        if input_ids.shape[0] != slots.shape[0]:
            raise ValueError(f"forward: input_ids has {input_ids.shape[0]} rows but slots has {tuple(slots.shape)}")
        return CacheBatch(
            cache, slots, start_pos, input_ids.shape[1], cfg.num_kv_groups, cfg.max_position_embeddings
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        start_pos: torch.Tensor,
        last_only: bool = False,
    ) -> torch.Tensor:
        """input_ids [B, T] int64; slots [B] int64; start_pos [B] int64 = position of each row's first token.

        Writes the K/V of row b's T tokens at positions start_pos[b]..start_pos[b]+T-1 of slot slots[b]; each
        token attends causally to cache positions [0, start_pos[b]+t] of its slot (sliding window where the
        architecture has one). Returns logits [B, T, vocab] float32 ([B, 1, vocab] when last_only). Does NOT
        change cache lengths: the caller commits with cache.set_length.
        """
        raise NotImplementedError
