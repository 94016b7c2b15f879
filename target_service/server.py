"""The target service process: the `Target` gRPC servicer around the engine.

The servicer is thin: it turns each `Connect` stream into a `Connection`, forwards Submit/Cancel
to the engine (converted by specstream/data/engine_wire.py) and drains the connection's outbox
into the stream as protobuf.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from specstream.data.config import DraftConfig, TargetConfig
from specstream.data.engine_wire import info_to_pb, message_to_pb, request_from_pb
from specstream.data.errors import SpecstreamError
from specstream.data.propose import Proposer
from specstream.models.config import ModelLoadError
from specstream.models.loader import load_model, serving_choice
from specstream.models.registry import resolve_dtype, resolve_model
from specstream.serving.compute import compute_executor
from specstream.serving.grpc_server import ServiceServer
from specstream.serving.metrics import TargetMetrics
from specstream.serving.native_memory import HeapTrimmer, bound_kernel_caches
from specstream.text.grammar import compiler_for
from specstream_pb import target_pb2, target_pb2_grpc
from target_service.connection import Connection
from target_service.draft_client import DraftClient
from target_service.draft_deadline import DraftDeadline
from target_service.engine import Engine
from target_service.local_draft import LocalDraft

DRAFT_STARTUP_WAIT_S = 10.0  # at start-up, wait this long for a draft that is still loading its model

log = logging.getLogger(__name__)
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["Target"].full_name


class TargetServicer(target_pb2_grpc.TargetServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Connect(self, request_iterator, context: grpc.aio.ServicerContext):  # noqa: N802
        conn = Connection()
        self.engine.attach(conn)
        reader = asyncio.create_task(self._read(request_iterator, conn))
        try:
            while (message := await conn.outbox.get()) is not None:
                yield message_to_pb(message)
        finally:
            reader.cancel()
            self.engine.detach(conn)

    async def _read(self, request_iterator, conn: Connection) -> None:
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "submit":
                    self._submit(conn, message.submit.requests)
                elif kind == "cancel":
                    self.engine.cancel(conn, list(message.cancel.ids))
        finally:
            conn.close()

    def _submit(self, conn: Connection, requests) -> None:
        accepted = []
        for pb in requests:
            try:
                accepted.append(request_from_pb(pb))
            except SpecstreamError as exc:  # settings the engine cannot even represent
                self.engine.reject(conn, pb.id, exc)
        self.engine.submit(conn, accepted)

    async def GetInfo(self, request, context):  # noqa: N802
        return info_to_pb(self.engine.info())


async def serve(config: TargetConfig, build_proposer: Callable[[DraftConfig], Proposer] | None = None) -> None:
    """Serves until stopped. `build_proposer` builds a colocated draft (`config.colocated_draft`) on
    the torch thread: the caller supplies it (draft_service.build.build_proposer), since services
    do not import each other."""
    bound_kernel_caches(config.memory.kernel_cache_capacity)  # before the first matmul
    compute = compute_executor("engine-compute", config.torch_threads)  # all torch work
    spec = config.model
    model = await asyncio.get_running_loop().run_in_executor(
        compute, lambda: load_model(resolve_model(spec.path), dtype=resolve_dtype(spec.dtype, spec.device),
                                    device=spec.device, weights=spec.weights))
    if model.output_token_ids is not None:
        raise ModelLoadError(f"{spec.path}: predicts over a subset of its vocabulary (specstream.output_vocab); "
                             "such a model can only serve as a draft")
    draft: DraftClient | LocalDraft | None = None
    if config.draft_url:
        draft = DraftClient(config.draft_url, config.draft_timeout_s, config.draft_retry_s,
                            options=config.server.grpc_options(), security=config.draft_security,
                            deadline=DraftDeadline(config.draft_timeout_s, config.draft_deadline_floor_s,
                                                   config.draft_deadline_factor),
                            target_layers=model.config.num_layers, target_width=model.config.hidden_size)
    elif config.colocated_draft is not None:
        if build_proposer is None:
            raise ValueError("colocated_draft: serve() needs build_proposer to build it")
        proposer = await asyncio.get_running_loop().run_in_executor(compute, build_proposer, config.colocated_draft)
        draft = LocalDraft(proposer, compute, config.colocated_draft.work_ahead)
    metrics = TargetMetrics(config.max_gamma, config.batch_rows)
    grammars = compiler_for(resolve_model(spec.path))
    if grammars is None:
        log.warning("%s: no tokenizer.json beside the model: constrained requests are refused", spec.path)
    engine = Engine(model, config, draft, compute, metrics, grammars=grammars)
    server = ServiceServer(config.server, [SERVICE_NAME], metrics.registry)
    target_pb2_grpc.add_TargetServicer_to_server(TargetServicer(engine), server.server)
    await server.start()
    if isinstance(draft, DraftClient):  # the stream is up before SERVING: Load.draft_connected is true at once
        await draft.wait_connected(timeout_s=max(config.draft_timeout_s, DRAFT_STARTUP_WAIT_S))
    await engine.time_draft()  # before SERVING: the first request's passes are priced from it
    engine_task = asyncio.create_task(engine.run(), name="engine")
    trimmer = asyncio.create_task(HeapTrimmer(config.memory.heap_trim_interval_s).run(compute), name="heap-trim")
    await server.set_serving(True)
    log.info("target %s serving %s (%s, %s weights) on %s (draft: %s)", model.config.name,
             model.config.architecture, model.dtype, model.weights, server.address, draft.url if draft else "none")
    log.info("target model: %s", serving_choice(model, spec.dtype, spec.weights))

    async def on_stop() -> None:
        trimmer.cancel()
        engine_task.cancel()
        engine.shutdown()
        if draft is not None:
            await draft.close()

    await server.serve_forever(on_stop)

