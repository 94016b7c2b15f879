"""The models `specstream serve` and `make demo` use when none are given.

The project ships a trained pair in `specstream/demo_models/` (made by `specstream train-demo`;
see the model cards there). Should those files be missing (a stripped install), this falls back
to building a random-init Llama pair and SAYS SO wherever it is used: the target has small deeper
layers so that a draft made of its first layer (same embeddings, norm and head) agrees with it
often, which exercises speculation for real, but the text is gibberish.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from specstream.models.cache import models_home
from specstream.models.random_init import write_random_checkpoint
from specstream.text.tokenizer import BOS_TOKEN, EOS_TOKEN, build_byte_level_tokenizer, save_tokenizer_files

RANDOM_INIT_NOTICE = ("NOTE: using RANDOM-INIT demo models (no trained pair ships yet): the text is gibberish; "
                      "speculation, acceptance and speed are real.")
_VERSION = "random-v2"


SHIPPED = Path(__file__).parent.parent / "demo_models"  # package data of specstream/


def default_model_dirs() -> tuple[Path, Path, bool]:
    """(target dir, draft dir, is_random_init): the shipped pair, else a random pair built on first use."""
    if (SHIPPED / "target" / "model.safetensors").exists() and (SHIPPED / "draft" / "model.safetensors").exists():
        return SHIPPED / "target", SHIPPED / "draft", False
    root = models_home() / _VERSION
    target, draft = root / "target", root / "draft"
    if not (draft / "config.json").exists():
        build_random_pair(target, draft)
    return target, draft, True


def build_random_pair(target: Path, draft: Path, seed: int = 0, hidden_size: int = 512, layers: int = 8,
                      vocab_size: int = 512, damping: float = 0.02) -> None:
    """A random-init target and a one-layer draft cut from it (see the module docstring)."""
    tok = build_byte_level_tokenizer(vocab_size=vocab_size)
    vocab = tok.get_vocab_size()
    config = {
        "vocab_size": vocab, "hidden_size": hidden_size, "intermediate_size": hidden_size * 11 // 4,
        "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": tok.token_to_id(BOS_TOKEN), "eos_token_id": tok.token_to_id(EOS_TOKEN),
    }
    write_random_checkpoint(target, config, seed=seed)
    weights = load_file(str(target / "model.safetensors"))
    # Damp every layer after the first so the one-layer draft predicts like the target most of the time.
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")) and not name.startswith("model.layers.0."):
            weights[name] = tensor * damping
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    draft.mkdir(parents=True, exist_ok=True)
    keep = {k: v.clone() for k, v in weights.items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    save_file(keep, str(draft / "model.safetensors"), metadata={"format": "pt"})
    (draft / "config.json").write_text(json.dumps({**json.loads((target / "config.json").read_text()),
                                                   "num_hidden_layers": 1}, indent=2))
    for path in (target, draft):
        save_tokenizer_files(tok, path, bos=BOS_TOKEN, eos=EOS_TOKEN)
