"""Beam search in the target engine (target_service/beam.py) against transformers, and the
streaming policies against each other.

- Fixed width: the n-best hypotheses, their order and scores equal transformers'
  `generate(num_beams=k, num_return_sequences=k, do_sample=False, length_penalty, early_stopping)`
  on the same checkpoint (k = 1: greedy decoding). The stop ids are tokens the model emits often,
  so hypotheses end at different steps and the finished list and early stopping matter.
- Variable width: VAR-STREAM (top-up at ε·n, minimal length first) and VAR-STR-FIFO return
  exactly what VAR-BATCH returns, whatever ε, batch size and arrival order; δ and M that prune
  nothing give transformers' fixed-width result through the pruning code.
- Beams share the engine: mixed with ordinary (speculative) requests nothing changes; a
  cancelled beam frees all its rows; bad beam options are INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from tests.support.checkpoints import load_hf_model, make_hf_checkpoint

from draft_service.proposer import DraftProposer
from specstream.data.config import ModelSpec, TargetConfig
from specstream.data.engine import BeamOptions, SequenceRequest, Speculation
from specstream.data.errors import InvalidArgumentError
from specstream.data.sampling import SamplingParams
from specstream.models.loader import load_model
from target_service.connection import Connection
from target_service.engine import Engine
from target_service.inprocess import run_requests
from target_service.local_draft import LocalDraft

PROMPTS = [[1, 5, 9, 33, 7], [1, 44, 3, 60], [1, 100, 101, 102, 103, 104, 9], [1, 17], [1, 70, 71, 72, 73, 74, 75, 76]]
HF_EARLY_STOPPING = {"heuristic": False, "first_k": True, "never": "never"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("beam") / "llama", "llama", vocab_size=128, seed=3)


@pytest.fixture(scope="module")
def model(checkpoint: Path):
    return load_model(checkpoint)


@pytest.fixture(scope="module")
def reference(checkpoint: Path):
    return load_hf_model(checkpoint)


@pytest.fixture(scope="module")
def stop_ids(model) -> list[int]:
    """The two tokens greedy decoding of PROMPTS emits most: hypotheses end early and at different steps."""
    counts: Counter[int] = Counter()
    for tokens in _run(model, [_request(i, p, 16) for i, p in enumerate(PROMPTS)]).values():
        counts.update(tokens.token_ids)
    return [t for t, _ in counts.most_common(2)]


def _request(i: int, prompt: list[int], max_new: int, beam: BeamOptions | None = None, stop: list[int] = (),
             speculation: Speculation = Speculation("off")) -> SequenceRequest:
    return SequenceRequest(str(i), list(prompt), max_new, frozenset(stop), frozenset(stop[:1]), speculation, beam=beam)


def _engine(model, draft=None, **config) -> Engine:
    settings = {"max_slots": 24, "max_seq_len": 128, "max_gamma": 4, **config}
    return Engine(model, TargetConfig(model=ModelSpec("beam-test"), **settings), draft)


def _run(model, requests: list[SequenceRequest], draft=None, **config) -> dict:
    engine = _engine(model, draft, **config)
    return {r.request_id: r for r in run_requests(engine, requests, timeout_s=120)}


def _hf_beams(reference, prompt: list[int], k: int, max_new: int, stop: list[int], length_penalty: float,
              early_stopping: str) -> list[tuple[list[int], float | None]]:
    out = reference.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=k, do_sample=False,
                             max_new_tokens=max_new, length_penalty=length_penalty,
                             early_stopping=HF_EARLY_STOPPING[early_stopping], eos_token_id=stop, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    beams = []
    for j in range(k):
        tokens = out.sequences[j, len(prompt):].tolist()
        ends = [i for i, t in enumerate(tokens) if t in stop]
        tokens = tokens[: ends[0] + 1] if ends else tokens  # cut the padding after the stop token
        beams.append((tokens, float(out.sequences_scores[j]) if k > 1 else None))
    return beams


# -- fixed width = transformers -------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, "heuristic"), (0.5, "first_k"), (2.0, "never"),
                                                           (-1.0, "heuristic")])
def test_fixed_width_equals_transformers(model, reference, stop_ids, k, length_penalty, early_stopping):
    budgets = [14, 9, 16, 12, 10]
    beam = BeamOptions(k, k, length_penalty, early_stopping)
    ours = _run(model, [_request(i, p, n, beam, stop_ids) for i, (p, n) in enumerate(zip(PROMPTS, budgets))])
    ended_early = 0
    for i, (prompt, budget) in enumerate(zip(PROMPTS, budgets)):
        want = _hf_beams(reference, prompt, k, budget, stop_ids, length_penalty, early_stopping)
        got = ours[str(i)].final.sequences
        assert [h.token_ids for h in got] == [w[0] for w in want], f"prompt {i}: beams differ from transformers'"
        if k > 1:
            assert [h.score for h in got] == pytest.approx([w[1] for w in want], rel=1e-6, abs=2e-5), f"prompt {i}: scores"
        assert ours[str(i)].token_ids == got[0].token_ids  # the response's tokens are the best hypothesis
        for h in got:
            assert h.score == pytest.approx(h.logprob / len(h.token_ids) ** length_penalty, rel=1e-5)
            assert h.finish_reason == ("eos" if h.token_ids[-1] == stop_ids[0] else
                                       "stop" if h.token_ids[-1] in stop_ids else "length")
        ended_early += sum(h.finish_reason != "length" for h in got)
    if length_penalty <= 1.0:  # (2.0 favours long hypotheses: all of them run to the limit)
        assert ended_early > 0, "no hypothesis ended on a stop id: the finished-list logic went untested"


def test_one_beam_is_greedy_decoding(model, stop_ids):
    plain = _run(model, [_request(i, p, 14, None, stop_ids) for i, p in enumerate(PROMPTS)])
    beams = _run(model, [_request(i, p, 14, BeamOptions(1), stop_ids) for i, p in enumerate(PROMPTS)])
    for i in range(len(PROMPTS)):
        assert beams[str(i)].token_ids == plain[str(i)].token_ids
        assert beams[str(i)].final.finish_reason == plain[str(i)].final.finish_reason


# -- variable width and the streaming policies ----------------------------------------------------------------
POLICIES = {
    "VAR-BATCH": {"policy": "static", "row_selection": "all"},
    "VAR-STREAM 1/6": {"policy": "topup", "refill_threshold": 1 / 6, "row_selection": "min_length"},
    "VAR-STREAM 1/3": {"policy": "topup", "refill_threshold": 1 / 3, "row_selection": "min_length"},
    "VAR-STREAM 1/2": {"policy": "topup", "refill_threshold": 1 / 2, "row_selection": "min_length"},
    "VAR-STR-FIFO": {"policy": "topup", "refill_threshold": 1 / 3, "row_selection": "fifo"},
}


def _variable_requests(stop_ids, order_seed: int) -> list[SequenceRequest]:
    beam = BeamOptions(4, 3, 1.0, "heuristic", beam_threshold=0.3, max_candidates_per_parent=2)
    extra = random.Random(0)
    prompts = [p + [extra.randrange(3, 128)] for p in PROMPTS for _ in range(2)]  # 10 requests
    requests = [_request(i, p, 6 + (5 * i) % 11, beam, stop_ids) for i, p in enumerate(prompts)]
    random.Random(order_seed).shuffle(requests)  # arrival order
    return requests


def _outputs(results: dict) -> dict:
    """Per request its hypotheses (tokens, finish reason) in order, and their scores. Tokens must be
    equal; scores agree to float32 rounding only: the forward's matrix products round differently
    at different batch shapes."""
    return {rid: ([(h.token_ids, h.finish_reason) for h in r.final.sequences],
                  [x for h in r.final.sequences for x in (h.score, h.logprob)]) for rid, r in results.items()}


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid][0] == want[rid][0], f"{what}: request {rid}"
        assert got[rid][1] == pytest.approx(want[rid][1], rel=1e-6, abs=1e-6), f"{what}: request {rid} scores"


def test_var_stream_returns_what_var_batch_returns(model, stop_ids):
    baseline = _outputs(_run(model, _variable_requests(stop_ids, 0), **POLICIES["VAR-BATCH"], max_batch=8))
    pruned = sum(len(v[0]) < 3 for v in baseline.values())
    for name, policy in POLICIES.items():
        for batch, order in ((8, 1), (12, 2), (4, 3)):
            got = _outputs(_run(model, _variable_requests(stop_ids, order), **policy, max_batch=batch))
            _assert_same(got, baseline, f"{name} at n={batch}, arrival order {order}")
    assert pruned  # the variable width did prune: some requests have fewer than 3 hypotheses left


def test_variable_width_prunes_expansions(model, stop_ids):
    fixed = BeamOptions(4, 3)
    variable = BeamOptions(4, 3, beam_threshold=1.0, max_candidates_per_parent=2)
    prompts = PROMPTS[:3]
    wide = _run(model, [_request(i, p, 12, fixed, stop_ids) for i, p in enumerate(prompts)])
    narrow = _run(model, [_request(i, p, 12, variable, stop_ids) for i, p in enumerate(prompts)])
    for i in range(3):
        assert narrow[str(i)].final.stats.beam_expansions < wide[str(i)].final.stats.beam_expansions


@pytest.mark.parametrize("k", [2, 5])
def test_no_pruning_is_fixed_width(model, reference, stop_ids, k):
    """δ and M that prune nothing run the variable-width code (threshold test, per-parent cap)
    and give transformers' fixed-width beams."""
    beam = BeamOptions(k, k, 1.0, "heuristic", beam_threshold=1e30, max_candidates_per_parent=k)
    ours = _run(model, [_request(i, p, 12, beam, stop_ids) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        want = _hf_beams(reference, prompt, k, 12, stop_ids, 1.0, "heuristic")
        assert [h.token_ids for h in ours[str(i)].final.sequences] == [w[0] for w in want]


# -- one engine for beams and ordinary requests ---------------------------------------------------------------
def test_beams_and_ordinary_requests_mixed_give_what_they_give_alone(model, checkpoint, stop_ids):
    beam = BeamOptions(3, 2, 1.0, "heuristic", beam_threshold=2.0)
    beams = [_request(f"b{i}", p, 10, beam, stop_ids) for i, p in enumerate(PROMPTS[:3])]
    plain = [_request(f"p{i}", p, 12, None, stop_ids, Speculation("fixed", 3)) for i, p in enumerate(PROMPTS[2:])]

    def draft():  # the target's own weights: proposals are accepted, rows advance several tokens per step
        return LocalDraft(DraftProposer(load_model(checkpoint), max_slots=16, max_seq_len=128))

    alone_beams = _run(model, beams, max_batch=12)
    alone_plain = _run(model, plain, draft())
    mixed = _run(model, [*beams, *plain][::-1], draft(), max_batch=12)
    for rid, result in {**alone_beams, **alone_plain}.items():
        assert mixed[rid].token_ids == result.token_ids, rid
    _assert_same(_outputs({r: mixed[r] for r in alone_beams}), _outputs(alone_beams), "beams mixed with others")
    assert any(r.final.stats.accepted_tokens for r in alone_plain.values())  # the ordinary rows did speculate


def test_cancelling_a_beam_frees_all_its_rows(model):
    import asyncio

    engine = _engine(model, max_slots=12)
    conn = Connection()

    async def main():
        loop = asyncio.create_task(engine.run())
        try:
            engine.attach(conn)
            engine.submit(conn, [_request(0, PROMPTS[0], 60, BeamOptions(5, 3))])
            while engine.cache.num_free > engine.cache.num_slots - 5 or not engine.running or engine.running[0].beam.generated < 3:
                await asyncio.sleep(0.01)
            forked = sum(engine.cache.sources(s) is not None for s in engine.running[0].beam_slots)
            engine.cancel(conn, ["0"])
            while True:
                message = await asyncio.wait_for(conn.outbox.get(), 30)
                if any(e.finish_reason for e in message.events):
                    return forked, message.events[0]
        finally:
            loop.cancel()

    forked, final = asyncio.run(main())
    assert forked >= 1  # hypotheses did share their prefix
    assert final.finish_reason == "cancelled" and not final.sequences
    assert engine.cache.num_free == engine.cache.num_slots and not engine.cache.shared and not engine.running  # beams keep nothing


@pytest.mark.parametrize("field,kwargs", [
    ("beam.num_beams", {"num_beams": 0}),
    ("beam.num_return_sequences", {"num_return_sequences": 4}),
    ("beam.num_return_sequences", {"num_return_sequences": 0}),
    ("beam.length_penalty", {"length_penalty": float("nan")}),
    ("beam.length_penalty", {"length_penalty": float("inf")}),
    ("beam.beam_threshold", {"beam_threshold": 0.0}),
    ("beam.beam_threshold", {"beam_threshold": float("nan")}),
    ("beam.max_candidates_per_parent", {"max_candidates_per_parent": 4}),
    ("beam.max_candidates_per_parent", {"max_candidates_per_parent": -1}),
    ("beam.early_stopping", {"early_stopping": "sometimes"}),
])
def test_bad_beam_options_name_the_field(field, kwargs):
    with pytest.raises(InvalidArgumentError) as raised:
        BeamOptions(**{"num_beams": 3, **kwargs})
    assert raised.value.field == field


@pytest.mark.parametrize("field,extra", [
    ("beam.num_beams", {"beam": BeamOptions(25)}),  # more than the engine's 24 slots
    ("temperature", {"sampling": SamplingParams(temperature=0.7)}),
    ("speculation.mode", {"speculation": Speculation("fixed", 2)}),
    ("logprobs", {"logprobs": 2}),
])
def test_the_engine_refuses_what_it_cannot_run_and_serves_the_rest(model, field, extra):
    good = _request("good", PROMPTS[0], 5, BeamOptions(2))
    bad = _request("bad", PROMPTS[1], 5, BeamOptions(3))
    for name, value in extra.items():
        setattr(bad, name, value)
    results = _run(model, [good, bad])
    error = results["bad"].final.error
    assert isinstance(error, InvalidArgumentError) and error.field == field, error
    assert results["good"].final.finish_reason in ("length", "eos", "stop") and results["good"].final.sequences


def test_beam_options_cross_the_target_edge(model):
    """SequenceRequest.beam and the final event's sequences survive the protobuf edge."""
    from specstream.data.engine_wire import event_to_pb, request_from_pb
    from specstream_pb import common_pb2, target_pb2

    pb = target_pb2.SequenceRequest(id="x", prompt_token_ids=PROMPTS[0], max_new_tokens=6, beam=common_pb2.BeamSearch(
        num_beams=3, num_return_sequences=2, length_penalty=0.5, early_stopping=common_pb2.EARLY_STOPPING_NEVER,
        beam_threshold=2.5, max_candidates_per_parent=2))
    req = request_from_pb(pb)
    assert req.beam == BeamOptions(3, 2, 0.5, "never", 2.5, 2)
    unset = request_from_pb(target_pb2.SequenceRequest(id="y", prompt_token_ids=[1], max_new_tokens=1,
                                                       beam=common_pb2.BeamSearch(num_beams=2)))
    assert unset.beam == BeamOptions(2)
    assert request_from_pb(target_pb2.SequenceRequest(id="z", prompt_token_ids=[1], max_new_tokens=1)).beam is None
    final = _run(model, [req])["x"].final
    out = event_to_pb(final)
    assert [list(s.token_ids) for s in out.sequences] == [h.token_ids for h in final.sequences]
    assert [s.score for s in out.sequences] == pytest.approx([h.score for h in final.sequences])
    assert len(out.sequences) == 2 and out.stats.beam_expansions == final.stats.beam_expansions > 0
