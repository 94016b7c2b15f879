"""GGUF checkpoints: read with the ``gguf`` package, map llama.cpp's names to ours, convert once.

Contract:

* ``GGUFFile(path)`` opens a file (memory-mapped, never unpickled) and checks, before any tensor
  is read, that every tensor's type is known and its bytes lie inside the file; a truncated or
  corrupt file raises ``ModelLoadError`` naming the file and the tensor (or the header).
* ``hf_config(gguf)`` maps ``{arch}.*`` metadata to a Hugging Face ``config.json`` dict for the
  architectures of ``ARCHITECTURES``; ``hf_tensors(gguf, config)`` yields every weight under
  transformers' name as float32, dequantized (``gguf_dequant``) and, for Llama, with llama.cpp's
  Q/K row permutation undone (its converter interleaves the two rotary halves of each head).
  Shapes are checked against the metadata; an unknown tensor name is an error, not ignored.
* ``convert_gguf(path, cache_root)`` writes a checkpoint directory (``config.json``,
  ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``
  with the file's chat template; ``weights.q4.safetensors`` with its Q4_0/Q4_1 matrices as stored,
  see ``hf_q4_tensors``) under ``cache_root/gguf/<sha256 prefix>-v<N>/`` and returns it. The
  key is the file's content hash, so the second start only hashes the file; a converted copy is
  published by an atomic rename under a file lock, so processes starting together convert once.
  ``load_model`` and ``TextTokenizer.from_dir`` then read that directory like any other checkpoint.

What it does not know: the math of the models (``llama.py``), serving, chat rendering.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from kernels.int4 import Q4_FILE, pack_codes
from specstream.models.cache import GGUF_CONVERTER_VERSION, file_sha256, gguf_cache_dir
from specstream.models.config import ModelLoadError
from specstream.models.gguf_dequant import FORMATS, Q4_TYPES, dequantize, nbytes, q4_parts
from specstream.models.gguf_tokenizer import build_gguf_tokenizer

__all__ = ["ARCHITECTURES", "GGUFFile", "convert_gguf", "hf_config", "hf_tensors"]



def _reader_class():
    from gguf import GGUFReader  # imported lazily: only GGUF users pay for it

    class _CheckedReader(GGUFReader):
        """GGUFReader that checks each tensor's type and extent before mapping it, so a bad file
        fails with the tensor's name instead of a reshape error deep in numpy."""

        def _build_tensors(self, start_offs: int, fields: list) -> None:  # type: ignore[override]
            from gguf import GGMLQuantizationType

            size = len(self.data)
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", errors="replace")
                try:
                    kind = GGMLQuantizationType(int(raw_dtype[0])).name
                except ValueError:
                    raise ModelLoadError(f"tensor {name!r}: unknown GGML type id {int(raw_dtype[0])}") from None
                n = int(np.prod(dims.astype(np.int64))) if len(dims) else 1
                if kind not in FORMATS:
                    raise ModelLoadError(
                        f"tensor {name!r}: quantization type {kind} is not supported (supported: {sorted(FORMATS)})"
                    )
                if n % FORMATS[kind].block:
                    raise ModelLoadError(f"tensor {name!r}: {n} elements is not a multiple of the {kind} block size")
                end = int(start_offs + offset[0]) + nbytes(kind, n)
                if end > size:
                    raise ModelLoadError(
                        f"tensor {name!r}: data ends at byte {end} but the file has {size} bytes (truncated file?)"
                    )
            super()._build_tensors(start_offs, fields)

    return _CheckedReader


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # GGMLQuantizationType name, e.g. "Q4_1"
    shape: tuple[int, ...]  # torch order (GGUF's ne reversed): [rows, cols] for a matrix
    raw: np.ndarray  # the tensor's bytes, memory-mapped


