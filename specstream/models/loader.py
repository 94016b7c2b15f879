"""Load a Hugging Face checkpoint directory into a ``CausalLM``, reading safetensors only.

Contract: ``load_model(path, dtype, device)`` reads ``config.json`` (+ ``generation_config.json`` for extra
eos ids), picks the model class for its architecture (``MODEL_CLASSES``), and fills it from
``model.safetensors`` or the shards listed in ``model.safetensors.index.json``, converting to ``dtype``;
with ``weights`` "int4"/"auto" it then serves the matrices that ``weights.q4.safetensors`` holds as
4-bit blocks (``int4.py``), and with "int4-rtn" (or "auto" for a draft) rounds a dense one to 4 bits.
Every tensor is shape-checked and every checkpoint tensor must be consumed (apart from known
buffers), so a config that disagrees with its weights fails at load. Every failure is a
``ModelLoadError`` naming the file and the field or tensor. The model comes back in eval mode with
``requires_grad`` off.

What it does not know: tokenizers, the math of any architecture, serving. It never unpickles: a
directory holding only ``pytorch_model.bin`` (or other pickle formats) is refused with a clear error,
because unpickling runs arbitrary code from the checkpoint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kernels import native
from kernels.int4 import Q4_FILE, q4_native, q4_rounded_native, unpack_codes
from specstream.data.config import ROUNDED_ACTIVATIONS, WEIGHT_FORMATS
from specstream.models.base import CausalLM
from specstream.models.config import CONFIG_PARSERS, ModelConfig, ModelLoadError, parse_config
from specstream.models.gpt2 import GPT2LMHeadModel
from specstream.models.llama import LlamaForCausalLM

__all__ = ["load_model", "read_config", "ModelLoadError", "MODEL_CLASSES", "DTYPES", "WEIGHTS", "SafetensorsSource"]

# Architecture name -> implementation; keys mirror config.CONFIG_PARSERS (kept apart to avoid an import cycle).
MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}
assert set(MODEL_CLASSES) == set(CONFIG_PARSERS), "every parsable architecture needs a model class"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

WEIGHTS = WEIGHT_FORMATS  # "auto", "dense", "int4", "int4-rtn": see specstream/data/config.py

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
_INT_DTYPES = frozenset({"I16", "I32", "I64"})
# Checkpoint tensors that are not parameters: causal-mask constants (old GPT-2), cached RoPE frequencies
# (old Llama exports), and lm_head copies stored next to tied embeddings (transformers ties them anyway).
_IGNORED_TENSORS = re.compile(
    r"(^|\.)attn\.(bias|masked_bias)$|\.rotary_emb\.inv_freq$|^lm_head\.weight$"
)


def _read_json(path: Path) -> Any:
    try:
        with path.open("r", encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from e
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from e


class SafetensorsSource:
    """Tensors of one checkpoint directory by name, in the requested dtype/device (a ``TensorSource``)."""

    def __init__(self, root: Path, dtype: torch.dtype, device: torch.device | str) -> None:
        self.root = root
        self.dtype = dtype
        self.device = torch.device(device)
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}
        self._taken: set[str] = set()
        index = root / INDEX_FILE
        single = root / SINGLE_FILE
        if index.is_file():
            self.describe = index  # where a missing tensor "should" have been listed
            self._where = self._read_index(index)
        elif single.is_file():
            self.describe = single
            self._where = {name: single for name in self._open(single).keys()}
        else:
            raise self._no_weights_error()

    def _no_weights_error(self) -> ModelLoadError:
        pickles = sorted(p.name for p in self.root.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
        if pickles:
            return ModelLoadError(
                f"{self.root / pickles[0]}: only pickle weights found ({', '.join(pickles)}); refusing to unpickle "
                f"(it can run arbitrary code). Convert the checkpoint to {SINGLE_FILE}, e.g. "
                f"AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir) with transformers."
            )
        others = sorted(p.name for p in self.root.glob("*.safetensors"))
        hint = f" (found {', '.join(others)}, but no {INDEX_FILE} naming them)" if others else ""
        return ModelLoadError(f"{self.root}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")

    def _read_index(self, index: Path) -> dict[str, Path]:
        raw = _read_json(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ModelLoadError(f"{index}: field 'weight_map' must map tensor names to shard file names")
        where: dict[str, Path] = {}
        for name, shard_name in weight_map.items():
            shard = self.root / shard_name
            if shard.parent != self.root:
                raise ModelLoadError(f"{index}: tensor {name!r} points outside the checkpoint: {shard_name!r}")
            if not shard.is_file():
                raise ModelLoadError(f"{index}: tensor {name!r} is in shard {shard_name}, which does not exist")
            where[name] = shard
        return where

    def _open(self, file: Path) -> Any:
        handle = self._handles.get(file)
        if handle is None:
            try:
                handle = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from e
            self._handles[file] = handle
        return handle

    def has(self, name: str) -> bool:
        return name in self._where

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        file = self._where.get(name)
        if file is None:
            raise ModelLoadError(f"{self.describe}: missing tensor {name!r}")
        handle = self._open(file)
        if name not in handle.keys():
            raise ModelLoadError(f"{file}: missing tensor {name!r} (listed in {INDEX_FILE})")
        sl = handle.get_slice(name)
        got = tuple(sl.get_shape())
        if got != tuple(shape):
            raise ModelLoadError(f"{file}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")
        if sl.get_dtype() not in _FLOAT_DTYPES:
            raise ModelLoadError(
                f"{file}: tensor {name!r} has dtype {sl.get_dtype()}; only float weights are supported"
            )
        self._taken.add(name)
        return handle.get_tensor(name).to(device=self.device, dtype=self.dtype)

    def take_index(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        file = self._where.get(name)
        if file is None:
            raise ModelLoadError(f"{self.describe}: missing tensor {name!r}")
        sl = self._open(file).get_slice(name)
        if tuple(sl.get_shape()) != tuple(shape) or sl.get_dtype() not in _INT_DTYPES:
            raise ModelLoadError(f"{file}: tensor {name!r} must be an integer tensor of shape {list(shape)}, "
                                 f"got {sl.get_dtype()} {list(sl.get_shape())}")
        self._taken.add(name)
        return self._open(file).get_tensor(name).to(device=self.device, dtype=torch.int64)

    def unexpected(self) -> list[str]:
        """Checkpoint tensors nobody took, minus known non-parameters."""
        return sorted(n for n in self._where if n not in self._taken and not _IGNORED_TENSORS.search(n))

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory, without touching its weights."""
    root = Path(path)
    config_file = root / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{config_file}: missing config.json (is {root} a Hugging Face checkpoint directory?)")
    raw = _read_json(config_file)
    gen_file = root / "generation_config.json"
    generation = _read_json(gen_file) if gen_file.is_file() else None
    if generation is not None and not isinstance(generation, dict):
        raise ModelLoadError(f"{gen_file}: top level must be a JSON object")
    return parse_config(raw, name=_model_name(raw, root), source=config_file, generation=generation)


