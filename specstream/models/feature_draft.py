"""A feature draft on disk: an EAGLE-style head (specstream/models/feature_head.py) packaged to serve.

A directory holds ``config.json`` and ``model.safetensors``: the head's norms in bfloat16, its
``output_ids``, and each matrix either in bfloat16 (``<name>.weight``) or, as the shipped draft is
stored, in the 4 bits it is served with on a CPU (``<name>.q4_codes`` packed two to a byte,
``.q4_scale`` and ``.q4_min`` per block of 32, float16: round to nearest, ``kernels.int4.rtn_parts``);
dense serving dequantizes those. ``config.json``'s ``specstream`` object says what it is and what it reads::

    {"specstream": {"name": "smollm2-135m-feature", "kind": "feature_head",
                    "head": {HeadSpec fields},
                    "target": {"model": "smollm2", "sha256": "<embedding digest>", "layers": [30]}}}

The head reads the target's input embedding and output rows, which are not stored: they are read
from the target's checkpoint (``target.model``, resolved by the caller), and the embedding's digest
must be the one recorded at training time (as a token draft's shared embedding is checked).
``target.layers`` are the target layers whose features the head reads (num_hidden_layers: the final,
normed hidden state), which the draft service reports in GetInfo.

What it does not know: serving (draft_service/feature.py), training (tools.distill.feature).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kernels.int4 import Q4Weight, pack_codes, q4_dense, q4_native, q4_rounded_native, rtn_parts, unpack_codes
from kernels.lm_head import OutputHead
from specstream.data.config import ROUNDED_ACTIVATIONS
from specstream.models.config import ModelLoadError, card_acceptance
from specstream.models.feature_head import FeatureHead, HeadSpec
from specstream.models.loader import DTYPES, SafetensorsSource, activation_bits, embedding_sha256, read_config

__all__ = ["KIND", "FeatureDraft", "dense_head_state", "feature_draft_layers", "is_feature_draft",
           "load_feature_draft", "save_feature_draft", "target_parts"]

KIND = "feature_head"
WEIGHTS = "model.safetensors"
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


@dataclass
class FeatureDraft:
    name: str
    head: FeatureHead  # float32 parameters, eval mode; served in ``dtype`` (FeatureHead.serve)
    embed: torch.Tensor  # [V, H] the target's input embedding (bfloat16)
    rows: torch.Tensor  # [N, H] float32: the target's output rows of head.output_ids
    target_layers: tuple[int, ...]  # the target layers whose features it reads
    output: OutputHead  # the rows as served: dense in ``dtype``, or 4-bit
    dtype: torch.dtype = torch.float32  # the activations' when serving
    weights: str = "dense"  # what was served: "dense", "int4 (N matrices)" or "int4-a16 (N matrices)"
    acceptance: tuple[tuple[bool, float], ...] = ()  # its card's measured α per kind (card_acceptance)
    target_dir: Path | None = None  # the target's checkpoint (its tokenizer is the head's)

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]


def _ours(path: Path) -> dict | None:
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    ours = raw.get("specstream") if isinstance(raw, dict) else None
    return ours if isinstance(ours, dict) and ours.get("kind") == KIND else None


def is_feature_draft(path: str | Path) -> bool:
    """Whether ``path`` is a feature draft's directory (else: a model checkpoint, or nothing)."""
    return _ours(Path(path)) is not None


def feature_draft_layers(path: str | Path) -> tuple[int, ...]:
    """The target layers the feature draft at ``path`` reads (the last: the final state), as its config records them."""
    ours = _ours(Path(path))
    if ours is None:
        raise ValueError(f"{path}: not a feature draft (no specstream.kind={KIND!r} in its config.json)")
    return tuple(ours["target"]["layers"])


