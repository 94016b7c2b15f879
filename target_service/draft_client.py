"""The target's side of `Draft.Speculate`: one bidi stream, one response per request, in order; a
``DraftSource`` (target_service/drafting.py) whose items and proposals cross the wire as protobuf.

Failures never reach the engine as exceptions: `propose` returns None and the engine decodes with
γ = 0 for that step. Every round trip has a deadline derived from the draft's measured round
trips for requests of that shape (target_service/draft_deadline.py, capped by `timeout_s`), so a
hung draft stalls one step by that deadline, once: a timeout, a broken stream or a malformed reply
cancels the stream, and a late reply dies with it. No step ever waits for a (re)connection: a
background task keeps the stream up. While there is none, it asks the draft for its `GetInfo`
(waiting for the channel to reconnect, whose backoff is capped near `retry_s`; attempts at least
`retry_s` apart), and when the draft answers it opens a stream and checks it with an empty
`ProposeBatch` (which exercises the draft's compute thread, not only its event loop) before the
engine may use it. After a stream failed, the first attempt waits `retry_s`; streams that fail
again before any reply succeeded wait twice as long each time (up to `MAX_RETRY_S`), so a draft
that answers probes but not real work cannot stall a step every `retry_s`. A new stream means the
draft holds no state, which `epoch` tells the engine (it then resends whole contexts). A stream
that ends while idle (the draft died) is noticed at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from specstream.data.config import ChannelSecurity
from specstream.data.propose import Proposal, ProposeItem
from specstream.data.propose_wire import info_from_pb, item_to_pb, proposal_from_pb
from specstream.serving.channels import open_channel
from specstream_pb import draft_pb2, draft_pb2_grpc
from target_service.draft_deadline import DraftDeadline, Shape
from target_service.drafting import DraftSource, feature_refusal

log = logging.getLogger(__name__)

MAX_RETRY_S = 30.0  # reconnection attempts after failures in a row are spaced out to at most this
_RPC_ERRORS = (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError)


class DraftClient(DraftSource):
    asks_early = True  # proposals compute in the draft's process: the next pass's can start early

    def __init__(self, url: str, timeout_s: float, retry_s: float, options: list | None = None,
                 security: ChannelSecurity | None = None, deadline: DraftDeadline | None = None,
                 target_layers: int = 0, target_width: int = 0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.deadline = deadline or DraftDeadline(timeout_s)
        # gRPC backs reconnection off up to 2 minutes; a restarted draft must be found within about retry_s.
        backoff_ms = max(200, int(retry_s * 1000))
        options = [*(options or []), ("grpc.initial_reconnect_backoff_ms", 200),
                   ("grpc.min_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", backoff_ms)]
        self._channel = open_channel(url, options, security)
        self._stub = draft_pb2_grpc.DraftStub(self._channel)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._lock = asyncio.Lock()  # one request in flight on the stream, and its one response
        self._lost = asyncio.Event()  # set when the stream fails: the keeper reconnects
        self._keeper: asyncio.Task[None] | None = None
        self._failures = 0  # streams that failed in a row, without a successful exchange between
        self._next_try = 0.0
        self._on_change: Callable[[], None] | None = None
        self.epoch = 0  # bumped whenever a stream is (re)opened: the draft's state starts empty
        self.held_sequences = 0  # as last reported by the draft
        self.fallbacks = 0  # exchanges that failed (deadline, broken stream, bad reply) since start
        self.last_deadline_s = 0.0  # the deadline the latest exchange was given
        self.model_name = ""
        self.vocab_size = 0
        self.max_context_length = 0  # tokens the draft can hold per sequence (from GetInfo)
        # A draft that reads features: what this target can send (its layer count and hidden size),
        # what the draft reads (from GetInfo), and why a draft was refused at connect ("" if not).
        self.target_layers, self.target_width = target_layers, target_width
        self.feature_layers: tuple[int, ...] = ()
        self.feature_width = 0
        self.refused = ""
        self.acceptance: dict[tuple[str, bool], float] = {}  # the draft card's α per (source, greedy)
        self.lookup = ""  # the model-free lookup it asks first (DraftInfo.lookup)
        self.prefix_cache = False  # it keeps released sequences' state (DraftInfo.prefix_cache)

    @property
    def connected(self) -> bool:
        return self._call is not None

    def watch(self, callback: Callable[[], None]) -> None:
        """`callback()` runs whenever `connected` changes (the engine reports its load then)."""
        self._on_change = callback

    def start(self) -> None:
        """Starts keeping a stream open in the background (idempotent; needs a running loop)."""
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.create_task(self._keep_connected(), name=f"draft-keeper {self.url}")

    async def fetch_info(self, timeout_s: float = 2.0, wait_for_ready: bool = False) -> bool:
        """The draft's GetInfo (model, vocabulary, context). With `wait_for_ready` the call waits
        for the channel to (re)connect instead of failing at once, so a draft that comes back is
        found as soon as gRPC reconnects to it."""
        try:
            info = await self._stub.GetInfo(draft_pb2.DraftInfoRequest(), timeout=timeout_s,
                                            wait_for_ready=wait_for_ready)
        except grpc.aio.AioRpcError as exc:
            log.log(logging.DEBUG if wait_for_ready else logging.WARNING, "draft %s unavailable: %s", self.url,
                    exc.code().name)
            return False
        ignored: list[str] = []
        info = info_from_pb(info, ignored)
        for entry in ignored:  # untrusted input: said, then left out
            log.warning("draft %s: DraftInfo.acceptance entry %s ignored: needs a source and an alpha between 0 "
                        "and 1", self.url, entry)
        refused = feature_refusal(info.feature_layers, info.feature_width, self.target_layers, self.target_width)
        if refused:  # never connected: the engine decodes plainly; said once per reason
            if refused != self.refused:
                log.error("draft %s (%s) refused: %s", self.url, info.model_name, refused)
            self.refused, self.feature_layers, self.feature_width = refused, (), 0
            return False
        self.refused = ""
        self.model_name, self.vocab_size = info.model_name, info.vocab_size
        self.max_context_length = info.max_context_length
        self.feature_layers, self.feature_width = info.feature_layers, info.feature_width
        self.acceptance = dict(info.acceptance)
        self.lookup = info.lookup
        self.prefix_cache = info.prefix_cache
        return True

    async def ready(self) -> bool:
        """True when a stream is open. Never waits: (re)connecting happens in the background."""
        self.start()
        return self._call is not None

    async def start_propose(self, step: int, items: list[ProposeItem], traceparent: str = "",
                            item_traceparents: list[str] | None = None) -> asyncio.Future:
        """``propose``, started: returns as soon as the request is written to the stream (or the
        exchange ended without), with the exchange's answer to await."""
        sent = asyncio.Event()
        task = asyncio.ensure_future(self.propose(step, items, traceparent, item_traceparents, sent))
        written = asyncio.ensure_future(sent.wait())
        await asyncio.wait({task, written}, return_when=asyncio.FIRST_COMPLETED)
        written.cancel()
        return task

    async def propose(self, step: int, items: list[ProposeItem], traceparent: str = "",
                      item_traceparents: list[str] | None = None,
                      sent: asyncio.Event | None = None) -> list[Proposal] | None:
        parents = item_traceparents or [""] * len(items)
        batch = draft_pb2.ProposeBatch(step=step, items=[item_to_pb(it, tp) for it, tp in zip(items, parents)])
        shape = Shape(depth=max((it.gamma for it in items), default=0), proposals=sum(it.gamma for it in items),
                      fed=sum(len(it.append) for it in items))
        response = await self._exchange(draft_pb2.ProposeRequest(propose=batch, traceparent=traceparent), shape, sent)
        if response is None:
            return None
        if len(response.proposals) != len(items):
            self._fail(f"answered {len(response.proposals)} proposals for {len(items)} items")
            return None
        return [proposal_from_pb(p) for p in response.proposals]

    async def release(self, keys: list[int]) -> None:
        if keys and self.connected:
            await self._exchange(draft_pb2.ProposeRequest(release=draft_pb2.Release(seq_ids=keys)), Shape())

    async def _exchange(self, request: draft_pb2.ProposeRequest, shape: Shape,
                        sent: asyncio.Event | None = None) -> draft_pb2.ProposeResponse | None:
        async with self._lock:
            call = self._call
            if call is None:
                return None
            wait = self.last_deadline_s = self.deadline.deadline(shape)
            started = time.perf_counter()
            try:
                response = await asyncio.wait_for(self._round_trip(call, request, sent), wait)
            except asyncio.TimeoutError:
                self.deadline.timed_out()
                self._fail(f"no reply within its {wait * 1e3:.0f} ms deadline")
                return None
            except _RPC_ERRORS as exc:
                self._fail(f"{type(exc).__name__}: {getattr(exc, 'code', lambda: '')()}")
                return None
            if response is grpc.aio.EOF:
                self._fail("stream closed")
                return None
            self.deadline.observe(shape, time.perf_counter() - started)
            self._failures = 0
            self.held_sequences = response.held_sequences
            return response

    @staticmethod
    async def _round_trip(call: grpc.aio.StreamStreamCall, request: draft_pb2.ProposeRequest,
                          sent: asyncio.Event | None = None):
        await call.write(request)
        if sent is not None:
            sent.set()
        return await call.read()

    async def _keep_connected(self) -> None:
        """While no stream is open: GetInfo (waiting for the channel to connect), then a new stream
        that must answer an empty batch before the engine may use it; attempts start at least
        `retry_s` apart (more after streams that failed, see `_fail`)."""
        while True:
            if self._call is not None:
                await self._lost.wait()
                continue
            pause = self._next_try - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            started = time.monotonic()
            try:
                if await self.fetch_info(timeout_s=max(2.0 * self.retry_s, 1.0), wait_for_ready=True) \
                        and await self._open():
                    continue
            except Exception:  # noqa: BLE001 - a bug here must not end reconnection for good
                log.exception("draft %s: reconnecting failed", self.url)
            self._next_try = started + self.retry_s  # the draft is down (or stopped): keep looking

    async def _open(self) -> bool:
        call = self._stub.Speculate()
        wait = max(self.deadline.deadline(Shape()), 2.0)  # a first reply may come from a cold process
        try:
            response = await asyncio.wait_for(self._round_trip(call, draft_pb2.ProposeRequest(
                propose=draft_pb2.ProposeBatch())), wait)
        except (asyncio.TimeoutError, *_RPC_ERRORS) as exc:
            log.warning("draft %s did not answer a new stream (%s)", self.url, type(exc).__name__)
            call.cancel()
            return False
        if response is grpc.aio.EOF:
            return False
        async with self._lock:
            self._call = call
            self._lost.clear()
            self.epoch += 1
            self.held_sequences = response.held_sequences
        call.add_done_callback(lambda done: self._ended(done))
        log.info("draft stream %d open to %s (%s)", self.epoch, self.url, self.model_name)
        self._changed()
        return True

    def _ended(self, call) -> None:
        """The stream finished by itself (the draft went away) while it was ours."""
        # During an exchange the exchange itself reports the failure (a deadline cancels the call,
        # which lands here first).
        if call is self._call and not self._lock.locked():
            self._fail("stream ended")

    def _retry_interval(self) -> float:
        return min(self.retry_s * 2.0 ** max(self._failures - 1, 0), max(self.retry_s, MAX_RETRY_S))

    def _fail(self, why: str) -> None:
        self.fallbacks += 1
        self._failures += 1
        retry = self._retry_interval()
        log.warning("draft %s failed (%s); decoding without speculation, reconnecting in %.1fs", self.url, why, retry)
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        self.held_sequences = 0
        self._next_try = time.monotonic() + retry
        self._lost.set()
        if call is not None:
            self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    async def wait_connected(self, timeout_s: float) -> bool:
        """Startup: starts the keeper and waits until a stream is open (or `timeout_s` passes)."""
        self.start()
        deadline = time.monotonic() + timeout_s
        while self._call is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self._call is not None

    async def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        await self._channel.close()
