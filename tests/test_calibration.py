"""The engine times its verify forwards at start-up (target_service/calibration.py), so the γ
controller prices its first choices with measured costs."""

from __future__ import annotations

from draft_service.proposer import DraftProposer
from specstream.data.config import ModelSpec, TargetConfig
from specstream.models.loader import load_model
from target_service.calibration import shapes, verify_costs
from target_service.engine import Engine
from target_service.local_draft import LocalDraft


def test_shapes_cover_every_batch_one_width_and_a_few_per_batch_size():
    got = shapes(max_slots=8, max_width=5)
    assert [w for r, w in got if r == 1] == [1, 2, 3, 4, 5]
    assert {r for r, _ in got} == {1, 2, 4, 8}
    assert sorted(w for r, w in got if r == 8) == [1, 2, 3, 5]
    sizes = [r * w for r, w in got]
    assert sizes == sorted(sizes)  # smallest first: a budget cuts the dearest
    assert all(r * w <= 16 for r, w in shapes(max_slots=64, max_width=17, max_positions=16))
    assert {r for r, _ in shapes(max_slots=6, max_width=2)} == {1, 2, 4, 6}


def test_verify_costs_time_each_shape_and_leave_the_slots_free(model_zoo):
    model = load_model(model_zoo["target"])
    cache = model.new_cache(4, 64)
    taken = cache.alloc()  # a slot in use stays in use and untouched
    cache.set_length(taken, 7)
    samples = verify_costs(model, cache, max_width=3)
    assert [p for p, _ in samples] == [r * w for r, w in shapes(3, 3)]
    assert all(s > 0.0 for _, s in samples)
    assert cache.num_free == 3 and cache.length(taken) == 7
    assert verify_costs(model, cache, max_width=3, budget_s=0.0) == []


def test_an_engine_with_a_draft_starts_with_measured_verify_costs(model_zoo):
    model = load_model(model_zoo["target"])
    draft = LocalDraft(DraftProposer(load_model(model_zoo["partial"]), 2, 128))
    config = TargetConfig(model=ModelSpec(str(model_zoo["target"])), max_slots=2, max_seq_len=128, max_gamma=4)
    engine = Engine(model, config, draft)
    costs = engine.controller.costs
    assert costs.verify.samples == len(shapes(2, 5))
    assert set(costs.residual) == {r * w for r, w in shapes(2, 5)}
    assert costs.ready and costs.draft.samples == 0
    # Until the draft has proposed, a draft forward is priced below a one-position verify, and
    # deeper drafting costs more.
    assert 0.0 < costs.draft_s(1, 1) < costs.verify_s(1) and costs.draft_s(2, 2) > costs.draft_s(1, 1)
    assert engine.cache.num_free == 2
    off = Engine(model, TargetConfig(model=config.model, max_slots=2, max_seq_len=128, max_gamma=4, calibrate=False),
                 draft)
    assert off.controller.costs.verify.samples == 0
