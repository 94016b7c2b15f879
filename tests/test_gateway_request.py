"""`gateway.request` against a scripted fake router: logprobs travel with their tokens (also when a
stop string cuts an event in the middle), the seed comes back, unary equals the stream, and the
reported queue time adds the gateway's wait to the target's."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from gateway.request import generate, stream_chunks
from gateway.ticket import Ticket
from gateway.validation import Limits, ValidRequest, validate
from specstream.data.config import GatewayConfig
from specstream.data.engine import SequenceEvent, SequenceRequest, TargetInfo, TokenLogprob
from specstream.data.errors import InternalError, OverloadedError
from specstream.serving.metrics import GatewayMetrics
from specstream.text.tokenizer import TextTokenizer, build_byte_level_tokenizer
from specstream_pb import common_pb2, generation_pb2

TT = TextTokenizer(build_byte_level_tokenizer(), eos_token_ids=[1], bos_token_id=0)
LIMITS = Limits.build(GatewayConfig("t:1", "m"), TargetInfo(vocab_size=TT.vocab_size, max_context_length=256,
                                                            max_gamma=8))
TEXT = "x = 1 # STOP here and more text"
IDS = TT.encode(TEXT)[1:]  # without BOS
STOP_END = next(k for k in range(1, len(IDS) + 1) if "STOP" in TT.decode(IDS[:k]))  # tokens up to the match


def _logprob(i: int, token: int) -> TokenLogprob:
    # Distinct per position (and exact in float32, as on the wire), so a shifted or dropped entry
    # cannot go unnoticed.
    return TokenLogprob(token_id=token, logprob=-0.125 * (i + 1), top=[(token, -0.125 * (i + 1)), (2, -8.0)])


LOGPROBS = [_logprob(i, t) for i, t in enumerate(IDS)]


def _plain(pb: common_pb2.TokenLogprob) -> TokenLogprob:
    """A public response's logprob, read back for comparison."""
    return TokenLogprob(pb.token_id, pb.logprob, [(alt.token_id, alt.logprob) for alt in pb.top])


class FakeTarget:
    """Stands in for the router: plays back a fixed list of SequenceEvents for every submitted
    request, as if it had waited `gateway_wait` seconds in the gateway's queue; records cancels."""

    def __init__(self, events: list[SequenceEvent], gateway_wait: float = 0.0) -> None:
        self.events = events
        self.gateway_wait = gateway_wait
        self.submitted: list[SequenceRequest] = []
        self.cancelled: list[str] = []

    def submit(self, request: SequenceRequest) -> Ticket:
        self.submitted.append(request)
        ticket = Ticket(dataclasses.replace(request, id="7"), number=len(self.submitted), enqueued_at=100.0,
                        dispatched_at=100.0 + self.gateway_wait)
        for event in self.events:
            ticket.events.put_nowait(event)
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        self.cancelled.append(ticket.request.id)


def _events(step: int, with_logprobs: bool) -> list[SequenceEvent]:
    events = []
    for start in range(0, len(IDS), step):
        event = SequenceEvent(id="7", token_ids=IDS[start:start + step])
        if with_logprobs:
            event.logprobs.extend(LOGPROBS[start:start + step])
        events.append(event)
    events[-1].finish_reason = "length"
    events[-1].stats.target_passes = len(events)
    return events


def _request(**fields) -> ValidRequest:
    return validate(generation_pb2.GenerateRequest(prompt="# a", max_new_tokens=len(IDS), **fields), LIMITS, TT)


def _stream(req: ValidRequest, target: FakeTarget) -> list[generation_pb2.GenerateStreamResponse]:
    async def main():
        return [chunk async for chunk in stream_chunks(req, target, TT, GatewayMetrics())]

    return asyncio.run(main())


def _assert_aligned(chunks: list[generation_pb2.GenerateStreamResponse]) -> None:
    for i, chunk in enumerate(chunks):
        assert [lp.token_id for lp in chunk.logprobs] == list(chunk.token_ids), f"chunk {i}"


@pytest.mark.parametrize("step", [1, 3, 4, 5, len(IDS)])
def test_logprobs_travel_with_their_tokens(step):
    req = _request(temperature=0.5, seed=1234, logprobs=True, top_logprobs=2)
    chunks = _stream(req, FakeTarget(_events(step, with_logprobs=True)))
    _assert_aligned(chunks)
    assert [t for c in chunks for t in c.token_ids] == IDS
    assert [_plain(lp) for c in chunks for lp in c.logprobs] == LOGPROBS
    assert "".join(c.text for c in chunks) == TEXT
    assert [c.seed for c in chunks] == [0] * (len(chunks) - 1) + [1234]  # the final chunk only


