"""Shared fixtures: seeded RNGs and tiny random-init model pairs built on the fly (no downloads)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def model_zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny target with three drafts sharing its tokenizer:
    `same` (identical weights: everything accepted), `unrelated` (other random weights: almost
    nothing accepted) and `partial` (the target's first layer: often but not always accepted)."""
    from specstream.default_models import build_random_pair
    from specstream.models import write_random_checkpoint
    from specstream.tokenizer import BOS_TOKEN, EOS_TOKEN, build_byte_level_tokenizer, save_tokenizer_files
    import json
    import shutil

    root = tmp_path_factory.mktemp("zoo")
    build_random_pair(root / "target", root / "partial", seed=1, hidden_size=64, layers=3, vocab_size=300,
                      damping=0.3)
    shutil.copytree(root / "target", root / "same")
    config = json.loads((root / "target" / "config.json").read_text())
    config["num_hidden_layers"] = 2
    write_random_checkpoint(root / "unrelated", config, seed=99)
    tok = build_byte_level_tokenizer(vocab_size=300)
    save_tokenizer_files(tok, root / "unrelated", bos=BOS_TOKEN, eos=EOS_TOKEN)
    return {name: root / name for name in ("target", "same", "unrelated", "partial")}
