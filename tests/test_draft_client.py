"""The target's gRPC draft client against a real draft servicer in this process whose proposer can
be made to hang (as a SIGSTOPped draft: the request is taken and never answered) and released (as
SIGCONT): a step waits at most its deadline, then every row decodes with γ = 0; the late reply is
dropped with its stream; the draft's copy of each sequence is rebuilt on the next stream; greedy
output stays the target's plain greedy output; speculation resumes once the draft answers again;
the stream (and `draft_connected`) is up before the first request."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from tests.support.engine_harness import run_engine, speculation

from draft_service.proposer import DraftProposer
from draft_service.server import DraftServicer
from specstream.data.config import ModelSpec, TargetConfig
from specstream.data.engine import SequenceRequest
from specstream.models.loader import load_model
from specstream.serving.metrics import DraftMetrics
from specstream_pb import draft_pb2_grpc
from target_service.connection import Connection
from target_service.draft_client import DraftClient
from target_service.draft_deadline import DraftDeadline
from target_service.drafting import DraftSource
from target_service.engine import Engine

PROMPTS = [[0, 5, 6], [1, 2, 3, 4], [7, 8], [9, 10, 11, 12, 13]]
MAX_NEW = 160
STEP_S = 0.01  # every verify pass is made to take at least this long, so a run outlasts a hang


class GatedProposer(DraftProposer):
    """The real proposer behind a gate: while it is closed every call (propose, release) blocks on
    the draft's compute thread. Records what each call asked of it: (key, rollback_to, len(append))."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[list[tuple[object, int, int]]] = []

    def propose(self, items):
        self.gate.wait()
        self.calls.append([(it.key, it.rollback_to, len(it.append)) for it in items])
        return super().propose(items)

    def release(self, keys):
        self.gate.wait()
        super().release(keys)


