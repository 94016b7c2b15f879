"""The draft distillation pipeline's pieces, on small inputs: the prompt set, the records file, the
reduced output vocabulary, the loss, and the progress of generating and training on a tiny target (the
full pipeline is `specstream train-draft`, hours long)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from tools.distill.data import TOP_K, Record, generate_responses, load_records, save_records
from tools.distill.prompts import build_prompts


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
    from tools.distill.train import choose_output_vocab

    records = [_record(0, [50, 50, 50, 60]), _record(1, [50, 70])]
    vocab = choose_output_vocab(records, 3, always=[2], vocab_size=200)
    assert vocab.tolist() == sorted(vocab.tolist()) and len(vocab) == 3
    assert {2, 50} <= set(vocab.tolist())  # the end token, and the most frequent first choice


def test_the_teacher_is_restricted_to_the_draft_vocabulary_and_renormalised() -> None:
    from tools.distill.train import _examples

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


CHAT = ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama with a byte-level tokenizer and a chat template: a target to distil from."""
    from tests.support.checkpoints import make_hf_checkpoint

    from specstream.text.tokenizer import BOS_TOKEN, EOS_TOKEN, build_byte_level_tokenizer, save_tokenizer_files

    target = make_hf_checkpoint(tmp_path_factory.mktemp("distill") / "target", "llama", vocab_size=300, seed=5,
                                max_position_embeddings=512)
    save_tokenizer_files(build_byte_level_tokenizer(vocab_size=300), target, bos=BOS_TOKEN, eos=EOS_TOKEN)
    (target / "chat_template.jinja").write_text(CHAT)
    return target


def _progress_lines(err: str, unit: str) -> list[tuple[int, int]]:
    """(done, total) of every progress line on stderr counted in ``unit``."""
    return [(int(a), int(b)) for a, b in re.findall(rf"(\d+)/(\d+) {unit} \(", err)]


def test_generate_and_train_show_their_progress_to_the_end(tiny_target, tmp_path, capsys) -> None:
    """train-draft's stages count what they do: each prompt answered, each optimiser step; off a
    terminal as plain lines on stderr, while their own lines stay on stdout."""
    from tools.distill.data import generate_responses
    from tools.distill.train import train_draft

    prompts = [{"id": i, "split": "held_out" if i % 4 == 0 else "train",
                "messages": [{"role": "user", "content": f"question {i}: what is {i} + {i}?"}]} for i in range(12)]
    records = generate_responses(tiny_target, prompts, dtype="float32", max_new_tokens=8, max_slots=4, log_every=5,
                                 quiet=True)
    out, err = capsys.readouterr()
    assert len(records) == 12 and all(0 < len(r.response) <= 8 for r in records)
    assert _progress_lines(err, "prompts")[-1] == (12, 12)
    assert "[generate] 10/12 prompts" in out and "prompts (" not in out  # its own lines, not progress

    trained = train_draft(tiny_target, tmp_path / "draft", records, target_ref=str(tiny_target), quiet=True)
    out, err = capsys.readouterr()
    steps = _progress_lines(err, "steps")
    assert steps[0] == (0, trained["train_steps"]) and steps[-1] == (trained["train_steps"],) * 2
    assert "epoch 6/6" in err and f"step {trained['train_steps']}/{trained['train_steps']}" in out
    assert (tmp_path / "draft" / "model.safetensors").is_file()


def test_generate_answers_a_structured_prompt_under_its_constraint(tiny_target) -> None:
    """Stage ``generate`` (tools.distill.data, prompts of tools.distill.structured) serves a prompt's
    constraint: every answer of a random tiny target is a prefix its grammar accepts (whole, or cut
    by the budget), where unconstrained answers of the same model are not."""
    from specstream.data.constraint import Constraint
    from specstream.text.grammar import compiler_for
    from specstream.text.tokenizer import TextTokenizer
    from tools.distill.structured import structured_prompts

    prompts = [p for p in structured_prompts(seed=0, count=40) if p["domain"] != "tool"][:4]
    tok = TextTokenizer.from_dir(tiny_target)
    ends = {t for t in (tok.end_of_turn_id, *tok.eos_token_ids) if t is not None}
    compiler = compiler_for(tiny_target)

    def accepted(p: dict, response: list[int]) -> bool:
        body = [t for t in response if t not in ends]
        return compiler.compile(Constraint(**p["constraint"])).matcher().consume(body) == len(body)

    free = [{k: v for k, v in p.items() if k != "constraint"} for p in prompts]
    constrained = generate_responses(tiny_target, prompts, dtype="float32", max_new_tokens=16, quiet=True)
    unconstrained = generate_responses(tiny_target, free, dtype="float32", max_new_tokens=16, quiet=True)
    assert [r.prompt_id for r in constrained] == [p["id"] for p in prompts]
    assert all(accepted(p, r.response) and r.response for p, r in zip(prompts, constrained))
    assert not all(accepted(p, r.response) for p, r in zip(prompts, unconstrained))
