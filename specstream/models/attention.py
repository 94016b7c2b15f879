"""How one forward reads and writes the slot KV cache: ``CacheBatch``.

Built once per forward from (cache, slots, start_pos, T): it validates the request, decides how
each layer writes and reads the cache (slice views when possible, gathers otherwise) and builds
the boolean attention masks once, so layers only do tensor work. Knows nothing about checkpoints,
weight names or which slot belongs to which request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import native
from specstream.models.kv_cache import KVCache

__all__ = ["CacheBatch"]


@dataclass(frozen=True)
class _WindowPlan:
    """How every layer with one sliding-window size reads the cache in this forward."""

    lo: int  # first absolute key position read; keys are [lo, kv_len)
    mask: torch.Tensor | None  # [B or 1, 1, n_rep*T, kv_len-lo] bool (True = attend), query rows folded per kv head


@dataclass(frozen=True)
class NativeLayer:
    """What the native decoder-layer op needs of one layer (models/llama.py builds it)."""

    layer: int
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    eps: float
    weights: list[torch.Tensor]  # the four projections' native 4-bit operands: (codes, d, m) x 4
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int  # 0: none


@dataclass(frozen=True)
class NativeStack:
    """Consecutive Llama layers as one native call (kernels/csrc/layer_stack.cpp, ``LayerStack``): one
    OpenMP parallel region per forward for all of them, where a call per layer cost a Python call
    and ~5 forks and joins each (a sizeable share of a step on a 30-layer model: docs/benchmarks.md,
    "Figures behind design choices")."""

    layers: tuple[int, ...]  # the cache layers they read and write
    op: object  # the library's LayerStack

    @classmethod
    def build(cls, plan: list[NativeLayer], activation_bits: int = 0) -> NativeStack | None:
        """The stack of ``plan``'s layers, or None when they differ in what the op takes once for
        all (norm epsilon, heads, head size, scale) or the library is off. ``activation_bits`` 8 or 16: the
        projections take their inputs rounded to that many bits per block (models/llama.py, ``activation_bits``)."""
        library = native.library()
        first = plan[0]
        shared = (first.eps, first.num_heads, first.num_kv_heads, first.head_dim, first.scale)
        if library is None or any((p.eps, p.num_heads, p.num_kv_heads, p.head_dim, p.scale) != shared for p in plan):
            return None
        op = library.LayerStack([[p.input_norm, p.post_norm, *p.weights] for p in plan], *shared,
                                [p.window for p in plan], activation_bits)
        return cls(tuple(p.layer for p in plan), op)


class CacheBatch:
    """One forward's view of the cache: validated slots/positions, write strategy and masks for all layers.

    Row b's T tokens sit at positions start_pos[b] .. start_pos[b]+T-1 of slot slots[b]; each attends to its
    slot's keys [0, position] (or the last ``window`` of them).

    A tree (``parents`` [B, T]: node t's parent, an earlier node; the root, node 0, has -1) verifies
    several branches in one forward: node t is still stored at start_pos[b] + t, but it is at
    position start_pos[b] + depth(t) (its RoPE, its learned position) and attends to the prefix
    [0, start_pos[b]) and its own ancestors only, read in the order a chain's position of that depth
    reads its keys, so each node's output is the bits of the chain through it. A tree whose every
    row is a chain is the chain forward.
    """

    def __init__(
        self,
        cache: KVCache,
        slots: torch.Tensor,
        start_pos: torch.Tensor,
        num_tokens: int,
        num_kv_groups: int,
        max_positions: int,
        parents: torch.Tensor | None = None,
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

        tree = _tree_paths(parents, B, num_tokens) if parents is not None else None
        depths = torch.tensor([[len(p) - 1 for p in row] for row in tree], dtype=torch.int64) if tree else None
        self._paths = tree  # per row, per node: its ancestors' indices, the root first and itself last
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
        stored_cpu = torch.tensor(start_list, dtype=torch.int64)[:, None] + arange_t  # [B, T]: where each is written
        # A tree's nodes sit at their depth; a chain's at their index (where they are written).
        self.tree = depths is not None
        self._parents_cpu = parents.to(dtype=torch.int64).contiguous() if depths is not None else None  # [B, T]
        positions_cpu = stored_cpu if depths is None else stored_cpu - arange_t + depths  # [B, T]
        self._positions_cpu = positions_cpu  # [B, T]; masks are built host-side, then copied once
        self.positions = positions_cpu.to(device)  # [B, T]
        self._stored = stored_cpu.to(device) if depths is not None else self.positions  # [B, T]
        self._slot_index_cpu = torch.tensor(slot_list, dtype=torch.int64)  # [B]
        self._starts_cpu = torch.tensor(start_list, dtype=torch.int64)  # [B]
        self._slot_index = slots.to(device=device, dtype=torch.int64)  # [B]
        self._windows: dict[int | None, _WindowPlan] = {}
        # Rows that read positions from other slots (KVCache.fork): one source slot per key position.
        self._sources: torch.Tensor | None = None  # [B, kv_len]
        tables = [cache.sources(s) for s in slot_list] if cache.shared else []
        if any(t is not None for t in tables):
            for s, p, t in zip(slot_list, start_list, tables):
                if t is not None and p < len(t):
                    raise ValueError(f"forward: slot {s} writes position {p} inside its shared prefix "
                                     f"(positions [0, {len(t)}) live in other slots)")
            self._sources = torch.tensor([(t or [])[: self.kv_len] + [s] * (self.kv_len - len(t or []))
                                          for s, t in zip(slot_list, tables)], dtype=torch.int64, device=device)

    # -- the native path ------------------------------------------------------------------------------------
    def native_attention(self, layer: int, qkv: torch.Tensor, num_heads: int, head_dim: int, scale: float,
                         window: int | None, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE, the cache write and the attention of one layer in the native CPU op (kernels/csrc):
        qkv [B, T, (Hq+2Hkv)*D] straight from the fused projection, rope the model's (cos, sin)
        tables [n, D]. Returns [B, T, Hq*D]. Each position's output depends only on its own
        query, keys and values (see the op), so it is the same in a prefill, a decode step, a verify
        window or beside other rows."""
        library = native.library()
        assert library is not None, "callers check native_ready first"
        return library.attention(qkv.contiguous(), self.cache.k[layer], self.cache.v[layer], rope[0], rope[1],
                                 self._slot_index_cpu, self._starts_cpu, self._sources, self._parents_cpu, num_heads,
                                 self.cache.num_kv_heads, head_dim, scale, window or 0)

    def native_layers(self, x: torch.Tensor, stack: NativeStack, rope: tuple[torch.Tensor, torch.Tensor]
                      ) -> torch.Tensor:
        """Llama decoder layers in one native CPU call (``NativeStack``): x [B, T, H] bfloat16 or float32;
        their attention is ``native_attention``'s. Returns [B, T, H]."""
        k, v = self.cache.k, self.cache.v
        return stack.op.forward(x, [k[i] for i in stack.layers], [v[i] for i in stack.layers], rope[0], rope[1],
                                self._slot_index_cpu, self._starts_cpu, self._sources, self._parents_cpu)

    def native_ready(self, dtype: torch.dtype) -> bool:
        """Whether this forward takes the native attention: a CPU cache of float32 or bfloat16 and
        the library built (else the torch path below serves)."""
        return (self.cache.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                and self.cache.k[0].dtype == dtype and native.library() is not None)

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
            kc[rows, :, self._stored] = k.transpose(1, 2)
            vc[rows, :, self._stored] = v.transpose(1, 2)

    # -- reads ----------------------------------------------------------------------------------------------
    def _tree_plan(self, window: int | None, lo: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(index, valid) [B, T, K]: where node t's keys lie among the read keys [lo, kv_len) (the
        prefix in order, then its ancestors root first: a chain's order), padded to the longest."""
        lists = []
        for b, (start, paths) in enumerate(zip(self._starts_cpu.tolist(), self._paths)):
            for path in paths:
                first = 0 if window is None else max(0, start + len(path) - window)  # the node's own window
                lists.append([*range(first - lo, start - lo),
                              *(start + t - lo for d, t in enumerate(path) if start + d >= first)])
        K = max(len(keys) for keys in lists)
        index = torch.tensor([keys + [0] * (K - len(keys)) for keys in lists], dtype=torch.int64)  # [B*T, K]
        valid = torch.tensor([[True] * len(keys) + [False] * (K - len(keys)) for keys in lists])  # [B*T, K]
        return index.view(self.B, self.T, K), valid.view(self.B, self.T, K)

    def _attend_tree(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lo: int, scale: float,
                     window: int | None) -> torch.Tensor:
        """Tree attention on the torch path: every node over its own keys (``_tree_plan``), gathered
        per node so each reads them in a chain's order. q [B, H, T, D], keys/values [B, Hkv, L-lo, D]
        -> [B, T, H*D]."""
        B, H, T, D = q.shape
        index, valid = self._tree_plan(window, lo)  # [B, T, K]
        device = keys.device
        rows = torch.arange(B, device=device)[:, None, None, None]  # [B, 1, 1, 1]
        heads = torch.arange(keys.shape[1], device=device)[None, :, None, None]  # [1, Hkv, 1, 1]
        at = index.to(device)[:, None]  # [B, 1, T, K]
        node_keys, node_values = keys[rows, heads, at], values[rows, heads, at]  # [B, Hkv, T, K, D]
        qf = q.reshape(B, H // self.n_rep, self.n_rep, T, D).transpose(2, 3)  # [B, Hkv, T, n_rep, D]
        mask = valid.to(device)[:, None, :, None, :]  # [B, 1, T, 1, K]
        out = _attention_over_cache(qf, node_keys, node_values, mask, scale)  # [B, Hkv, T, n_rep, D]
        return out.transpose(2, 3).reshape(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)  # [B, T, H*D]

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
            # No fused causal kernel, even for a fresh prompt: its rows' bits differ from the
            # masked path's, and a prompt prefilled in one chunk must give the same cache as one
            # split across steps (the split depends on what else is admitted).
            if T == 1:
                # One query per row at the last key: [lo, L) is exactly its causal (windowed) range.
                return _WindowPlan(lo, None)
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
        return _WindowPlan(lo, mask)

    def attend(self, layer: int, q: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
        """Attention of q [B, H, T, D] over the cached keys (this forward's already written). Returns [B, T, H*D]."""
        plan = self._plan(window)
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        lo, L = plan.lo, self.kv_len
        if self._sources is not None:
            # Per position, from the slot that holds it (shared prefixes): [B, Hkv, L-lo, D]
            heads = torch.arange(kc.shape[1], device=kc.device)[None, :, None]  # [1, Hkv, 1]
            where = self._sources[:, None, lo:L]  # [B, 1, L-lo]
            at = torch.arange(lo, L, device=kc.device)[None, None, :]  # [1, 1, L-lo]
            keys, values = kc[where, heads, at], vc[where, heads, at]
        elif self.contiguous:
            keys = kc[self.slot0 : self.slot0 + self.B, :, lo:L]  # [B, Hkv, L-lo, D] view
            values = vc[self.slot0 : self.slot0 + self.B, :, lo:L]  # [B, Hkv, L-lo, D] view
        else:
            # Narrow first so the gather copies L-lo positions, not max_len.
            keys = kc[:, :, lo:L][self._slot_index]  # [B, Hkv, L-lo, D]
            values = vc[:, :, lo:L][self._slot_index]  # [B, Hkv, L-lo, D]
        B, H, T, D = q.shape
        if self.tree:
            return self._attend_tree(q, keys, values, lo, scale, window)
        # GQA without repeating K/V: the n_rep query heads sharing a kv head become extra query rows.
        qf = q.reshape(B, H // self.n_rep, self.n_rep * T, D)  # [B, Hkv, n_rep*T, D]
        out = _attention_over_cache(qf, keys, values, plan.mask, scale)  # [B, Hkv, n_rep*T, D]
        return out.reshape(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)  # [B, T, H*D]


def _tree_paths(parents: torch.Tensor, B: int, T: int) -> list[list[list[int]]] | None:
    """Each node's path from the root (node indices, itself last) per row, from parents [B, T]
    (ValueError unless node 0's parent is -1 and every other node's an earlier node); None when
    every row is a chain (each node's parent the one before it)."""
    if tuple(parents.shape) != (B, T):
        raise ValueError(f"forward: parents must have shape [B, T] = [{B}, {T}], got {tuple(parents.shape)}")
    rows: list[list[int]] = parents.tolist()
    if all(row == list(range(-1, T - 1)) for row in rows):
        return None
    paths = []
    for b, row in enumerate(rows):
        if row[0] != -1 or any(not 0 <= p < t for t, p in enumerate(row) if t):
            raise ValueError(f"forward: parents of row {b} must be -1 for node 0 and an earlier node for every "
                             f"other, got {row}")
        row_paths: list[list[int]] = []
        for t, p in enumerate(row):
            row_paths.append([*row_paths[p], t] if t else [0])
        paths.append(row_paths)
    return paths


def _attention_over_cache(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """softmax(q kᵀ · scale) v, for decode steps and verify windows over cached keys.

    Each output row is the same bits however many query rows and masked trailing keys the call
    has: a verify forward over γ+1 positions must give exactly the logits of γ+1 decode steps, or
    greedy speculation would not reproduce plain decoding. SDPA's fused CPU kernel does not
    promise that (in bfloat16 a row changes with the number of rows and with where the key count
    ends inside a vector block); batched matmuls (each score a dot product over D, each output a
    product over the keys in order) and a row-wise float64 softmax do. It is also faster than the
    fused kernel for batches of sequences, and slower for a single one (docs/benchmarks.md, "Figures
    behind design choices").
    q [B, Hkv, R, D], keys/values [B, Hkv, L, D], mask [B or 1, 1, R, L] (True = attend) -> [B, Hkv, R, D]."""
    scores = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scale)  # [B, Hkv, R, L]
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    # The softmax in float64: a float32 row sum is reduced in an order that depends on the row's
    # length, so masked trailing keys changed the probabilities' last bits (seen on SmolLM2: a prompt
    # prefilled in two chunks got another cache than in one). In float64 the sum's order is far
    # below the rounding to the values' dtype.
    probs = torch.softmax(scores.double(), dim=-1).to(values.dtype)  # [B, Hkv, R, L]
    return torch.matmul(probs, values)  # [B, Hkv, R, D]
