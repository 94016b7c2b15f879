"""The draft distillation pipeline's pieces, on small inputs: the prompt set, the records file, the
reduced output vocabulary and the loss (the full pipeline is `specstream train-draft`, hours long)."""

from __future__ import annotations

import math

import pytest
import torch

from specstream.tools.distill.data import TOP_K, Record, load_records, save_records
from specstream.tools.distill.prompts import build_prompts


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    return build_prompts(400, seed=0)


def test_prompts_are_deterministic_and_split_by_subject(prompts) -> None:
    assert prompts == build_prompts(400, seed=0)
    sources = {p["source"] for p in prompts}
    assert {"docstring", "topic"} <= sources  # these ship with every Python; man pages with Debian
    train = {p["subject"] for p in prompts if p["split"] == "train"}
    held = {p["subject"] for p in prompts if p["split"] == "held_out"}
    assert held and train and not train & held
    for p in prompts:
        assert p["messages"][-1]["role"] == "user" and p["messages"][-1]["content"].strip()
        assert len(p["messages"][-1]["content"]) < 1200
    assert len({p["messages"][-1]["content"] for p in prompts}) == len(prompts)


def _record(i: int, response: list[int], split: str = "train") -> Record:
    n = len(response)
    ids = torch.arange(TOP_K, dtype=torch.int32).repeat(n, 1) + torch.tensor(response, dtype=torch.int32)[:, None]
    logprobs = torch.log_softmax(-torch.arange(TOP_K, dtype=torch.float32), 0).repeat(n, 1)
    return Record(i, split, i % 2 == 1, [1, 2, 3], response, ids, logprobs)


def test_records_round_trip_through_one_safetensors_file(tmp_path) -> None:
    records = [_record(0, [5, 6, 7]), _record(1, [9], "held_out"), _record(2, [])]
    save_records(records, tmp_path / "r.safetensors")
    back = load_records(tmp_path / "r.safetensors")
    for a, b in zip(records, back):
        assert (a.prompt_id, a.split, a.sampled, a.prompt, a.response) == (b.prompt_id, b.split, b.sampled, b.prompt,
                                                                           b.response)
        assert torch.equal(a.top_ids, b.top_ids)
        assert torch.allclose(a.top_logprobs, b.top_logprobs, rtol=2**-10, atol=0)  # stored as float16


def test_output_vocabulary_keeps_the_most_frequent_first_choices_and_the_end_tokens() -> None:
    from specstream.tools.distill.train import choose_output_vocab

    records = [_record(0, [50, 50, 50, 60]), _record(1, [50, 70])]
    vocab = choose_output_vocab(records, 3, always=[2], vocab_size=200)
    assert vocab.tolist() == sorted(vocab.tolist()) and len(vocab) == 3
    assert {2, 50} <= set(vocab.tolist())  # the end token, and the most frequent first choice


def test_the_teacher_is_restricted_to_the_draft_vocabulary_and_renormalised() -> None:
    from specstream.tools.distill.train import _examples

    vocab = torch.tensor([3, 5, 7])
    index = torch.full((100,), -1, dtype=torch.int64)
    index[vocab] = torch.arange(3)
    r = Record(0, "train", False, [1, 2], [5], torch.tensor([[5, 9, 3] + [90] * (TOP_K - 3)], dtype=torch.int32),
               torch.log(torch.tensor([[0.5, 0.3, 0.1] + [0.1 / (TOP_K - 3)] * (TOP_K - 3)])))
    [(ids, cols, probs, first)] = _examples([r], index)
    assert ids.tolist() == [1, 2] and first == 1  # the last prompt token predicts the response's first
    assert cols[0, :3].tolist() == [1, -1, 0] and (cols[0, 3:] == -1).all()
    # Mass outside the draft's vocabulary (token 9, the tail) is dropped and the rest renormalised.
    assert probs[0, 0].item() == pytest.approx(0.5 / 0.6) and probs[0, 2].item() == pytest.approx(0.1 / 0.6)
    assert probs[0, 1].item() == 0 and math.isclose(probs.sum().item(), 1.0, rel_tol=1e-6)
