"""Shared fixtures: seeded RNGs and tiny random-init model pairs built on the fly (no downloads)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # The Triton kernels' tests run them in Triton's CPU interpreter; it must be chosen before
    # anything imports Triton. With a GPU they run on it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/container/ runs the built image as three containers: it needs a Docker daemon and the
# image, which neither `make test` nor CI builds. `make container-test` names the folder, which
# pytest then collects; a plain `pytest` run never does.
collect_ignore = ["container"]

# The longest files, first: `make test` runs three workers (pytest-xdist, a file at a time), and a
# long file started last would leave one worker idle while it runs alone.
LONGEST_FIRST = ("test_sampling_exact.py", "test_triton_kernels.py", "test_smollm2.py", "test_bench.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


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
    import json
    import shutil

    from specstream.models.defaults import build_random_pair
    from specstream.models.random_init import write_random_checkpoint
    from specstream.text.tokenizer import BOS_TOKEN, EOS_TOKEN, build_byte_level_tokenizer, save_tokenizer_files

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


@pytest.fixture(scope="session")
def feature_pair(model_zoo, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The zoo's target and a tiny feature draft of it (tests/support/feature_pair.py)."""
    from tests.support.feature_pair import train_feature_pair

    return train_feature_pair(model_zoo, tmp_path_factory.mktemp("feature") / "draft")


@pytest.fixture(scope="session")
def sampling_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 32-token target whose next-token distributions are neither flat nor one-hot (entropy
    1.2-2.4 nats at T 0.7-1.5), and a draft that disagrees with it in structured ways: one layer
    instead of two (the target's second layer is damped, so they agree ~65% of the time), an
    over-confident output layer (x1.3), and tokens 0<->1 and 2<->3 swapped, so q puts mass where
    p has little and gives none where p's top-k keeps the most."""
    import json

    from safetensors.torch import load_file, save_file

    from specstream.models.random_init import write_random_checkpoint

    root = tmp_path_factory.mktemp("sampling_pair")
    config = {"vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "max_position_embeddings": 64, "initializer_range": 0.4,
              "bos_token_id": 30, "eos_token_id": 31}
    write_random_checkpoint(root / "target", config, seed=3)
    weights = load_file(str(root / "target" / "model.safetensors"))
    for name in weights:
        if name.startswith("model.layers.1.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.3
    save_file(weights, str(root / "target" / "model.safetensors"), metadata={"format": "pt"})
    draft = {k: v.clone() for k, v in weights.items() if not k.startswith("model.layers.1.")}
    swap = torch.arange(32)
    swap[:4] = torch.tensor([1, 0, 3, 2])
    draft["lm_head.weight"] = (draft["lm_head.weight"] * 1.3)[swap].contiguous()
    (root / "draft").mkdir()
    save_file(draft, str(root / "draft" / "model.safetensors"), metadata={"format": "pt"})
    target_config = json.loads((root / "target" / "config.json").read_text())
    (root / "draft" / "config.json").write_text(json.dumps({**target_config, "num_hidden_layers": 1}))
    # The same draft predicting over 18 of the 32 tokens only (FR-Spec style): q is 0 elsewhere.
    subset = torch.tensor([0, 1, 2, 3, *range(4, 32, 2)], dtype=torch.int32)
    (root / "draft_subset").mkdir()
    save_file({**draft, "specstream.output_token_ids": subset}, str(root / "draft_subset" / "model.safetensors"),
              metadata={"format": "pt"})
    (root / "draft_subset" / "config.json").write_text(json.dumps(
        {**target_config, "num_hidden_layers": 1, "specstream": {"output_vocab": len(subset)}}))
    return {"target": root / "target", "draft": root / "draft", "draft_subset": root / "draft_subset",
            "feature_draft": _random_feature_draft(root / "target", root / "feature_draft")}


def _random_feature_draft(target_dir: Path, out: Path) -> Path:
    """A feature draft of ``target_dir`` (an EAGLE-style head over its final features,
    specstream/models/feature_draft.py) with random weights, scoring 24 of its 32 tokens (q is 0
    on the other 8): its guesses agree with the target sometimes, as a draft's should here."""
    from specstream.models.feature_draft import save_feature_draft
    from specstream.models.feature_head import FeatureHead
    from specstream.models.loader import read_config
    from tools.distill.feature import _spec

    config = read_config(target_dir)
    torch.manual_seed(4)
    head = FeatureHead(_spec(config, 24))
    head.output_ids.copy_(torch.tensor([*range(16), *range(16, 32, 2)]))  # 24 ids
    save_feature_draft(out, "random-feature", head, str(target_dir), target_dir, (config.num_layers,))
    return out


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory):
    """Throwaway certificates (tools/certs.py): `pki.dir` holds a stack's files from one CA
    (ca.crt, {gateway,target,draft,client}.crt/.key, api-tokens, internal-token); `pki.other` the
    same from another CA, whose certificates every server here must refuse."""
    from tests.support.pki import Pki

    return Pki.make(tmp_path_factory.mktemp("pki"))
