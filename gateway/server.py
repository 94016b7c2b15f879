"""The gateway process: the public `Generation` servicer.

Thin: admission (a bound on requests in flight), validation, then `gateway.request` does the
work. Health turns SERVING once the target has answered and the Connect stream is open.
"""

from __future__ import annotations

import logging

import grpc

from gateway import request as pipeline
from gateway.target_client import TargetClient
from gateway.validation import Limits, validate
from specstream.config import GatewayConfig
from specstream.errors import OverloadedError
from specstream.grpc_server import ServiceServer
from specstream.tokenizer import TextTokenizer
from specstream_pb import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, config: GatewayConfig, target: TargetClient, tokenizer: TextTokenizer) -> None:
        self.config = config
        self.target = target
        self.tokenizer = tokenizer
        self.limits = Limits.build(config, target.info)
        self.eos_ids = tuple(sorted(set(target.info.eos_token_ids) | set(tokenizer.eos_token_ids)))
        self.in_flight = 0

    def _admit(self, request: generation_pb2.GenerateRequest):
        if self.in_flight >= self.config.max_in_flight:
            raise OverloadedError(f"{self.in_flight} requests in flight (max_in_flight={self.config.max_in_flight}); "
                                  "retry later")
        return validate(request, self.limits, self.tokenizer)

    async def Generate(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        valid = self._admit(request)
        self.in_flight += 1
        try:
            return await pipeline.generate(valid, self.target, self.tokenizer, self.eos_ids)
        finally:
            self.in_flight -= 1

    async def GenerateStream(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        valid = self._admit(request)
        self.in_flight += 1
        try:
            async for chunk in pipeline.stream_chunks(valid, self.target, self.tokenizer, self.eos_ids):
                yield chunk
        finally:
            self.in_flight -= 1

    async def GetModelInfo(self, request, context):  # noqa: N802
        info, load = self.target.info, self.target.load
        return generation_pb2.ModelInfo(
            target_model=info.model_name, draft_model=info.draft_model_name, vocab_size=info.vocab_size,
            max_context_length=info.max_context_length, max_new_tokens_limit=self.limits.max_new_tokens,
            max_gamma=info.max_gamma, default_gamma=info.default_gamma, eos_token_ids=list(self.eos_ids),
            running_sequences=load.running, queued_sequences=load.queued, free_slots=load.free_slots,
            draft_sequences=load.draft_sequences, draft_connected=load.draft_connected,
            gateway_in_flight=self.in_flight)


async def serve(config: GatewayConfig) -> None:
    tokenizer = TextTokenizer.from_dir(config.tokenizer_path)
    target = TargetClient(config.target_url, options=config.server.grpc_options())
    await target.start(timeout_s=config.connect_timeout_s)
    server = ServiceServer(config.server, [SERVICE_NAME])
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(config, target, tokenizer), server.server)
    await server.start()
    await target.connected.wait()
    await server.set_serving(True)
    target.on_state = server.set_serving  # NOT_SERVING while the target stream is down
    log.info("gateway serving on %s -> target %s (%s)", server.address, config.target_url, target.info.model_name)
    await server.serve_forever(on_stop=target.close)
