"""Parse a Hugging Face ``config.json`` into a ``ModelConfig``.

Contract: ``parse_config(raw, name=..., source=...)`` turns the JSON of one supported architecture
(see ``CONFIG_PARSERS``) into an immutable ``ModelConfig`` holding every number the model code needs
to allocate parameters and run. Anything that would change the math but that we do not implement
(an unknown architecture, a rope type other than default/linear/llama3, partial rotary, cross
attention, an unknown activation) raises ``ModelLoadError`` naming the file, the field and its value,
rather than silently producing a model that disagrees with the reference implementation.

What it does not know: tensors, dtypes, devices, or how weights are named; that lives in the model
modules (``llama.py``, ``gpt2.py``) and in ``loader.py``, which maps architectures to model classes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ModelLoadError",
    "RopeConfig",
    "ModelConfig",
    "CONFIG_PARSERS",
    "MODEL_TYPE_TO_ARCHITECTURE",
    "SUPPORTED_ROPE_TYPES",
    "card_acceptance",
    "parse_config",
]


class ModelLoadError(ValueError):
    """A checkpoint directory cannot be turned into a model; the message names the file and field/tensor."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, already normalised from either config.json spelling."""

    rope_type: str  # "default" | "linear" | "llama3"
    theta: float
    factor: float = 1.0
    # llama3 only: frequency band edges and the pre-extension context length.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    name: str  # directory name of the checkpoint
    architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    intermediate_size: int
    norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2, Llama attention_bias, GPT-2)
    o_bias: bool  # bias on the attention output projection (Llama attention_bias, GPT-2)
    mlp_bias: bool
    # RoPE models only; None for learned absolute positions (GPT-2).
    rope: RopeConfig | None = None
    # Per layer: sliding-window size in tokens (a query at p sees keys p-w+1..p), None = full causal.
    layer_windows: tuple[int | None, ...] = ()
    # Softmax scale multiplier per layer on top of 1/sqrt(head_dim) (GPT-2 scale_attn_by_inverse_layer_idx).
    attn_scale: float | None = None  # None -> head_dim ** -0.5
    scale_attn_by_inverse_layer_idx: bool = False
    # Drafts (config.json "specstream" object): predict over this many of the vocabulary's tokens
    # only (FR-Spec); their ids are the checkpoint's "specstream.output_token_ids". None: all.
    output_vocab: int | None = None
    # Drafts: read model.embed_tokens.weight from this model (a name or path the caller resolves)
    # at load time instead of shipping a copy; the sha256 of its float32 bytes must match.
    shared_embedding: str | None = None
    shared_embedding_sha256: str | None = None
    # Drafts: the acceptance rate α its card says was measured, per kind ((greedy, α) pairs:
    # True for greedy requests, False for sampled ones); see ``card_acceptance``.
    acceptance: tuple[tuple[bool, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.layer_windows:
            # Hand-built configs (tests, tools) may omit it: every layer is then full causal.
            object.__setattr__(self, "layer_windows", (None,) * self.num_layers)
        assert self.num_heads % self.num_kv_heads == 0, "validated by the parser"
        assert len(self.layer_windows) == self.num_layers, "parsers fill one entry per layer"

    @property
    def num_kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def softmax_scale(self, layer: int) -> float:
        scale = self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale
        if self.scale_attn_by_inverse_layer_idx:
            scale /= float(layer + 1)
        return scale


class _Fields:
    """Typed access to one config.json dict; every failure names the file and field."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def error(self, field: str, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: field {field!r} {problem}")

    def _lookup(self, names: tuple[str, ...]) -> tuple[str, Any]:
        for n in names:
            if n in self.raw and self.raw[n] is not None:
                return n, self.raw[n]
        return names[0], None

    def int_(self, *names: str, default: int | None = None, minimum: int = 1) -> int:
        """The first present name's value; ``default`` if none is present, else a 'missing' error."""
        field, value = self._lookup(names)
        if value is None:
            if default is not None:
                return default
            raise self.error(field, "is missing")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(field, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.error(field, f"must be >= {minimum}, got {value}")
        return value

    def opt_int(self, *names: str) -> int | None:
        field, value = self._lookup(names)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(field, f"must be an integer or null, got {value!r}")
        return value

    def float_(self, *names: str, default: float) -> float:
        field, value = self._lookup(names)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(field, f"must be a number, got {value!r}")
        return float(value)

    def bool_(self, *names: str, default: bool) -> bool:
        field, value = self._lookup(names)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(field, f"must be true/false, got {value!r}")
        return value

    def str_(self, *names: str, default: str) -> str:
        field, value = self._lookup(names)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(field, f"must be a string, got {value!r}")
        return value

    def token_ids(self, field: str) -> tuple[int, ...]:
        value = self.raw.get(field)
        if value is None:
            return ()
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int):
                raise self.error(field, f"must be an integer or a list of integers, got {value!r}")
        return tuple(values)


# Activations the model code implements; checked here so an unknown one fails at load, not mid-request.
SUPPORTED_ACTIVATIONS: frozenset[str] = frozenset({"silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu"})
SUPPORTED_ROPE_TYPES: frozenset[str] = frozenset({"default", "linear", "llama3"})


def _parse_rope(f: _Fields, max_position_embeddings: int) -> RopeConfig:
    """Accept both transformers-5 ``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling``."""
    field = "rope_parameters" if f.raw.get("rope_parameters") is not None else "rope_scaling"
    params = f.raw.get(field) or {}
    if not isinstance(params, Mapping):
        raise f.error(field, f"must be an object, got {params!r}")
    if any(isinstance(v, Mapping) for v in params.values()):
        raise f.error(field, "per-layer-type rope parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = sorted(SUPPORTED_ROPE_TYPES)
        raise f.error(f"{field}.rope_type", f"= {rope_type!r} is not supported (supported: {supported})")
    partial = params.get("partial_rotary_factor", f.raw.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise f.error("partial_rotary_factor", f"= {partial!r} is not supported (only 1.0)")

    theta_value = params.get("rope_theta")
    if theta_value is None:
        theta_value = f.raw.get("rope_theta")
    if theta_value is None:
        theta_value = 10000.0  # transformers' default_theta
    if isinstance(theta_value, bool) or not isinstance(theta_value, (int, float)) or theta_value <= 0:
        raise f.error("rope_theta", f"must be a positive number, got {theta_value!r}")
    sub = _Fields(params, f"{f.source} ({field})")
    if rope_type == "default":
        return RopeConfig("default", float(theta_value))
    if params.get("factor") is None:
        raise f.error(f"{field}.factor", f"is missing (required for rope_type {rope_type!r})")
    factor = sub.float_("factor", default=1.0)
    if rope_type == "linear":
        return RopeConfig("linear", float(theta_value), factor=factor)
    # llama3: transformers falls back to max_position_embeddings when the original length is absent.
    return RopeConfig(
        "llama3",
        float(theta_value),
        factor=factor,
        low_freq_factor=sub.float_("low_freq_factor", default=1.0),
        high_freq_factor=sub.float_("high_freq_factor", default=4.0),
        # A top-level original_max_position_embeddings wins, as in transformers (Phi-3 style configs).
        original_max_position_embeddings=f.int_(
            "original_max_position_embeddings",
            default=sub.int_("original_max_position_embeddings", default=max_position_embeddings),
        ),
    )


def _common_tokens(f: _Fields, generation: Mapping[str, Any] | None) -> tuple[int | None, tuple[int, ...]]:
    bos = f.opt_int("bos_token_id")
    eos = list(f.token_ids("eos_token_id"))
    if generation is not None:
        g = _Fields(generation, f.source.replace("config.json", "generation_config.json"))
        if bos is None:
            bos = g.opt_int("bos_token_id")
        for t in g.token_ids("eos_token_id"):
            if t not in eos:
                eos.append(t)
    return bos, tuple(eos)


def _heads(f: _Fields, hidden: int, heads_field: tuple[str, ...]) -> tuple[int, int, int]:
    num_heads = f.int_(*heads_field)
    num_kv_heads = f.int_("num_key_value_heads", default=num_heads)
    if num_heads % num_kv_heads != 0:
        raise f.error("num_key_value_heads", f"= {num_kv_heads} must divide num_attention_heads = {num_heads}")
    head_dim = f.opt_int("head_dim")
    if head_dim is None:
        if hidden % num_heads != 0:
            raise f.error("hidden_size", f"= {hidden} is not divisible by num_attention_heads = {num_heads}")
        head_dim = hidden // num_heads
    if head_dim <= 0 or head_dim % 2 != 0:
        raise f.error("head_dim", f"= {head_dim} must be a positive even number")
    return num_heads, num_kv_heads, head_dim


def _activation(f: _Fields, *names: str, default: str) -> str:
    act = f.str_(*names, default=default)
    if act not in SUPPORTED_ACTIVATIONS:
        raise f.error(names[0], f"= {act!r} is not supported (supported: {sorted(SUPPORTED_ACTIVATIONS)})")
    return act


def _parse_llama_family(
    f: _Fields, name: str, architecture: str, generation: Mapping[str, Any] | None
) -> ModelConfig:
    hidden = f.int_("hidden_size")
    num_layers = f.int_("num_hidden_layers")
    num_heads, num_kv_heads, head_dim = _heads(f, hidden, ("num_attention_heads",))
    max_pos = f.int_("max_position_embeddings")
    bos, eos = _common_tokens(f, generation)

    if architecture == "Qwen2ForCausalLM":
        qkv_bias, o_bias, mlp_bias = True, False, False
        layer_windows = _qwen2_windows(f, num_layers)
    else:
        attention_bias = f.bool_("attention_bias", default=False)
        qkv_bias, o_bias = attention_bias, attention_bias
        mlp_bias = f.bool_("mlp_bias", default=False) if architecture == "LlamaForCausalLM" else False
        if architecture == "MistralForCausalLM":
            window = f.opt_int("sliding_window")
            if window is not None and window < 1:
                raise f.error("sliding_window", f"must be >= 1 or null, got {window}")
            layer_windows = (window,) * num_layers
        else:
            layer_windows = (None,) * num_layers

    return ModelConfig(
        name=name,
        architecture=architecture,
        vocab_size=f.int_("vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        bos_token_id=bos,
        eos_token_ids=eos,
        intermediate_size=f.int_("intermediate_size"),
        norm_eps=f.float_("rms_norm_eps", default=1e-6),
        hidden_act=_activation(f, "hidden_act", default="silu"),
        tie_word_embeddings=f.bool_("tie_word_embeddings", default=False),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        rope=_parse_rope(f, max_pos),
        layer_windows=layer_windows,
    )


def _qwen2_windows(f: _Fields, num_layers: int) -> tuple[int | None, ...]:
    """Qwen2 only slides when use_sliding_window, and then only from max_window_layers on (or per layer_types)."""
    if not f.bool_("use_sliding_window", default=False):
        return (None,) * num_layers
    window = f.opt_int("sliding_window")
    if window is None:
        return (None,) * num_layers
    if window < 1:
        raise f.error("sliding_window", f"must be >= 1 or null, got {window}")
    layer_types = f.raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise f.error("layer_types", f"must be a list of {num_layers} strings, got {layer_types!r}")
        kinds = {"sliding_attention": window, "full_attention": None}
        for t in layer_types:
            if t not in kinds:
                raise f.error("layer_types", f"contains unsupported layer type {t!r}")
        return tuple(kinds[t] for t in layer_types)
    first = f.int_("max_window_layers", default=28, minimum=0)
    return tuple(window if i >= first else None for i in range(num_layers))


def _parse_gpt2(f: _Fields, name: str, architecture: str, generation: Mapping[str, Any] | None) -> ModelConfig:
    hidden = f.int_("n_embd", "hidden_size")
    num_layers = f.int_("n_layer", "num_hidden_layers")
    num_heads = f.int_("n_head", "num_attention_heads")
    if hidden % num_heads != 0:
        raise f.error("n_embd", f"= {hidden} is not divisible by n_head = {num_heads}")
    if f.bool_("add_cross_attention", default=False):
        raise f.error("add_cross_attention", "= true is not supported")
    bos, eos = _common_tokens(f, generation)
    scale_weights = f.bool_("scale_attn_weights", default=True)
    return ModelConfig(
        name=name,
        architecture=architecture,
        vocab_size=f.int_("vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        max_position_embeddings=f.int_("n_positions", "max_position_embeddings"),
        bos_token_id=bos,
        eos_token_ids=eos,
        intermediate_size=f.int_("n_inner", default=4 * hidden),
        norm_eps=f.float_("layer_norm_epsilon", default=1e-5),
        hidden_act=_activation(f, "activation_function", default="gelu_new"),
        tie_word_embeddings=f.bool_("tie_word_embeddings", default=True),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        rope=None,
        layer_windows=(None,) * num_layers,
        attn_scale=None if scale_weights else 1.0,
        scale_attn_by_inverse_layer_idx=f.bool_("scale_attn_by_inverse_layer_idx", default=False),
    )


ConfigParser = Callable[[_Fields, str, str, Mapping[str, Any] | None], ModelConfig]

# Architecture name (config.json "architectures") -> parser. loader.MODEL_CLASSES has the same keys.
CONFIG_PARSERS: dict[str, ConfigParser] = {
    "LlamaForCausalLM": _parse_llama_family,
    "MistralForCausalLM": _parse_llama_family,
    "Qwen2ForCausalLM": _parse_llama_family,
    "GPT2LMHeadModel": _parse_gpt2,
}

# For config.json files without "architectures" (hand-written or very old ones).
MODEL_TYPE_TO_ARCHITECTURE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


def _architecture(f: _Fields) -> str:
    archs = f.raw.get("architectures")
    if archs is None:
        model_type = f.raw.get("model_type")
        if model_type in MODEL_TYPE_TO_ARCHITECTURE:
            return MODEL_TYPE_TO_ARCHITECTURE[model_type]
        raise f.error("architectures", f"is missing and model_type {model_type!r} is not recognised")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise f.error("architectures", f"must be a non-empty list of strings, got {archs!r}")
    for a in archs:
        if a in CONFIG_PARSERS:
            return a
    raise f.error("architectures", f"= {archs!r} is not supported (supported: {sorted(CONFIG_PARSERS)})")


def parse_config(
    raw: Mapping[str, Any],
    *,
    name: str,
    source: str | Path = "config.json",
    generation: Mapping[str, Any] | None = None,
) -> ModelConfig:
    """Build a ModelConfig from config.json's dict (and generation_config.json's, for extra eos ids).

    ``source`` only appears in error messages; ``name`` becomes ``ModelConfig.name``.
    """
    f = _Fields(raw, str(source))
    if not isinstance(raw, Mapping):
        raise ModelLoadError(f"{source}: top level must be a JSON object")
    architecture = _architecture(f)
    config = CONFIG_PARSERS[architecture](f, name, architecture, generation)
    return _parse_extension(f, config)


def _parse_extension(f: _Fields, config: ModelConfig) -> ModelConfig:
    """Our own optional "specstream" object of config.json (transformers ignores unknown keys)."""
    ext = f.raw.get("specstream")
    if ext is None:
        return config
    if not isinstance(ext, Mapping):
        raise f.error("specstream", f"must be an object, got {ext!r}")
    x = _Fields(ext, f"{f.source} (specstream)")
    output_vocab = x.opt_int("output_vocab")
    if output_vocab is not None and not 1 <= output_vocab <= config.vocab_size:
        raise x.error("output_vocab", f"= {output_vocab} must be in 1..vocab_size ({config.vocab_size})")
    shared = ext.get("shared_embedding")
    model = sha = None
    if shared is not None:
        if not isinstance(shared, Mapping):
            raise x.error("shared_embedding", f"must be an object with 'model' and 'sha256', got {shared!r}")
        s = _Fields(shared, f"{f.source} (specstream.shared_embedding)")
        model, sha = s.str_("model", default=""), s.str_("sha256", default="")
        if not model or len(sha) != 64:
            raise x.error("shared_embedding", f"needs 'model' and a 64-hex-digit 'sha256', got {dict(shared)!r}")
        if config.architecture not in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
            raise x.error("shared_embedding", f"is not supported for {config.architecture}")
    if output_vocab is not None and config.architecture == "GPT2LMHeadModel":
        raise x.error("output_vocab", "is not supported for GPT2LMHeadModel")
    return dataclasses.replace(config, output_vocab=output_vocab, shared_embedding=model, shared_embedding_sha256=sha,
                               acceptance=card_acceptance(ext, f.source))


def card_acceptance(ext: Mapping[str, Any], source: str) -> tuple[tuple[bool, float], ...]:
    """A draft card's measured acceptance rates (config.json "specstream"."acceptance": {"greedy": α,
    "sampled": α}, either optional; written by the tools that train drafts, from held-out requests
    verified by the target) as (greedy, α) pairs. The target's γ controller starts its estimate of
    the draft's proposals of each kind there instead of a guess (target_service/gamma.py)."""
    raw = ext.get("acceptance")
    if raw is None:
        return ()
    if not isinstance(raw, Mapping) or not set(raw) <= {"greedy", "sampled"}:
        raise ModelLoadError(f"{source}: field 'specstream.acceptance' must be an object with 'greedy' and/or "
                             f"'sampled', got {raw!r}")
    out = []
    for kind, greedy in (("greedy", True), ("sampled", False)):
        value = raw.get(kind)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
            raise ModelLoadError(f"{source}: field 'specstream.acceptance.{kind}' must be a number between 0 and 1 "
                                 f"(exclusive), got {value!r}")
        out.append((greedy, float(value)))
    return tuple(out)