class GGUFFile:
    """Metadata and tensors of one GGUF file; errors name the file and the key or tensor."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such GGUF file")
        try:
            reader = _reader_class()(str(self.path))
        except ModelLoadError as e:
            raise ModelLoadError(f"{self.path}: {e}") from None
        except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError, OverflowError) as e:
            raise ModelLoadError(f"{self.path}: not a readable GGUF file: header or metadata is truncated or corrupt ({e})") from e
        self._reader = reader
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except (ValueError, IndexError, UnicodeDecodeError) as e:
                raise ModelLoadError(f"{self.path}: metadata {key!r} cannot be decoded ({e})") from e
        self.tensors: dict[str, GGUFTensor] = {}
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            raw = t.data.reshape(-1).view(np.uint8)
            self.tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name, shape, raw)

    def error(self, key: str, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: metadata {key!r} {problem}")

    def int_(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.metadata.get(key)
        if value is None:
            if default is None:
                raise self.error(key, "is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"= {value!r} must be an integer")
        if value < minimum:
            raise self.error(key, f"= {value} must be >= {minimum}")
        return value

    def float_(self, key: str, default: float) -> float:
        value = self.metadata.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise self.error(key, f"= {value!r} must be a finite number")
        return float(value)

    def str_(self, key: str, default: str | None = None) -> str:
        value = self.metadata.get(key, default)
        if not isinstance(value, str):
            raise self.error(key, "is missing" if value is None else f"= {value!r} must be a string")
        return value

    def read_q4(self, name: str) -> tuple[torch.Tensor, ...]:
        """(codes, scale, min) of a Q4_0/Q4_1 matrix in torch order (``gguf_dequant.q4_parts``)."""
        t = self.tensors[name]
        try:
            return q4_parts(t.raw, t.type_name, t.shape, name)
        except ModelLoadError as e:
            raise ModelLoadError(f"{self.path}: {e}") from None

    def read(self, name: str) -> torch.Tensor:
        """One tensor as float32 in torch order."""
        t = self.tensors[name]
        try:
            return dequantize(t.raw, t.type_name, t.shape, name)
        except ModelLoadError as e:
            raise ModelLoadError(f"{self.path}: {e}") from None


@dataclass(frozen=True)
class Architecture:
    hf_name: str  # config.json "architectures" entry
    permute_qk: bool  # llama.cpp's converter permuted q/k rows for its rotary layout
    qkv_bias: bool  # the attention projections carry biases


# general.architecture -> how it maps. Llama covers Llama 1/2/3 and Mistral-as-Llama files.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("LlamaForCausalLM", permute_qk=True, qkv_bias=False),
    "qwen2": Architecture("Qwen2ForCausalLM", permute_qk=False, qkv_bias=True),
}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


def _architecture(gguf: GGUFFile) -> tuple[str, Architecture]:
    arch = gguf.str_("general.architecture")
    if arch not in ARCHITECTURES:
        raise gguf.error("general.architecture", f"= {arch!r} is not supported (supported: {sorted(ARCHITECTURES)})")
    return arch, ARCHITECTURES[arch]


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """config.json for the file (transformers' field names), from ``{arch}.*`` metadata."""
    arch, spec = _architecture(gguf)
    hidden = gguf.int_(f"{arch}.embedding_length")
    heads = gguf.int_(f"{arch}.attention.head_count")
    kv_heads = gguf.int_(f"{arch}.attention.head_count_kv", default=heads)
    if hidden % heads:
        raise gguf.error(f"{arch}.attention.head_count", f"= {heads} does not divide {arch}.embedding_length = {hidden}")
    head_dim = gguf.int_(f"{arch}.attention.key_length", default=hidden // heads)
    rope_dims = gguf.int_(f"{arch}.rope.dimension_count", default=head_dim)
    if rope_dims != head_dim:
        raise gguf.error(f"{arch}.rope.dimension_count", f"= {rope_dims}: partial rotary (head_dim {head_dim}) is not supported")
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{gguf.path}: tensor 'token_embd.weight' is missing")
    vocab = gguf.int_(f"{arch}.vocab_size", default=embed.shape[0])
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) != vocab:
        raise gguf.error("tokenizer.ggml.tokens", f"has {len(tokens)} tokens but the model's vocabulary is {vocab}")
    rope_scaling = None
    scaling = gguf.metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": gguf.float_(f"{arch}.rope.scaling.factor", 1.0)}
    elif scaling != "none":
        raise gguf.error(f"{arch}.rope.scaling.type", f"= {scaling!r} is not supported (supported: 'none', 'linear')")
    if "rope_freqs.weight" in gguf.tensors:
        raise ModelLoadError(f"{gguf.path}: tensor 'rope_freqs.weight' (per-frequency RoPE factors) is not supported")
    config: dict[str, Any] = {
        "architectures": [spec.hf_name],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": gguf.int_(f"{arch}.feed_forward_length"),
        "num_hidden_layers": gguf.int_(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": gguf.int_(f"{arch}.context_length"),
        "rms_norm_eps": gguf.float_(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": gguf.float_(f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "torch_dtype": "float32",
    }
    for key, field in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if key in gguf.metadata:
            config[field] = gguf.int_(key, minimum=0)
    return config


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` (convert_hf_to_gguf.py): each head's rows were reordered from
    [first rotary half, second half] to interleaved pairs; [rows, cols] -> same shape."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _expected_shape(hf_name: str, config: dict[str, Any]) -> tuple[int, ...] | None:
    H, V, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {
        "embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "norm.weight": (H,),
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "q_proj.weight": (q, H), "k_proj.weight": (kv, H), "v_proj.weight": (kv, H), "o_proj.weight": (H, q),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
        "gate_proj.weight": (inter, H), "up_proj.weight": (inter, H), "down_proj.weight": (H, inter),
    }
    for suffix, shape in shapes.items():
        if hf_name.endswith(suffix):
            return shape
    return None


def _required(gguf: GGUFFile, config: dict[str, Any]) -> list[str]:
    """GGUF names of every tensor the model needs (the output matrix only when untied)."""
    _, spec = _architecture(gguf)
    per_layer = [name for name in _LAYER_TENSORS if spec.qkv_bias or not name.endswith(".bias")]
    names = ["token_embd.weight", "output_norm.weight"]
    names += [f"blk.{i}.{name}" for i in range(config["num_hidden_layers"]) for name in per_layer]
    return names


def hf_tensors(gguf: GGUFFile, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, float32 tensor) for every tensor of the file, checked and un-permuted."""
    arch, spec = _architecture(gguf)
    layers = config["num_hidden_layers"]
    for name, t in gguf.tensors.items():
        if name in _GLOBAL_TENSORS:
            hf_name = _GLOBAL_TENSORS[name]
        else:
            m = _LAYER_NAME.match(name)
            if m is None or m.group(2) not in _LAYER_TENSORS:
                raise ModelLoadError(f"{gguf.path}: tensor {name!r} is not part of a supported {arch} model")
            if int(m.group(1)) >= layers:
                raise ModelLoadError(
                    f"{gguf.path}: tensor {name!r} is past {arch}.block_count = {layers}")
            if m.group(2).endswith(".bias") and not spec.qkv_bias:
                raise ModelLoadError(f"{gguf.path}: tensor {name!r}: attention biases are not supported for {arch}")
            hf_name = f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}"
        want = _expected_shape(hf_name, config)
        if want is not None and t.shape != want:
            raise ModelLoadError(
                f"{gguf.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(want)} from the {arch}.* metadata")
        yield hf_name, _unpermuted(gguf.read(name), name, spec, config)


def _unpermuted(w: torch.Tensor, name: str, spec: Architecture, config: dict[str, Any]) -> torch.Tensor:
    """A tensor with per-row data ([rows, ...]) in transformers' row order."""
    if spec.permute_qk and name.endswith(("attn_q.weight", "attn_k.weight")):
        return _unpermute(w, config["num_attention_heads"] if "attn_q" in name else config["num_key_value_heads"])
    return w


def hf_q4_tensors(gguf: GGUFFile, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The 4-bit matrices of the file as they are stored, for ``models/int4.py``: for each Q4_0/Q4_1
    tensor, ``<hf name>.q4_codes`` ([rows, cols/2] uint8, ``int4.pack_codes``), ``.q4_scale`` and
    ``.q4_min`` ([rows, cols/32] float32), rows in transformers' order. Call after ``hf_tensors``
    has checked names and shapes."""
    _, spec = _architecture(gguf)
    for name, t in gguf.tensors.items():
        if t.type_name not in Q4_TYPES or len(t.shape) != 2:
            continue
        m = _LAYER_NAME.match(name)
        hf_name = _GLOBAL_TENSORS[name] if m is None else f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}"
        codes, scale, minimum = (_unpermuted(part, name, spec, config) for part in gguf.read_q4(name))
        yield f"{hf_name}.q4_codes", pack_codes(codes).contiguous()
        yield f"{hf_name}.q4_scale", scale.contiguous()
        yield f"{hf_name}.q4_min", minimum.contiguous()


def _write_checkpoint(gguf: GGUFFile, out: Path, sha256: str) -> None:
    config = hf_config(gguf)
    tok = build_gguf_tokenizer(gguf.metadata)  # before the weights: a bad tokenizer fails fast
    weights = dict(hf_tensors(gguf, config))
    missing = sorted(set(_required(gguf, config)) - set(gguf.tensors))
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{gguf.path}: missing tensor(s) {shown}")
    config["specstream"] = {"name": gguf.path.name.removesuffix(".gguf"),
                            "source": {"gguf": gguf.path.name, "sha256": sha256,
                                       "converter_version": GGUF_CONVERTER_VERSION}}
    out.mkdir(parents=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    del weights
    q4 = dict(hf_q4_tensors(gguf, config))
    if q4:
        save_file(q4, str(out / Q4_FILE), metadata={"format": "specstream-q4"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    tok.tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tok.tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    # safetensors creates its files 0600 whatever the umask; the weights get the mode the other
    # files got, so that a cache written by one user (an image build's root) serves another (the
    # image's non-root user).
    mode = (out / "config.json").stat().st_mode & 0o777
    for weights_file in out.glob("*.safetensors"):
        weights_file.chmod(mode)


def convert_gguf(path: str | Path, cache_root: str | Path) -> Path:
    """The converted checkpoint directory of a GGUF file (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    sha256 = file_sha256(path)
    out = gguf_cache_dir(sha256, Path(cache_root))
    if (out / "config.json").is_file():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / f"{out.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting the same file
            if (out / "config.json").is_file():
                return out
            for stale in out.parent.glob(f"{out.name}.tmp-*"):  # left by a converter that was killed
                shutil.rmtree(stale, ignore_errors=True)
            tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
            try:
                _write_checkpoint(GGUFFile(path), tmp, sha256)
                shutil.rmtree(out, ignore_errors=True)  # an incomplete copy cannot be there, but be sure
                os.replace(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot write its converted copy under {out.parent} ({e}); "
                             "set SPECSTREAM_HOME to a writable directory") from e
    return out
