"""Model layer of specstream: checkpoint loading, the slot KV cache and the decoder implementations.

Contract: ``load_model(dir)`` turns a Hugging Face checkpoint directory (safetensors only) into a
``CausalLM`` whose ``forward(input_ids, cache, slots, start_pos)`` reads/writes a ``KVCache`` made by
``model.new_cache``; ``write_random_checkpoint`` makes a small random Llama checkpoint for demos and tests.

What it does not know: tokenizers, sampling, speculative verification, scheduling, or transport.
"""

from specstream.models.config import ModelConfig, ModelLoadError
from specstream.models.base import CausalLM
from specstream.models.kv_cache import KVCache
from specstream.models.loader import load_model, read_config
from specstream.models.random_init import write_random_checkpoint

__all__ = [
    "load_model",
    "read_config",
    "ModelLoadError",
    "CausalLM",
    "ModelConfig",
    "KVCache",
    "write_random_checkpoint",
]
