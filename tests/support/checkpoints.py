"""Test helpers: tiny random-init Hugging Face checkpoints built with ``transformers``.

Contract: ``make_hf_checkpoint(path, arch, ...)`` saves a 2-layer, hidden-64 model of one of ``ARCHS``
with ``save_pretrained`` (safetensors; sharded with an index when ``sharded=True``) and returns ``path``.
Weights are deterministic for a given seed. Unlike transformers' own init, norms and biases are
randomised too and the init range is larger, so loading a bias or norm wrong, or mis-masking attention,
moves the logits well past the parity tolerance. ``load_hf_model`` reloads a directory as the eager
transformers reference.

What it does not know: specstream; these only make reference checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "llama3_gqa", "mistral", "qwen2", "gpt2")

# Shared by the Llama-family variants; overrides may replace any field.
_LLAMA_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _config(arch: str, vocab_size: int, overrides: dict[str, Any]) -> Any:
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**{**_LLAMA_COMMON, "vocab_size": vocab_size, **overrides})
    if arch == "llama3_gqa":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # Small, so the scaled, smoothed and untouched frequency bands all occur at head_dim 16.
            "original_max_position_embeddings": 32,
        }
        base = {**_LLAMA_COMMON, "num_key_value_heads": 2, "rope_parameters": rope}
        return tf.LlamaConfig(**{**base, "vocab_size": vocab_size, **overrides})
    if arch == "mistral":
        # A window shorter than the test sequences, so the sliding mask is exercised.
        base = {**_LLAMA_COMMON, "num_key_value_heads": 2, "sliding_window": 6}
        return tf.MistralConfig(**{**base, "vocab_size": vocab_size, **overrides})
    if arch == "qwen2":
        rope = {"rope_type": "default", "rope_theta": 1e6}
        base = {**_LLAMA_COMMON, "num_key_value_heads": 2, "rope_parameters": rope}
        return tf.Qwen2Config(**{**base, "vocab_size": vocab_size, **overrides})
    if arch == "gpt2":
        base = {
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 128,
            "initializer_range": 0.1,
            "bos_token_id": 0,
            "eos_token_id": 0,
        }
        return tf.GPT2Config(**{**base, "vocab_size": vocab_size, **overrides})
    raise ValueError(f"make_hf_checkpoint: unknown arch {arch!r}; expected one of {ARCHS}")


_MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "llama3_gqa": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


def make_hf_checkpoint(
    path: str | Path,
    arch: str,
    vocab_size: int = 128,
    seed: int = 0,
    *,
    sharded: bool = False,
    tie_word_embeddings: bool | None = None,
    **overrides: Any,
) -> Path:
    """Save a tiny random ``arch`` checkpoint into ``path`` (created) and return it."""
    import transformers as tf

    if tie_word_embeddings is not None:
        overrides["tie_word_embeddings"] = tie_word_embeddings
    config = _config(arch, vocab_size, overrides)
    torch.manual_seed(seed)
    model = getattr(tf, _MODEL_CLASSES[arch])(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # transformers initialises norms to 1 and biases to 0, which would hide loading mistakes.
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif p.dim() == 1:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    # ~40 KB shards: several shards plus model.safetensors.index.json for these tiny models.
    model.save_pretrained(out, max_shard_size="40KB" if sharded else "10GB")
    return out


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """The transformers reference for a checkpoint directory: eager attention, eval mode."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=dtype)
    return model.eval()
