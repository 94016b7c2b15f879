"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) running against a slot ``KVCache``.

Contract: ``LlamaForCausalLM(config, dtype, device)`` allocates uninitialised parameters for any
``ModelConfig`` parsed from LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM; ``load_weights``
fills them from tensors with transformers' names; ``forward`` follows ``CausalLM.forward``. Covered:
GQA, explicit ``head_dim``, RoPE default / linear / llama3, q/k/v(/o) biases (Qwen2, ``attention_bias``),
``mlp_bias``, per-layer sliding windows (Mistral, Qwen2 ``use_sliding_window``), tied or untied
embeddings. The numerics follow transformers (RoPE tables computed in float32 then rounded to the
model dtype, RMSNorm in float32), so fp32 logits match transformers to ~1e-5.

What it does not know: files and key discovery (``loader.py``), tokenisation, sampling, which slots a
request owns. q/k/v and gate/up are stored fused (one matmul each) — the checkpoint layout is only
visible in ``load_weights``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels import native
from kernels.int4 import Q4Weight, rtn_parts
from kernels.int8 import Q8Weight
from kernels.linear import linear
from kernels.lm_head import OutputHead
from specstream.models.attention import CacheBatch, NativeLayer, NativeStack
from specstream.models.base import (ACTIVATIONS, CausalLM, Q4Parts, TensorSource, check_keep, rms_norm, silu_mul,
                                    with_kept_layers)
from specstream.models.config import ModelConfig, ModelLoadError, RopeConfig
from specstream.models.kv_cache import KVCache

__all__ = ["LlamaForCausalLM", "rope_inv_freq"]

# RoPE tables start this long (or max_position_embeddings if shorter) and grow to the longest cache.
_INITIAL_ROPE_LEN = 2048


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] float32, as transformers' ROPE_INIT_FUNCTIONS compute them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [D/2]
    inv_freq = 1.0 / (rope.theta**exponents)  # [D/2]
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    assert rope.rope_type == "llama3", f"config.py only admits supported rope types, got {rope.rope_type}"
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)  # [D/2]
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)  # [D/2]
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled  # [D/2]
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)  # [D/2]
    return torch.where(is_medium, smoothed, scaled)


