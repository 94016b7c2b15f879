"""The draft service process: the `Draft` gRPC servicer around a proposer (DraftConfig.proposer:
the draft model, prompt-lookup n-grams, or both; or the synthetic benchmark proposer).

Thin: each `Speculate` stream gets its own key space; every request gets exactly one response;
a stream's sequences are released when it ends. All torch work runs on one thread: the event
loop's own (``InlineExecutor``: a proposal is computed where its request was read, with no hop to a
worker and back), or, with ``DraftConfig.work_ahead``, one worker thread, which after each proposal
is sent drafts the next round (draft_service/work_ahead.py) until any stream's next request arrives.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import Executor

import grpc

from draft_service import tracing
from draft_service.build import build_proposer
from specstream.data.config import DraftConfig
from specstream.data.propose import DraftInfo, Proposer
from specstream.data.propose_wire import info_to_pb, item_from_pb, proposal_to_pb
from specstream.serving.compute import InlineExecutor, compute_executor, run_at_idle_priority
from specstream.serving.grpc_server import ServiceServer
from specstream.serving.metrics import DraftMetrics
from specstream.serving.native_memory import HeapTrimmer, bound_kernel_caches
from specstream_pb import draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, proposer: Proposer, compute: Executor,
                 metrics: DraftMetrics, work_ahead: str = "off") -> None:
        self.proposer = proposer
        self.metrics = metrics
        self._streams = itertools.count(1)
        self._compute = compute  # the one thread that does all torch work
        # DraftConfig.work_ahead, where the proposer can ("off" where it cannot); requests read on
        # any stream so far: work ahead stops at its next forward once one more has arrived.
        self.work_ahead = work_ahead if proposer.works_ahead else "off"
        self._requests = 0

    async def Speculate(self, request_iterator, context: grpc.aio.ServicerContext):  # noqa: N802
        stream = next(self._streams)
        keys: set[tuple[int, int]] = set()
        loop = asyncio.get_running_loop()
        try:
            async for request in request_iterator:
                self._requests += 1
                response = draft_pb2.ProposeResponse()
                if request.WhichOneof("kind") == "propose":
                    batch = request.propose
                    items = [item_from_pb((stream, it.seq_id), it) for it in batch.items]
                    keys.update(item.key for item in items)
                    started = time.time_ns()
                    with self.metrics.time_propose():
                        proposals = await loop.run_in_executor(self._compute, self._propose, items)
                    tracing.record_propose(request, proposals, started, time.time_ns())
                    response.step = batch.step
                    response.proposals.extend(self.reply(it, p) for it, p in zip(batch.items, proposals))
                elif request.WhichOneof("kind") == "release":
                    released = [(stream, seq_id) for seq_id in request.release.seq_ids]
                    await loop.run_in_executor(self._compute, self.proposer.release, released)
                    keys.difference_update(released)
                response.held_sequences = self.proposer.held
                yield response
                if self.work_ahead != "off" and request.WhichOneof("kind") == "propose" and request.propose.items:
                    loop.run_in_executor(self._compute, self._work_ahead, self._requests)
        finally:
            await loop.run_in_executor(self._compute, self.proposer.release, list(keys))

    def _propose(self, items: list) -> list:
        proposals = self.proposer.propose(items)
        if self.work_ahead != "off":
            self.metrics.observe_ahead(self.proposer.ahead_counts)
        return proposals

    def _work_ahead(self, seen: int) -> None:
        """On the compute thread, after a reply: the next rounds, until a request arrives after the
        ``seen`` ones (on any stream)."""

        def arrived() -> bool:
            return self._requests != seen

        if not arrived():
            run_at_idle_priority(lambda: self.proposer.work_ahead(arrived), self.work_ahead == "idle")
            self.metrics.observe_ahead(self.proposer.ahead_counts)

    async def GetInfo(self, request, context):  # noqa: N802
        return info_to_pb(DraftInfo.of(self.proposer))

    def reply(self, item: draft_pb2.ProposeItem, proposal) -> draft_pb2.Proposal:
        """The wire form of the proposer's answer to ``item`` (a fuzzing probe overrides it)."""
        return proposal_to_pb(item.seq_id, proposal)


async def serve(config: DraftConfig) -> None:
    bound_kernel_caches(config.memory.kernel_cache_capacity)  # before the first matmul
    # Load and run on one thread (see specstream.serving.compute): this one, unless the draft works
    # ahead (its loop must read the next request while it works) or is told not to.
    compute = InlineExecutor(config.torch_threads) if config.compute_on_loop and config.work_ahead == "off" \
        else compute_executor("draft-compute", config.torch_threads)

    proposer = await asyncio.get_running_loop().run_in_executor(compute, build_proposer, config)
    metrics = DraftMetrics()
    metrics.watch_sequences(held=lambda: proposer.held)
    server = ServiceServer(config.server, [SERVICE_NAME], metrics.registry)
    draft_pb2_grpc.add_DraftServicer_to_server(DraftServicer(proposer, compute, metrics, config.work_ahead), server.server)
    await server.start()
    await server.set_serving(True)
    log.info("draft %s serving on %s", proposer.name, server.address)
    trimmer = asyncio.create_task(HeapTrimmer(config.memory.heap_trim_interval_s).run(compute), name="heap-trim")

    async def on_stop() -> None:
        trimmer.cancel()

    await server.serve_forever(on_stop)
