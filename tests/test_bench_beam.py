"""`specstream bench beam` (tools/bench/beam.py) end to end on a tiny random checkpoint, in-process.

Timings depend on the machine, so this checks what must hold whatever they are: every request was
decoded within its own budget and ends on a stop id or at that budget; variable width expands
fewer candidates than fixed width; the streaming policies, an implementation detail of VAR-BATCH
(the paper's §3 and Table 4), return its best hypotheses and expand exactly as many candidates, in
fewer steps (they hold twice the beams they expand); the agreement rates are the fractions of
requests whose recorded best hypotheses match; and transformers' `generate(num_beams=k)` on the
same float32 checkpoint returns our FIXED best hypotheses token for token.

The checkpoint is a random Llama whose next-token distributions are peaked enough (init range 0.3)
that δ prunes and a stop id ends a hypothesis early; 1024 positions, because the benchmark also
times the shared-prefix cache at a 512-token context.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.support.checkpoints import make_hf_checkpoint

K, REQUESTS = 3, 8
STREAMING = ("VAR-STREAM ε=1/3", "VAR-STR-FIFO ε=1/3")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory):
    from specstream.text.tokenizer import BOS_TOKEN, EOS_TOKEN, build_byte_level_tokenizer, save_tokenizer_files
    from tools.bench import beam
    from tools.bench.models import BenchModels
    from tools.progress import Progress

    shown: list[Progress] = []

    class Recorded(Progress):
        """The run's progress, kept to look at afterwards."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            shown.append(self)

    root = tmp_path_factory.mktemp("bench-beam")
    target = make_hf_checkpoint(root / "target", "llama", vocab_size=300, seed=3, initializer_range=0.3,
                                max_position_embeddings=1024)
    save_tokenizer_files(build_byte_level_tokenizer(vocab_size=300), target, bos=BOS_TOKEN, eos=EOS_TOKEN)
    models = BenchModels("tiny", Path(target), None, "float32")
    out = root / "out"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(beam, "Progress", Recorded)
        returned = beam.run(models, out, ks=(K,), n_requests=REQUESTS, min_new=4, max_new=16, threshold=1.0,
                            epsilons=(1 / 3,), rows_per_beam=2)
    return out, returned, json.loads((out / "beam.json").read_text()), shown


def test_writes_the_table_json_and_plots(result):
    from tools.bench import beam

    out, returned, data, _ = result
    assert data["device"] and data["requests"] == REQUESTS
    assert list(data["runs"]) == [str(K)]
    assert list(data["runs"][str(K)]["methods"]) == ["FIXED", "VAR-BATCH", *STREAMING]
    for png in ("beam_wall_time.png", "beam_expansions_per_step.png"):
        assert (out / png).stat().st_size > 1000, png
    assert all(name in beam.tables(returned) for name in ("VAR-BATCH", *STREAMING, "transformers"))


def test_every_request_ran_within_its_own_budget(result):
    _, _, data, _ = result
    budgets, stops = data["max_new_tokens"], set(data["stop_ids"])
    assert len(budgets) == REQUESTS and len(set(budgets)) > 1  # the stream's requests vary in length
    ended_early = 0
    for name, r in data["runs"][str(K)]["methods"].items():
        assert len(r["best"]) == REQUESTS, name
        for i, (best, budget) in enumerate(zip(r["best"], budgets)):
            assert 1 <= len(best) <= budget, (name, i)
            assert len(best) == budget or best[-1] in stops, (name, i)  # only a stop id ends one early
            ended_early += len(best) < budget
        assert r["steps"] > 0 and r["expansions"] >= r["steps"], name
    assert ended_early, "no best hypothesis ended on a stop id: EOS handling went untested"


def test_variable_width_prunes_and_streaming_changes_only_the_schedule(result):
    _, _, data, _ = result
    runs = data["runs"][str(K)]["methods"]
    fixed, batch = runs["FIXED"], runs["VAR-BATCH"]
    assert batch["expansions"] < fixed["expansions"]  # δ and M pruned hypotheses
    for name in STREAMING:
        r = runs[name]
        assert r["best"] == batch["best"] and r["same_as_var_batch"] is True, name
        # each request's search is the same whichever beams share its steps: the same candidates ...
        assert r["expansions"] == batch["expansions"], name
        # ... packed into fewer steps: twice the KV slots hold more beams than one static batch
        assert r["steps"] < batch["steps"], name


def test_agreement_is_measured_on_the_outputs(result):
    _, _, data, _ = result
    row = data["runs"][str(K)]
    fixed = row["methods"]["FIXED"]["best"]
    others = [(name, r) for name, r in row["methods"].items() if name != "FIXED"]
    for name, r in [*others, ("transformers", row["transformers"])]:
        matches = sum(a == b for a, b in zip(r["best"], fixed))
        assert 0.0 <= r["top1_agreement_with_fixed"] <= 1.0, name
        assert r["top1_agreement_with_fixed"] == pytest.approx(matches / REQUESTS), name


def test_transformers_beams_equal_our_fixed_width_beams(result):
    """float32 on both sides, dense weights: the same arithmetic, so the same best hypotheses."""
    _, _, data, _ = result
    row = data["runs"][str(K)]
    assert row["transformers"]["best"] == row["methods"]["FIXED"]["best"]


def test_progress_counts_every_request_it_plans(result):
    """Each method's requests as the engine finishes them, the warm-up's and transformers' too, and
    the threshold sweep's: the total planned up front is the work done."""
    _, _, data, shown = result
    [progress] = shown
    methods = len(data["runs"][str(K)]["methods"])
    deltas = len(data["threshold_sweep"]["rows"])
    assert progress.total == 2 + (methods + 1) * REQUESTS + deltas * REQUESTS  # warm-up 2, transformers 1 pass
    assert progress.done == progress.total and progress.unit == "requests"
