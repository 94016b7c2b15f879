"""Beam search through the served gateway, over gRPC, in front of a scripted target replica.

The gateway is the real one: `GenerationServicer` in a `ServiceServer` (so the `ErrorInterceptor`
chooses the status), a `Router` and a `TargetClient` with its `Connect` stream open to a target on
a loopback port. The target answers every request as the engine's contract for beams says
(`specstream/data/engine.py`): one step with no tokens, then the last event with the best
hypothesis' tokens in `token_ids` and the n best in `sequences`; it reads requests and writes
events with the target's own protobuf edge (specstream/data/engine_wire.py). Checked: `beam`
reaches the target as sent, every hypothesis comes back detokenized like the main text,
`GenerateStream` sends exactly one chunk that equals the unary response, and every bad beam option
or combination is INVALID_ARGUMENT naming the field before anything reaches the target. The
engine's own beams through the three real processes: tests/integration/test_beam_stack.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest
from test_gateway_validation import BAD_BEAM_REQUESTS

from gateway.router import Router
from gateway.server import SERVICE_NAME, GenerationServicer
from gateway.service import Gateway
from gateway.target_client import TargetClient
from specstream.data.batch_stats import BatchStats
from specstream.data.config import GatewayConfig, ServerConfig
from specstream.data.engine import (
    BeamHypothesis,
    EngineMessage,
    Load,
    SequenceEvent,
    SequenceRequest,
    SequenceStats,
    TargetInfo,
)
from specstream.data.engine_wire import info_to_pb, message_to_pb, request_from_pb
from specstream.serving.grpc_server import ServiceServer
from specstream.serving.metrics import GatewayMetrics
from specstream.text.tokenizer import TextTokenizer, build_byte_level_tokenizer
from specstream_client import AsyncClient, BeamSequence
from specstream_pb import common_pb2, generation_pb2, generation_pb2_grpc, target_pb2_grpc

TT = TextTokenizer(build_byte_level_tokenizer(), eos_token_ids=[1], bos_token_id=0)
EOS = 1
LOAD = Load(max_slots=8, free_slots=8, running=0, queued=0, draft_sequences=0, draft_connected=False,
            batch=BatchStats("static", 8))
PROMPT = "The capital of France is"
# Best first, as the engine ranks them; the first ends on EOS (a special token the text leaves out),
# the third holds "é" (two bytes, two tokens of the byte-level vocabulary).
TEXTS = [" Paris.", " Paris, the city", " the café"]
HYPOTHESES = [
    BeamHypothesis(token_ids=TT.encode(TEXTS[0])[1:] + [EOS], score=-0.25, logprob=-2.0, finish_reason="eos"),
    BeamHypothesis(token_ids=TT.encode(TEXTS[1])[1:], score=-0.5, logprob=-8.0, finish_reason="length"),
    BeamHypothesis(token_ids=TT.encode(TEXTS[2])[1:], score=-0.75, logprob=-9.0, finish_reason="length"),
]
EXPANSIONS = 23


class ScriptedTarget(target_pb2_grpc.TargetServicer):
    """One target replica answering each request the way the engine answers a beam request."""

    def __init__(self) -> None:
        self.requests: list[SequenceRequest] = []

    async def GetInfo(self, request, context):  # noqa: N802
        return info_to_pb(TargetInfo(model_name="scripted", vocab_size=TT.vocab_size, max_context_length=256,
                                     max_gamma=8, default_gamma=4, eos_token_ids=[EOS], load=LOAD))

    async def Connect(self, request_iterator, context):  # noqa: N802
        yield message_to_pb(EngineMessage(LOAD))  # a new connection gets a load message at once
        step = 0
        async for message in request_iterator:
            for pb in message.submit.requests:
                req = request_from_pb(pb)
                assert req.beam is not None, "this target serves beam requests only"
                self.requests.append(req)
                best = HYPOTHESES[:req.beam.num_return_sequences]
                step += 1
                yield message_to_pb(EngineMessage(LOAD, step, [SequenceEvent(
                    req.id, queue_seconds=0.25, stats=SequenceStats(target_passes=1))]))
                step += 1
                yield message_to_pb(EngineMessage(LOAD, step, [SequenceEvent(
                    req.id, token_ids=list(best[0].token_ids), finish_reason=best[0].finish_reason, sequences=best,
                    stats=SequenceStats(target_passes=5, beam_expansions=EXPANSIONS))]))


@dataclass
class Served:
    target: ScriptedTarget
    address: str  # the gateway's
    stub: generation_pb2_grpc.GenerationStub


@asynccontextmanager
async def served_gateway() -> AsyncIterator[Served]:
    target = ScriptedTarget()
    target_server = grpc.aio.server()
    target_pb2_grpc.add_TargetServicer_to_server(target, target_server)
    target_port = target_server.add_insecure_port("127.0.0.1:0")
    await target_server.start()
    replica = TargetClient(f"127.0.0.1:{target_port}", retry_s=0.1)
    await replica.start(timeout_s=10)
    router = Router([replica], max_queue=8)
    metrics = GatewayMetrics()
    servicer = GenerationServicer(Gateway(GatewayConfig(replica.url, "scripted"), router, replica.info, TT, metrics))
    gateway = ServiceServer(ServerConfig(), [SERVICE_NAME], metrics.registry)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, gateway.server)
    await gateway.start()
    for _ in range(500):  # the Connect stream answers and the health watch settles (no health service: serving)
        if replica.routable:
            break
        await asyncio.sleep(0.01)
    assert replica.routable, "the scripted target never became routable"
    channel = grpc.aio.insecure_channel(gateway.address)
    try:
        yield Served(target, gateway.address, generation_pb2_grpc.GenerationStub(channel))
    finally:
        await channel.close()
        await gateway.server.stop(None)
        await replica.close()
        await target_server.stop(None)


def _beam_request(**beam) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=12,
                                          beam=common_pb2.BeamSearch(**{"num_beams": 4, **beam}))


def test_a_beam_comes_back_with_every_hypothesis_detokenized() -> None:
    async def main() -> None:
        async with served_gateway() as served:
            response = await served.stub.Generate(_beam_request(num_return_sequences=3, length_penalty=0.5))
            chunks = [chunk async for chunk in served.stub.GenerateStream(_beam_request(num_return_sequences=3))]
            (sent_unary, sent_stream) = served.target.requests

        # `beam` reached the engine as the caller set it.
        assert (sent_unary.beam.num_beams, sent_unary.beam.num_return_sequences, sent_unary.beam.length_penalty) == \
            (4, 3, 0.5)
        assert sent_stream.beam.length_penalty == 1.0 and sent_stream.sampling.temperature == 0.0

        assert [list(s.token_ids) for s in response.sequences] == [h.token_ids for h in HYPOTHESES]
        assert [s.text for s in response.sequences] == [TT.decode(h.token_ids) for h in HYPOTHESES] == TEXTS
        assert [(s.score, s.logprob) for s in response.sequences] == [(h.score, h.logprob) for h in HYPOTHESES]
        assert [s.finish_reason for s in response.sequences] == [common_pb2.FINISH_REASON_EOS,
                                                                 common_pb2.FINISH_REASON_LENGTH,
                                                                 common_pb2.FINISH_REASON_LENGTH]
        # The main result is the best hypothesis, its text made the same way (EOS skipped).
        assert list(response.token_ids) == HYPOTHESES[0].token_ids and response.text == response.sequences[0].text
        assert response.finish_reason == common_pb2.FINISH_REASON_EOS
        assert response.stats.beam_expansions == EXPANSIONS
        assert response.usage.completion_tokens == len(HYPOTHESES[0].token_ids)
        assert response.timings.queue_seconds >= 0.25  # the target's wait is in it

        assert len(chunks) == 1, "a beam request is one chunk: the engine reports nothing before its end"
        (chunk,) = chunks
        assert chunk.text == response.text and list(chunk.token_ids) == list(response.token_ids)
        assert list(chunk.sequences) == list(response.sequences) and chunk.finish_reason == response.finish_reason
        assert chunk.stats.beam_expansions == EXPANSIONS and chunk.usage == response.usage

    asyncio.run(main())


def test_the_sdk_reads_the_n_best_unary_and_streamed() -> None:
    async def main() -> None:
        async with served_gateway() as served, AsyncClient(served.address, timeout=30) as client:
            result = await client.generate(PROMPT, max_new_tokens=12, num_beams=3, num_return_sequences=2,
                                           early_stopping=True, beam_threshold=2.5, max_candidates_per_parent=2)
            chunks = [c async for c in client.generate_stream(PROMPT, max_new_tokens=12, num_beams=3,
                                                              num_return_sequences=2, speculation="off")]
            (sent, _) = served.target.requests

        assert (sent.beam.early_stopping, sent.beam.beam_threshold, sent.beam.max_candidates_per_parent) == \
            ("first_k", 2.5, 2)
        want = [BeamSequence(text=t, token_ids=h.token_ids, score=h.score, logprob=h.logprob,
                             finish_reason=h.finish_reason) for t, h in zip(TEXTS, HYPOTHESES[:2])]
        assert result.sequences == want and result.text == TEXTS[0] and result.finish_reason == "eos"
        assert result.stats.beam_expansions == EXPANSIONS
        assert len(chunks) == 1 and chunks[0].sequences == want and chunks[0].is_final

    asyncio.run(main())


@pytest.mark.parametrize(("field", "fields"), BAD_BEAM_REQUESTS)
def test_a_bad_beam_request_is_invalid_argument_naming_the_field(field: str, fields: dict) -> None:
    async def main() -> None:
        async with served_gateway() as served:
            request = generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=4, **fields)
            for call in (served.stub.Generate, _first_chunk(served.stub.GenerateStream)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(request)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert info.value.details().startswith(f"{field}="), info.value.details()
            assert served.target.requests == []  # refused before anything reached the target
            # ... and the gateway carries on
            assert (await served.stub.Generate(_beam_request(num_return_sequences=1))).sequences

    asyncio.run(main())


def _first_chunk(stream_method):
    async def call(request):
        async for chunk in stream_method(request):
            return chunk

    return call