async def _draft_server(proposer) -> tuple[grpc.aio.Server, str, ThreadPoolExecutor]:
    compute = ThreadPoolExecutor(1, thread_name_prefix="test-draft")
    server = grpc.aio.server()
    draft_pb2_grpc.add_DraftServicer_to_server(DraftServicer(proposer, compute, DraftMetrics()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", compute


def _slow_engine(model_zoo, client: DraftClient, early: bool = False) -> Engine:
    model = load_model(model_zoo["target"])
    config = TargetConfig(model=ModelSpec(str(model_zoo["target"])), max_slots=4, max_seq_len=256, max_gamma=8,
                          calibrate=False, draft_early=early)
    engine = Engine(model, config, client)
    verify = engine._verify_compute

    def slow_verify(*args):
        time.sleep(STEP_S)
        return verify(*args)

    engine._verify_compute = slow_verify
    return engine


def test_a_hung_draft_costs_one_deadline_then_plain_decoding_and_speculation_comes_back(model_zoo):
    proposer = GatedProposer(load_model(model_zoo["partial"]), max_slots=16, max_seq_len=256)
    report = {}

    async def main():
        server, address, compute = await _draft_server(proposer)
        client = DraftClient(address, timeout_s=5.0, retry_s=0.1, deadline=DraftDeadline(5.0, floor_s=0.1))
        engine = _slow_engine(model_zoo, client)
        loop_task = asyncio.create_task(engine.run())
        try:
            assert await client.wait_connected(5.0)
            assert engine.load().draft_connected  # before any request
            assert engine.load().draft_model == client.model_name != ""
            conn = Connection()
            engine.attach(conn)
            engine.submit(conn, [SequenceRequest(str(i), p, MAX_NEW, speculation=speculation(4))
                                 for i, p in enumerate(PROMPTS)])
            tokens = {str(i): [] for i in range(len(PROMPTS))}
            stamps = {str(i): [] for i in range(len(PROMPTS))}
            finals, hung_at, released_at, reconnected_at, first_after_hang = {}, None, None, None, None
            epoch_before = client.epoch
            while len(finals) < len(PROMPTS):
                message = await asyncio.wait_for(conn.outbox.get(), 30)
                now = time.monotonic()
                for event in message.events:
                    if event.token_ids:
                        tokens[event.id] += event.token_ids
                        stamps[event.id].append(now)
                    if event.finish_reason is not None:
                        finals[event.id] = event
                generated = min(len(t) for t in tokens.values())
                if hung_at is None and generated >= 30:
                    proposer.gate.clear()  # the draft stops answering from its next request on
                    hung_at, at_hang, fallbacks_at_hang = now, generated, client.fallbacks
                elif hung_at is not None and first_after_hang is None and message.events:
                    first_after_hang = now
                    report["deadline_s"] = client.last_deadline_s  # of the round trip that got no reply
                elif released_at is None and hung_at is not None and generated >= at_hang + 20:
                    assert not client.connected  # fell back: decoding plainly, not waiting
                    proposer.gate.set()  # the draft answers again (and its late reply goes nowhere)
                    released_at = now
                    report["fallbacks"] = client.fallbacks - fallbacks_at_hang
                if released_at is not None and reconnected_at is None and client.connected:
                    reconnected_at = now
            report.update(fallback_s=first_after_hang - hung_at,
                          resume_s=(reconnected_at - released_at) if reconnected_at else None,
                          worst_gap_s=max(b - a for s in stamps.values() for a, b in zip(s, s[1:])),
                          worst_gap_before_s=max(b - a for s in stamps.values() for a, b in zip(s, s[1:])
                                                 if b <= hung_at),
                          epochs=(epoch_before, client.epoch))
            return tokens, finals
        finally:
            proposer.gate.set()
            loop_task.cancel()
            await client.close()
            await server.stop(0)
            compute.shutdown(wait=False)

    tokens, finals = asyncio.run(main())
    plain, _ = run_engine(model_zoo["target"], None, PROMPTS, 0, MAX_NEW, max_slots=4, max_seq_len=256)
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == plain  # exact: the target's greedy tokens
    print(f"hung draft: deadline {report['deadline_s'] * 1e3:.0f} ms, first plain step after "
          f"{report['fallback_s'] * 1e3:.0f} ms, worst gap {report['worst_gap_s'] * 1e3:.0f} ms, "
          f"stream back {report['resume_s']} s after release")
    # The deadline derives from the measured round trips: ~0.1 s on an idle machine, up to ~0.8 s
    # with busy processes beside the test (their spread widens it), far below the 5 s cap either way.
    assert report["deadline_s"] < 2.5
    # The slack: 0.5 s, plus the worst gap between tokens before the hang (what this machine's load
    # already cost a step then: a loaded host stretched a gap to ~0.7 s with a 0.1 s deadline).
    slack = 0.5 + report["worst_gap_before_s"]
    assert report["fallback_s"] < report["deadline_s"] + slack
    assert report["worst_gap_s"] < report["deadline_s"] + slack  # the hang cost one deadline, no more
    # Between the hang and the release, one round trip timed out; no step waited on the dead
    # stream again. (Counted from the hang: on a loaded machine an honest round trip before it
    # can miss its deadline too, which is the deadline's business, not this test's.)
    assert report["fallbacks"] == 1
    assert report["resume_s"] is not None and report["resume_s"] < 3.0
    # The stream came back (a new epoch). On a loaded machine an honest round trip after the
    # release can miss its deadline too and reconnect once more: the deadline's business again.
    assert report["epochs"][1] >= report["epochs"][0] + 1
    # Speculation came back for the sequences still running, and accepted tokens after it did.
    streams = sorted({key[0] for call in proposer.calls for key, _, _ in call})
    assert len(streams) >= 2, "nothing was proposed on a new stream"
    new_stream = [call for call in proposer.calls if call and call[0][0][0] == streams[-1]]
    # Resynchronised: each sequence's first item on the new stream starts from nothing and sends
    # its whole context (prompt + everything generated so far); later items append 1-2 tokens.
    first_seen: dict[int, tuple[int, int]] = {}
    for call in new_stream:
        for (stream, seq_id), rollback_to, appended in call:
            if seq_id not in first_seen:
                first_seen[seq_id] = (rollback_to, appended)
            else:
                assert 1 <= appended <= 2
    assert all(rollback == 0 and appended > 30 for rollback, appended in first_seen.values()), first_seen
    assert sum(f.stats.accepted_tokens for f in finals.values()) > 0


def test_the_stream_is_up_before_the_first_request_and_a_dead_draft_is_noticed_while_idle(model_zoo):
    proposer = GatedProposer(load_model(model_zoo["partial"]), max_slots=4, max_seq_len=64)

    async def main():
        server, address, compute = await _draft_server(proposer)
        client = DraftClient(address, timeout_s=5.0, retry_s=0.1)
        changes = []
        client.watch(lambda: changes.append(client.connected))
        try:
            assert await client.wait_connected(5.0) and client.connected and changes == [True]
            await server.stop(0)  # the draft goes away while nothing is being proposed
            deadline = time.monotonic() + 5.0
            while client.connected and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert not client.connected and changes == [True, False]
            assert await client.propose(1, []) is None  # no stream: nothing is attempted, nothing raises
        finally:
            await client.close()
            compute.shutdown(wait=False)

    asyncio.run(main())


def test_the_next_pass_is_asked_for_as_soon_as_a_pass_is_verified(model_zoo):
    """Through a real draft servicer at batch 1, a fixed γ: nearly every pass's draft call went out
    before the pass started (the answer to an early request), and the output is plain greedy's."""
    proposer = GatedProposer(load_model(model_zoo["partial"]), max_slots=16, max_seq_len=256)

    async def main():
        server, address, compute = await _draft_server(proposer)
        client = DraftClient(address, timeout_s=5.0, retry_s=0.1)
        engine = _slow_engine(model_zoo, client, early=True)
        loop_task = asyncio.create_task(engine.run())
        try:
            assert await client.wait_connected(5.0)
            conn = Connection()
            engine.attach(conn)
            engine.submit(conn, [SequenceRequest("0", PROMPTS[1], 60, speculation=speculation(3))])
            tokens = []
            while True:
                message = await asyncio.wait_for(conn.outbox.get(), 30)
                tokens += [t for event in message.events for t in event.token_ids]
                final = [event for event in message.events if event.finish_reason is not None]
                if final:
                    return tokens, dict(engine.drafting.early), final[0].stats.target_passes
        finally:
            loop_task.cancel()
            await client.close()
            await server.stop(0)
            compute.shutdown(wait=False)

    tokens, early, passes = asyncio.run(main())
    assert tokens == run_engine(model_zoo["target"], None, [PROMPTS[1]], 0, 60, max_seq_len=256)[0][0]
    # Every decode pass but the first (asked when it started) took an early answer; the prefill and
    # the last pass asked nothing early.
    assert early.get("used", 0) >= passes - 3 and early.get("dropped", 0) == 0, (early, passes)


class _Source(DraftSource):
    """A draft source whose answers are set by the test: `early` to the request sent early, `late`
    to any other; `epoch` as a DraftClient's."""

    asks_early = True
    url, model_name, vocab_size, max_context_length, connected, held_sequences = "test", "test", 300, 256, True, 0

    def __init__(self, early: list[int], late: list[int]) -> None:
        self.epoch, self.answers, self.asked = 1, {"early": early, "late": late}, []

    async def ready(self) -> bool:
        return True

    async def start_propose(self, step, items, traceparent="", item_traceparents=None):
        return asyncio.ensure_future(self._answer("early", items))

    async def propose(self, step, items, traceparent="", item_traceparents=None):
        return await self._answer("late", items)

    async def _answer(self, which, items):
        from specstream.data.propose import Proposal

        self.asked.append(which)
        item = items[0]
        return [Proposal(self.answers[which], item.rollback_to + len(item.append) + len(self.answers[which]) - 1)]


def test_an_early_answer_is_verified_only_for_the_rows_tokens_and_stream_it_was_asked_for():
    """A stale early answer (another stream, a sequence that moved on, other rows) is never what a
    pass verifies: it asks afresh, and verifies that answer."""
    from target_service.drafting import Drafting
    from target_service.gamma import GammaController
    from target_service.sequence import Sequence

    def row(seq_id=1, tokens=(5, 6, 7)):
        return Sequence(seq_id, str(seq_id), None, list(tokens), 2, 50, frozenset(), frozenset(), gamma=2)

    async def verified(change) -> tuple[list[int], list[str]]:
        source = _Source(early=[10, 11], late=[20, 21])
        drafting = Drafting(source, GammaController(), 300)
        rows = [row()]
        await drafting.propose_early(rows, 2)
        rows = change(source, rows)
        checks = await drafting.propose(rows, 2)
        return checks[0].proposals, source.asked

    assert asyncio.run(verified(lambda source, rows: rows)) == ([10, 11], ["early"])

    def new_stream(source, rows):
        source.epoch += 1
        return rows

    def moved_on(source, rows):
        rows[0].tokens.append(9)
        return rows

    for change in (new_stream, moved_on, lambda source, rows: [*rows, row(2)], lambda source, rows: [row(2)]):
        proposals, asked = asyncio.run(verified(change))
        assert proposals == [20, 21] and asked == ["early", "late"], change


class CardProposer(DraftProposer):
    """A real proposer whose card states acceptance rates, one of them valid (as DraftInfo carries them)."""

    @property
    def acceptance(self) -> dict[tuple[str, bool], float]:
        return {("model", True): 0.42, ("model", False): 1.5, ("", True): 0.3}


def test_the_controller_starts_from_the_acceptance_the_draft_states(model_zoo):
    """Through GetInfo, the engine's γ controller starts the (model, greedy) pool at the card's α; entries
    that are no rate, or name no proposer, are ignored; a draft in the process gives its card at once."""
    from target_service.local_draft import LocalDraft

    proposer = CardProposer(load_model(model_zoo["partial"]), max_slots=4, max_seq_len=64)

    async def main():
        server, address, compute = await _draft_server(proposer)
        client = DraftClient(address, timeout_s=5.0, retry_s=0.1)
        engine = _slow_engine(model_zoo, client)
        try:
            assert engine.controller.priors == {}  # nothing is known before the draft connects
            assert await client.wait_connected(5.0)
            assert client.acceptance == {("model", True): 0.42}
            return engine.controller
        finally:
            await client.close()
            await server.stop(0)
            compute.shutdown(wait=False)

    controller = asyncio.run(main())
    assert controller.priors == {("model", True): 0.42}
    assert controller.pooled_alpha("model", True) == 0.42 and controller.alpha(1, True) == 0.42  # a new row too
    assert controller.pooled_alpha("model", False) == controller.pooled_alpha("ngram", True) == controller.prior_alpha
    local = Engine(load_model(model_zoo["target"]), TargetConfig(model=ModelSpec(str(model_zoo["target"])), max_slots=2,
                                                                 max_seq_len=64, calibrate=False), LocalDraft(proposer))
    assert local.controller.priors == {("model", True): 0.42}
