"""The target engine loop (design §3): admit → propose → verify → accept → commit → emit.

Every running sequence advances once per step: the draft service proposes up to γ tokens per
sequence, ONE target forward scores all of them (rows of different lengths and γ side by side),
greedy acceptance keeps the longest agreeing prefix plus the target's own next token, and a
rejection is undone by resetting the slot's KV length (O(1)). When the draft is down or a request
says `speculation=off` the same loop decodes plainly (γ = 0).

The engine works on token ids only: it knows nothing about text, gRPC framing or the gateway.
Model forwards run on one worker thread so the event loop keeps serving the gRPC streams.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

import kernels
from specstream.compute import compute_executor
from specstream.config import TargetConfig
from specstream.errors import InvalidArgumentError
from specstream.models import CausalLM
from specstream_pb import common_pb2, draft_pb2, target_pb2
from target_service.connection import Connection
from target_service.draft_client import DraftClient
from target_service.sequence import Sequence

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: CausalLM, config: TargetConfig, draft: DraftClient | None,
                 compute: ThreadPoolExecutor | None = None) -> None:
        self.model = model
        self.config = config
        self.draft = draft
        self.max_len = min(config.max_seq_len, model.config.max_position_embeddings)
        # All torch work belongs on this one thread (see specstream.compute).
        self._compute = compute or compute_executor("engine-compute")
        self.cache = self._compute.submit(model.new_cache, config.max_slots, self.max_len).result()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_request: dict[tuple[Connection, str], Sequence] = {}
        self.connections: set[Connection] = set()
        self._cancels: list[tuple[Connection, str]] = []
        self._touched: list[Sequence] = []  # sequences with something to report this step
        self._seq_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self.step_count = 0
        self._background: set[asyncio.Task] = set()

    # ----- limits and load -------------------------------------------------------------------
    @property
    def max_context_length(self) -> int:
        """prompt + max_new_tokens must fit; the rest of a slot is headroom for γ+1 proposals."""
        return self.max_len - self.config.max_gamma - 1

    def load_pb(self) -> target_pb2.Load:
        return target_pb2.Load(
            max_slots=self.config.max_slots,
            free_slots=self.cache.num_free,
            running=len(self.running),
            queued=len(self.waiting),
            draft_sequences=self.draft.held_sequences if self.draft else 0,
            draft_connected=bool(self.draft and self.draft.connected),
        )

    # ----- requests from connections (called on the event loop) -------------------------------
    def attach(self, conn: Connection) -> None:
        self.connections.add(conn)
        conn.send(target_pb2.TargetMessage(load=self.load_pb()))

    def detach(self, conn: Connection) -> None:
        self.connections.discard(conn)
        self._cancels.extend(key for key in self.by_request if key[0] is conn)
        self._wake.set()

    def submit(self, conn: Connection, requests: list[target_pb2.SequenceRequest]) -> None:
        for req in requests:
            try:
                gamma = self._validate(conn, req)
            except InvalidArgumentError as exc:
                conn.send(_error_message(req.id, exc))
                continue
            seq = Sequence.from_pb(next(self._seq_ids), conn, req, gamma)
            self.by_request[(conn, req.id)] = seq
            self.waiting.append(seq)
        self._wake.set()

    def cancel(self, conn: Connection, request_ids: list[str]) -> None:
        self._cancels.extend((conn, rid) for rid in request_ids)
        self._wake.set()

    def _validate(self, conn: Connection, req: target_pb2.SequenceRequest) -> int:
        vocab = self.model.config.vocab_size
        if (conn, req.id) in self.by_request:
            raise InvalidArgumentError("id", req.id, "already running on this connection")
        if not req.prompt_token_ids:
            raise InvalidArgumentError("prompt_token_ids", [], "must not be empty")
        bad = next((t for t in req.prompt_token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidArgumentError("prompt_token_ids", bad, f"token id must be < vocab size {vocab}")
        if req.max_new_tokens < 1:
            raise InvalidArgumentError("max_new_tokens", req.max_new_tokens, "must be >= 1")
        total = len(req.prompt_token_ids) + req.max_new_tokens
        if total > self.max_context_length:
            raise InvalidArgumentError("max_new_tokens", req.max_new_tokens,
                                       f"prompt ({len(req.prompt_token_ids)}) + max_new_tokens exceeds "
                                       f"the context length {self.max_context_length}")
        mode, gamma = req.speculation.mode, req.speculation.gamma
        if mode == common_pb2.SPECULATION_MODE_AUTO:
            return self.config.default_gamma
        if mode == common_pb2.SPECULATION_MODE_OFF:
            return 0
        if mode == common_pb2.SPECULATION_MODE_FIXED and 1 <= gamma <= self.config.max_gamma:
            return gamma
        if mode == common_pb2.SPECULATION_MODE_FIXED:
            raise InvalidArgumentError("speculation.gamma", gamma, f"must be in 1..{self.config.max_gamma}")
        raise InvalidArgumentError("speculation.mode", mode, "unknown speculation mode")

    # ----- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            if not (self.waiting or self.running or self._cancels):
                self._wake.clear()
                await self._wake.wait()
            try:
                await self.step()
                self._emit()
            except Exception:  # noqa: BLE001 - a bug must fail the batch, not kill the service
                log.exception("engine step %d failed; failing its sequences", self.step_count)
                self._fail_all("internal error in the target engine step")
            await asyncio.sleep(0)  # let the gRPC streams run between steps

    async def step(self) -> None:
        self.step_count += 1
        await self._apply_cancels()
        await self._admit()
        if self.running:
            await self._decode()
        await self._retire()

    async def _apply_cancels(self) -> None:
        cancels, self._cancels = self._cancels, []
        for key in cancels:
            seq = self.by_request.get(key)
            if seq is not None and seq.finish_reason is None:
                seq.finish_reason = "cancelled"
                self._touched.append(seq)

    async def _admit(self) -> None:
        """Moves waiting sequences into free slots and prefills them, oldest first."""
        while self.waiting and self.cache.num_free:
            seq = self.waiting.popleft()
            if seq.finish_reason is not None:  # cancelled while queued: nothing to free but the id
                self.by_request.pop((seq.conn, seq.request_id), None)
                continue
            seq.slot = self.cache.alloc()
            assert seq.slot is not None
            seq.queue_seconds = time.monotonic() - seq.arrival
            self.running.append(seq)  # before prefill: if it fails, _fail_all reports and frees it
            await self._prefill(seq)
            self._touched.append(seq)

    async def _prefill(self, seq: Sequence) -> None:
        prompt = torch.tensor([seq.tokens], dtype=torch.int64)  # [1, P]
        first = await self._run_compute(self._prefill_compute, prompt, seq.slot)
        self.cache.set_length(seq.slot, seq.prompt_len)
        seq.target_passes += 1
        seq.append([first])

    def _prefill_compute(self, prompt: torch.Tensor, slot: int) -> int:
        with torch.inference_mode():
            logits = self.model(prompt, self.cache, torch.tensor([slot]), torch.tensor([0]), last_only=True)
            return int(kernels.argmax(logits[0, -1]))  # the step's one host sync

    async def _decode(self) -> None:
        rows = [s for s in self.running if s.finish_reason is None]
        if not rows:
            return
        proposals = await self._propose(rows)
        ctx_lens = [len(s.tokens) for s in rows]
        accepted, target_tokens = await self._run_compute(self._verify_compute, rows, proposals)
        for seq, ctx_len, props, k, tokens in zip(rows, ctx_lens, proposals, accepted, target_tokens):
            self._accept(seq, ctx_len, props, k, tokens)
            self._touched.append(seq)

    async def _propose(self, rows: list[Sequence]) -> list[list[int]]:
        """Asks the draft for γ tokens per row (γ capped by the budget); [] where it has none."""
        proposals: list[list[int]] = [[] for _ in rows]
        if self.draft is None or not any(s.gamma for s in rows) or not await self.draft.ready():
            return proposals
        # Past the draft's own context limit a sequence decodes plainly rather than resending
        # its whole context every step.
        room = self.draft.max_context_length
        gammas = [min(s.gamma, s.remaining - 1, room - len(s.tokens)) for s in rows]
        # A draft with a smaller vocabulary (e.g. a 0.5B model drafting for a 7B one of the same
        # family) cannot read ids past its own; such sequences decode plainly.
        gammas = [0 if s.max_token >= self.draft.vocab_size else g for s, g in zip(rows, gammas)]
        if max(gammas) <= 0:
            return proposals
        items, asked = [], []
        for i, (seq, gamma) in enumerate(zip(rows, gammas)):
            if gamma <= 0:
                continue
            if seq.draft_epoch != self.draft.epoch:  # a fresh stream holds nothing
                seq.draft_len, seq.draft_epoch = 0, self.draft.epoch
            items.append(draft_pb2.ProposeItem(seq_id=seq.seq_id, rollback_to=seq.draft_len,
                                               append_token_ids=seq.tokens[seq.draft_len:], gamma=gamma))
            asked.append(i)
        replies = await self.draft.propose(self.step_count, items)
        if replies is None:
            return proposals
        vocab = self.model.config.vocab_size
        for i, reply in zip(asked, replies):
            seq = rows[i]
            tokens = list(reply.token_ids[: gammas[i]])
            cut = next((j for j, t in enumerate(tokens) if t >= vocab), len(tokens))
            proposals[i] = tokens[:cut]
            # Beyond the context the draft holds its own guesses; `_accept` keeps the part the
            # target agreed with.
            seq.draft_len = reply.length
            seq.draft_tokens += len(proposals[i])
        return proposals

    def _verify_compute(self, rows: list[Sequence], proposals: list[list[int]]) -> tuple[list[int], list[list[int]]]:
        """ONE forward over every row's [last token, proposals...] (design §3), then greedy verify."""
        gamma = max(len(p) for p in proposals)
        batch = len(rows)
        input_ids = torch.zeros(batch, gamma + 1, dtype=torch.int64)  # [B, G+1]; padding is never read
        draft = torch.full((batch, gamma), -1, dtype=torch.int64)  # [B, G]
        for b, (seq, props) in enumerate(zip(rows, proposals)):
            input_ids[b, 0] = seq.tokens[-1]
            input_ids[b, 1 : 1 + len(props)] = torch.tensor(props, dtype=torch.int64)
            draft[b, : len(props)] = input_ids[b, 1 : 1 + len(props)]
        num_draft = torch.tensor([len(p) for p in proposals], dtype=torch.int64)  # [B]
        slots = torch.tensor([s.slot for s in rows], dtype=torch.int64)  # [B]
        start = torch.tensor([len(s.tokens) - 1 for s in rows], dtype=torch.int64)  # [B]
        with torch.inference_mode():
            logits = self.model(input_ids, self.cache, slots, start)  # [B, G+1, V]
            device = logits.device
            num_accepted, target_tokens = kernels.greedy_verify(draft.to(device), num_draft.to(device), logits)
            # The step's one host sync: both results in one transfer.
            packed = torch.cat([num_accepted[:, None], target_tokens], dim=1).tolist()  # [B, G+2]
        return [row[0] for row in packed], [row[1:] for row in packed]

    def _accept(self, seq: Sequence, ctx_len: int, proposals: list[int], k: int, target_tokens: list[int]) -> None:
        seq.target_passes += 1
        seq.decode_passes += 1
        seq.append(target_tokens[: k + 1])  # k accepted proposals, then the correction or bonus token
        seq.accepted_tokens += min(k, len(seq.tokens) - ctx_len)  # a stop id may cut the run short
        seq.rejections += k < len(proposals)
        # The draft fed ctx + proposals[:-1]; only the first k of those agree with the target.
        seq.draft_len = min(seq.draft_len, ctx_len + k)
        if seq.finish_reason is None:
            # Commit (or roll back): the newest token is not in the cache yet, everything before is.
            self.cache.set_length(seq.slot, len(seq.tokens) - 1)

    async def _retire(self) -> None:
        """Frees the slots and draft state of sequences that ended this step."""
        done = [s for s in self.running if s.finish_reason is not None]
        done += [s for s in self.waiting if s.finish_reason is not None]
        if not done:
            return
        self.running = [s for s in self.running if s.finish_reason is None]
        self.waiting = deque(s for s in self.waiting if s.finish_reason is None)
        for seq in done:
            if seq.slot is not None:
                self.cache.free(seq.slot)
                seq.slot = None
            self.by_request.pop((seq.conn, seq.request_id), None)
        if self.draft is not None:
            await self.draft.release([s.seq_id for s in done if s.draft_epoch == self.draft.epoch])

    def _fail_all(self, why: str, code: grpc.StatusCode = grpc.StatusCode.INTERNAL) -> None:
        failed = [*self.running, *self.waiting]
        for seq in failed:
            if seq.slot is not None:
                self.cache.free(seq.slot)
            seq.conn.send(_error_message(seq.request_id, None, why, code))
            self.by_request.pop((seq.conn, seq.request_id), None)
        self.running, self.waiting, self._touched = [], deque(), []
        if self.draft is not None and failed:
            epoch = self.draft.epoch
            task = asyncio.create_task(self.draft.release([s.seq_id for s in failed if s.draft_epoch == epoch]))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _emit(self) -> None:
        """One message per connection per step: every touched sequence's event, plus load."""
        per_conn: dict[Connection, list[target_pb2.SequenceEvent]] = {}
        for seq in dict.fromkeys(self._touched):  # de-duplicated, in order
            per_conn.setdefault(seq.conn, []).append(seq.event_pb())
        self._touched = []
        load = self.load_pb()
        for conn in self.connections:
            events = per_conn.get(conn)
            if events:
                conn.send(target_pb2.TargetMessage(
                    events=target_pb2.Events(step=self.step_count, events=events), load=load))
            else:
                conn.send(target_pb2.TargetMessage(load=load))

    async def _run_compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    def shutdown(self) -> None:
        self._fail_all("the target service is shutting down", grpc.StatusCode.UNAVAILABLE)
        self._compute.shutdown(wait=False)


def _error_message(request_id: str, exc: Exception | None, why: str = "",
                   code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> target_pb2.TargetMessage:
    error = common_pb2.SequenceError(code=code.value[0], message=str(exc) if exc else why)
    event = target_pb2.SequenceEvent(id=request_id, finish_reason=common_pb2.FINISH_REASON_ERROR, error=error)
    return target_pb2.TargetMessage(events=target_pb2.Events(events=[event]))
