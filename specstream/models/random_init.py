"""Write a random-weight LlamaForCausalLM checkpoint in Hugging Face layout, with torch + safetensors only.

Contract: ``write_random_checkpoint(path, config, seed, dtype)`` creates ``path`` (if needed) and writes
``config.json`` (``"architectures": ["LlamaForCausalLM"]``, ``model_type`` llama, every field transformers
needs) and ``model.safetensors`` with transformers' tensor names. ``config`` holds LlamaConfig field names
and overrides the small defaults in ``DEFAULT_CONFIG``. The same (config, seed) always gives the same
weights, whatever ``dtype`` (they are drawn in float32, then rounded). The result loads with
``specstream.models.load_model`` and with ``transformers.AutoModelForCausalLM.from_pretrained``.

What it does not know: tokenizers (the caller picks a vocab_size matching its tokenizer) and any other
architecture. Weights are N(0, initializer_range) with unit norms, so outputs are plausible-looking noise:
fine for plumbing, latency and parity tests, meaningless as text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specstream.models.config import parse_config

__all__ = ["write_random_checkpoint", "DEFAULT_CONFIG"]

DEFAULT_CONFIG: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.02,
}

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_random_checkpoint(
    path: str | Path, config: Mapping[str, Any], seed: int, dtype: str = "float32"
) -> Path:
    """Write config.json + model.safetensors of a random LlamaForCausalLM into ``path``; returns the directory."""
    torch_dtype = _DTYPES.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"write_random_checkpoint: dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    root = Path(path)
    cfg: dict[str, Any] = {**DEFAULT_CONFIG, **dict(config)}
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", dtype=dtype)
    # Fails here, before anything is written, if the overrides make an unloadable config.
    parsed = parse_config(cfg, name=root.name, source="write_random_checkpoint config")

    V, H, inter = parsed.vocab_size, parsed.hidden_size, parsed.intermediate_size
    q, kv = parsed.num_heads * parsed.head_dim, parsed.num_kv_heads * parsed.head_dim
    std = float(cfg["initializer_range"])
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).to(torch_dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch_dtype)

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch_dtype)

    # Insertion order fixes the RNG draw order, hence the weights, for a given seed.
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(V, H)}  # [V, H]
    for i in range(parsed.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = ones(H)  # [H]
        tensors[p + "self_attn.q_proj.weight"] = normal(q, H)  # [Hq*D, H]
        tensors[p + "self_attn.k_proj.weight"] = normal(kv, H)  # [Hkv*D, H]
        tensors[p + "self_attn.v_proj.weight"] = normal(kv, H)  # [Hkv*D, H]
        tensors[p + "self_attn.o_proj.weight"] = normal(H, q)  # [H, Hq*D]
        if parsed.qkv_bias:
            tensors[p + "self_attn.q_proj.bias"] = zeros(q)  # [Hq*D]
            tensors[p + "self_attn.k_proj.bias"] = zeros(kv)  # [Hkv*D]
            tensors[p + "self_attn.v_proj.bias"] = zeros(kv)  # [Hkv*D]
            tensors[p + "self_attn.o_proj.bias"] = zeros(H)  # [H]
        tensors[p + "post_attention_layernorm.weight"] = ones(H)  # [H]
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, H)  # [I, H]
        tensors[p + "mlp.up_proj.weight"] = normal(inter, H)  # [I, H]
        tensors[p + "mlp.down_proj.weight"] = normal(H, inter)  # [H, I]
        if parsed.mlp_bias:
            tensors[p + "mlp.gate_proj.bias"] = zeros(inter)  # [I]
            tensors[p + "mlp.up_proj.bias"] = zeros(inter)  # [I]
            tensors[p + "mlp.down_proj.bias"] = zeros(H)  # [H]
    tensors["model.norm.weight"] = ones(H)  # [H]
    if not parsed.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(V, H)  # [V, H]

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    # transformers refuses safetensors files without format metadata.
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root
