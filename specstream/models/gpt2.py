"""GPT-2 decoder (GPT2LMHeadModel checkpoints) running against a slot ``KVCache``.

Contract: ``GPT2LMHeadModel(config, dtype, device)`` allocates uninitialised parameters; ``load_weights``
reads transformers' names with or without the ``transformer.`` prefix (new saves vs. old hub
checkpoints), transposing the Conv1D ``[in, out]`` weights into ``[out, in]`` once at load; ``forward``
follows ``CausalLM.forward``. Positions are learned (``wpe``), so no cache may be longer than
``n_positions``. ``scale_attn_weights`` and ``scale_attn_by_inverse_layer_idx`` are honoured; the
``attn.bias`` / ``attn.masked_bias`` buffers in old checkpoints are causal-mask constants and are ignored.

What it does not know: files (``loader.py``), tokenisation, sampling. ``reorder_and_upcast_attn`` only
changes fp16 rounding in transformers' eager path and is not reproduced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.linear import linear
from kernels.lm_head import OutputHead
from specstream.models.attention import CacheBatch
from specstream.models.base import ACTIVATIONS, CausalLM, TensorSource, check_keep, with_kept_layers
from specstream.models.config import ModelConfig
from specstream.models.kv_cache import KVCache

__all__ = ["GPT2LMHeadModel"]


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised on purpose: every parameter is overwritten by load_weights.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class _GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        c = config
        H, inner = c.hidden_size, c.intermediate_size
        kw = {"dtype": dtype, "device": device}
        self.layer = layer
        self.num_heads = c.num_heads
        self.head_dim = c.head_dim
        self.eps = c.norm_eps
        self.scale = c.softmax_scale(layer)
        self.act = ACTIVATIONS[c.hidden_act]
        self.ln1_w, self.ln1_b = _param(H, **kw), _param(H, **kw)  # [H], [H]
        self.qkv_w, self.qkv_b = _param(3 * H, H, **kw), _param(3 * H, **kw)  # [3H, H], [3H]
        self.o_w, self.o_b = _param(H, H, **kw), _param(H, **kw)  # [H, H], [H]
        self.ln2_w, self.ln2_b = _param(H, **kw), _param(H, **kw)  # [H], [H]
        self.fc_w, self.fc_b = _param(inner, H, **kw), _param(inner, **kw)  # [I, H], [I]
        self.proj_w, self.proj_b = _param(H, inner, **kw), _param(H, **kw)  # [H, I], [H]

    def load(self, src: TensorSource, prefix: str, hidden: int, inner: int) -> None:
        H = hidden
        self.ln1_w.copy_(src.take(prefix + "ln_1.weight", (H,)))
        self.ln1_b.copy_(src.take(prefix + "ln_1.bias", (H,)))
        self.ln2_w.copy_(src.take(prefix + "ln_2.weight", (H,)))
        self.ln2_b.copy_(src.take(prefix + "ln_2.bias", (H,)))
        # Conv1D stores [in, out]; F.linear wants [out, in].
        self.qkv_w.copy_(src.take(prefix + "attn.c_attn.weight", (H, 3 * H)).t())
        self.qkv_b.copy_(src.take(prefix + "attn.c_attn.bias", (3 * H,)))
        self.o_w.copy_(src.take(prefix + "attn.c_proj.weight", (H, H)).t())
        self.o_b.copy_(src.take(prefix + "attn.c_proj.bias", (H,)))
        self.fc_w.copy_(src.take(prefix + "mlp.c_fc.weight", (H, inner)).t())
        self.fc_b.copy_(src.take(prefix + "mlp.c_fc.bias", (inner,)))
        self.proj_w.copy_(src.take(prefix + "mlp.c_proj.weight", (inner, H)).t())
        self.proj_b.copy_(src.take(prefix + "mlp.c_proj.bias", (H,)))

    def forward(self, x: torch.Tensor, batch: CacheBatch) -> torch.Tensor:
        B, T, H = x.shape
        D = self.head_dim
        h = F.layer_norm(x, (H,), self.ln1_w, self.ln1_b, self.eps)  # [B, T, H]
        q, k, v = linear(h, self.qkv_w, self.qkv_b).split(H, dim=-1)  # 3 x [B, T, H]
        q = q.view(B, T, self.num_heads, D).transpose(1, 2)  # [B, Hq, T, D]
        k = k.view(B, T, self.num_heads, D).transpose(1, 2)  # [B, Hq, T, D]
        v = v.view(B, T, self.num_heads, D).transpose(1, 2)  # [B, Hq, T, D]
        batch.write(self.layer, k, v)
        attn = batch.attend(self.layer, q, self.scale)  # [B, T, H]
        x = x + linear(attn, self.o_w, self.o_b)  # [B, T, H]
        h = F.layer_norm(x, (H,), self.ln2_w, self.ln2_b, self.eps)  # [B, T, H]
        return x + linear(self.act(linear(h, self.fc_w, self.fc_b)), self.proj_w, self.proj_b)  # [B, T, H]


class GPT2LMHeadModel(CausalLM):
    """GPT-2 with learned positions, LayerNorm, fused Conv1D q/k/v and an lm_head tied to wte by default."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(config)
        c = config
        assert c.num_kv_heads == c.num_heads, "GPT-2 has no grouped-query attention"
        kw = {"dtype": dtype, "device": device}
        self.wte = _param(c.vocab_size, c.hidden_size, **kw)  # [V, H]
        self.wpe = _param(c.max_position_embeddings, c.hidden_size, **kw)  # [P, H]
        self.blocks = nn.ModuleList(_GPT2Block(c, i, dtype, device) for i in range(c.num_layers))
        self.lnf_w, self.lnf_b = _param(c.hidden_size, **kw), _param(c.hidden_size, **kw)  # [H], [H]
        self.lm_head = None if c.tie_word_embeddings else _param(c.vocab_size, c.hidden_size, **kw)  # [V, H]

    def load_weights(self, source: TensorSource) -> None:
        c = self.config
        V, H, P = c.vocab_size, c.hidden_size, c.max_position_embeddings
        # transformers saves GPT2LMHeadModel under "transformer."; the original hub files have bare names.
        p = "transformer." if source.has("transformer.wte.weight") else ""
        with torch.no_grad():
            self.wte.copy_(source.take(p + "wte.weight", (V, H)))
            self.wpe.copy_(source.take(p + "wpe.weight", (P, H)))
            for i, block in enumerate(self.blocks):
                assert isinstance(block, _GPT2Block)
                block.load(source, f"{p}h.{i}.", H, c.intermediate_size)
            self.lnf_w.copy_(source.take(p + "ln_f.weight", (H,)))
            self.lnf_b.copy_(source.take(p + "ln_f.bias", (H,)))
            if self.lm_head is not None:
                self.lm_head.copy_(source.take("lm_head.weight", (V, H)))

    @property
    def output_head(self) -> OutputHead:
        return OutputHead(self.wte if self.lm_head is None else self.lm_head)  # [V, H]

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
        check_keep(keep, len(self.blocks))
        batch = self._cache_batch(input_ids, cache, slots, start_pos, parents)
        ids = input_ids.to(self.wte.device)
        x = F.embedding(ids, self.wte) + F.embedding(batch.positions, self.wpe)  # [B, T, H]
        kept = []
        for i, block in enumerate(self.blocks):
            x = block(x, batch)  # [B, T, H]
            if i + 1 in keep:
                kept.append(x)
        if last_only:
            x, kept = x[:, -1:], [k[:, -1:] for k in kept]  # [B, 1, H]
        H = self.config.hidden_size
        final = F.layer_norm(x, (H,), self.lnf_w, self.lnf_b, self.config.norm_eps)  # [B, T', H]
        return with_kept_layers(final, kept, self.config.norm_eps)
