"""The everyday prompt set (specstream/tools/distill/everyday.py): held out by subject, in every domain."""

from __future__ import annotations

from collections import defaultdict

from specstream.tools.distill.everyday import DOMAINS, everyday_prompts


def test_held_out_subjects_never_appear_in_training_and_every_domain_has_some() -> None:
    prompts = everyday_prompts(seed=0, per_subject=8)
    splits: dict[tuple[str, str], set[str]] = defaultdict(set)
    for p in prompts:
        splits[(p["domain"], p["subject"])].add(p["split"])
        assert p["messages"] == [{"role": "user", "content": p["messages"][0]["content"]}]
        assert p["subject"] in p["messages"][0]["content"]  # the subject is what is asked about
    assert all(len(s) == 1 for s in splits.values())  # a subject is wholly train or wholly held out
    for domain in DOMAINS:
        held = {subject for (d, subject), s in splits.items() if d == domain and s == {"held_out"}}
        train = {subject for (d, subject), s in splits.items() if d == domain and s == {"train"}}
        assert held and train and len(held) < len(train), domain
    assert len({p["id"] for p in prompts}) == len(prompts)


def test_the_split_does_not_move_with_the_seed_but_the_templates_do() -> None:
    a, b = everyday_prompts(seed=0), everyday_prompts(seed=1)
    assert {p["subject"] for p in a if p["split"] == "held_out"} == {p["subject"] for p in b if p["split"] == "held_out"}
    assert [p["messages"] for p in a] != [p["messages"] for p in b]
