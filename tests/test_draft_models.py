"""Drafts that share the target's embedding (read at load time, sha256-checked) and predict over a
subset of the vocabulary (FR-Spec): loading, logits, the proposer's id mapping, and lossless
greedy speculation with such a draft through the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_service.proposer import DraftProposer
from specstream.data.propose import ProposeItem
from specstream.data.sampling import SamplingParams
from specstream.models.config import ModelLoadError
from specstream.models.loader import embedding_sha256, load_model
from tests.support.engine_harness import run_engine

SUBSET = [0, 1, 2, *range(3, 300, 3)]  # 102 of the 300 tokens, EOS (1) among them


@pytest.fixture(scope="module")
def drafts(model_zoo, tmp_path_factory) -> dict[str, Path]:
    """`full`: the zoo's one-layer partial draft (the target's first layer, embedding and head);
    `shared`: the same, reading the embedding from the target and predicting over SUBSET."""
    root = tmp_path_factory.mktemp("drafts")
    target = model_zoo["target"]
    weights = load_file(str(model_zoo["partial"] / "model.safetensors"))
    config = json.loads((model_zoo["partial"] / "config.json").read_text())
    embed = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    full = {**weights, "model.embed_tokens.weight": embed}
    (root / "full").mkdir()
    save_file(full, str(root / "full" / "model.safetensors"))
    (root / "full" / "config.json").write_text(json.dumps(config))
    # Untied, as the zoo's target: the subset's head rows come from lm_head.weight.
    own = {k: v for k, v in weights.items() if k != "model.embed_tokens.weight"}
    own["specstream.output_token_ids"] = torch.tensor(SUBSET, dtype=torch.int32)
    (root / "shared").mkdir()
    save_file(own, str(root / "shared" / "model.safetensors"))
    ext = {"output_vocab": len(SUBSET), "shared_embedding": {"model": "zoo-target", "sha256": embedding_sha256(embed)}}
    (root / "shared" / "config.json").write_text(json.dumps({**config, "specstream": ext}))
    return {"full": root / "full", "shared": root / "shared", "target": target}


def _resolver(drafts):
    return lambda ref: drafts["target"] if ref == "zoo-target" else pytest.fail(f"unexpected reference {ref}")


def test_a_shared_embedding_subset_draft_computes_the_full_drafts_logit_columns(drafts) -> None:
    full = load_model(drafts["full"])
    shared = load_model(drafts["shared"], resolve=_resolver(drafts))
    assert shared.output_token_ids.tolist() == SUBSET and full.output_token_ids is None
    ids = torch.tensor([[0, 17, 42, 99, 5]])
    outs = []
    for model in (full, shared):
        cache = model.new_cache(1, 16)
        with torch.inference_mode():
            outs.append(model(ids, cache, torch.tensor([cache.alloc()]), torch.tensor([0])))
    assert outs[1].shape[-1] == len(SUBSET)
    assert torch.allclose(outs[1], outs[0][..., SUBSET], atol=1e-5)


def test_the_shared_embedding_must_be_the_one_trained_with(drafts, tmp_path) -> None:
    other = tmp_path / "other-target"
    other.mkdir()
    weights = load_file(str(drafts["target"] / "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] + 1e-3
    save_file(weights, str(other / "model.safetensors"))
    (other / "config.json").write_text((drafts["target"] / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="a different target model"):
        load_model(drafts["shared"], resolve=lambda ref: other)
    with pytest.raises(ModelLoadError, match="no model resolver was given"):
        load_model(drafts["shared"])


def test_output_ids_are_checked(drafts, tmp_path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    weights = load_file(str(drafts["shared"] / "model.safetensors"))
    weights["specstream.output_token_ids"] = torch.tensor([0, 0, *SUBSET[2:]], dtype=torch.int32)
    save_file(weights, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((drafts["shared"] / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="must be distinct ids"):
        load_model(bad, resolve=_resolver(drafts))
    config = json.loads((drafts["shared"] / "config.json").read_text())
    config["specstream"]["output_vocab"] = 301
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"output_vocab' = 301 must be in 1..vocab_size \(300\)"):
        load_model(bad, resolve=_resolver(drafts))


def test_the_proposer_sends_token_ids_not_columns(drafts) -> None:
    proposer = DraftProposer(load_model(drafts["shared"], resolve=_resolver(drafts)), 4, 64)
    greedy, sampled = proposer.propose([
        ProposeItem("g", 0, [0, 17, 42], 4),
        ProposeItem("s", 0, [0, 17, 42], 4, SamplingParams(temperature=1.0, seed=3)),
    ])
    assert len(greedy.tokens) == 4 and set(greedy.tokens) <= set(SUBSET)
    assert len(sampled.tokens) == 4 and set(sampled.tokens) <= set(SUBSET)
    width = sampled.q_width
    for row in range(4):
        ids = sampled.q_ids[row * width : (row + 1) * width]
        probs = sampled.q_probs[row * width : (row + 1) * width]
        assert set(i for i, p in zip(ids, probs) if p > 0) <= set(SUBSET)
        assert abs(sum(probs) - 1) < 1e-5
        assert sampled.tokens[row] in [i for i, p in zip(ids, probs) if p > 0]


def test_greedy_speculation_with_a_subset_draft_equals_plain_decoding(drafts) -> None:
    prompts = [[0, 5, 9], [0, 17, 42, 99, 5, 3], [0, 250]]
    proposer = DraftProposer(load_model(drafts["shared"], resolve=_resolver(drafts)), 16, 128)
    plain, _ = run_engine(drafts["target"], None, prompts, 0, 24, max_seq_len=128)
    spec, finals = run_engine(drafts["target"], None, prompts, 4, 24, max_seq_len=128, proposer=proposer)
    assert spec == plain
    assert sum(f.stats.accepted_tokens for f in finals) > 0  # the draft really took part


def test_the_target_service_refuses_a_vocabulary_subset_model(sampling_pair, tmp_path) -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "tools.cli", "target", "--model", str(sampling_pair["draft_subset"]),
                             "--port", "0", "--dtype", "float32"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "can only serve as a draft" in result.stderr


def test_the_card_states_measured_acceptance_and_the_proposer_reports_it(drafts, tmp_path) -> None:
    """config.json "specstream"."acceptance" (what `record_acceptance` writes after measuring) reaches
    the proposer, and from it DraftInfo; a value that is no rate is refused naming the field."""
    from specstream.data.propose import DraftInfo
    from specstream.data.propose_wire import info_to_pb
    from tools.distill.measure import record_acceptance

    card = tmp_path / "card"
    card.mkdir()
    (card / "model.safetensors").write_bytes((drafts["shared"] / "model.safetensors").read_bytes())
    (card / "config.json").write_text((drafts["shared"] / "config.json").read_text())
    assert load_model(card, resolve=_resolver(drafts)).config.acceptance == ()  # a card without it
    record_acceptance(card, 0.53712, None)
    proposer = DraftProposer(load_model(card, resolve=_resolver(drafts)), 2, 64)
    assert proposer.acceptance == {("model", True): 0.537}
    record_acceptance(card, 0.41, 0.3)
    proposer = DraftProposer(load_model(card, resolve=_resolver(drafts)), 2, 64)
    assert proposer.acceptance == {("model", True): 0.41, ("model", False): 0.3}
    info = info_to_pb(DraftInfo.of(proposer))
    assert sorted((e.source, e.greedy, round(e.alpha, 6)) for e in info.acceptance) == \
        [("model", False, 0.3), ("model", True, 0.41)]
    config = json.loads((card / "config.json").read_text())
    for bad, field in (({"greedy": 1.0}, "acceptance.greedy"), ({"sampled": True}, "acceptance.sampled"),
                       ({"greedy": 0.5, "top_p": 0.9}, "acceptance'"), (0.5, "acceptance'")):
        config["specstream"]["acceptance"] = bad
        (card / "config.json").write_text(json.dumps(config))
        with pytest.raises(ModelLoadError, match=f"specstream.{field}"):
            load_model(card, resolve=_resolver(drafts))


def test_the_shipped_drafts_state_their_measured_acceptance() -> None:
    """The default pair's cards carry the α their training logs measured (train_log.json)."""
    from specstream.models.config import card_acceptance
    from specstream.models.registry import DRAFTS

    for name, expected in (("smollm2-135m-draft", lambda log: {True: log["greedy"]["alpha"],
                                                              False: log["sampled"]["alpha"]}),
                           ("smollm2-135m-feature", lambda log: {True: log["served"]["feature (model)"]["alpha"]})):
        root = DRAFTS / name
        stated = dict(card_acceptance(json.loads((root / "config.json").read_text())["specstream"], name))
        measured = expected(json.loads((root / "train_log.json").read_text()))
        assert stated.keys() == measured.keys() and all(abs(stated[k] - measured[k]) < 5e-4 for k in stated), \
            (stated, measured)
