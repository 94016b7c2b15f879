"""The structured-output prompt set (tools/distill/structured.py): held out by value, the benchmark's
values never trained on, every constraint compiles (stage ``generate`` answers under it:
tests/test_distill.py)."""

from __future__ import annotations

import json
import re

from specstream.data.constraint import Constraint
from specstream.text.grammar import compiler_for
from tools.distill.structured import BENCH_VALUES, FAMILIES, _split_pools, structured_prompts


def _words(prompt: dict) -> set[str]:
    return set(re.findall(r"[A-Za-z]+", prompt["messages"][-1]["content"]))


def test_held_out_values_never_appear_in_training_prompts_and_every_family_has_both_splits() -> None:
    prompts = structured_prompts(seed=0, count=800)
    pools = _split_pools()
    held_values = {v for values in pools["held_out"].values() for v in values}
    train_values = {v for values in pools["train"].values() for v in values}
    assert not held_values & train_values and BENCH_VALUES <= held_values
    for p in prompts:
        if p["split"] == "train":  # the benchmark's names, cities and items are not asked about in training
            assert not _words(p) & BENCH_VALUES, p["messages"][-1]["content"]
    for family in (*FAMILIES, "tool"):
        splits = {p["split"] for p in prompts if p["domain"] == family}
        assert splits == {"train", "held_out"}, family
    assert len({p["id"] for p in prompts}) == len(prompts)
    # the held-out prompts do draw held-out values
    assert any(_words(p) & BENCH_VALUES for p in prompts if p["split"] == "held_out")


def test_the_same_seed_gives_the_same_set_and_another_seed_another() -> None:
    assert structured_prompts(seed=0, count=50) == structured_prompts(seed=0, count=50)
    assert structured_prompts(seed=0, count=50) != structured_prompts(seed=1, count=50)
    assert structured_prompts(seed=0, count=0) == []


def test_every_constraint_compiles_on_the_model_tokenizer_and_its_schema_is_json(model_zoo) -> None:
    compiler = compiler_for(model_zoo["target"])
    for p in structured_prompts(seed=0, count=120):
        constraint = Constraint(**p["constraint"])
        if constraint.kind == "json_schema":
            assert json.loads(constraint.source)["type"] == "object"
        else:  # a tool call: the tools are listed in the system message, the call's grammar is a structural tag
            assert p["domain"] == "tool" and p["messages"][0]["role"] == "system"
        assert compiler.compile(constraint).matcher().mask().any()