# Whether layers that can run as one native call do (``_LlamaLayer.native_weights``); benchmarks turn
# it off to measure the op-by-op path beside it.
FUSED_LAYERS = True


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _serve_q4(module: nn.Module, attr: str, what: str, codes: torch.Tensor, scale: torch.Tensor,
              minimum: torch.Tensor, dtype: torch.dtype) -> bool:
    """Replace the dense parameter ``attr`` by its 4-bit form, when the kernel takes its shape;
    whether it did. ``what`` names the checkpoint matrices in errors."""
    dense = getattr(module, attr)
    if tuple(codes.shape) != tuple(dense.shape):
        raise ModelLoadError(f"4-bit data for {what}: shape {list(codes.shape)}, expected {list(dense.shape)}")
    if not Q4Weight.fits(*codes.shape):
        return False  # the kernel's 16 x 32 tiles do not divide it: stays dense
    del module._parameters[attr]  # a plain attribute from now on: the dense copy is freed
    setattr(module, attr, Q4Weight.from_parts(codes, scale, minimum, dtype))
    return True


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised on purpose: every parameter is overwritten by load_weights.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class _LlamaLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.layer = layer
        self.activation_bits = 0  # the model's (LlamaForCausalLM.activation_bits)
        self.num_heads = c.num_heads
        self.num_kv_heads = c.num_kv_heads
        self.head_dim = c.head_dim
        self.eps = c.norm_eps
        self.window = c.layer_windows[layer]
        self.scale = c.softmax_scale(layer)
        self.act = ACTIVATIONS[c.hidden_act]
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.intermediate = c.intermediate_size
        H = c.hidden_size
        kw = {"dtype": dtype, "device": device}
        self.input_norm = _param(H, **kw)  # [H]
        self.qkv_w = _param(self.q_size + 2 * self.kv_size, H, **kw)  # [(Hq+2Hkv)*D, H] fused q/k/v
        self.qkv_b = _param(self.q_size + 2 * self.kv_size, **kw) if c.qkv_bias else None  # [(Hq+2Hkv)*D]
        self.o_w = _param(H, self.q_size, **kw)  # [H, Hq*D]
        self.o_b = _param(H, **kw) if c.o_bias else None  # [H]
        self.post_norm = _param(H, **kw)  # [H]
        self.gate_up_w = _param(2 * c.intermediate_size, H, **kw)  # [2I, H] fused gate/up
        self.gate_up_b = _param(2 * c.intermediate_size, **kw) if c.mlp_bias else None  # [2I]
        self.down_w = _param(H, c.intermediate_size, **kw)  # [H, I]
        self.down_b = _param(H, **kw) if c.mlp_bias else None  # [H]

    def load(self, src: TensorSource, prefix: str, hidden: int) -> None:
        q, kv, inter = self.q_size, self.kv_size, self.intermediate
        a, m = prefix + "self_attn.", prefix + "mlp."
        self.input_norm.copy_(src.take(prefix + "input_layernorm.weight", (hidden,)))
        self.post_norm.copy_(src.take(prefix + "post_attention_layernorm.weight", (hidden,)))
        self.qkv_w[:q].copy_(src.take(a + "q_proj.weight", (q, hidden)))
        self.qkv_w[q : q + kv].copy_(src.take(a + "k_proj.weight", (kv, hidden)))
        self.qkv_w[q + kv :].copy_(src.take(a + "v_proj.weight", (kv, hidden)))
        if self.qkv_b is not None:
            self.qkv_b[:q].copy_(src.take(a + "q_proj.bias", (q,)))
            self.qkv_b[q : q + kv].copy_(src.take(a + "k_proj.bias", (kv,)))
            self.qkv_b[q + kv :].copy_(src.take(a + "v_proj.bias", (kv,)))
        self.o_w.copy_(src.take(a + "o_proj.weight", (hidden, q)))
        if self.o_b is not None:
            self.o_b.copy_(src.take(a + "o_proj.bias", (hidden,)))
        self.gate_up_w[:inter].copy_(src.take(m + "gate_proj.weight", (inter, hidden)))
        self.gate_up_w[inter:].copy_(src.take(m + "up_proj.weight", (inter, hidden)))
        self.down_w.copy_(src.take(m + "down_proj.weight", (hidden, inter)))
        if self.gate_up_b is not None and self.down_b is not None:
            self.gate_up_b[:inter].copy_(src.take(m + "gate_proj.bias", (inter,)))
            self.gate_up_b[inter:].copy_(src.take(m + "up_proj.bias", (inter,)))
            self.down_b.copy_(src.take(m + "down_proj.bias", (hidden,)))

    @staticmethod
    def _fused(prefix: str) -> dict[str, tuple[str, ...]]:
        """Each fused weight attribute -> the checkpoint matrices stacked in it, in row order."""
        a, m = prefix + "self_attn.", prefix + "mlp."
        return {
            "qkv_w": (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
            "o_w": (a + "o_proj.weight",),
            "gate_up_w": (m + "gate_proj.weight", m + "up_proj.weight"),
            "down_w": (m + "down_proj.weight",),
        }

    def use_q4(self, parts: Q4Parts, prefix: str, dtype: torch.dtype) -> int:
        """Swap each fused projection whose every checkpoint part has 4-bit data for a Q4Weight."""
        swapped = 0
        for attr, names in self._fused(prefix).items():
            found = [parts(name) for name in names]
            if any(part is None for part in found):
                continue  # a mixed-precision group stays dense
            codes, scale, minimum = (torch.cat(group) for group in zip(*found))  # [N, K], [N, K/32] x2
            if _serve_q4(self, attr, ", ".join(names), codes, scale, minimum, dtype):
                swapped += len(names)
        return swapped

    def quantize_int4(self, dtype: torch.dtype) -> int:
        """Each fused projection the kernel can take, quantized to 4 bits (``LlamaForCausalLM.quantize_int4``)."""
        return sum(_serve_q4(self, attr, attr, *rtn_parts(getattr(self, attr).detach()), dtype)
                   for attr in self._fused("") if Q4Weight.fits(*getattr(self, attr).shape))

    def attention(self, x: torch.Tensor, batch: CacheBatch, cos: torch.Tensor, sin: torch.Tensor,
                  rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [B, T, H] -> x + attention block [B, T, H]; writes this layer's K/V into the cache.
        With ``rope`` (the model's full cos/sin tables) the native CPU op does RoPE, the write and
        the attention in one call (``CacheBatch.native_attention``); cos/sin are then unused."""
        B, T, _ = x.shape
        D = self.head_dim
        h = rms_norm(x, self.input_norm, self.eps)  # [B, T, H]
        qkv = linear(h, self.qkv_w, self.qkv_b, self.activation_bits)  # [B, T, (Hq+2Hkv)*D]
        if rope is not None:
            attn = batch.native_attention(self.layer, qkv, self.num_heads, D, self.scale, self.window, rope)
            return x + linear(attn, self.o_w, self.o_b, self.activation_bits)  # [B, T, H]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = _apply_rope(q.view(B, T, self.num_heads, D).transpose(1, 2), cos, sin)  # [B, Hq, T, D]
        k = _apply_rope(k.view(B, T, self.num_kv_heads, D).transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
        v = v.view(B, T, self.num_kv_heads, D).transpose(1, 2)  # [B, Hkv, T, D]
        batch.write(self.layer, k, v)
        attn = batch.attend(self.layer, q, self.scale, self.window)  # [B, T, Hq*D]
        return x + linear(attn, self.o_w, self.o_b, self.activation_bits)  # [B, T, H]

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> x + MLP block [B, T, H]."""
        h = rms_norm(x, self.post_norm, self.eps)  # [B, T, H]
        gate_up = linear(h, self.gate_up_w, self.gate_up_b, self.activation_bits)  # [B, T, 2I]
        if self.act is F.silu:
            act = silu_mul(gate_up)  # [B, T, I]
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # 2 x [B, T, I]
            act = self.act(gate) * up
        return x + linear(act, self.down_w, self.down_b, self.activation_bits)  # [B, T, H]

    def forward(self, x: torch.Tensor, batch: CacheBatch, cos: torch.Tensor, sin: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return self.mlp(self.attention(x, batch, cos, sin, rope))  # [B, T, H]

    def native_plan(self, dtype: torch.dtype) -> NativeLayer | None:
        """This layer's operands for the native op, or None where it runs op by op (``native_weights``)."""
        weights = self.native_weights(dtype)
        if weights is None:
            return None
        return NativeLayer(self.layer, self.input_norm, self.post_norm, self.eps, weights, self.num_heads,
                           self.num_kv_heads, self.head_dim, self.scale, self.window or 0)

    def native_weights(self, dtype: torch.dtype) -> list[torch.Tensor] | None:
        """The four projections' operands for the native layers (kernels/csrc/layer_stack.cpp,
        ``LayerStack``) when this layer is what they compute: bfloat16 or float32, every projection
        4-bit on the native kernel, no biases, SiLU; else None (the layer runs op by op).
        ``FUSED_LAYERS`` False turns it off (the op-by-op path is the reference)."""
        projections = (self.qkv_w, self.o_w, self.gate_up_w, self.down_w)
        if not (FUSED_LAYERS and dtype in (torch.bfloat16, torch.float32) and self.act is F.silu
                and self.input_norm.dtype == dtype
                and all(isinstance(w, Q4Weight) and w.native for w in projections)
                and self.qkv_b is None and self.o_b is None and self.gate_up_b is None and self.down_b is None):
            return None
        return [t for w in projections for t in (w.packed, w.d, w.m)]


class LlamaForCausalLM(CausalLM):
    """Llama / Mistral / Qwen2 decoder; see the module docstring for what is covered."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(config)
        assert config.rope is not None, "llama-family configs always carry RoPE parameters"
        c = config
        self.embed = _param(c.vocab_size, c.hidden_size, dtype=dtype, device=device)  # [V, H]
        self.layers = nn.ModuleList(_LlamaLayer(c, i, dtype, device) for i in range(c.num_layers))
        self.norm = _param(c.hidden_size, dtype=dtype, device=device)  # [H]
        # A draft over a vocabulary subset gets its own head rows even when tied: a contiguous
        # [N, H] matrix, so the output matmul reads N rows, not V.
        head_rows = c.output_vocab or c.vocab_size
        self.lm_head = (
            None if c.tie_word_embeddings and c.output_vocab is None
            else _param(head_rows, c.hidden_size, dtype=dtype, device=device)
        )  # [V or N, H]
        self.register_buffer(
            "output_ids", torch.zeros(head_rows, dtype=torch.int64, device=device) if c.output_vocab else None,
            persistent=False)  # [N] token id of each logit column
        self.head_q8: Q8Weight | None = None  # the output layer as 8-bit blocks (use_q8_head), else the dense one
        self.register_buffer("inv_freq", rope_inv_freq(c.rope, c.head_dim).to(device), persistent=False)  # [D/2]
        self._rope_len = 0
        self._activation_bits = 0
        self._native_runs: dict[tuple, tuple[tuple, list]] = {}  # by cuts: (what native_runs were built from, them)
        self._build_rope(min(_INITIAL_ROPE_LEN, c.max_position_embeddings))

    def _build_rope(self, n: int) -> None:
        # Built outside inference mode so the tables stay usable by any later caller (plain no_grad too).
        with torch.inference_mode(False), torch.no_grad():
            positions = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)  # [n]
            freqs = positions[:, None] * self.inv_freq.float()[None, :]  # [n, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
            dtype = self.embed.dtype
            self.register_buffer("rope_cos", emb.cos().to(dtype), persistent=False)  # [n, D]
            self.register_buffer("rope_sin", emb.sin().to(dtype), persistent=False)  # [n, D]
        self._rope_len = n

    @property
    def output_token_ids(self) -> torch.Tensor | None:
        return self.output_ids

    def _prepare_positions(self, max_len: int) -> None:
        if max_len > self._rope_len:
            self._build_rope(max_len)

    def load_weights(self, source: TensorSource) -> None:
        c = self.config
        V, H = c.vocab_size, c.hidden_size
        with torch.no_grad():
            self.embed.copy_(source.take("model.embed_tokens.weight", (V, H)))
            for i, layer in enumerate(self.layers):
                assert isinstance(layer, _LlamaLayer)
                layer.load(source, f"model.layers.{i}.", H)
            self.norm.copy_(source.take("model.norm.weight", (H,)))
            if c.output_vocab is not None:
                ids = source.take_index("specstream.output_token_ids", (c.output_vocab,))  # [N]
                if int(ids.min()) < 0 or int(ids.max()) >= V or len(set(ids.tolist())) != len(ids):
                    raise ModelLoadError(f"{c.name}: 'specstream.output_token_ids' must be distinct ids in 0..{V - 1}")
                self.output_ids.copy_(ids)
                full = self.embed if c.tie_word_embeddings else source.take("lm_head.weight", (V, H))  # [V, H]
                self.lm_head.copy_(full[ids.to(full.device)])
            elif self.lm_head is not None:
                self.lm_head.copy_(source.take("lm_head.weight", (V, H)))

    def use_q4(self, parts: Q4Parts) -> int:
        """The layers' projections and an untied, full-vocabulary output layer; the embedding lookup
        (and a tied output layer, which is the embedding) stay dense."""
        swapped = sum(layer.use_q4(parts, f"model.layers.{i}.", self.dtype)  # type: ignore[operator]
                      for i, layer in enumerate(self.layers))
        head = parts("lm_head.weight") if self.lm_head is not None and self.config.output_vocab is None else None
        if head is not None:
            swapped += _serve_q4(self, "lm_head", "lm_head.weight", *head, self.dtype)
        return swapped

    def head_name(self) -> str | None:
        """The checkpoint tensor the full-vocabulary output layer reads (None: a draft's subset)."""
        if self.config.output_vocab is not None:
            return None
        return "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"

    def use_q8_head(self, dense: torch.Tensor) -> bool:
        """Serve the output layer from 8-bit blocks when ``dense`` (its float32 checkpoint tensor) is
        exactly a Q8_0 matrix (a GGUF file's Q8_0 embedding); whether it does. The embedding lookup
        keeps reading the dense matrix (one row a token)."""
        if self.lm_head is not None and not isinstance(self.lm_head, torch.Tensor):
            return False  # already 4-bit
        head = Q8Weight.from_exact(dense)
        if head is None or head.shape != self.output_head.weight.shape:
            return False
        self.head_q8 = head
        return True

    def quantize_int4(self) -> int:
        """The layers' fused projections and an own output layer (untied, or a draft's vocabulary
        subset); the embedding, which a tied head shares, stays dense."""
        dtype = self.dtype
        swapped = sum(layer.quantize_int4(dtype) for layer in self.layers)  # type: ignore[operator]
        if self.lm_head is not None and Q4Weight.fits(*self.lm_head.shape):
            swapped += _serve_q4(self, "lm_head", "lm_head", *rtn_parts(self.lm_head.detach()), dtype)
        return swapped

    def embed_positions(self, input_ids: torch.Tensor, batch: CacheBatch) -> tuple[torch.Tensor, ...]:
        """(hidden [B, T, H], cos, sin [B, 1, T, D]): the input embedding and this forward's RoPE rows."""
        if batch.kv_len > self._rope_len:
            # Only for caches built without new_cache; new_cache sizes the tables up front.
            self._build_rope(batch.kv_len)
        # One table lookup per forward, shared by every layer.
        cos = self.rope_cos[batch.positions].unsqueeze(1)  # [B, 1, T, D]
        sin = self.rope_sin[batch.positions].unsqueeze(1)  # [B, 1, T, D]
        return F.embedding(input_ids.to(self.embed.device), self.embed), cos, sin  # [B, T, H], ...

    @property
    def exact_trees(self) -> bool:
        """Where the native attention serves (CPU, float32 or bfloat16): it reads a node's keys in
        a chain's order (``CacheBatch``)."""
        return self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16) \
            and native.library() is not None

    @property
    def output_head(self) -> OutputHead:
        """[V, H] (or [N, H] over a draft's vocabulary subset, columns named by output_ids)."""
        if self.head_q8 is not None:  # its inputs rounded to 16 bits where the layers' are (kernels/int8.py)
            return OutputHead(self.head_q8, bits=16 if self._activation_bits == 16 else 0)
        return OutputHead(self.embed if self.lm_head is None else self.lm_head, output_ids=self.output_ids)

    @property
    def activation_bits(self) -> int:
        """How many bits the layers round their projections' inputs to per block of 32 before
        multiplying them in integers: 8 or 16 (kernels/csrc/q4_matmul.cpp; load_model's weights
        "int4-a8", "int4-a16"), fused and op by op alike; 0: the inputs as they are."""
        return self._activation_bits

    @activation_bits.setter
    def activation_bits(self, bits: int) -> None:
        self._activation_bits = bits
        for layer in self.layers:
            layer.activation_bits = bits

    def native_runs(self, dtype: torch.dtype, cuts: tuple[int, ...] = ()) -> list[tuple[range, NativeStack | None]]:
        """The layers in runs: each run of consecutive layers that can run natively
        (``_LlamaLayer.native_plan``) as one native call (``NativeStack``), the others one by one
        (None); a run also ends after each layer in ``cuts`` (1-based: its output is kept). Built
        once and kept while the layers' matrices, ``dtype``, ``FUSED_LAYERS`` and
        ``activation_bits`` are the same objects (a swapped matrix builds them anew). Checked every
        forward, so only what can be swapped is compared: the four matrices, plain attributes. The
        norms are parameters, only ever updated in place (which the stacks see: they hold the same
        tensors), and reading 60 of them through ``nn.Module.__getattr__`` a forward was measurable
        (docs/benchmarks.md, "Figures behind design choices").
        """
        key = (dtype, FUSED_LAYERS, self.activation_bits, *(t for layer in self.layers for t in (
            layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w)))
        kept = self._native_runs.get(cuts)
        if kept is not None and len(kept[0]) == len(key) and all(a is b for a, b in zip(kept[0], key)):
            return kept[1]
        plans = [layer.native_plan(dtype) for layer in self.layers]
        runs: list[tuple[range, NativeStack | None]] = []
        start = 0
        for end in range(1, len(plans) + 1):  # a run ends where the next layer differs in being native
            if end == len(plans) or (plans[end] is None) != (plans[start] is None) or end in cuts:
                stack = NativeStack.build(plans[start:end], self.activation_bits) if plans[start] is not None else None
                runs.append((range(start, end), stack))
                start = end
        self._native_runs[cuts] = (key, runs)
        return runs

    def run_layers(self, x: torch.Tensor, batch: CacheBatch, cos: torch.Tensor, sin: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor] | None, keep: tuple[int, ...] = (),
                   kept: list[torch.Tensor] | None = None) -> torch.Tensor:
        """x [B, T, H] through every decoder layer as the model serves them: runs of native layers
        as one call each (``native_runs``, when ``rope`` says the native attention is built), the
        rest op by op. Returns [B, T, H]; the outputs of the layers in ``keep`` (1-based, ascending)
        are appended to ``kept``."""
        runs = self.native_runs(x.dtype, keep) if rope is not None else [(range(len(self.layers)), None)]
        for layers, stack in runs:
            if stack is not None:
                x = batch.native_layers(x, stack, rope)  # [B, T, H]
                if layers.stop in keep:
                    kept.append(x)
            else:
                for i in layers:
                    x = self.layers[i](x, batch, cos, sin, rope)  # [B, T, H]
                    if i + 1 in keep:
                        kept.append(x)
        return x

    def hidden(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        start_pos: torch.Tensor,
        last_only: bool = False,
        keep: tuple[int, ...] = (),
        parents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See ``CausalLM.hidden``: the final, normed hidden states [B, T', H], after the outputs
        of the layers in ``keep`` (EAGLE-3's fusion, specstream.models.feature_head)."""
        check_keep(keep, len(self.layers))
        batch = self._cache_batch(input_ids, cache, slots, start_pos, parents)
        x, cos, sin = self.embed_positions(input_ids, batch)  # [B, T, H]
        # The native CPU attention, wherever it is built: the same op for every forward (prefill,
        # decode, verify), so a position's K/V and output never depend on which kind computed it.
        rope = (self.rope_cos, self.rope_sin) if batch.native_ready(self.dtype) else None
        kept: list[torch.Tensor] = []
        x = self.run_layers(x, batch, cos, sin, rope, keep, kept)  # [B, T, H]
        if last_only:
            x, kept = x[:, -1:], [k[:, -1:] for k in kept]  # [B, 1, H]
        return with_kept_layers(rms_norm(x, self.norm, self.config.norm_eps), kept, self.config.norm_eps)
