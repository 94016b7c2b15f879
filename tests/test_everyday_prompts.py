"""The everyday prompt set (tools/distill/everyday.py): held out by subject, in every domain."""

from __future__ import annotations

from collections import defaultdict

from tools.distill.everyday import DOMAINS, everyday_prompts


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


def test_the_shipped_everyday_set_is_what_the_pipeline_builds_and_benchmarks_send_it_domain_by_domain() -> None:
    """The feature draft ships the prompt set it was trained and measured on (its held-out split is
    what `bench --prompt-set everyday` sends): it is everyday_prompts' output, and the benchmark's
    first prompts take one held-out prompt from each domain in turn."""
    import gzip
    import json

    from tools.bench.models import PROMPT_SETS, chat_prompts
    from tools.distill.feature import FeatureConfig

    with gzip.open(PROMPT_SETS["everyday"], "rt", encoding="utf-8") as fh:
        shipped = [json.loads(line) for line in fh]
    cfg = FeatureConfig()
    assert shipped == everyday_prompts(cfg.seed, cfg.per_subject)

    class Tok:  # what chat_prompts needs of a tokenizer: the prompt's text stands in for its ids
        @staticmethod
        def encode_chat(messages):
            return messages[0]["content"]

    first = chat_prompts(Tok, len(DOMAINS), "everyday")
    held = {p["messages"][0]["content"]: p for p in shipped if p["split"] == "held_out"}
    assert all(text in held for text in first)
    assert sorted(held[text]["domain"] for text in first) == sorted(DOMAINS)