def target_parts(target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, H] and output layer [V, H] (its tied embedding when it has
    none of its own), float32, as its checkpoint holds them."""
    config = read_config(target_dir)
    shape = (config.vocab_size, config.hidden_size)
    with SafetensorsSource(target_dir, torch.float32, "cpu") as source:
        embed = source.take(EMBED, shape)
        head = source.take(LM_HEAD, shape) if source.has(LM_HEAD) else embed
    return embed, head


def load_feature_draft(path: str | Path, resolve: Callable[[str], Path], dtype: str = "float32",
                       weights: str = "dense") -> FeatureDraft:
    """The head at ``path`` with the parts of the target it reads; ``resolve`` turns the recorded
    target reference into its checkpoint directory. Served with ``dtype`` activations; ``weights``
    "auto" serves its matrices and output rows in 4 bits where the int4 kernel serves ``dtype``
    (bfloat16 with AVX-512 BF16, float32 with AVX2): the shipped head's own stored blocks, a
    dense one's rounded to nearest; "int4" / "int4-rtn" always, "dense" never. Their inputs are
    rounded as the format rounds a target's (``activation_bits``: "int4-a8" / "int4-a16" to 8 / 16
    bits per block of 32, "auto" to 16 in float32 on AVX2), where the native kernel can. Errors
    name the file and the field."""
    root = Path(path)
    ours = _ours(root)
    where = root / "config.json"
    if ours is None:
        raise ModelLoadError(f"{where}: not a feature draft (specstream.kind must be {KIND!r})")
    try:
        spec = HeadSpec(**ours["head"])
        target = ours["target"]
        ref, digest, layers = str(target["model"]), str(target["sha256"]), tuple(int(x) for x in target["layers"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{where}: specstream.head / specstream.target malformed ({e!r}); expected the "
                             "HeadSpec fields and target.model, target.sha256, target.layers") from e
    if not layers:
        raise ModelLoadError(f"{where}: specstream.target.layers is empty: a feature draft reads at least one layer")
    if layers[:-1] != spec.extra_layers:
        raise ModelLoadError(f"{where}: specstream.target.layers={list(layers)}, but the head reads "
                             f"{list(spec.extra_layers)} before the final layer (specstream.head.extra_layers)")
    acceptance = card_acceptance(ours, str(where))
    head = FeatureHead(spec)
    try:
        state, parts = _dense_state(load_file(str(root / WEIGHTS)))
        head.load_state_dict(state)
    except (OSError, RuntimeError, KeyError, ValueError) as e:
        raise ModelLoadError(f"{root / WEIGHTS}: not the weights of the head config.json describes ({e})") from e
    head.eval().requires_grad_(False)
    embed, out = target_parts(resolve(ref))
    if embed.shape[1] != spec.hidden:
        raise ModelLoadError(f"{where}: specstream.head.hidden={spec.hidden}, but target {ref!r} has hidden size "
                             f"{embed.shape[1]}")
    if embedding_sha256(embed) != digest:
        raise ModelLoadError(f"{where}: target {ref!r} has an embedding with a different sha256 than the head was "
                             f"trained with (specstream.target.sha256 {digest[:16]}...): a different target model")
    rows = out[head.output_ids].contiguous()  # [N, H]
    torch_dtype = DTYPES[dtype]
    int4 = weights in ("int4", "int4-rtn", *ROUNDED_ACTIVATIONS) or (weights == "auto" and q4_native(torch_dtype))
    bits = activation_bits(weights, torch_dtype) if int4 else 0
    bits = bits if q4_rounded_native(torch_dtype, bits) else 0
    swapped = head.serve(torch_dtype, int4, parts, bits)
    served_rows = Q4Weight.from_parts(*rtn_parts(rows), torch_dtype) if int4 and Q4Weight.fits(*rows.shape) \
        else rows.to(torch_dtype)
    swapped += isinstance(served_rows, Q4Weight)
    served = f"int4-a{bits}" if bits else "int4"
    return FeatureDraft(str(ours.get("name") or root.name), head, embed.to(torch.bfloat16), rows, layers,
                        OutputHead(served_rows, bits=bits), torch_dtype,
                        f"{served} ({swapped} matrices)" if swapped else "dense", acceptance, Path(resolve(ref)))


def dense_head_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The float32 state dict of the head stored at ``path`` (its 4-bit matrices dequantized): where
    a further training of it starts (tools/distill/feature.py)."""
    return _dense_state(load_file(str(Path(path) / WEIGHTS)))[0]


def _dense_state(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """The file's tensors -> (a float32 state dict for FeatureHead, {matrix: its 4-bit parts})."""
    state, parts = {}, {}
    for key, value in tensors.items():
        if key.endswith(".q4_codes"):
            name = key[: -len(".q4_codes")]
            codes = unpack_codes(value)  # [N, K]
            scale, minimum = tensors[f"{name}.q4_scale"].float(), tensors[f"{name}.q4_min"].float()
            parts[name] = (codes, scale, minimum)
            state[f"{name}.weight"] = q4_dense(codes, scale, minimum, torch.float32)
        elif not key.endswith((".q4_scale", ".q4_min")):
            state[key] = value.float() if value.is_floating_point() else value
    return state, parts


def save_feature_draft(out_dir: Path, name: str, head: FeatureHead, target_ref: str, target_dir: Path,
                       layers: tuple[int, ...], int4: bool = False) -> None:
    """Writes ``head`` as a feature draft of the target ``target_ref``: its weights in bfloat16, or
    with ``int4`` each matrix the int4 kernel takes in the 4 bits it is served with on a CPU."""
    out_dir.mkdir(parents=True, exist_ok=True)
    embed, _ = target_parts(target_dir)
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
               for k, v in head.state_dict().items()}
    for matrix in head.matrices if int4 else ():
        w = tensors[f"{matrix}.weight"].float()  # [N, K]: the bfloat16 values, as a bfloat16 file serves them
        if Q4Weight.fits(*w.shape):
            codes, scale, minimum = rtn_parts(w)
            del tensors[f"{matrix}.weight"]
            tensors |= {f"{matrix}.q4_codes": pack_codes(codes).contiguous(),
                        f"{matrix}.q4_scale": scale.to(torch.float16), f"{matrix}.q4_min": minimum.to(torch.float16)}
    save_file(tensors, str(out_dir / WEIGHTS))
    config = {"specstream": {"name": name, "kind": KIND, "head": head.spec.to_json(),
                             "target": {"model": target_ref, "sha256": embedding_sha256(embed), "layers": list(layers)}}}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
