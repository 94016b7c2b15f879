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



def test_the_structured_stage_serves_held_out_tasks_under_their_constraints(capsys) -> None:
    """`train-draft --stage structured`'s measurement (tools.distill.feature.structured_acceptance)
    on two held-out tasks through the real pair: the shipped feature draft behind prompt lookup at
    γ = 4 proposes and is kept (forced tokens and copies), and the figures come per task family."""
    from specstream.models.registry import DRAFTS, resolve_dtype, resolve_model
    from tools.distill.feature import structured_acceptance

    held = [p for p in structured_prompts(0, 60) if p["split"] == "held_out"]
    tasks = [next(p for p in held if p["domain"] == "tool"), next(p for p in held if p["domain"] != "tool")]
    out = structured_acceptance(resolve_model("smollm2"), {"feature": DRAFTS / "smollm2-135m-feature"}, tasks,
                                max_new_tokens=48, dtype=resolve_dtype("auto"))["feature"]
    assert out["prompts"] == 2 and out["gamma"] == 4 and out["accepted"] > 0
    assert out["mean_accepted_length"] > 1.5  # a JSON answer's structure alone is more than one token a pass
    assert set(out["by_domain"]) == {t["domain"] for t in tasks}
    assert all(d["prompts"] == 1 and d["mean_accepted_length"] >= 1.0 for d in out["by_domain"].values())
    assert "[structured] feature:" in capsys.readouterr().out