def _model_name(raw: Any, root: Path) -> str:
    """The directory's name, or the name a converter recorded (a GGUF cache directory is named by hash)."""
    ours = raw.get("specstream") if isinstance(raw, dict) else None
    name = ours.get("name") if isinstance(ours, dict) else None
    return name if isinstance(name, str) and name else root.resolve().name


class SharedEmbeddingSource:
    """A draft's tensors, with ``model.embed_tokens.weight`` read from another checkpoint (the
    target whose embedding the draft shares) and checked against the sha256 the draft recorded."""

    NAME = "model.embed_tokens.weight"

    def __init__(self, own: SafetensorsSource, shared_dir: Path, sha256: str) -> None:
        self.own = own
        self.shared_dir = shared_dir
        self.sha256 = sha256

    def has(self, name: str) -> bool:
        return name == self.NAME or self.own.has(name)

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name != self.NAME:
            return self.own.take(name, shape)
        with SafetensorsSource(self.shared_dir, torch.float32, "cpu") as shared:
            embed = shared.take(name, shape)  # [V, H] float32, as the draft was trained against
        digest = embedding_sha256(embed)
        if digest != self.sha256:
            raise ModelLoadError(
                f"{self.shared_dir}: tensor {name!r} has sha256 {digest[:16]}..., but the draft was trained with "
                f"{self.sha256[:16]}... (config.json specstream.shared_embedding): a different target model")
        return embed.to(device=self.own.device, dtype=self.own.dtype)

    def take_index(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.own.take_index(name, shape)


def embedding_sha256(embed: torch.Tensor) -> str:
    """The digest a draft records for the embedding it shares: sha256 of the float32 bytes."""
    import hashlib

    return hashlib.sha256(embed.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def _use_q4(model: CausalLM, file: Path) -> int:
    """Swap the model's matrices that ``file`` has 4-bit data for; returns how many."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names = set(f.keys())

            def parts(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
                keys = (f"{name}.q4_codes", f"{name}.q4_scale", f"{name}.q4_min")
                if not all(k in names for k in keys):
                    return None
                codes, scale, minimum = (f.get_tensor(k) for k in keys)
                if codes.dtype != torch.uint8 or scale.dtype != torch.float32 or minimum.dtype != torch.float32:
                    raise ModelLoadError(f"{file}: tensor {name!r}: 4-bit parts must be uint8 codes and float32 "
                                         f"scale/min, got {codes.dtype}, {scale.dtype}, {minimum.dtype}")
                return unpack_codes(codes), scale, minimum

            swapped = model.use_q4(parts)
    except SafetensorError as e:
        raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from e
    return swapped


def _use_q8_head(model: CausalLM, root: Path) -> bool:
    """Serve the output layer as 8-bit blocks (kernels/int8.py) when the checkpoint's float32 matrix
    is exactly a Q8_0 one and the native CPU kernels load; whether it does."""
    name = getattr(model, "head_name", lambda: None)()
    if name is None or native.library() is None:
        return False
    with safe_open(str(root / "model.safetensors"), framework="pt", device="cpu") as f:
        if name not in f.keys():
            return False
        dense = f.get_tensor(name)
    return dense.dtype == torch.float32 and model.use_q8_head(dense)


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu",
               resolve: Callable[[str], Path] | None = None, weights: str = "dense", draft: bool = False) -> CausalLM:
    """A ready model (eval mode, no grad) from a checkpoint directory; see the module docstring.

    ``resolve`` turns a model reference (a draft's ``specstream.shared_embedding.model``) into a
    checkpoint directory; without it such a draft cannot be loaded. ``weights``: one of ``WEIGHTS``
    (``draft``: the model only proposes, so ``auto`` may round it to 4 bits); the model's ``weights``
    attribute says what was served ("int4 (N matrices)", "int4-a8 (N matrices)", "int4-rtn (N matrices)", ...
    or "dense")."""
    torch_dtype = DTYPES.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"load_model: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if weights not in WEIGHTS:
        raise ValueError(f"load_model: weights {weights!r} is not one of {WEIGHTS}")
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(f"{root}: not a directory (expected a checkpoint with config.json)")
    q4_file = root / Q4_FILE
    if weights in ("int4", "int4-rtn", *ROUNDED_ACTIVATIONS) and torch.device(device).type != "cpu":
        raise ModelLoadError(f"weights={weights!r} runs on the CPU only, got device {device!r}")
    bits = ROUNDED_ACTIVATIONS.get(weights, 0)
    if bits and not q4_rounded_native(torch_dtype, bits):
        raise ModelLoadError(f"weights={weights!r} needs the native library and dtype float32 on a CPU with AVX2"
                             + (", or bfloat16 with AVX-512 BF16 and VNNI" if bits == 8 else "")
                             + f"; got dtype {dtype!r}")
    if weights in ("int4", *ROUNDED_ACTIVATIONS):
        if not q4_file.is_file():
            raise ModelLoadError(f"{root}: weights={weights!r} needs {Q4_FILE}, which converting a GGUF file with "
                                 "Q4_0/Q4_1 tensors writes; this checkpoint has none")
    config = read_config(root)
    if torch.device(device).type == "cpu":
        # The native CPU ops load (or build) now, not in the first forward: a service's first reply
        # must not pay for it (its peers time it).
        native.library()
    with SafetensorsSource(root, torch_dtype, device) as own:
        source: SafetensorsSource | SharedEmbeddingSource = own
        if config.shared_embedding is not None:
            if resolve is None:
                raise ModelLoadError(f"{root / 'config.json'}: shares the embedding of model "
                                     f"{config.shared_embedding!r}, but no model resolver was given")
            assert config.shared_embedding_sha256 is not None, "parse_config requires it"
            source = SharedEmbeddingSource(own, resolve(config.shared_embedding), config.shared_embedding_sha256)
        model = MODEL_CLASSES[config.architecture](config, torch_dtype, device)
        model.load_weights(source)
        extra = own.unexpected()
    if extra:
        shown = ", ".join(repr(n) for n in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise ModelLoadError(
            f"{own.describe}: unexpected tensor(s) {shown} not used by {config.architecture} "
            f"as configured in config.json (num_hidden_layers={config.num_layers})"
        )
    # auto: the checkpoint's own 4-bit matrices wherever a 4-bit kernel beats dense matmuls: bfloat16
    # on a CPU, and float32 on one the native kernel serves (AVX2; ATen's kernel is slower than dense
    # matmuls in float32), there with the layers' inputs rounded to 16 bits per block (int4-a16: a
    # step 1.07-1.22x faster, its logits within 0.001 of the file's on average, 0.11 for the bfloat16 path
    # that AVX-512 machines serve; docs/benchmarks.md, "16-bit layer inputs"). Never int4-a8: its
    # 8-bit inputs are llama.cpp's arithmetic and answers, not the file's (docs/benchmarks.md, "On the
    # AVX2 EPYC itself"), so only a user asks for it. A dense draft is rounded to 4 bits in bfloat16
    # only: in float32 rounding would move its acceptance for a gain not measured.
    cpu = torch.device(device).type == "cpu"
    bf16 = cpu and torch_dtype == torch.bfloat16
    served = weights
    if weights == "auto":
        own = q4_file.is_file() and (bf16 or (cpu and q4_native(torch_dtype)))
        served = "int4" if own else "int4-rtn" if bf16 and draft else "dense"
        if served == "int4" and activation_bits("auto", torch_dtype) == 16:  # float32 on the native kernel
            served = "int4-a16"
    swapped = (_use_q4(model, q4_file) if served in ("int4", *ROUNDED_ACTIVATIONS) else
               model.quantize_int4() if served == "int4-rtn" else 0)
    model.activation_bits = ROUNDED_ACTIVATIONS.get(served, 0) if swapped else 0
    # asked for: an error; auto falls back to dense quietly
    if swapped == 0 and weights in ("int4", "int4-rtn", *ROUNDED_ACTIVATIONS):
        raise ModelLoadError(f"{root}: weights={weights!r}, but none of its matrices fits the int4 kernel "
                             f"({config.architecture})")
    model.weights = f"{served} ({swapped} matrices)" if swapped else "dense"
    if served in ("int4", *ROUNDED_ACTIVATIONS) and _use_q8_head(model, root):
        model.weights += ", 8-bit output layer"
    model.eval()
    model.requires_grad_(False)
    return model


def activation_bits(weights: str, dtype: torch.dtype) -> int:
    """The bits a weight format rounds each block of 32 inputs of its 4-bit matrices to (0: the
    inputs as they are): the named format's (``ROUNDED_ACTIVATIONS``), and for ``auto`` 16 where the
    native kernel rounds ``dtype``'s to 16 (float32 on AVX2). Auto's choice for a target
    (``load_model``) and for a feature draft (feature_draft.py) alike."""
    if weights == "auto":
        return 16 if q4_rounded_native(dtype, 16) else 0
    return ROUNDED_ACTIVATIONS.get(weights, 0)


def serving_choice(model: CausalLM, dtype: str, weights: str) -> str:
    """For the start-up log: the dtype and weights a model serves with, what was asked (``auto``
    decides by the CPU), and the CPU features that decided them (specstream.models.registry
    ``resolve_dtype``; ``load_model``'s weights: the native 4-bit kernel per activation dtype)."""
    from specstream.models.registry import bfloat16_features
    from specstream.serving.compute import cpu_name

    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    chosen = f"dtype {dtype} -> {str(model.dtype).removeprefix('torch.')}; weights {weights} -> {model.weights}"
    if model.device.type != "cpu":
        return f"{chosen}; on {model.device}"
    bf16 = ", ".join(f"{name} {yes(flag)}" for name, flag in bfloat16_features().items())
    kernel = ("none (the native library is not built)" if native.library() is None else
              f"bfloat16 {yes(q4_native(torch.bfloat16))}, float32 {yes(q4_native(torch.float32))}")
    return f"{chosen}; on {cpu_name()}: {bf16}; native 4-bit kernel: {kernel}"
