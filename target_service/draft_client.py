"""The target's side of `Draft.Speculate`: one bidi stream, one response per request, in order; a
``DraftSource`` (target_service/drafting.py) whose items and proposals cross the wire as protobuf.

Failures never reach the engine as exceptions: `propose` returns None and the engine decodes with
γ=0 for that step. A dead draft costs a step nothing (reachability is probed in the background); a
hung one costs at most `timeout_s`, once. After `retry_s` a fresh stream opens; a new stream means
the draft holds no state, which `epoch` tells the engine (it then resends whole contexts).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from draft_service.proposer import Proposal, ProposeItem
from specstream.channels import open_channel
from specstream.config import ChannelSecurity
from specstream_pb import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)


class DraftClient:
    def __init__(self, url: str, timeout_s: float, retry_s: float, options: list | None = None,
                 security: ChannelSecurity | None = None) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._channel = open_channel(url, options, security)
        self._stub = draft_pb2_grpc.DraftStub(self._channel)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._lock = asyncio.Lock()
        self._next_try = 0.0
        self._reachable = False  # GetInfo answered since the last failure
        self._probe: asyncio.Task[None] | None = None
        self.epoch = 0  # bumped whenever a stream is (re)opened: the draft's state starts empty
        self.held_sequences = 0  # as last reported by the draft
        self.model_name = ""
        self.vocab_size = 0
        self.max_context_length = 0  # tokens the draft can hold per sequence (from GetInfo)

    @property
    def connected(self) -> bool:
        return self._call is not None

    async def fetch_info(self, timeout_s: float = 2.0) -> bool:
        try:
            info = await self._stub.GetInfo(draft_pb2.DraftInfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.warning("draft %s unavailable: %s", self.url, exc.code().name)
            return False
        self.model_name, self.vocab_size = info.model_name, info.vocab_size
        self.max_context_length = info.max_context_length
        return True

    async def ready(self) -> bool:
        """True when a stream is open (opening one now if the draft is known to be up)."""
        async with self._lock:
            return self._call is not None or await self._open()

    async def propose(self, step: int, items: list[ProposeItem], traceparent: str = "",
                      item_traceparents: list[str] | None = None) -> list[Proposal] | None:
        parents = item_traceparents or [""] * len(items)
        batch = draft_pb2.ProposeBatch(step=step, items=[_item_to_pb(it, tp) for it, tp in zip(items, parents)])
        response = await self._exchange(draft_pb2.ProposeRequest(propose=batch, traceparent=traceparent))
        if response is None:
            return None
        if len(response.proposals) != len(items):
            self._fail(f"answered {len(response.proposals)} proposals for {len(items)} items")
            return None
        return [_proposal_from_pb(p) for p in response.proposals]

    async def release(self, keys: list[int]) -> None:
        if keys and self.connected:
            await self._exchange(draft_pb2.ProposeRequest(release=draft_pb2.Release(seq_ids=keys)))

    async def _exchange(self, request: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse | None:
        async with self._lock:
            if self._call is None and not await self._open():
                return None
            assert self._call is not None
            try:
                response = await asyncio.wait_for(self._round_trip(self._call, request), self.timeout_s)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.TimeoutError, asyncio.InvalidStateError) as exc:
                self._fail(f"{type(exc).__name__}: {getattr(exc, 'code', lambda: '')()}")
                return None
            if response is grpc.aio.EOF:
                self._fail("stream closed")
                return None
            self.held_sequences = response.held_sequences
            return response

    @staticmethod
    async def _round_trip(call: grpc.aio.StreamStreamCall, request: draft_pb2.ProposeRequest):
        await call.write(request)
        return await call.read()

    async def _open(self) -> bool:
        """Opens a stream if the draft is known to be up; otherwise starts checking in the
        background, so a dead or slow draft never stalls an engine step."""
        if self._reachable:
            self._reachable = False
            self._call = self._stub.Speculate()
            self.epoch += 1
            log.info("draft stream %d open to %s (%s)", self.epoch, self.url, self.model_name)
            return True
        if self._probe is None and time.monotonic() >= self._next_try:
            self._probe = asyncio.create_task(self._check())
        return False

    async def _check(self) -> None:
        try:
            self._reachable = await self.fetch_info()
            if not self._reachable:
                self._next_try = time.monotonic() + self.retry_s
        finally:
            self._probe = None

    def _fail(self, why: str) -> None:
        log.warning("draft %s failed (%s); decoding without speculation for %.1fs", self.url, why, self.retry_s)
        if self._call is not None:
            self._call.cancel()
        self._call = None
        self.held_sequences = 0
        self._next_try = time.monotonic() + self.retry_s

    async def wait_connected(self, timeout_s: float) -> bool:
        """Startup helper: wait until the draft answers GetInfo (then the next step connects)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self.fetch_info():
                self._reachable = True
                return True
            await asyncio.sleep(0.2)
        return False

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        if self._call is not None:
            self._call.cancel()
            self._call = None
        await self._channel.close()


def _item_to_pb(item: ProposeItem, traceparent: str) -> draft_pb2.ProposeItem:
    p = item.sampling
    sampling = common_pb2.Sampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed)
    return draft_pb2.ProposeItem(seq_id=item.key, rollback_to=item.rollback_to, append_token_ids=item.append,
                                 gamma=item.gamma, sampling=sampling, traceparent=traceparent)


def _proposal_from_pb(pb: draft_pb2.Proposal) -> Proposal:
    return Proposal(list(pb.token_ids), pb.length, pb.q_width, list(pb.q_ids), list(pb.q_probs),
                    **({"source": pb.proposer} if pb.proposer else {}))
