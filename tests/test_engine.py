"""Engine bookkeeping: queued cancellation, draft synchronisation, validation of sequence requests."""

from __future__ import annotations

import asyncio

from tests.support.engine_harness import speculation

from draft_service.proposer import DraftProposer
from specstream.data.config import ModelSpec, TargetConfig
from specstream.data.engine import SequenceEvent, SequenceRequest, Speculation
from specstream.models.loader import load_model
from target_service.connection import Connection
from target_service.engine import Engine
from target_service.local_draft import LocalDraft


class RecordingProposer(DraftProposer):
    """The real proposer, remembering what each call asked it to append."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.appends: list[tuple[object, int, int]] = []  # (key, rollback_to, len(append))

    def propose(self, items):
        self.appends += [(it.key, it.rollback_to, len(it.append)) for it in items]
        return super().propose(items)


def _engine(model_zoo, draft: str | None = None, max_slots: int = 2):
    model = load_model(model_zoo["target"])
    proposer = RecordingProposer(load_model(model_zoo[draft]), 8, 512) if draft else None
    config = TargetConfig(model=ModelSpec(str(model_zoo["target"])), max_slots=max_slots, max_seq_len=512, max_gamma=8)
    return Engine(model, config, LocalDraft(proposer) if proposer else None), proposer


def _request(rid: str, max_new: int = 8, gamma: int = 4, prompt=(0, 5, 6)) -> SequenceRequest:
    return SequenceRequest(rid, list(prompt), max_new, speculation=speculation(gamma))


async def _until_finished(conn: Connection, ids: set[str]) -> dict[str, SequenceEvent]:
    final = {}
    while not ids <= set(final):
        message = await asyncio.wait_for(conn.outbox.get(), 30)
        final.update({e.id: e for e in message.events if e.finish_reason})
    return final


def test_cancel_while_queued_frees_the_id(model_zoo):
    engine, _ = _engine(model_zoo, max_slots=1)

    async def main():
        conn = Connection()
        engine.attach(conn)
        task = asyncio.create_task(engine.run())
        engine.submit(conn, [_request("a", max_new=50), _request("b")])
        await asyncio.sleep(0)  # "b" is queued behind "a" (one slot)
        engine.cancel(conn, ["b"])
        final = await _until_finished(conn, {"a", "b"})
        assert final["b"].finish_reason == "cancelled"
        assert (conn, "b") not in engine.by_request
        engine.submit(conn, [_request("b")])  # the id is free again
        final = await _until_finished(conn, {"b"})
        assert final["b"].finish_reason == "length"
        assert engine.by_request == {} and engine.load().free_slots == 1
        task.cancel()

    asyncio.run(main())


def test_draft_gets_only_new_tokens_after_the_first_step(model_zoo):
    """The draft keeps what the target accepted: after the prompt, each step appends just the
    correction/bonus token (plus the last proposal when all were accepted), never the context again."""
    engine, proposer = _engine(model_zoo, draft="partial")

    async def main():
        conn = Connection()
        engine.attach(conn)
        task = asyncio.create_task(engine.run())
        engine.submit(conn, [_request("a", max_new=40, prompt=list(range(2, 30)))])
        await _until_finished(conn, {"a"})
        task.cancel()

    asyncio.run(main())
    first, *rest = proposer.appends
    assert first[1:] == (0, 29)  # prompt + the prefill's token
    assert rest and all(n <= 2 for _, _, n in rest), proposer.appends
    assert proposer.held == 0  # released when the sequence finished


def test_the_controller_is_told_what_each_rows_draft_has_not_seen(model_zoo):
    """RowView.unfed, which prices a row's next guess (a probe's catch-up): for a row asked every
    step, exactly what that step's call appends (the prompt at first, then the committed tokens
    the draft had not kept); for a row that never drafts, every token it has."""
    engine, proposer = _engine(model_zoo, draft="partial")
    views: list[dict[int, tuple[int, int]]] = []  # per step: seq id -> (unfed, γ chosen)
    choose = engine.controller.choose

    def recording(rows, caps):
        gammas = choose(rows, caps)
        views.append({r.seq_id: (r.unfed, g) for r, g in zip(rows, gammas)})
        return gammas

    engine.controller.choose = recording

    async def main():
        conn = Connection()
        engine.attach(conn)
        task = asyncio.create_task(engine.run())
        engine.submit(conn, [_request("a", max_new=30, gamma=3, prompt=list(range(2, 20))),
                             _request("b", max_new=30, gamma=0, prompt=list(range(2, 9)))])
        await _until_finished(conn, {"a", "b"})
        task.cancel()

    asyncio.run(main())
    a, b = sorted({seq for step in views for seq in step})
    asked = [step[a][0] for step in views if a in step and step[a][1] > 0]
    assert asked == [n for key, _, n in proposer.appends if key == a] and asked[0] == 19, (asked, proposer.appends)
    assert [step[b][0] for step in views if b in step] == list(range(8, 8 + 29))  # one token a step, never sent


def test_accepted_counts_per_position_add_up_to_the_accepted_tokens(model_zoo):
    """Per-position acceptance (vLLM's num_accepted_tokens_per_pos for one sequence): with the
    identical draft every proposal is kept, so position i counts every pass given more than i
    proposals; with the partial draft the counts fall with position and sum to accepted_tokens."""
    finals = {}
    for draft in ("same", "partial"):
        engine, _ = _engine(model_zoo, draft=draft)

        async def main():
            conn = Connection()
            engine.attach(conn)
            task = asyncio.create_task(engine.run())
            engine.submit(conn, [_request("a", max_new=40, prompt=list(range(2, 30)))])
            final = await _until_finished(conn, {"a"})
            task.cancel()
            return final["a"].stats

        finals[draft] = asyncio.run(main())
    same, partial = finals["same"], finals["partial"]
    given_more_than = [sum(n for g, n in enumerate(same.gamma_histogram) if g > i) for i in range(4)]
    assert same.accepted_per_position == given_more_than, (same.accepted_per_position, same.gamma_histogram)
    assert sum(partial.accepted_per_position) == partial.accepted_tokens > 0
    assert partial.rejections > 0, "the partial draft should be rejected sometimes"
    counts = partial.accepted_per_position
    assert all(a >= b for a, b in zip(counts, counts[1:])), counts


def test_invalid_sequence_requests_get_error_events(model_zoo):
    engine, _ = _engine(model_zoo)
    conn = Connection()
    engine.submit(conn, [
        SequenceRequest("empty", [], 3),
        _request("toolong", max_new=10_000),
        _request("badgamma", gamma=99),
        SequenceRequest("badtok", [10**6], 3),
        SequenceRequest("badmax", [1], 3, speculation=Speculation("auto", max_gamma=9)),
        SequenceRequest("dup", [1], 3),
        SequenceRequest("dup", [1], 3),
    ])
    errors = {}
    while not conn.outbox.empty():
        for event in conn.outbox.get_nowait().events:
            errors[event.id] = event.error
    # Every error names the field and the value, and its class is its status.
    assert {rid: e.code.name for rid, e in errors.items()} == {
        "empty": "INVALID_ARGUMENT", "toolong": "INVALID_ARGUMENT", "badgamma": "INVALID_ARGUMENT",
        "badtok": "INVALID_ARGUMENT", "badmax": "INVALID_ARGUMENT", "dup": "ALREADY_EXISTS"}
    errors = {rid: str(e) for rid, e in errors.items()}
    assert errors["empty"].startswith("prompt_token_ids")
    assert errors["toolong"].startswith("max_new_tokens=10000")
    assert errors["badgamma"].startswith("speculation.gamma=99")
    assert errors["badtok"].startswith("prompt_token_ids=1000000")
    assert errors["badmax"].startswith("speculation.max_gamma=9")
    assert errors["dup"].startswith("id='dup'")
    assert [seq.request_id for seq in engine.waiting] == ["dup"]  # the first one runs


def test_prefill_failure_fails_only_that_request_and_frees_its_slot(model_zoo):
    engine, _ = _engine(model_zoo, max_slots=1)
    real = engine._prefill_compute
    calls = []

    def flaky(group, length):
        calls.append(group)
        if len(calls) == 1:
            raise RuntimeError("simulated out-of-memory in prefill")
        return real(group, length)

    engine._prefill_compute = flaky

    async def main():
        conn = Connection()
        engine.attach(conn)
        task = asyncio.create_task(engine.run())
        engine.submit(conn, [_request("a")])
        final = await _until_finished(conn, {"a"})
        assert final["a"].finish_reason == "error" and "internal error" in str(final["a"].error)
        assert final["a"].error.code.name == "INTERNAL"
        assert engine.load().free_slots == 1 and engine.by_request == {}
        engine.submit(conn, [_request("a")])  # the id and the slot are usable again
        final = await _until_finished(conn, {"a"})
        assert final["a"].finish_reason == "length"
        task.cancel()

    asyncio.run(main())


def test_draft_with_a_smaller_vocabulary_is_skipped_not_crashed(model_zoo, tmp_path):
    """Ids the draft cannot embed (a smaller-vocabulary draft of the same family) mean plain
    decoding for that sequence, with the same output."""
    import json

    from specstream.models.random_init import write_random_checkpoint

    config = json.loads((model_zoo["target"] / "config.json").read_text())
    small = write_random_checkpoint(tmp_path / "small", {**config, "vocab_size": 200}, seed=3)
    model = load_model(model_zoo["target"])
    proposer = DraftProposer(load_model(small), 8, 512)
    config_t = TargetConfig(model=ModelSpec(str(model_zoo["target"])), max_slots=2, max_seq_len=512, max_gamma=8)
    engines = {"plain": Engine(model, config_t, None), "spec": Engine(model, config_t, LocalDraft(proposer))}
    prompts = {"low": [0, 5, 6, 7], "high": [0, 250, 260]}

    async def main(engine):
        conn = Connection()
        engine.attach(conn)
        task = asyncio.create_task(engine.run())
        engine.submit(conn, [_request(name, max_new=20, prompt=p) for name, p in prompts.items()])
        tokens = {name: [] for name in prompts}
        final = {}
        while len(final) < len(prompts):
            message = await asyncio.wait_for(conn.outbox.get(), 30)
            for event in message.events:
                tokens[event.id] += event.token_ids
                if event.finish_reason:
                    final[event.id] = event
        task.cancel()
        return tokens, final

    plain, _ = asyncio.run(main(engines["plain"]))
    spec, final = asyncio.run(main(engines["spec"]))
    assert spec == plain
    assert final["high"].stats.draft_tokens == 0
    assert all(f.finish_reason == "length" for f in final.values())