@pytest.mark.parametrize("step", [1, 2, 3, 4, 5, 8, len(IDS)])
def test_a_stop_string_cuts_logprobs_where_it_cuts_tokens(step):
    assert 0 < STOP_END < len(IDS)  # the stop string ends inside the generation
    target = FakeTarget(_events(step, with_logprobs=True))
    chunks = _stream(_request(stop=["STOP"], logprobs=True, top_logprobs=2), target)
    _assert_aligned(chunks)
    assert [t for c in chunks for t in c.token_ids] == IDS[:STOP_END]
    assert [_plain(lp) for c in chunks for lp in c.logprobs] == LOGPROBS[:STOP_END]
    assert "".join(c.text for c in chunks) == TEXT[:TEXT.index("STOP")]
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert chunks[-1].usage.completion_tokens == STOP_END
    assert "7" in target.cancelled


def test_events_without_logprobs_add_none():
    chunks = _stream(_request(stop=["STOP"]), FakeTarget(_events(3, with_logprobs=False)))
    assert [t for c in chunks for t in c.token_ids] == IDS[:STOP_END]
    assert all(len(c.logprobs) == 0 for c in chunks)


def test_unary_concatenates_logprobs_and_returns_the_seed():
    req = _request(temperature=1.0, stop=["STOP"], logprobs=True)
    target = FakeTarget(_events(4, with_logprobs=True))
    response = asyncio.run(generate(req, target, TT, GatewayMetrics()))
    assert list(response.token_ids) == IDS[:STOP_END]
    assert [_plain(lp) for lp in response.logprobs] == LOGPROBS[:STOP_END]
    assert response.seed == req.seed == target.submitted[0].sampling.seed
    chunks = _stream(req, FakeTarget(_events(4, with_logprobs=True)))
    assert response.text == "".join(c.text for c in chunks)
    assert response.seed == chunks[-1].seed


def test_the_gateway_picked_seed_is_returned():
    req = _request()  # no seed: the gateway picked one
    target = FakeTarget(_events(4, with_logprobs=False))
    response = asyncio.run(generate(req, target, TT, GatewayMetrics()))
    assert response.seed == req.seed == target.submitted[0].sampling.seed
    assert len(response.logprobs) == 0


def test_misaligned_logprobs_from_the_target_are_an_internal_error():
    events = _events(4, with_logprobs=True)
    del events[1].logprobs[-1]
    target = FakeTarget(events)
    with pytest.raises(InternalError, match="3 logprobs for 4 tokens") as info:
        _stream(_request(logprobs=True), target)
    assert info.value.code == grpc.StatusCode.INTERNAL
    assert "7" in target.cancelled  # the sequence is let go


def test_an_error_event_reaches_the_caller_as_its_own_class_after_the_tokens_before_it():
    events = _events(4, with_logprobs=False)[:2]
    events.append(SequenceEvent(id="7", finish_reason="error", error=OverloadedError("the target is full")))
    target = FakeTarget(events)
    chunks = []

    async def main():
        async for chunk in stream_chunks(_request(), target, TT, GatewayMetrics()):
            chunks.append(chunk)

    with pytest.raises(OverloadedError, match="the target is full") as info:
        asyncio.run(main())
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [t for c in chunks for t in c.token_ids] == IDS[:8] and not chunks[-1].finish_reason


def test_queue_seconds_adds_the_gateway_wait_to_the_targets():
    events = _events(4, with_logprobs=False)
    events[0].queue_seconds = 0.25  # the target reports its own wait on the first event
    response = asyncio.run(generate(_request(), FakeTarget(events, gateway_wait=1.5), TT, GatewayMetrics()))
    assert response.timings.queue_seconds == pytest.approx(1.75)


@pytest.mark.parametrize("step", [1, 4])
def test_metrics_count_what_the_caller_got(step):
    metrics = GatewayMetrics()

    async def main():
        req = _request(stop=["STOP"])
        return [c async for c in stream_chunks(req, FakeTarget(_events(step, False)), TT, metrics)]

    chunks = asyncio.run(main())
    final, r = chunks[-1], metrics.registry
    assert r.get_sample_value("specstream:generation_tokens_total") == final.usage.completion_tokens == STOP_END
    assert r.get_sample_value("specstream:prompt_tokens_total") == final.usage.prompt_tokens
    assert r.get_sample_value("specstream:request_success_total", {"finish_reason": "stop"}) == 1
    assert r.get_sample_value("specstream:request_success_total", {"finish_reason": "length"}) == 0
    # One inter-token observation per token after the first chunk's.
    assert r.get_sample_value("specstream:inter_token_latency_seconds_count") == STOP_END - len(chunks[0].token_ids)
    assert r.get_sample_value("specstream:e2e_request_latency_seconds_sum") == final.timings.total_seconds
    assert r.get_sample_value("specstream:time_to_first_token_seconds_sum") == \
        final.timings.time_to_first_token_seconds
    assert r.get_sample_value("specstream:inter_token_latency_seconds_sum") == pytest.approx(
        final.timings.total_seconds - final.timings.time_to_first_token_seconds)
