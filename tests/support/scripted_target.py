"""A target of a test's own, serving `Target.Connect` on a loopback port: it answers every request
with REPLY's tokens, one per `delay` seconds, and records what it is sent and cancelled. The
gateway in front of it is the real one, so gateway tests run without a model."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from specstream.data.batch_stats import BatchStats
from specstream.data.engine import EngineMessage, Load, SequenceEvent, SequenceStats, TargetInfo, TokenLogprob
from specstream.data.engine_wire import info_to_pb, message_to_pb, request_from_pb
from specstream.data.errors import InvalidArgumentError
from specstream.text.chat import ChatTemplate
from specstream.text.tokenizer import TextTokenizer, build_byte_level_tokenizer
from specstream_pb import target_pb2_grpc

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TT = TextTokenizer(build_byte_level_tokenizer(), eos_token_ids=[1], bos_token_id=0, chat_template=ChatTemplate(CHATML))
MODEL = "scripted"
LOAD = Load(max_slots=8, free_slots=8, running=0, queued=0, draft_sequences=0, draft_connected=False,
            batch=BatchStats("static", 8))
REPLY = " Paris, the city of light."
TOKENS = TT.encode(REPLY)[1:]  # without BOS
STATS = SequenceStats(draft_tokens=12, accepted_tokens=7, target_passes=6, mean_accepted_length=2.0, rejections=3,
                      gamma_histogram=[1, 0, 1, 0, 3], accepted_per_position=[4, 2, 1])


@dataclass
class StreamingTarget(target_pb2_grpc.TargetServicer):
    """Answers every request with REPLY's tokens (up to max_new_tokens), one per `delay` seconds.
    A prompt containing "FAIL" fails after two tokens; "SLOW" streams 100x slower."""

    delay: float = 0.005
    max_context_length: int = 256
    repeat: bool = False  # REPLY's tokens over and over, up to max_new_tokens (else REPLY once at most)
    requests: list = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    async def GetInfo(self, request, context):  # noqa: N802
        return info_to_pb(TargetInfo(model_name=MODEL, vocab_size=TT.vocab_size,
                                     max_context_length=self.max_context_length, max_gamma=8, default_gamma=4,
                                     eos_token_ids=[1], load=LOAD))

    async def Connect(self, request_iterator, context):  # noqa: N802
        out: asyncio.Queue = asyncio.Queue()
        running: dict[str, asyncio.Task] = {}
        out.put_nowait(EngineMessage(LOAD))

        async def produce(req) -> None:
            text = TT.decode(req.prompt_token_ids)
            delay = self.delay * (100 if "SLOW" in text else 1)
            tokens = (TOKENS * (1 + req.max_new_tokens // len(TOKENS)) if self.repeat else TOKENS)[:req.max_new_tokens]
            for i, token in enumerate(tokens):
                await asyncio.sleep(delay)
                last = i == len(tokens) - 1
                if "FAIL" in text and i == 2:
                    out.put_nowait(EngineMessage(LOAD, 0, [SequenceEvent(
                        req.id, finish_reason="error", error=InvalidArgumentError("prompt", "FAIL", "scripted"))]))
                    return
                logprobs = [TokenLogprob(token, -0.5, [(token, -0.5), (2, -1.5)][:req.logprobs])] \
                    if req.logprobs is not None else []
                out.put_nowait(EngineMessage(LOAD, 0, [SequenceEvent(
                    req.id, token_ids=[token], logprobs=logprobs, finish_reason="length" if last else None,
                    stats=STATS, queue_seconds=0.125 if i == 0 else None)]))

        async def read() -> None:
            async for message in request_iterator:
                for pb in message.submit.requests:
                    req = request_from_pb(pb)
                    self.requests.append(req)
                    running[req.id] = asyncio.ensure_future(produce(req))
                for rid in message.cancel.ids:
                    self.cancelled.append(rid)
                    if rid in running:
                        running[rid].cancel()

        reader = asyncio.ensure_future(read())
        try:
            while True:
                yield message_to_pb(await out.get())
        finally:
            reader.cancel()
            for task in running.values():
                task.cancel()
