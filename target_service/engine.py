"""The target engine loop (docs/architecture.md §4): admit → propose → verify → accept → commit → emit.

Every running sequence advances once per step: the draft service proposes up to γ tokens per
sequence, ONE target forward scores all of them (rows of different lengths and γ side by side),
verification keeps the accepted prefix plus the target's own next token (greedy matching, or
Leviathan's rule for sampling requests: target_service.settle), and a rejection is undone by
resetting the slot's KV length (O(1)). When the draft is down or a request says `speculation=off`
the same loop decodes plainly (γ = 0). A beam request (target_service/beam.py) takes one row per
running hypothesis in the same forward; its hypotheses share their common prefix in the KV cache
(KVCache.fork: forking a hypothesis copies a table of slot numbers, never K/V).

The engine works on token ids only and speaks plain dataclasses (specstream/data/engine.py): it
knows nothing about text, protobuf or the gateway. Drafts are target_service/drafting.py's business,
the γ per row the controller's (target_service/gamma.py), verification target_service/settle.py's,
batching target_service/scheduler.py's. Model forwards run on one worker thread so the event loop
keeps serving the gRPC streams. For a draft that reads the target's features, the engine keeps each
sequence's committed features (the hidden states of its prompt and of the positions each verify
committed, as bfloat16 bytes: ``Sequence.features``), which Drafting sends with the items. A
constrained request holds its grammar's matcher; each pass cuts its proposals where the grammar
refuses them and masks the target's scores at every position it verifies
(target_service/grammar_rows.py), the masks filled beside the forward. A prompt that starts as a
cached one did starts from its K/V (specstream/models/prefix_cache.py: the conversation's next turn
takes over the slot of its last, a shared system prompt is forked) and prefills only the rest.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kernels.lm_head import Hidden
from kernels.nbest import MAX_K, topk_logprobs, topk_logprobs_reference
from specstream.data.batch_stats import BatchStats
from specstream.data.config import TargetConfig
from specstream.data.constraint import Constraint
from specstream.data.engine import EngineMessage, Load, SequenceEvent, SequenceRequest, TargetInfo
from specstream.data.errors import (
    AlreadyExistsError,
    InternalError,
    InvalidArgumentError,
    SpecstreamError,
    UnavailableError,
)
from specstream.data.prefix import BLOCK, block_keys, reusable_blocks
from specstream.data.request_rules import RequestLimits, check_request
from specstream.models.base import CausalLM
from specstream.serving import telemetry
from specstream.serving.compute import core_beside_model, torch_thread
from specstream.serving.metrics import TargetMetrics
from specstream.serving.thread_governor import ThreadGovernor
from specstream.text.grammar import Grammar, GrammarCompiler
from target_service import tracing
from target_service.calibration import sampled_verify_extra, verify_costs
from target_service.connection import Connection
from target_service.drafting import Drafting, DraftSource, feature_refusal
from target_service.gamma import AUTO_GAMMA, GammaController
from target_service.grammar_rows import GrammarMasks
from specstream.models.prefix_cache import PrefixCache, capacity_for
from target_service.scheduler import Scheduler
from target_service.sequence import Sequence
from target_service.settle import Verdict, VerifyRow, settle

log = logging.getLogger(__name__)

DRAFT_TIMING_DEPTH = 8  # the deepest guess the start-up draft timing asks for (time_draft)


def prefill_chunk(configured: int, device: torch.device | str) -> int:
    """Prompt tokens per prefill step: ``TargetConfig.prefill_chunk``, or by the model's device (0)."""
    return configured or (512 if str(device).startswith("cuda") else 128)


@dataclass
class EngineTimings:
    """Where the engine's time went, cumulative over the loop iterations that decoded and
    prefilled nothing (steady decoding): the whole iteration (scheduling, drafting, the forward,
    settling, committing, emitting); of it, the model's layers (``model.hidden``); the whole
    call on the compute thread (the layers, the output layer and verification); and the wait for the
    draft's proposals. The iteration less the compute call and the draft is host work: scheduling,
    building the rows, the hop to the compute thread and back, committing, metrics, tracing,
    emitting. Each steady iteration also goes to the metrics (TargetMetrics.observe_pass)."""

    decode_steps: int = 0
    decode_s: float = 0.0
    decode_forward_s: float = 0.0
    decode_compute_s: float = 0.0
    decode_draft_s: float = 0.0  # waiting for the proposals: building the items, the draft's round trip


def feature_bytes(hidden: torch.Tensor) -> bytes:
    """hidden [n, feature width] -> the bytes of its n features in bfloat16, as a feature draft reads them."""
    return hidden.to(torch.bfloat16).cpu().contiguous().view(torch.uint8).numpy().tobytes()


