"""The servers' shared interceptor: bytes that are not the method's message are INVALID_ARGUMENT
naming the request (not grpc's UNKNOWN with a logged traceback), for unary and streamed requests,
and the server carries on."""

from __future__ import annotations

import asyncio
import logging

import grpc
from prometheus_client import CollectorRegistry

from specstream.data.config import ServerConfig
from specstream.serving.grpc_server import ServiceServer
from specstream_pb import generation_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc

GARBAGE = [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x12\xff\xff\xff\xff\x0f"]  # bad tag, short length, huge length


class Generation(generation_pb2_grpc.GenerationServicer):
    async def Generate(self, request, context):  # noqa: N802
        return generation_pb2.GenerateResponse(text=request.prompt)

    async def GenerateStream(self, request, context):  # noqa: N802
        yield generation_pb2.GenerateStreamResponse(text=request.prompt)


class Target(target_pb2_grpc.TargetServicer):
    async def Connect(self, request_iterator, context):  # noqa: N802
        async for message in request_iterator:
            yield target_pb2.TargetMessage(load=target_pb2.Load(running=len(message.submit.requests)))


def _raw(channel, method: str, kind: str):
    make = getattr(channel, kind)
    return make(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)


def test_undecodable_requests_are_invalid_argument_and_nothing_is_logged(caplog) -> None:
    async def main():
        server = ServiceServer(ServerConfig(), ["specstream.v1.Generation", "specstream.v1.Target"],
                               CollectorRegistry())
        generation_pb2_grpc.add_GenerationServicer_to_server(Generation(), server.server)
        target_pb2_grpc.add_TargetServicer_to_server(Target(), server.server)
        await server.start()
        errors = []
        async with grpc.aio.insecure_channel(server.address) as channel:
            for data in GARBAGE:
                for method, kind in (("Generation/Generate", "unary_unary"),
                                     ("Generation/GenerateStream", "unary_stream")):
                    call = _raw(channel, f"/specstream.v1.{method}", kind)(data)
                    try:
                        if kind == "unary_stream":
                            [item async for item in call]
                        else:
                            await call
                    except grpc.aio.AioRpcError as exc:
                        errors.append((method, exc.code(), exc.details()))
                good = target_pb2.GatewayMessage().SerializeToString()
                connect = _raw(channel, "/specstream.v1.Target/Connect", "stream_stream")(iter([good, data]))
                try:
                    [item async for item in connect]
                except grpc.aio.AioRpcError as exc:
                    errors.append(("Target/Connect", exc.code(), exc.details()))
            served = await generation_pb2_grpc.GenerationStub(channel).Generate(
                generation_pb2.GenerateRequest(prompt="still here"))
        await server.server.stop(0)
        return errors, served

    with caplog.at_level(logging.DEBUG):
        errors, served = asyncio.run(main())
    assert len(errors) == 3 * len(GARBAGE), errors
    for method, code, details in errors:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code, details)
        assert details.startswith(f"request: the bytes are not a valid {method.split('/')[1]} request message")
    assert served.text == "still here"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
