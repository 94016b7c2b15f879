"""The target engine loop (design §3): admit → propose → verify → accept → commit → emit.

Every running sequence advances once per step: the draft service proposes up to γ tokens per
sequence, ONE target forward scores all of them (rows of different lengths and γ side by side),
verification keeps the accepted prefix plus the target's own next token (greedy matching, or
Leviathan's rule for sampling requests: target_service.verify), and a rejection is undone by
resetting the slot's KV length (O(1)). When the draft is down or a request says `speculation=off`
the same loop decodes plainly (γ = 0).

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

from specstream import telemetry
from specstream.compute import compute_executor
from specstream.config import TargetConfig
from specstream.errors import InvalidArgumentError
from specstream.metrics import TargetMetrics
from specstream.models import CausalLM
from specstream.sampling import SamplingParams
from specstream_pb import common_pb2, draft_pb2, target_pb2
from target_service.batch_stats import BatchStats
from target_service.connection import Connection
from target_service.draft_client import DraftClient
from target_service.scheduler import Scheduler
from target_service import tracing
from target_service.sequence import Sequence
from target_service.verify import Row, Verdict, verify

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: CausalLM, config: TargetConfig, draft: DraftClient | None,
                 compute: ThreadPoolExecutor | None = None, metrics: TargetMetrics | None = None) -> None:
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
        self.scheduler = Scheduler(config)
        self.stats = BatchStats(config.policy, config.batch_rows)
        # Prometheus counters (specstream/metrics.py); the gauges read the queues when scraped.
        self.metrics = metrics or TargetMetrics(config.max_gamma, config.batch_rows)
        self.metrics.watch_sequences(running=lambda: len(self.running), waiting=lambda: len(self.waiting))
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
            batch=self.stats.to_pb(),
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
                sampling = _sampling(req)
            except InvalidArgumentError as exc:
                conn.send(_error_message(req.id, exc))
                continue
            seq = Sequence.from_pb(next(self._seq_ids), conn, req, gamma, sampling)
            seq.span = tracing.start_sequence(seq, req.traceparent)
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
        if req.logprobs and req.top_logprobs > vocab:
            raise InvalidArgumentError("top_logprobs", req.top_logprobs, f"must be <= vocab size {vocab}")
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
        await self._prefill()
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
        """Moves waiting sequences into free slots, oldest first, as many as the policy allows
        (target_service/scheduler.py). Every slot has room for prompt + max_new_tokens + γ + 1:
        `_validate` refused anything longer."""
        quota = self.scheduler.admissions(len(self.running), self.cache.num_free)
        while self.waiting and quota > 0 and self.cache.num_free:
            seq = self.waiting.popleft()
            if seq.finish_reason is not None:  # cancelled while queued: nothing to free but the id
                self.by_request.pop((seq.conn, seq.request_id), None)
                tracing.finish_sequence(seq)
                continue
            seq.slot = self.cache.alloc()
            assert seq.slot is not None
            seq.queue_seconds = time.monotonic() - seq.arrival
            self.stats.record_admission(seq.queue_seconds)
            seq.span.add_event("admitted", {"specstream.queue_s": seq.queue_seconds})
            self.running.append(seq)  # before prefill: if it fails, _fail_all reports and frees it
            quota -= 1

    async def _prefill(self) -> None:
        """Feeds up to `prefill_chunk` prompt tokens of admitted sequences, oldest first, so a long
        prompt holds running rows up for one chunk per step, not its whole length. A sequence whose
        prompt is complete gets its first token. Chunks of equal length share one forward."""
        budget = self.config.prefill_chunk
        chunks: dict[int, list[tuple[Sequence, int]]] = {}
        for seq in self.running:
            todo = seq.prompt_len - seq.prefilled
            if todo <= 0 or seq.finish_reason is not None:
                continue
            if budget == 0:
                break
            length = min(todo, budget)
            budget -= length
            chunks.setdefault(length, []).append((seq, seq.prefilled))
        for length, group in chunks.items():
            verdicts = await self._run_compute(self._prefill_compute, group, length)
            for (seq, start), verdict in zip(group, verdicts):
                seq.prefilled = start + length
                self.cache.set_length(seq.slot, seq.prefilled)
                self.stats.prefill_tokens += length
                if verdict is not None:  # the prompt is complete: its first token
                    seq.span.add_event("prefilled")
                    seq.target_passes += 1
                    seq.last_expanded = self.step_count
                    seq.append(verdict.tokens, verdict.logprobs)
                    self._touched.append(seq)

    def _prefill_compute(self, group: list[tuple[Sequence, int]], length: int) -> list[Verdict | None]:
        """Prompt tokens [start, start + length) of each sequence -> a Verdict (the first token)
        for those whose prompt this completes, None for the rest."""
        ids = torch.tensor([seq.tokens[start : start + length] for seq, start in group], dtype=torch.int64)  # [b, L]
        slots = torch.tensor([seq.slot for seq, _ in group], dtype=torch.int64)  # [b]
        starts = torch.tensor([start for _, start in group], dtype=torch.int64)  # [b]
        verdicts: list[Verdict | None] = [None] * len(group)
        with torch.inference_mode():
            logits = self.model(ids, self.cache, slots, starts, last_only=True)  # [b, 1, V]
            done = [i for i, (seq, start) in enumerate(group) if start + length == seq.prompt_len]
            if done:
                rows = [Row(group[i][0].sampling, group[i][0].prompt_len, logprobs=group[i][0].logprobs) for i in done]
                for i, verdict in zip(done, verify(logits[done], rows)):
                    verdicts[i] = verdict
        return verdicts

    async def _decode(self) -> None:
        ready = [s for s in self.running if s.finish_reason is None and s.prefilled == s.prompt_len]
        rows = self.scheduler.select(ready, self.step_count) if ready else []
        if not rows:
            return
        for seq in rows:
            seq.last_expanded = self.step_count
        span = tracing.start_step(self.step_count, rows)
        checks = await self._propose(rows, telemetry.traceparent_of(span) if span.is_recording() else "")
        width = 1 + max(len(c.proposals) for c in checks)
        self.stats.record_step(len(rows), width, sum(1 + len(c.proposals) for c in checks), len(self.waiting))
        self.metrics.observe_step(len(rows))
        started = time.perf_counter()
        verdicts = await self._run_compute(self._verify_compute, rows, checks)
        tracing.end_step(span, checks, verdicts, time.perf_counter() - started)
        for seq, check, verdict in zip(rows, checks, verdicts):
            self._accept(seq, check, verdict)
            self._touched.append(seq)

    async def _propose(self, rows: list[Sequence], traceparent: str = "") -> list[Row]:
        """Asks the draft for γ tokens per row (γ capped by the budget), each with the sparse q it
        was sampled from when the row samples; what each row will verify (no proposals where the
        draft has none)."""
        proposals = [Row(s.sampling, len(s.tokens), logprobs=s.logprobs) for s in rows]
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
                                               append_token_ids=seq.tokens[seq.draft_len:], gamma=gamma,
                                               sampling=seq.sampling_pb,
                                               traceparent=tracing.sequence_traceparent(seq)))
            asked.append(i)
        replies = await self.draft.propose(self.step_count, items, traceparent)
        if replies is None:
            return proposals
        for i, reply in zip(asked, replies):
            seq = rows[i]
            proposals[i] = self._check_proposal(seq, reply, gammas[i])
            # Beyond the context the draft holds its own guesses; `_accept` keeps the part the
            # target agreed with.
            seq.draft_len = reply.length
            seq.draft_tokens += len(proposals[i].proposals)
        return proposals

    def _check_proposal(self, seq: Sequence, reply: draft_pb2.Proposal, gamma: int) -> Row:
        """The usable part of a draft's reply, as a Row to verify: tokens the target can score,
        with the q table when the row samples (none from a model-free proposer: point masses).
        A malformed table is a draft bug; its proposals are dropped rather than trusted."""
        vocab = self.model.config.vocab_size
        tokens = list(reply.token_ids[:gamma])
        cut = next((j for j, t in enumerate(tokens) if t >= vocab), len(tokens))
        row = Row(seq.sampling, len(seq.tokens), tokens[:cut], logprobs=seq.logprobs)
        width = reply.q_width
        if seq.sampling.greedy or not width or not row.proposals:
            return row
        size = len(row.proposals) * width
        ids, probs = reply.q_ids[:size], reply.q_probs[:size]
        if len(ids) != size or len(probs) != size or max(ids) >= vocab or min(probs) < 0.0 \
                or not sum(probs) < float("inf"):  # also catches NaN
            log.warning("draft sent a malformed q for sequence %d; ignoring its proposals", seq.seq_id)
            row.proposals = []
            return row
        row.q_width, row.q_ids, row.q_probs = width, ids, probs
        return row

    def _verify_compute(self, rows: list[Sequence], checks: list[Row]) -> list[Verdict]:
        """ONE forward over every row's [last token, proposals...] (design §3), then verification."""
        gamma = max(len(c.proposals) for c in checks)
        # [B, G+1]: last committed token, proposals, zero padding (never read)
        input_ids = torch.tensor([[seq.tokens[-1], *c.proposals, *[0] * (gamma - len(c.proposals))]
                                  for seq, c in zip(rows, checks)], dtype=torch.int64)
        slots = torch.tensor([s.slot for s in rows], dtype=torch.int64)  # [B]
        start = torch.tensor([len(s.tokens) - 1 for s in rows], dtype=torch.int64)  # [B]
        with torch.inference_mode():
            logits = self.model(input_ids, self.cache, slots, start)  # [B, G+1, V]
            return verify(logits, checks)

    def _accept(self, seq: Sequence, check: Row, verdict: Verdict) -> None:
        ctx_len, k = check.position, verdict.accepted
        seq.target_passes += 1
        seq.decode_passes += 1
        seq.append(verdict.tokens, verdict.logprobs)  # k accepted proposals, then the correction or bonus token
        accepted = min(k, len(seq.tokens) - ctx_len)  # a stop id may cut the run short
        seq.accepted_tokens += accepted
        seq.rejections += k < len(check.proposals)
        self.metrics.observe_accept(len(check.proposals), accepted)
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
            tracing.finish_sequence(seq)
            if seq.slot is not None:
                self.cache.free(seq.slot)
                seq.slot = None
            self.by_request.pop((seq.conn, seq.request_id), None)
        if self.draft is not None:
            await self.draft.release([s.seq_id for s in done if s.draft_epoch == self.draft.epoch])

    def _fail_all(self, why: str, code: grpc.StatusCode = grpc.StatusCode.INTERNAL) -> None:
        failed = [*self.running, *self.waiting]
        for seq in failed:
            tracing.finish_sequence(seq, why)
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


def _sampling(req: target_pb2.SequenceRequest) -> SamplingParams:
    try:
        return SamplingParams.from_pb(req.sampling)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"sampling.{exc.field}", exc.value, exc.reason) from exc


def _error_message(request_id: str, exc: Exception | None, why: str = "",
                   code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> target_pb2.TargetMessage:
    error = common_pb2.SequenceError(code=code.value[0], message=str(exc) if exc else why)
    event = target_pb2.SequenceEvent(id=request_id, finish_reason=common_pb2.FINISH_REASON_ERROR, error=error)
    return target_pb2.TargetMessage(events=target_pb2.Events(events=[event]))