class Engine:
    def __init__(self, model: CausalLM, config: TargetConfig, draft: DraftSource | None,
                 compute: ThreadPoolExecutor | None = None, metrics: TargetMetrics | None = None,
                 controller: GammaController | None = None, grammars: GrammarCompiler | None = None) -> None:
        refused = feature_refusal(draft.feature_layers, draft.feature_width, model.config.num_layers,
                                  model.config.hidden_size) if draft is not None else ""
        if refused:  # a draft in this process; one behind gRPC is checked when it connects (DraftClient)
            raise ValueError(f"draft {draft.model_name}: {refused}")
        self.model = model
        self.config = config
        self.grammars = grammars  # compiles constraints on the model's tokenizer (None: constraints refused)
        self.masks = GrammarMasks(beside=core_beside_model(model.device, config.torch_threads))
        self.controller = controller or GammaController(config.gamma_policy, config.default_gamma, config.max_gamma)
        # Trees only where each node's scores are exactly the chain's (else greedy could differ from plain).
        branches = config.tree_branches if model.exact_trees else 0
        if config.tree_branches and not branches:
            log.info("tree_branches=%d: chains only, this model's forward is not the native CPU one",
                     config.tree_branches)
        self.drafting = Drafting(draft, self.controller, model.config.vocab_size, tree_branches=branches,
                                 forced_tokens=config.forced_tokens)
        self.max_len = min(config.max_seq_len, model.config.max_position_embeddings)
        self.prefill_chunk = prefill_chunk(config.prefill_chunk, model.device)
        # All torch work belongs on this one thread (see specstream.serving.compute).
        self._compute = compute or torch_thread()
        self.governor = ThreadGovernor(self._compute.submit(torch.get_num_threads).result()) \
            if config.adapt_threads and str(model.device) == "cpu" else None
        self._compute_calls = 0  # the engine's calls submitted to the torch thread and not done
        kept = capacity_for(config.prefix_cache_slots, config.max_slots, model, self.max_len)
        self.cache = self._compute.submit(model.new_cache, config.max_slots + kept, self.max_len).result()
        self.prefix = PrefixCache(self.cache, kept) if kept else None
        if self.prefix is not None:
            log.info("prefix cache: %d KV-cache slots of %d tokens beside the %d running ones", kept, self.max_len,
                     config.max_slots)
        if config.calibrate and draft is not None:
            started = time.perf_counter()
            samples = self._compute.submit(verify_costs, model, self.cache,
                                           min(config.max_gamma, self.max_len - 1) + 1, config.max_slots).result()
            for positions, seconds in samples:
                self.controller.observe_verify_timing(positions, seconds)
            extra = self._compute.submit(sampled_verify_extra, model, self.cache).result() if samples else 0.0
            self.controller.observe_sampled_timing(extra)
            log.info("timed %d verify shapes and a sampling row's verification (+%.2f ms) in %.2f s for the γ "
                     "controller", len(samples), extra * 1e3, time.perf_counter() - started)
        self.waiting: deque[Sequence] = deque()
        self.compiling: set[Sequence] = set()  # constrained sequences whose grammar is compiling (_compile)
        self._compiler = ThreadPoolExecutor(2, thread_name_prefix="grammar-compile")
        self.running: list[Sequence] = []
        self.by_request: dict[tuple[Connection, str], Sequence] = {}
        self.connections: set[Connection] = set()
        self._cancels: list[tuple[Connection, str]] = []
        self._touched: list[Sequence] = []  # sequences with something to report this step
        self._seq_ids = itertools.count(1)  # from 1: sequence 0 is the draft's start-up timing (time_draft)
        self._wake = asyncio.Event()
        self.step_count = 0
        self.timings = EngineTimings()
        self._step_forward_s = 0.0  # this iteration's time in model.hidden (the compute thread adds it)
        self._step_compute_s = 0.0  # and in the whole verify call on the compute thread
        self._step_draft_s = 0.0  # and waiting for the draft's proposals
        self._step_prefilled = False  # this iteration ran a prefill chunk
        self._step_decoded = False  # this iteration ran a decode pass
        self.scheduler = Scheduler(config)
        self.stats = BatchStats(config.policy, config.batch_rows)
        # Prometheus counters (specstream/serving/metrics.py); the gauges read the queues when scraped.
        self.metrics = metrics or TargetMetrics(config.max_gamma, config.batch_rows)
        self.metrics.watch_sequences(running=lambda: len(self.running), waiting=lambda: len(self.waiting))
        self.drafting.on_malformed = self.metrics.observe_malformed
        self.drafting.on_draft_prefix = self.metrics.observe_draft_prefix
        self._background: set[asyncio.Task] = set()
        if draft is not None:  # the gateway learns of a draft (re)connecting without waiting for a step
            draft.watch(self._draft_changed)
            self._draft_changed()

    # ----- limits and load -------------------------------------------------------------------
    @property
    def max_context_length(self) -> int:
        """prompt + max_new_tokens must fit; the rest of a slot is headroom for γ+1 proposals."""
        return self.max_len - self.config.max_gamma - 1

    def info(self) -> TargetInfo:
        """What this target serves and its load now (``Target.GetInfo``)."""
        source = self.drafting.source
        return TargetInfo(model_name=self.model.config.name, vocab_size=self.model.config.vocab_size,
                          max_context_length=self.max_context_length, max_gamma=self.config.max_gamma,
                          default_gamma=self.config.default_gamma, eos_token_ids=list(self.model.config.eos_token_ids),
                          draft_model_name=source.model_name if source is not None else "", load=self.load())

    def load(self) -> Load:
        return Load(max_slots=self.config.max_slots, free_slots=self._free_slots(), running=len(self.running),
                    queued=len(self.waiting) + len(self.compiling), draft_sequences=self.drafting.held_sequences,
                    draft_connected=self.drafting.connected, batch=self.stats.snapshot(),
                    draft_model=self.drafting.model_name)

    # ----- requests from connections (called on the event loop) -------------------------------
    def _draft_changed(self) -> None:
        """The draft (re)connected or went away: the γ controller starts its pools from what a
        connected draft's card states (DraftInfo.acceptance), and the gateways hear of it."""
        if self.drafting.connected:
            self.controller.set_priors(self.drafting.acceptance)
        self._report_load()

    def _report_load(self) -> None:
        load = self.load()
        for conn in self.connections:
            conn.send(EngineMessage(load))

    def attach(self, conn: Connection) -> None:
        self.connections.add(conn)
        conn.send(EngineMessage(self.load()))

    def detach(self, conn: Connection) -> None:
        self.connections.discard(conn)
        self._cancels.extend(key for key in self.by_request if key[0] is conn)
        self._wake.set()

    def submit(self, conn: Connection, requests: list[SequenceRequest]) -> None:
        for req in requests:
            try:
                gamma, max_gamma = self._validate(conn, req)
                grammar = self._grammar(req)
            except SpecstreamError as exc:
                self.reject(conn, req.id, exc)
                continue
            seq = Sequence.from_request(next(self._seq_ids), conn, req, gamma, max_gamma)
            seq.span = tracing.start_sequence(seq, req.traceparent)
            self.by_request[(conn, req.id)] = seq
            if req.constraint is not None and grammar is None:
                self._compile(seq, req.constraint)
            else:
                self._queue(seq, grammar)
        self._wake.set()

    def _queue(self, seq: Sequence, grammar: Grammar | None) -> None:
        if grammar is not None:
            seq.matcher = grammar.matcher()
            self.metrics.constrained.labels(kind=seq.constraint.kind).inc()
        self.waiting.append(seq)

    def _grammar(self, req: SequenceRequest) -> Grammar | None:
        """A constrained request's compiled grammar if this service has it (cached by its source, so
        a schema seen before costs a copy of its matcher); None for free text or one not compiled yet."""
        if req.constraint is None:
            return None
        if self.grammars is None:
            raise InvalidArgumentError(req.constraint.field, req.constraint.source,
                                       "this target has no tokenizer to compile a constraint against")
        return self.grammars.cached(req.constraint)

    def _compile(self, seq: Sequence, constraint: Constraint) -> None:
        """Compiles a constraint on the compiler's threads (llguidance works without the GIL), so
        other streams never wait for it; the sequence queues once it is compiled, or ends with the
        compiler's reason. A cancel meanwhile ends it as if it were queued (``_retire``)."""
        self.compiling.add(seq)
        future = self._compiler.submit(self.grammars.compile, constraint)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # the engine driven by hand, no loop running: wait for it here
            self._compiled(seq, future)
            return
        future.add_done_callback(lambda done: loop.call_soon_threadsafe(self._compiled, seq, done))

    def _compiled(self, seq: Sequence, done: Future) -> None:
        if seq not in self.compiling:  # cancelled or failed meanwhile: already ended
            return
        self.compiling.discard(seq)
        error = done.exception() if not done.cancelled() else UnavailableError("the target service is shutting down")
        if error is None:
            self._queue(seq, done.result())
        else:
            if not isinstance(error, SpecstreamError):
                log.error("compiling sequence %d's constraint failed", seq.seq_id, exc_info=error)
                error = InternalError("internal error compiling the constraint")
            self.by_request.pop((seq.conn, seq.request_id), None)
            tracing.finish_sequence(seq, str(error))
            self.reject(seq.conn, seq.request_id, error)
        self._wake.set()

    def reject(self, conn: Connection, request_id: str, error: SpecstreamError) -> None:
        """Ends a request that never ran (bad settings, or one the edge could not read) with `error`."""
        conn.send(EngineMessage(self.load(), self.step_count, [SequenceEvent(request_id, finish_reason="error",
                                                                            error=error)]))

    def cancel(self, conn: Connection, request_ids: list[str]) -> None:
        self._cancels.extend((conn, rid) for rid in request_ids)
        self._wake.set()

    def _validate(self, conn: Connection, req: SequenceRequest) -> tuple[int, int]:
        """(γ, max γ) of a valid request (specstream/data/request_rules.py, as the gateway checked
        it): γ is AUTO_GAMMA when the controller decides."""
        if (conn, req.id) in self.by_request:
            raise AlreadyExistsError("id", req.id, "already running on this connection")
        check_request(req, self.limits)
        spec = req.speculation
        if req.beam is not None or spec.mode == "off":
            return 0, 0
        if spec.mode == "fixed":
            return spec.gamma, spec.gamma
        return AUTO_GAMMA, spec.max_gamma or self.config.max_gamma

    @property
    def limits(self) -> RequestLimits:
        """What a request must fit here: the model's vocabulary, a slot's context, the γ limit and,
        for a beam, the slots and rows one step can give it."""
        vocab = self.model.config.vocab_size
        return RequestLimits(vocab_size=vocab, max_context_length=self.max_context_length,
                             max_new_tokens=self.max_context_length, max_gamma=self.config.max_gamma,
                             max_top_logprobs=vocab, max_beams=min(self.config.max_slots, self.config.batch_rows))

    async def time_draft(self) -> None:
        """Times the draft for the γ controller before the first request, as the constructor timed
        the verify forward (``Drafting.time_draft``); nothing with ``calibrate`` off or no draft."""
        if not self.config.calibrate or self.drafting.source is None:
            return
        started = time.perf_counter()
        try:
            calls = await self.drafting.time_draft(min(self.config.max_gamma, DRAFT_TIMING_DEPTH))
        except Exception:  # noqa: BLE001 - a start-up measurement must not stop the service from serving
            log.warning("timing the draft at start-up failed; the γ controller starts from its prior", exc_info=True)
            return
        if calls:
            log.info("timed the draft over %d propose calls in %.2f s for the γ controller (a guess costs %.2f of a step)",
                     calls, time.perf_counter() - started, self.controller.draft_ratio())

    # ----- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            if not (self.waiting or self.running or self._cancels):
                self._wake.clear()
                await self._wake.wait()
            started = time.perf_counter()
            try:
                await self.step()
                self._emit()
                self._time_iteration(time.perf_counter() - started)
            except Exception:  # noqa: BLE001 - a bug must fail the batch, not kill the service
                log.exception("engine step %d failed; failing its sequences", self.step_count)
                self._fail_all(InternalError("internal error in the target engine step"))
            await asyncio.sleep(0)  # let the gRPC streams run between steps

    def _time_iteration(self, seconds: float) -> None:
        if self._step_decoded and not self._step_prefilled:
            self.timings.decode_steps += 1
            self.timings.decode_s += seconds
            self.timings.decode_forward_s += self._step_forward_s
            self.timings.decode_compute_s += self._step_compute_s
            self.timings.decode_draft_s += self._step_draft_s
            host = max(0.0, seconds - self._step_compute_s - self._step_draft_s)
            self.metrics.observe_pass({"target": self._step_compute_s, "draft": self._step_draft_s, "host": host})
            if self.governor is not None:
                self.metrics.forward_threads.set(self.governor.threads)

    async def step(self) -> None:
        self.step_count += 1
        self._step_forward_s, self._step_compute_s, self._step_prefilled, self._step_decoded = 0.0, 0.0, False, False
        self._step_draft_s = 0.0
        await self._apply_cancels()
        await self._admit()
        await self._prefill()
        if self._step_prefilled and self._touched:
            self._emit()  # a prompt's first token goes out now, not after this step's decode pass
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
        (target_service/scheduler.py); a beam takes its k slots at once. Every slot has room for
        prompt + max_new_tokens + γ + 1: `_validate` refused anything longer."""
        occupied = self._occupied()  # counted once, then kept up to date: a long queue costs no rescans
        free = self._free_slots(occupied)
        prefilling = [s for s in self.running if s.prefilled < s.prompt_len]  # the ones a seq may wait for
        needs = []
        for seq in itertools.islice(self.waiting, free + 1):  # nothing past these can fit
            needs.append(0 if seq.finish_reason is not None else seq.slots_needed)
        quota = self.scheduler.admissions(sum(s.width for s in self.running), free, needs)
        refill = bool(self.running)
        deferred = []  # waiting for a prefill they will fork: those behind them go first meanwhile
        for _ in range(quota):
            if not self.waiting:
                break
            seq = self.waiting[0]
            if seq.finish_reason is not None:  # cancelled while queued: nothing to free but the id
                self.waiting.popleft()
                self.by_request.pop((seq.conn, seq.request_id), None)
                tracing.finish_sequence(seq)
                continue
            if self._awaits_a_prefill(seq, prefilling):
                deferred.append(self.waiting.popleft())  # it forks that prompt rather than compute it again
                continue
            # Room is counted again for each: a hit admitted just before may pin a kept slot that
            # was counted as one eviction could free.
            if self._free_slots(occupied) < seq.slots_needed or not self._place(seq):
                break  # it waits, first in line, for the next step
            self.waiting.popleft()
            if seq.beam is not None:
                seq.hypothesis_slots = [seq.slot]
                self.metrics.observe_beam_admission(refill)
            seq.queue_seconds = time.monotonic() - seq.arrival
            self.stats.record_admission(seq.queue_seconds)
            seq.span.add_event("admitted", {"specstream.queue_s": seq.queue_seconds})
            self.running.append(seq)  # before prefill: if it fails, _fail_all reports and frees it
            occupied += len(seq.beam_slots) or 1
            prefilling.append(seq)
        self.waiting.extendleft(reversed(deferred))  # first in line again, in their order

    def _awaits_a_prefill(self, seq: Sequence, prefilling: list[Sequence]) -> bool:
        """Whether ``seq`` waits for a running sequence still prefilling at least half of its
        prompt's full blocks (the same blocks under the same salt: agents' calls sent together
        with one system prompt, a request's ``n`` samples): once that prefill is done, ``seq``
        forks its prompt from the prefix cache instead of computing it a second time. Not for
        blocks the other was served from the cache itself (they are there now), nor when ``seq``
        needs features the other will not keep. Those behind it in line are admitted meanwhile.
        ``prefilling``: the running sequences that had not prefilled their prompt when admission began."""
        if self.prefix is None or not self.prefix.capacity or seq.beam is not None:
            return False
        mine = self._prompt_keys(seq)
        if not mine:
            return False  # no full block to share
        needs_features = self._feature_row(seq) > 0
        for other in prefilling:
            if other.beam is not None or other.prefilled >= other.prompt_len or other.finish_reason is not None:
                continue
            if needs_features and not self._feature_row(other):
                continue  # its prompt will be kept without the features this one needs
            shared = 0
            for a, b in zip(mine, self._prompt_keys(other)):
                if a != b:
                    break
                shared += 1
            if shared and 2 * shared >= len(mine) and other.cached_tokens < shared * BLOCK:
                return True  # (blocks the other was itself served from the cache are there already)
        return False

    @staticmethod
    def _prompt_keys(seq: Sequence) -> list[bytes]:
        if seq.prompt_keys is None:
            seq.prompt_keys = block_keys(seq.tokens[:seq.prompt_len], seq.cache_salt, reusable_blocks(seq.prompt_len))
        return seq.prompt_keys

    def _occupied(self) -> int:
        """Slots the running sequences hold (a beam its k)."""
        return sum(len(s.beam_slots) or 1 for s in self.running)

    def _free_slots(self, running: int | None = None) -> int:
        """Slots new sequences may take now: within max_slots for running ones (``running``: their
        slots, when the caller keeps the count), and free in the KV cache or kept by the prefix
        cache with no running sequence reading them."""
        running = self._occupied() if running is None else running
        spare = self.cache.num_free
        if self.prefix is not None and spare < self.config.max_slots - running:
            pinned = {src for s in self.running for slot in (s.beam_slots or [s.slot])
                      for src in (self.cache.sources(slot) or ())}
            spare += self.prefix.freeable(pinned)
        return max(0, min(self.config.max_slots - running, spare))

    def _alloc(self, keep: int | None = None) -> int | None:
        """A free slot, evicting cached prefixes (but the one in slot ``keep``) while none is; None
        when that frees none."""
        slot = self.cache.alloc()
        while slot is None and self.prefix is not None and self.prefix.evict(keep):
            slot = self.cache.alloc()
        return slot

    def _feature_row(self, seq: Sequence) -> int:
        """Bytes of one position's features when ``seq`` will draft with a feature draft (it then
        keeps every position's), else 0."""
        return self.drafting.feature_width * 2 if seq.beam is None and seq.gamma != 0 else 0

    def _kept_features(self, seq: Sequence) -> tuple[bytearray | None, int]:
        """What the prefix cache keeps of a sequence's features, and their bytes a position: none
        unless they are every position's but the last at the attached draft's width (a draft that
        reconnected with another width leaves bytes of the old one until Drafting drops them)."""
        row = self._feature_row(seq)
        # Every position's but the last, or (a prefill just done, its first token not yet appended) all.
        if seq.features is None or not row or len(seq.features) not in ((len(seq.tokens) - 1) * row,
                                                                         len(seq.tokens) * row):
            return None, 0
        return seq.features, row

    def _place(self, seq: Sequence) -> bool:
        """The sequence's slot (a beam's k), starting from the longest cached prefix of its prompt,
        if any; False (nothing taken) when no slot can be had."""
        row = self._feature_row(seq)
        hit = None
        if self.prefix is not None:
            hit = self.prefix.lookup(seq.tokens[:seq.prompt_len], seq.cache_salt, row)
        if hit is not None and not hit.take_over and not self.cache.num_free and self.prefix.can_take(hit.slot):
            hit.take_over = True  # room would be made by evicting it: continue in it instead
        if hit is not None and hit.take_over:
            seq.slot = self.prefix.take(hit)
        else:
            # The hit's slot is not evicted to make room (its K/V would be freed before the fork);
            # when nothing else frees one, the prefix is recomputed in whatever slot frees.
            seq.slot = self._alloc(keep=hit.slot if hit is not None else None)
            if seq.slot is None:
                hit, seq.slot = None, self._alloc()
            if seq.slot is None:
                return False
            if hit is not None:
                self.cache.fork(hit.slot, seq.slot)
        if seq.beam is not None:
            seq.beam_slots = [seq.slot, *(self._alloc() for _ in range(seq.beam.k - 1))]
            if None in seq.beam_slots:
                for slot in seq.beam_slots:
                    if slot is not None:
                        self.cache.free(slot)
                seq.slot, seq.beam_slots = None, []
                return False
        if self.prefix is not None:
            self.metrics.observe_prefix(reusable_blocks(seq.prompt_len) * BLOCK, hit.length if hit else 0)
        if hit is not None:
            self.cache.set_length(seq.slot, hit.length)
            seq.prefilled = seq.cached_tokens = seq.reused = hit.length
            if row:
                seq.features = bytearray(hit.features)
            seq.span.set_attribute("specstream.cached_tokens", hit.length)
        return True

    async def _prefill(self) -> None:
        """Feeds up to ``prefill_chunk`` prompt tokens of admitted sequences, oldest first, so a long
        prompt holds running rows up for one chunk per step, not its whole length. A sequence whose
        prompt is complete gets its first token. Chunks of equal length share one forward."""
        budget = self.prefill_chunk
        chunks: dict[int, list[tuple[Sequence, int]]] = {}
        for seq in self.running:
            todo = seq.prompt_len - seq.prefilled
            if todo <= 0 or seq.finish_reason is not None:
                continue
            if seq.prefilled == 0 and self._feature_row(seq):
                seq.features = bytearray()  # a feature draft reads every position's feature
            if budget == 0:
                break
            length = min(todo, budget)
            budget -= length
            chunks.setdefault(length, []).append((seq, seq.prefilled))
        for length, group in chunks.items():
            self._step_prefilled = True
            verdicts = await self._run_compute(self._prefill_compute, group, length)
            for (seq, start), verdict in zip(group, verdicts):
                seq.prefilled = start + length
                self.cache.set_length(seq.slot, seq.prefilled)
                self.stats.prefill_tokens += length
                if verdict is not None:  # the prompt is complete: its first token (a beam's first step)
                    seq.span.add_event("prefilled")
                    if self.prefix is not None and seq.beam is None:  # others may fork it from now on
                        self.prefix.add_live(seq.slot, seq.tokens[:seq.prompt_len], seq.cache_salt,
                                             *self._kept_features(seq))
                    seq.target_passes += 1
                    seq.last_expanded = self.step_count
                    if seq.beam is not None:
                        self._advance_beam(seq, *verdict)
                    else:
                        seq.append(verdict.tokens, verdict.logprobs)
                    self._touched.append(seq)


    def _prefill_compute(self, group: list[tuple[Sequence, int]], length: int) -> list:
        """Prompt tokens [start, start + length) of each sequence -> a Verdict (the first token)
        for those whose prompt this completes (for a beam: its first candidates), None for the rest."""
        ids = torch.tensor([seq.tokens[start : start + length] for seq, start in group], dtype=torch.int64)  # [b, L]
        slots = torch.tensor([seq.slot for seq, _ in group], dtype=torch.int64)  # [b]
        starts = torch.tensor([start for _, start in group], dtype=torch.int64)  # [b]
        verdicts: list[Verdict | None] = [None] * len(group)
        keep = [i for i, (seq, _) in enumerate(group) if seq.features is not None]
        with torch.inference_mode():
            layers = self.drafting.keep_layers if keep else ()
            hidden = self.model.hidden(ids, self.cache, slots, starts, last_only=not keep,
                                       keep=layers)  # [b, L or 1, (len(layers) + 1) H]
            if keep:
                kept = hidden[keep].to(torch.bfloat16).cpu()  # [k, L, feature width]: one copy off the device
                for j, i in enumerate(keep):
                    group[i][0].features += feature_bytes(kept[j])
            hidden = hidden[:, -1:, hidden.shape[-1] - self.model.config.hidden_size:]  # [b, 1, H]: the final state
            done = [i for i, (seq, start) in enumerate(group) if start + length == seq.prompt_len]
            beams = [i for i in done if group[i][0].beam is not None]
            for i in beams:
                verdicts[i] = self._beam_candidates(hidden[i, :1], group[i][0])
            done = [i for i in done if group[i][0].beam is None]
            if done:
                rows = [group[i][0].first_row() for i in done]
                for i, verdict in zip(done, settle(Hidden(hidden[done, 0], self.model.output_head), rows)):
                    verdicts[i] = verdict
        return verdicts

    async def _decode(self) -> None:
        ready = [s for s in self.running if s.finish_reason is None and s.prefilled == s.prompt_len]
        chosen = self.scheduler.select(ready, self.step_count) if ready else []
        if not chosen:
            return
        started = time.perf_counter()
        self._step_decoded = True
        for seq in chosen:
            seq.last_expanded = self.step_count
        rows = [s for s in chosen if s.beam is None]
        beams = [s for s in chosen if s.beam is not None]
        span = tracing.start_step(self.step_count, chosen)
        checks = await self.drafting.propose(rows, self.step_count,
                                             telemetry.traceparent_of(span) if span.is_recording() else "") if rows else []
        masks = self.masks.start(rows, checks)  # constrained rows: proposals cut, masks filled beside the forward
        drafted = time.perf_counter()
        self._step_draft_s = drafted - started
        width = 1 + max((len(c.proposals) for c in checks), default=0)
        hypotheses = sum(s.width for s in beams)
        tokens = sum(1 + len(c.proposals) for c in checks) + hypotheses
        self.stats.record_step(len(rows) + hypotheses, width, tokens, len(self.waiting))
        self.metrics.observe_step(len(rows) + hypotheses)
        verdicts, candidates = await self._run_compute(self._verify_compute, rows, checks, beams, masks)
        if masks is not None:
            self.metrics.observe_grammar(self.masks.seconds, self.masks.dropped, sum(c.forced for c in checks))
        verified = time.perf_counter()
        self.metrics.observe_ahead(self.drafting.ahead_counts)
        self.drafting.after_verify(self._computing)  # a draft in this process may work ahead meanwhile
        for seq, check, verdict in zip(rows, checks, verdicts):
            self._accept(seq, check, verdict)
            self._touched.append(seq)
        for seq, (values, ids) in zip(beams, candidates):
            seq.target_passes += 1
            self.metrics.observe_beam_step(seq.width)
            self._advance_beam(seq, values, ids)
            self._touched.append(seq)
        proposals = tokens - len(rows) - hypotheses
        forced = sum(c.forced for c in checks)  # the grammar's: verified, but no draft guessed them
        draft_depth = max((c.chain - c.forced for c in checks), default=0)
        draft_s = drafted - started if proposals > forced else 0.0
        other_s = time.perf_counter() - verified + (0.0 if proposals > forced else drafted - started)
        step_s = time.perf_counter() - started
        sampled = [len(c.proposals) for seq, c in zip(rows, checks) if not seq.sampling.greedy and c.proposals]
        self.controller.observe_step(len(rows) + hypotheses, width - 1, proposals, verified - drafted, draft_s, other_s,
                                     self.drafting.fed, sum(sampled), len(sampled), (forced, draft_depth))
        if self._next_pass_is(rows, beams):  # the next pass's draft call starts before this pass's host work
            await self.drafting.propose_early(rows, self.step_count + 1,
                                              telemetry.traceparent_of(span) if span.is_recording() else "")
        self.metrics.observe_gammas([c.chain for c in checks], [len(c.proposals) - c.chain for c in checks])
        self.metrics.observe_controller(self.controller.pooled(), self.controller.cost_terms(),
                                        self.controller.predicted_s, step_s)
        tracing.end_step(span, checks, verdicts, verified - drafted, self.controller.predicted_s, step_s,
                         [s.width for s in beams])

    def _next_pass_is(self, rows: list[Sequence], beams: list[Sequence]) -> bool:
        """Whether to ask the draft service for the next pass now (``TargetConfig.draft_early``, off by default):
        when the next pass will decode exactly ``rows`` (every running sequence was in this pass and
        goes on, nothing waits to be admitted or cancelled, no beam runs: anything else would change
        its rows). A draft in this process (``LocalDraft``) is never asked early: it runs on the
        engine's own torch thread, so nothing would overlap (measured slower: docs/benchmarks.md)."""
        return (self.config.draft_early and self.drafting.asks_early and not beams and not self.waiting
                and not self._cancels and len(rows) == len(self.running) and all(s.finish_reason is None for s in rows))

    def _verify_compute(self, rows: list[Sequence], checks: list[VerifyRow], beams: list[Sequence],
                        masks: Future | None = None) -> tuple[list[Verdict], list[tuple[torch.Tensor, torch.Tensor]]]:
        """ONE forward over every row's [last token, proposals...] (docs/architecture.md §4) and every running
        beam hypothesis' last token, then verification, and each beam's best candidates. `masks`:
        the constrained rows' grammar masks being filled (GrammarMasks.start), taken after the forward."""
        began_call = time.perf_counter()
        try:
            return self._verify_rows(rows, checks, beams, masks)
        finally:
            self._step_compute_s += time.perf_counter() - began_call

    def _verify_rows(self, rows: list[Sequence], checks: list[VerifyRow], beams: list[Sequence],
                     masks: Future | None = None) -> tuple[list[Verdict], list[tuple[torch.Tensor, torch.Tensor]]]:
        gamma = max((len(c.proposals) for c in checks), default=0)
        # [B, G+1]: last committed token, proposals, zero padding (never read)
        input_ids = [[seq.tokens[-1], *c.proposals, *[0] * (gamma - len(c.proposals))] for seq, c in zip(rows, checks)]
        slots = [s.slot for s in rows]
        start = [len(s.tokens) - 1 for s in rows]
        for seq in beams:  # one row per hypothesis: its newest token, not yet in the cache
            position = seq.prompt_len + seq.beam.generated - 1
            for tokens, slot in zip(seq.beam.running, seq.hypothesis_slots):
                input_ids.append([tokens[-1], *[0] * gamma])
                slots.append(slot)
                start.append(position)
        # Trees: node t's parent per row; chains and padding hang each node under the one before.
        chain = list(range(-1, gamma))
        parents = torch.tensor([[-1, *c.parents, *chain[len(c.parents) + 1:]] for c in checks]
                               + [chain] * (len(slots) - len(checks)), dtype=torch.int64) \
            if any(c.parents for c in checks) else None  # [B, G+1]
        with torch.inference_mode():
            began = time.perf_counter()
            features = any(seq.features is not None for seq in rows)
            full = self.model.hidden(torch.tensor(input_ids, dtype=torch.int64), self.cache,
                                     torch.tensor(slots, dtype=torch.int64), torch.tensor(start, dtype=torch.int64),
                                     keep=self.drafting.keep_layers if features else (),
                                     parents=parents)  # [B, G+1, feature width]
            # [B, G+1, H]: the final state (a draft reading several layers gets them before it)
            hidden = full if full.shape[-1] == self.model.config.hidden_size else \
                full[..., -self.model.config.hidden_size:].contiguous()
            self._step_forward_s += time.perf_counter() - began
            for i, mask in (masks.result() if masks is not None else {}).items():
                checks[i].grammar_mask = mask
            # The output layer runs inside settlement: fused with it on the Triton backend.
            verdicts = settle(Hidden(hidden[: len(rows)].flatten(0, 1), self.model.output_head), checks,
                              coupled=self.config.speculative_sampling == "coupled") if rows else []
            if features:
                # The committed positions: the last token and the accepted ones (a stop token or the
                # budget may end the sequence inside them: then nothing reads them again).
                kept = full[: len(rows)].to(torch.bfloat16).cpu()  # [B, G+1, feature width]: one copy off the device
                for i, (seq, verdict) in enumerate(zip(rows, verdicts)):
                    if seq.features is not None:
                        nodes = [0, *verdict.path] if verdict.path is not None else list(range(verdict.accepted + 1))
                        seq.features += feature_bytes(kept[i, nodes])  # [k+1, H]
            candidates, at = [], len(rows)
            for seq in beams:
                candidates.append(self._beam_candidates(hidden[at : at + seq.width, 0], seq))
                at += seq.width
        return verdicts, candidates

    def _beam_candidates(self, hidden: torch.Tensor, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [w, H] of a beam's running hypotheses -> their best candidates (accumulated
        scores [w, c] float32, best first; token ids [w, c]) from the fused n-best op (a torch
        top-k past its window)."""
        c = min(seq.beam.candidates, self.model.config.vocab_size)
        nbest = topk_logprobs if c <= MAX_K else topk_logprobs_reference
        values, ids = nbest(Hidden(hidden, self.model.output_head), c, seq.beam.scores)
        return values.float().cpu(), ids.cpu()

    def _advance_beam(self, seq: Sequence, values: torch.Tensor, ids: torch.Tensor) -> None:
        """One search step, then the KV rows follow the hypotheses: a parent's first continuation
        keeps its slot (the newest position is committed), the others fork it into slots that
        lost their hypothesis (K/V shared, not copied)."""
        parents = seq.hypothesis_slots
        continuations = seq.beam.step(values, ids)
        length = seq.prompt_len + seq.beam.generated - 1  # committed: all but the newest token
        slots: list[int | None] = [None] * len(continuations)
        for j, c in enumerate(continuations):
            if parents[c.parent] not in slots:
                slots[j] = parents[c.parent]
                self.cache.set_length(slots[j], length)
        spare = [s for s in seq.beam_slots if s not in slots]
        for j, c in enumerate(continuations):
            if slots[j] is None:
                slots[j] = spare.pop()
                self.cache.fork(parents[c.parent], slots[j])
        seq.hypothesis_slots = slots
        if seq.beam.done:
            seq.end_search()
            self.metrics.observe_beam_end(seq.beam.expansions)

    def _accept(self, seq: Sequence, check: VerifyRow, verdict: Verdict) -> None:
        ctx_len, k = check.position, verdict.accepted
        seq.target_passes += 1
        seq.append(verdict.tokens, verdict.logprobs)  # k accepted proposals, then the correction or bonus token
        accepted = min(k, len(seq.tokens) - ctx_len)  # a stop id may cut the run short
        chain = check.chain
        on_chain = min(verdict.on_chain, accepted)  # a stop id may cut the run short here too
        seq.record_decode(chain, accepted, len(check.proposals) - chain, accepted - on_chain)
        seq.accepted_tokens += accepted
        seq.rejections += on_chain < chain
        self.metrics.observe_accept(chain, accepted)
        self.metrics.observe_branch_tokens(accepted - on_chain)
        self.drafting.settle(seq, check, verdict)
        if seq.gamma == AUTO_GAMMA:
            seq.alpha_estimate = self.controller.alpha(seq.seq_id, seq.sampling.greedy)
        if verdict.path:
            # A tree: the accepted nodes' K/V move to where a chain would have written them.
            self.cache.keep_path(seq.slot, ctx_len - 1, [0, *verdict.path])
        # Commit (or roll back): the newest token is not in the cache yet, everything before is. So
        # too when the sequence ended here: the prefix cache may keep what it holds.
        self.cache.set_length(seq.slot, len(seq.tokens) - 1)
        row = self._feature_row(seq)
        if seq.features is not None and row and len(seq.features) == (ctx_len + k) * row:
            # A stop id or the budget may end the run inside its accepted guesses: the features of
            # the positions after it were computed, but they are not the sequence's. (Any other
            # count, a draft that reconnected with another width, is left for Drafting to refuse.)
            del seq.features[(len(seq.tokens) - 1) * row:]

    async def _retire(self) -> None:
        """Frees the slots and draft state of sequences that ended this step."""
        done = [s for s in self.running if s.finish_reason is not None]
        done += [s for s in self.waiting if s.finish_reason is not None]
        done += [s for s in self.compiling if s.finish_reason is not None]
        if not done:
            return
        self.running = [s for s in self.running if s.finish_reason is None]
        self.waiting = deque(s for s in self.waiting if s.finish_reason is None)
        self.compiling = {s for s in self.compiling if s.finish_reason is None}
        for seq in done:
            tracing.finish_sequence(seq)
            self._release_slots(seq, keep=True)
            self.by_request.pop((seq.conn, seq.request_id), None)
        if self.prefix is not None:
            self.metrics.prefix_slots.set(self.prefix.retained)
        await self.drafting.release(done)

    def _release_slots(self, seq: Sequence, keep: bool) -> None:
        """Frees a sequence's slots; with ``keep``, the prefix cache may keep its one slot's K/V instead."""
        slots = seq.beam_slots or ([seq.slot] if seq.slot is not None else [])
        for slot in slots:
            if self.prefix is not None:
                self.prefix.drop(slot)
                if keep and seq.beam is None and self.prefix.retire(
                        slot, seq.tokens[:self.cache.length(slot)], seq.cache_salt, *self._kept_features(seq)):
                    continue
            self.cache.free(slot)
        seq.slot, seq.beam_slots, seq.hypothesis_slots = None, [], []

    def _fail_all(self, error: SpecstreamError) -> None:
        """Ends every sequence with `error` (a failed step, or shutdown)."""
        failed = [*self.running, *self.waiting, *self.compiling]
        for seq in failed:
            tracing.finish_sequence(seq, str(error))
            self._release_slots(seq, keep=False)
            seq.pending, seq.pending_logprobs = [], []
            seq.finish_reason, seq.error = "error", error
            self._touched.append(seq)
            self.by_request.pop((seq.conn, seq.request_id), None)
        self.running, self.waiting, self.compiling = [], deque(), set()
        if failed:
            self._emit()
            task = asyncio.create_task(self.drafting.release(failed))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _emit(self) -> None:
        """One message per connection per step: every touched sequence's event, plus load."""
        per_conn: dict[Connection, list[SequenceEvent]] = {}
        for seq in dict.fromkeys(self._touched):  # de-duplicated, in order
            per_conn.setdefault(seq.conn, []).append(seq.event())
        self._touched = []
        load = self.load()
        for conn in self.connections:
            conn.send(EngineMessage(load, self.step_count, per_conn.get(conn, [])))

    async def _run_compute(self, fn, *args):
        self._compute_calls += 1
        try:
            if self.governor is not None:  # a forward on as many threads as the CPU time the process gets
                return await asyncio.get_running_loop().run_in_executor(self._compute, self.governor.run, fn, *args)
            return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)
        finally:
            self._compute_calls -= 1

    def _computing(self) -> bool:
        """Whether a call of the engine's waits for (or runs on) the torch thread."""
        return self._compute_calls > 0

    def shutdown(self) -> None:
        self._fail_all(UnavailableError("the target service is shutting down"))
        self._compute.shutdown(wait=False)
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self.masks.shutdown()
