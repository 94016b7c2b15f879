"""An EAGLE-style draft head: one decoder layer over the target's own features.

Contract: ``FeatureHead(spec)`` maps, at each position i, [the target's feature f_i (its final,
normed hidden state, which predicts token i+1); the embedding of token i+1] through a linear fusion
(2H -> H) and one Llama decoder layer (causal attention over the head's own positions, RoPE at
position i+1, SwiGLU MLP) to a predicted feature g_i ~ f_{i+1}; the target's output rows
(``head_rows``: its tied embedding, or a subset of its vocabulary) turn g_i into logits over the
token i+2. Drafting runs it on its own predicted features: g_i and the embedding of the token it
chose give g_{i+1}, and so on (EAGLE-1/2); ``chain_logits`` computes that for every start position
of a sequence at once (offline acceptance, the training-time test).

Weights: ``fuse`` [H, 2H], the layer's norms, q/k/v, o, gate/up and down in transformers' Llama
shapes, and ``output_ids`` (the vocabulary rows the head scores). The target's embedding is not
stored: it is passed in (``embed``), as the draft service reads it from the target's checkpoint.

What it does not know: the cache of a serving engine, tokenisation, training (tools.distill.feature).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import native
from kernels.int4 import Q4Weight, rtn_parts
from kernels.linear import linear
from specstream.models.base import silu_mul

__all__ = ["FeatureHead", "HeadCache", "HeadSpec"]


@dataclass(frozen=True)
class HeadSpec:
    hidden: int  # the target's hidden size H
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float
    norm_eps: float
    vocab_out: int  # rows of the output layer the head scores
    # EAGLE-3's fusion: target layers (1-based) whose outputs, each RMS-normalized without a weight,
    # come before the final feature in the head's input: [layer a; layer b; ...; final] -> ``reduce``
    # (k H -> H). () reads the final feature only.
    extra_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_layers", tuple(int(layer) for layer in self.extra_layers))

    @property
    def input_width(self) -> int:
        """Numbers per position the head reads from the target: H per layer it reads."""
        return self.hidden * (1 + len(self.extra_layers))

    def to_json(self) -> dict:
        return asdict(self)


def _rope_tables(spec: HeadSpec, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, device=device).float() / spec.head_dim)
    freqs = torch.arange(n, device=device).float()[:, None] * inv[None]  # [n, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
    return emb.cos(), emb.sin()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class HeadCache:
    """The head's own keys and values per sequence slot: [slots, kv heads, max_len, D] each; slot
    s holds head positions 0..length[s]-1 (position i: the input (f_i, x_{i+1}), RoPE at i+1)."""

    def __init__(self, spec: HeadSpec, slots: int, max_len: int, dtype: torch.dtype = torch.float32) -> None:
        self.k = torch.zeros(slots, spec.kv_heads, max_len, spec.head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = [0] * slots
        self.max_len = max_len
        self._free = list(range(slots - 1, -1, -1))

    # Slots are owned from ``alloc`` to ``free``, as the KV cache's are (specstream/models/kv_cache.py),
    # so a prefix cache (specstream/models/prefix_cache.py) can keep and evict them. Nothing is shared:
    # a cached prefix is copied (``copy_prefix``), so no slot is ever read by another.
    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free slot, holding nothing (None: all are taken)."""
        if not self._free:
            return None
        slot = self._free.pop()
        self.length[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"HeadCache: slot {slot} is already free")
        self._free.append(slot)

    def has_readers(self, slot: int) -> bool:
        return False

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """dst gets src's first n positions and length n; src is unchanged."""
        if not 0 <= n <= self.length[src]:
            raise ValueError(f"HeadCache: copy_prefix n={n} out of range [0, length(src={src})={self.length[src]}]")
        if src != dst:
            self.k[dst, :, :n].copy_(self.k[src, :, :n])
            self.v[dst, :, :n].copy_(self.v[src, :, :n])
        self.length[dst] = n


