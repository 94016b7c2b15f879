"""The ``CausalLM`` contract every architecture implements, and the numeric helpers they share.

``CausalLM``: ``new_cache`` and ``forward(input_ids, cache, slots, start_pos)`` (see its docstring),
which is ``hidden(...)`` (the layers and the final norm) followed by ``output_head`` (the LM head).
Knows nothing about checkpoints and weight names (models and ``loader.py`` do that).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from kernels import native
from kernels.lm_head import OutputHead
from specstream.models.attention import CacheBatch
from specstream.models.config import SUPPORTED_ACTIVATIONS, ModelConfig
from specstream.models.kv_cache import KVCache

__all__ = ["CausalLM", "TensorSource", "Q4Parts", "ACTIVATIONS", "rms_norm", "silu_mul"]

# config.json activation name -> function; the same names transformers' ACT2FN uses.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
assert set(ACTIVATIONS) == SUPPORTED_ACTIVATIONS, "config.py validates against this list"


# What a 4-bit checkpoint part is handed to a model as: (codes [N, K] uint8, scale, min [N, K/32] float32),
# or None when the checkpoint has no 4-bit data for that name.
Q4Parts = Callable[[str], "tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None"]


def check_keep(keep: tuple[int, ...], num_layers: int) -> None:
    """``CausalLM.hidden``'s ``keep``: ascending layers 1..num_layers - 1 (the last is the final state)."""
    if any(not 1 <= layer < num_layers for layer in keep) or list(keep) != sorted(set(keep)):
        raise ValueError(f"keep={keep}: layers to keep are ascending, 1..{num_layers - 1}")


def with_kept_layers(final: torch.Tensor, kept: list[torch.Tensor], eps: float) -> torch.Tensor:
    """final [B, T, H] and the kept layers' outputs [B, T, H] each -> [B, T, (len(kept) + 1) H]:
    each kept output RMS-normalized without a weight (their scales differ by layer), then the final."""
    if not kept:
        return final
    ones = torch.ones(final.shape[-1], dtype=final.dtype, device=final.device)
    return torch.cat([*(rms_norm(k, ones, eps) for k in kept), final], dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with transformers' rounding: normalise in float32, round to x's dtype, then scale.
    On CPU, bfloat16 and float32 without gradients take the native op where it is built
    (kernels/csrc/layer_stack.cpp): one call instead of the ~8 ops torch dispatches for it, and in
    bfloat16 the very arithmetic of the native decoder layer, so a model gives the same bits op by
    op and fused."""
    if (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and weight.dtype == x.dtype
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        library = native.library()
        if library is not None:
            return library.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op on the fp32 path
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 I] (gate, then up) -> silu(gate) * up [..., I]. On CPU, float32 and bfloat16
    without gradients take the native op where it is built (kernels/csrc/layer_stack.cpp): the very
    arithmetic of the native decoder layer, so a model gives the same bits op by op and fused (its
    sigmoid from the softmax's e^x, within a few units in the last place of torch's; in bfloat16
    rounded where torch's two ops round)."""
    if (gate_up.device.type == "cpu" and gate_up.dtype in (torch.float32, torch.bfloat16)
            and not (torch.is_grad_enabled() and gate_up.requires_grad)):
        library = native.library()
        if library is not None:
            return library.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class TensorSource(Protocol):
    """What a model needs from a checkpoint: tensors by their checkpoint name, already in model dtype/device."""

    def has(self, name: str) -> bool: ...

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor, checked against ``shape``; raises ModelLoadError naming the file and tensor."""
        ...

    def take_index(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """An integer tensor (token ids) as int64, checked against ``shape``."""
        ...


class CausalLM(torch.nn.Module):
    """Base of every model: a decoder that reads and writes a slot KVCache.

    Subclasses allocate uninitialised parameters in ``__init__`` and fill them in ``load_weights``.
    """

    config: ModelConfig
    weights: str = "dense"  # what load_model served: "dense", "int4 (N matrices)" or "int4-rtn (N matrices)"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def output_token_ids(self) -> torch.Tensor | None:
        """[output_vocab] int64: the token id of each logit column, for models that predict over a
        subset of the vocabulary (drafts); None when logits cover the whole vocabulary in order."""
        return None

    def load_weights(self, source: TensorSource) -> None:
        raise NotImplementedError

    def use_q4(self, parts: Q4Parts) -> int:
        """Serve the weight matrices that ``parts`` has 4-bit data for from that data (``int4.py``)
        instead of their dense copies; returns how many checkpoint matrices now run in 4 bits.
        Architectures without 4-bit support keep everything dense and return 0."""
        return 0

    def quantize_int4(self) -> int:
        """Replace the dense weight matrices the int4 kernel can take by their round-to-nearest 4-bit
        quantization (``int4.rtn_parts``); returns how many. Changes the model: for drafts only.
        Architectures without 4-bit support change nothing and return 0."""
        return 0

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
        self, input_ids: torch.Tensor, cache: KVCache, slots: torch.Tensor, start_pos: torch.Tensor,
        parents: torch.Tensor | None = None,
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
            cache, slots, start_pos, input_ids.shape[1], cfg.num_kv_groups, cfg.max_position_embeddings, parents
        )

    @property
    def exact_trees(self) -> bool:
        """Whether a tree forward (``hidden(parents=...)``) gives each node the bits of the chain
        through it (the native CPU attention); elsewhere only to float tolerance."""
        return False

    @property
    def output_head(self) -> OutputHead:
        """The output layer: ``forward`` is ``output_head.logits(hidden(...))``. The engines hand
        it with the hidden states to the output ops (kernels/), which can fuse it with argmax,
        sampling and verification instead of building [tokens, vocab] logits."""
        raise NotImplementedError

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
        """The forward up to the output layer: final (normed) hidden states [B, T, H] ([B, 1, H] when
        last_only), in the model's dtype; cache writes and arguments as ``forward``. With ``keep``
        (1-based layers below the last, ascending): [B, T', (len(keep) + 1) H], the kept layers'
        outputs first (``with_kept_layers``): what a feature draft reading several layers gets.
        ``parents`` [B, T] int64: the rows are trees, not chains (``CacheBatch``): node t is written
        at start_pos + t and sees the prefix and its ancestors; each node's state is the one the
        chain through it would give."""
        raise NotImplementedError

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
        return self.output_head.logits(self.hidden(input_ids, cache, slots, start_pos, last_only))
