"""Test helpers: tiny GGUF files written with the ``gguf`` package's own writer and quantizers.

Contract: ``write_gguf(path, hf_dir, ...)`` turns a tiny Hugging Face Llama/Qwen2 checkpoint (see
``tests/support/checkpoints.py``) and a byte-level BPE tokenizer into a GGUF file the way llama.cpp's
``convert_hf_to_gguf.py`` lays it out: llama.cpp tensor names, Q/K rows permuted for Llama, norms in
F32 and matrices in ``qtype``, ``{arch}.*`` hyperparameters and ``tokenizer.ggml.*`` metadata.
``metadata`` overrides or removes (value None) keys; ``tensors`` renames/replaces them (to build
bad files).

What it does not know: specstream (it must not, to be an independent reference).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from safetensors.numpy import load_file

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _NAMES:
        return _NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: rotary halves -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def chatml_tokenizer(vocab_size: int = 300) -> tokenizers.Tokenizer:
    """A byte-level BPE with ChatML's special tokens (ids 0..2) before the byte alphabet."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["The quick brown fox jumps over the lazy dog 12345 times.", "def f(x):\n    return x * 2\n",
              "Speculative decoding verifies a draft's guesses in one forward pass.", "héllo wörld, 你好!"] * 20
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def write_gguf(path: Path, hf_dir: Path, tok: tokenizers.Tokenizer, *, arch: str = "llama", qtype: str = "F32",
               add_bos: bool = False, pre: str | None = "gpt2", chat_template: str | None = CHATML,
               metadata: dict[str, Any] | None = None, tensors: dict[str, np.ndarray | None] | None = None,
               tensor_types: dict[str, str] | None = None) -> Path:
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    writer = gguf.GGUFWriter(str(path), arch)
    meta: dict[str, Any] = {
        f"{arch}.block_count": ("uint32", config["num_hidden_layers"]),
        f"{arch}.context_length": ("uint32", config["max_position_embeddings"]),
        f"{arch}.embedding_length": ("uint32", config["hidden_size"]),
        f"{arch}.feed_forward_length": ("uint32", config["intermediate_size"]),
        f"{arch}.attention.head_count": ("uint32", heads),
        f"{arch}.attention.head_count_kv": ("uint32", kv_heads),
        f"{arch}.rope.freq_base": ("float32", float((config.get("rope_parameters") or {}).get(
            "rope_theta", config.get("rope_theta", 10000.0)))),
        f"{arch}.attention.layer_norm_rms_epsilon": ("float32", float(config["rms_norm_eps"])),
        f"{arch}.vocab_size": ("uint32", config["vocab_size"]),
        "tokenizer.ggml.model": ("string", "gpt2"),
        "tokenizer.ggml.pre": ("string", pre),
        "tokenizer.ggml.bos_token_id": ("uint32", 1),
        "tokenizer.ggml.eos_token_id": ("uint32", 2),
        "tokenizer.ggml.add_bos_token": ("bool", add_bos),
        "tokenizer.chat_template": ("string", chat_template),
    }
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    for key, value in (metadata or {}).items():
        meta[key] = value
    for key, (kind, value) in meta.items():
        if value is None:
            continue
        getattr(writer, f"add_{kind}")(key, value)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3 if t in special else 1 for t in tokens])
    writer.add_array("tokenizer.ggml.merges", merges)
    out: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        w = w.astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = permute(w, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = permute(w, kv_heads)
        out[gguf_name(name)] = w
    for name, replacement in (tensors or {}).items():
        if replacement is None:
            out.pop(name, None)
        else:
            out[name] = replacement
    for name, w in out.items():
        kind = (tensor_types or {}).get(name, qtype if w.ndim == 2 else "F32")
        qt = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(name, w.astype(np.float32))
        elif kind == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qt), raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