class FeatureHead(nn.Module):
    def __init__(self, spec: HeadSpec) -> None:
        super().__init__()
        self.spec = spec
        H, D = spec.hidden, spec.head_dim
        self.fuse = nn.Linear(2 * H, H, bias=False)  # [H, 2H]: (feature, embedding) -> H
        # [H, kH]: the target's k layers -> one feature (EAGLE-3's fusion; only with extra_layers)
        self.reduce = nn.Linear(spec.input_width, H, bias=False) if spec.extra_layers else None
        self.input_norm = nn.Parameter(torch.ones(H))
        self.q = nn.Linear(H, spec.heads * D, bias=False)
        self.kv = nn.Linear(H, 2 * spec.kv_heads * D, bias=False)
        self.o = nn.Linear(spec.heads * D, H, bias=False)
        self.post_norm = nn.Parameter(torch.ones(H))
        self.gate_up = nn.Linear(H, 2 * spec.intermediate, bias=False)
        self.down = nn.Linear(spec.intermediate, H, bias=False)
        self.register_buffer("output_ids", torch.arange(spec.vocab_out), persistent=True)  # [N] token ids scored
        self._served: dict[str, torch.Tensor | Q4Weight] | None = None  # serve(): the matrices as served
        self._bits = 0  # serve(): the 4-bit matrices' inputs rounded to this many bits per block (0: as they are)
        self._stack: object | None = None  # serve(): the layer as one native call (_native_stack), where it can be
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # _rope(): (cos, sin) [n, D]
        # _native_tables(): (cos, sin) [n, D] in the activations' dtype shifted by one row, and the float table they came from
        self._native_rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def matrices(self) -> tuple[str, ...]:
        """The linear layers' names (``reduce`` only when it reads several layers)."""
        return ("reduce",) * (self.reduce is not None) + ("fuse", "q", "kv", "o", "gate_up", "down")

    def serve(self, dtype: torch.dtype, int4: bool, parts: dict | None = None, bits: int = 0) -> int:
        """Serve the layer's matrices (not training them any more) in ``dtype`` activations, each
        rounded to 4 bits (``rtn_parts``, as a token draft is served) where the int4 kernel takes its
        shape when ``int4``, or taken as they are from ``parts`` ({name: (codes [N, K] uint8, scale,
        min [N, K/32] float32)}: a checkpoint stored in 4 bits); returns how many are 4-bit. The
        norms stay float32. ``bits`` 8 or 16 (only where kernels/int4.py ``q4_rounded_native``
        allows for ``dtype``): the 4-bit matrices take their inputs rounded to that many bits per
        block of 32, as a target served ``int4-a16`` does."""
        self._served, swapped = {}, 0
        self._bits = bits
        for name in self.matrices:
            w = getattr(self, name).weight.detach()
            if int4 and Q4Weight.fits(*w.shape):
                self._served[name] = Q4Weight.from_parts(*(parts[name] if parts and name in parts else rtn_parts(w)),
                                                         dtype)
                swapped += 1
            else:
                self._served[name] = w.to(dtype)
        self._stack = self._native_stack(dtype)
        return swapped

    def _native_stack(self, dtype: torch.dtype) -> object | None:
        """The layer as one call of the native op that runs the target's decoder layers
        (kernels/csrc/layer_stack.cpp, ``LayerStack``: norm, projections, RoPE, the cache write,
        attention, MLP and residuals in one OpenMP region), where it is served in bfloat16 with
        every projection 4-bit on the native kernel (q and kv fused into one qkv, the target's
        layout); else None (the layer runs op by op). One call instead of ~20 ops, whose per-op
        overhead dominated a drafting step inside a serving target. It serves float32 heads as well
        (the float32 4-bit kernel, AVX2): op by op, torch's float32 matrices of a few rows cost
        several times one row's time on an AMD CPU (MKL's small-matrix path); figures in
        docs/benchmarks.md, "Figures behind design choices". Its norms take the weights in the
        activations' dtype, as the target's do."""
        library = native.library()
        served = self._served or {}
        names = ("q", "kv", "o", "gate_up", "down")
        if library is None or dtype not in (torch.bfloat16, torch.float32) or not all(
                isinstance(served.get(n), Q4Weight) and served[n].native for n in names):
            return None
        qkv = Q4Weight.from_parts(*(torch.cat(pair) for pair in zip(served["q"].parts(), served["kv"].parts())), dtype)
        operands = [self.input_norm.detach().to(dtype).contiguous(), self.post_norm.detach().to(dtype).contiguous()]
        for w in (qkv, served["o"], served["gate_up"], served["down"]):
            operands += [w.packed, w.d, w.m]
        s = self.spec
        return library.LayerStack([operands], s.norm_eps, s.heads, s.kv_heads, s.head_dim, 1 / math.sqrt(s.head_dim),
                                  [0], self._bits)

    def _rope(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables [>= n, D] (kept: serving asks for one more position at a time)."""
        tables = self._rope_cache
        if tables is None or tables[0].shape[0] < n or tables[0].device != device:
            tables = self._rope_cache = _rope_tables(self.spec, max(n, 2 * (tables[0].shape[0] if tables else 256)),
                                                     device)
        return tables

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self._served is None:
            return getattr(self, name)(x)
        return linear(x, self._served[name], bits=self._bits)  # bits: the 4-bit matrices' only

    # -- the layer --------------------------------------------------------------------------------
    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., T, H] fused inputs -> (q [..., T, heads D], k and v [..., T, 2 kv D]) before RoPE."""
        h = _rms(x, self.input_norm, self.spec.norm_eps)
        return self._linear("q", h), self._linear("kv", h)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., T, H] fused inputs at token positions [..., T] -> q [..., heads, T, D], k, v [..., kv, T, D]."""
        s = self.spec
        cos, sin = self._rope(int(positions.max()) + 1, x.device)
        cos, sin = cos[positions].to(x.dtype).unsqueeze(-3), sin[positions].to(x.dtype).unsqueeze(-3)  # [..., 1, T, D]
        q, kv = self._projections(x)
        q = q.unflatten(-1, (s.heads, s.head_dim)).transpose(-2, -3)  # [..., heads, T, D]
        k, v = kv.unflatten(-1, (2 * s.kv_heads, s.head_dim)).transpose(-2, -3).chunk(2, dim=-3)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x [..., T, H], attn [..., heads, T, D] -> the layer's output [..., T, H]."""
        x = x + self._linear("o", attn.transpose(-2, -3).flatten(-2))
        return x + self._linear("down", silu_mul(self._linear("gate_up", _rms(x, self.post_norm, self.spec.norm_eps))))

    def target_input(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., T, input_width] -> [..., T, H]: the fusion of its layers
        (``reduce``) when the head reads several, else the final feature as it is. The head's own
        predicted features replace this when it drafts on."""
        return features if self.reduce is None else self._linear("reduce", features)

    def fused(self, features: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """[..., T, H] features and the next tokens' embeddings -> the layer's input [..., T, H]."""
        return self._linear("fuse", torch.cat((features, next_embeds), dim=-1))

    def forward(self, features: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """Teacher-forced over whole sequences: features [B, T, input_width] (f_0..f_{T-1}), next_embeds
        [B, T, H] (tokens 1..T) -> predicted features [B, T, H] (g_i ~ f_{i+1}), causal over the head's positions."""
        x = self.fused(self.target_input(features), next_embeds)
        T = x.shape[-2]
        q, k, v = self._qkv(x, torch.arange(1, T + 1, device=x.device))
        group = self.spec.heads // self.spec.kv_heads
        attn = F.scaled_dot_product_attention(q, k.repeat_interleave(group, -3), v.repeat_interleave(group, -3),
                                              is_causal=True)
        return self._finish(x, attn)

    def logits(self, predicted: torch.Tensor, head_rows: torch.Tensor) -> torch.Tensor:
        """predicted [..., H], head_rows [N, H] (the target's output rows for ``output_ids``) -> [..., N]."""
        return predicted @ head_rows.t()

    # -- drafting on its own features, every start at once -------------------------------------------
    def chain_logits(self, features: torch.Tensor, tokens: torch.Tensor, embed: torch.Tensor,
                     head_rows: torch.Tensor, steps: int, chosen: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """For one sequence: features [T, input_width] (the target's f_0..f_{T-1}), tokens [T + 1] (x_0..x_T),
        embed [V, H]. A draft round starting after position t knows f_0..f_t and x_{t+1}; step 1
        predicts g_t and its token d_1, step k feeds (g of step k-1, the embedding of d_{k-1}) at
        position t+k, attending to the true positions <= t and its own earlier steps. Returns the
        logits [steps, T, N] of every step from every start t and the tokens chosen [steps, T]
        (argmax, as ids of the full vocabulary; or ``chosen`` [steps, T] ids to feed instead)."""
        s = self.spec
        group = s.heads // s.kv_heads
        scale = 1 / math.sqrt(s.head_dim)
        T = features.shape[0]
        x = self.fused(self.target_input(features), embed[tokens[1:T + 1]])  # [T, H]
        starts = torch.arange(T, device=x.device)
        q, k_true, v_true = self._qkv(x, starts + 1)  # [heads, T, D], [kv, T, D]
        causal = starts[None, :] <= starts[:, None]  # [T(start), T(key)]: the true positions <= t
        chain_k, chain_v = [], []  # steps 2..: each start's own keys and values, [kv, T, D] a step
        all_logits, all_tokens = [], []
        g = x  # replaced by each step's output before it is read
        for step in range(steps):
            if step > 0:
                prev = all_tokens[-1] if chosen is None else chosen[step - 1]
                x = self.fused(g, embed[prev])  # [T, H]
                q, k, v = self._qkv(x, starts + 1 + step)
                chain_k.append(k)
                chain_v.append(v)
            qg = q.unflatten(0, (s.kv_heads, group))  # [kv, group, T, D]
            scores = (torch.einsum("hgtd,hkd->hgtk", qg, k_true) * scale).masked_fill(~causal, float("-inf"))
            if chain_k:  # [kv, group, T, T + steps so far]
                mine = torch.einsum("hgtd,htjd->hgtj", qg, torch.stack(chain_k, dim=-2)) * scale
                scores = torch.cat((scores, mine), dim=-1)
            weights = scores.softmax(-1)
            attn = torch.einsum("hgtk,hkd->hgtd", weights[..., :T], v_true)  # [kv, group, T, D]
            if chain_v:
                attn = attn + torch.einsum("hgtj,htjd->hgtd", weights[..., T:], torch.stack(chain_v, dim=-2))
            g = self._finish(x, attn.flatten(0, 1))  # [T, H]
            logits = self.logits(g, head_rows)  # [T, N]
            all_logits.append(logits)
            all_tokens.append(self.output_ids[logits.argmax(-1)])
        return torch.stack(all_logits), torch.stack(all_tokens)

    # -- incremental, as a draft serves -------------------------------------------------------------
    def _native_tables(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables [>= n, D] in ``dtype`` (the activations') shifted by one row (row i:
        position i + 1), as the native attention op reads them for head positions."""
        cos, sin = self._rope(n + 1, torch.device("cpu"))
        kept = self._native_rope
        if kept is None or kept[0].shape[0] < n or kept[2] is not cos or kept[0].dtype != dtype:
            kept = self._native_rope = (cos[1:].to(dtype).contiguous(), sin[1:].to(dtype).contiguous(), cos)
        return kept[0], kept[1]

    def _attend_native(self, x: torch.Tensor, cache: HeadCache, slot: int, start: int) -> torch.Tensor | None:
        """``_attend_cached`` in the native CPU op the target's layers use (RoPE, the cache write and
        attention over each position's keys, kernels/csrc/attention.cpp), for bfloat16 and float32
        served heads, where torch's attention for one query was dear (docs/benchmarks.md, "Figures
        behind design choices"). None where it does
        not apply."""
        s = self.spec
        if (self._served is None or x.dtype not in (torch.bfloat16, torch.float32) or cache.k.dtype != x.dtype
                or x.device.type != "cpu"):
            return None
        library = native.library()
        if library is None:
            return None
        n = x.shape[0]
        cos, sin = self._native_tables(start + n, x.dtype)
        if self._stack is not None:  # the whole layer in one call
            out = self._stack.forward(x[None].contiguous(), [cache.k], [cache.v], cos, sin, torch.tensor([slot]),
                                      torch.tensor([start]), None, None)  # [1, n, H]
            cache.length[slot] = start + n
            return out[0]
        qkv = torch.cat(self._projections(x), dim=-1)  # [n, (Hq + 2 Hkv) D]: q, k, v
        out = library.attention(qkv[None].contiguous(), cache.k, cache.v, cos, sin, torch.tensor([slot]),
                                torch.tensor([start]), None, None, s.heads, s.kv_heads, s.head_dim,
                                1 / math.sqrt(s.head_dim), 0)  # [1, n, Hq D]
        cache.length[slot] = start + n
        return self._finish(x, out[0].view(n, s.heads, s.head_dim).transpose(0, 1))

    def _attend_cached(self, x: torch.Tensor, cache: HeadCache, slot: int, start: int) -> torch.Tensor:
        """x [n, H] fused inputs of head positions start..start+n-1: their keys and values written to
        ``cache`` at those positions, each attending to positions <= its own -> outputs [n, H]."""
        s = self.spec
        n = x.shape[0]
        if start + n > cache.max_len:
            raise ValueError(f"HeadCache: positions up to {start + n} exceed its {cache.max_len}")
        native_out = self._attend_native(x, cache, slot, start)
        if native_out is not None:
            return native_out
        q, k, v = self._qkv(x, torch.arange(start + 1, start + n + 1))
        cache.k[slot, :, start:start + n] = k.to(cache.k.dtype)
        cache.v[slot, :, start:start + n] = v.to(cache.v.dtype)
        cache.length[slot] = start + n
        keys = cache.k[slot, :, :start + n].to(x.dtype)  # [kv, start + n, D]
        values = cache.v[slot, :, :start + n].to(x.dtype)
        if n == 1:  # one query sees every key: no mask, and a kv head's query heads attend as one block
            group = s.heads // s.kv_heads
            attn = F.scaled_dot_product_attention(q.view(s.kv_heads, group, s.head_dim), keys, values)
            attn = attn.view(s.heads, 1, s.head_dim)
        else:
            at = torch.arange(start, start + n)
            mask = torch.arange(start + n)[None, :] <= at[:, None]  # [n, start + n]
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self._finish(x, attn)

    def extend(self, cache: HeadCache, slot: int, start: int, features: torch.Tensor,
               next_embeds: torch.Tensor) -> torch.Tensor:
        """Head positions start.. from the target's features [n, input_width] and the next tokens' embeddings
        [n, H] (what the target committed): -> the head's outputs [n, H]; the last predicts the
        feature after them. Positions past ``start`` that the cache held (an earlier round's own
        guesses) are overwritten: a rollback is a length."""
        return self._attend_cached(self.fused(self.target_input(features), next_embeds), cache, slot, start)

    def draft(self, cache: HeadCache, slot: int, last: torch.Tensor, steps: int, embed: torch.Tensor,
              head_rows: torch.Tensor, choose: Callable[[torch.Tensor, int], int] | None = None,
              forced: Sequence[int] = (), stop: Callable[[], bool] | None = None) -> list[int]:
        """``steps`` guesses from the head's output ``last`` [H] at the cache's last position
        (``extend``'s last row: its input held the target's newest token): the first from ``last``,
        each next one from (the head's own feature, the guess before) at the next position.
        ``choose(g [H], step)`` picks a token id from a predicted feature (default: the argmax over
        ``head_rows``). The first ``len(forced)`` guesses are ``forced``'s tokens instead (a
        chain already proposed, drafted on from: draft_service/work_ahead.py). When ``stop()``
        turns true, fewer: the guesses made before it. The guesses' positions are written past the
        cache's length and not counted: the next round's ``extend`` overwrites them."""
        if choose is None:
            def choose(g: torch.Tensor, step: int) -> int:
                return int(self.output_ids[self.logits(g, head_rows).argmax()])
        start = cache.length[slot]
        g = last
        out = [forced[0] if forced else choose(g, 0)]
        for step in range(1, steps):
            if stop is not None and stop():
                break
            g = self._attend_cached(self.fused(g[None], embed[out[-1]][None].to(g.dtype)), cache, slot,
                                    start + step - 1)[0]
            out.append(forced[step] if step < len(forced) else choose(g, step))
        cache.length[slot] = start
        return out
