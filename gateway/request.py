"""One request's path through the gateway: admit it to the router (sent to a target replica or
queued), turn per-step token events into text chunks (incremental detokenization + stop strings),
and finish with usage, stats, timings and the seed used (and, for a beam request, its n best
hypotheses, each detokenized; the engine reports a beam only when its search ends, so
`GenerateStream` sends it as one chunk). With tools, the text is read for calls (gateway/tools.py
`CallReader`): each chunk's text is what the model wrote outside them, each call comes whole in the
chunk where it closes, and an answer that ends after calls finishes with TOOL_CALLS.
Log-probabilities come from the target, one per token; they are passed through in step with the
token ids (and cut with them at a stop string), never computed here. The engine's plain events
(specstream/data/engine.py) come in; the public response messages both fronts serve
(`GenerateStreamResponse`) go out.

`Generate` and `GenerateStream` both consume `stream_chunks`, so their results agree by
construction. Leaving early (client cancel, deadline, a stop string) cancels the sequence on the
target, which frees its slot and the draft's state, or takes it out of the gateway's queue.

A request whose replica is lost after it started continues on another one (gateway/resume.py):
its events keep coming on the same ticket, so the detokenizer and stop-string state here simply
carry on, and `completion_tokens` counts every token received. Each move is a `resumed` event on
the request's span and counts in `specstream:requests_resumed_total`.

`timings.queue_seconds` is the whole wait before prefill: time in the gateway's queue (admission ->
sent to the replica that served it) plus the target's own (arrival -> prefill start). Each chunk's
tokens and the final chunk go to a `RequestObserver` (specstream/serving/metrics.py), which turns them into
the gateway's Prometheus metrics.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Iterable

from gateway.router import Router
from gateway.tools import CallReader
from gateway.validation import ValidRequest
from specstream.data.engine import BeamHypothesis
from specstream.data.engine_wire import finish_reason_to_pb, hypothesis_to_pb, logprob_to_pb, stats_to_pb
from specstream.data.errors import InternalError
from specstream.serving import telemetry
from specstream.serving.metrics import GatewayMetrics, RequestObserver
from specstream.text.stop_strings import StopStringMatcher
from specstream.text.tokenizer import IncrementalDetokenizer, TextTokenizer
from specstream_pb import common_pb2, generation_pb2


async def stream_chunks(req: ValidRequest, router: Router, tokenizer: TextTokenizer,
                        metrics: GatewayMetrics) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
    span = _request_span(req)
    # The target's spans join this trace.
    sequence = dataclasses.replace(req.sequence, traceparent=telemetry.traceparent_of(span) or req.sequence.traceparent)
    try:
        ticket = router.submit(sequence)  # OverloadedError / UnavailableError: not admitted
    except Exception as exc:
        span.set_status(telemetry.StatusCode.ERROR, str(exc))
        span.end()
        raise
    observer = metrics.request()
    ticket.watcher = _ResumeWatcher(span, observer)
    detok = tokenizer.detokenizer(req.prompt_ids)
    stop = StopStringMatcher(req.stop) if req.stop else None
    unmatched = sequence.min_tokens  # tokens whose text no stop string may end in (min_tokens)
    calls = CallReader() if req.reads_calls else None  # the text outside calls, and each call whole
    timings = common_pb2.Timings()
    completion, first, cached = 0, True, 0
    try:
        while True:
            event = await ticket.events.get()
            if event.finish_reason == "error":  # the error's class is the status the target sent
                raise event.error or InternalError(f"sequence {event.id!r} ended with an error and no status")
            if first:  # the target reports its queue time on a sequence's first event
                timings.queue_seconds = ticket.gateway_queue_seconds + (event.queue_seconds or 0.0)
                cached = event.cached_tokens  # and the prompt tokens its prefix cache served
                first = False
            if event.logprobs and len(event.logprobs) != len(event.token_ids):
                raise InternalError(f"target sent {len(event.logprobs)} logprobs for {len(event.token_ids)} tokens")
            chunk = generation_pb2.GenerateStreamResponse(request_id=req.request_id)
            finish, matched = event.finish_reason, False
            for i, token in enumerate(event.token_ids):  # token by token, so nothing after a stop string leaks
                chunk.token_ids.append(token)
                if event.logprobs:
                    chunk.logprobs.append(logprob_to_pb(event.logprobs[i]))
                text = detok.push([token])
                if stop is not None and completion + i >= unmatched:
                    text, matched = stop.push(text)
                chunk.text += text
                if matched:
                    break
            completion += len(chunk.token_ids)
            now = time.monotonic()
            observer.tokens(len(chunk.token_ids), now)
            if chunk.token_ids and not timings.time_to_first_token_seconds:
                timings.time_to_first_token_seconds = now - req.received
                span.add_event("first_chunk")
            if not matched and finish is not None:
                text, matched = _flush(detok, stop)
                chunk.text += text
            if matched:
                finish = "stop"
                router.cancel(ticket)
            if calls is not None:
                chunk.text, made = calls.feed(chunk.text, final=finish is not None)
                chunk.tool_calls.extend(made)
            if finish is not None:
                timings.total_seconds = now - req.received
                chunk.finish_reason = finish_reason_to_pb(finish)
                if calls is not None and calls.called and finish in ("stop", "eos"):
                    chunk.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS
                chunk.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=completion,
                                                      cached_tokens=cached))
                chunk.stats.CopyFrom(stats_to_pb(event.stats))
                chunk.timings.CopyFrom(timings)
                chunk.seed = req.seed
                chunk.sequences.extend(_beam_sequences(tokenizer, req.prompt_ids, event.sequences))
                observer.finished(chunk, ticket.replica.url if ticket.replica is not None else "")
                _finish_span(span, chunk, ticket.resumes)
                yield chunk
                return
            if chunk.token_ids:
                yield chunk
    except BaseException as exc:
        span.set_status(telemetry.StatusCode.ERROR, type(exc).__name__)
        raise
    finally:
        router.cancel(ticket)  # no-op when the sequence already finished
        span.end()


def _request_span(req: ValidRequest):
    """The request's span (gen_ai semantic conventions), a child of the caller's traceparent."""
    sequence, sampling = req.sequence, req.sequence.sampling
    return telemetry.tracer("specstream.gateway").start_span(
        "gen_ai.generate", context=telemetry.context_from(sequence.traceparent), kind=telemetry.SpanKind.SERVER,
        attributes={"gen_ai.operation.name": "chat" if req.chat else "text_completion",
                    "gen_ai.request.model": req.model,
                    "gen_ai.request.max_tokens": sequence.max_new_tokens,
                    "gen_ai.request.temperature": sampling.temperature, "gen_ai.request.top_p": sampling.top_p,
                    "gen_ai.request.top_k": sampling.top_k, "gen_ai.request.seed": str(sampling.seed),
                    "specstream.request_id": req.request_id, "gen_ai.usage.input_tokens": len(req.prompt_ids)})


class _ResumeWatcher:
    """The ticket's `TicketWatcher` (gateway/ticket.py): each resume is a span event and a metric."""

    def __init__(self, span, observer: RequestObserver) -> None:
        self.span, self.observer = span, observer

    def resumed(self, why: str, tokens_before: int) -> None:
        self.observer.resumed()
        self.span.add_event("resumed", {"specstream.reason": why, "specstream.tokens_before": tokens_before})


def _finish_span(span, chunk: generation_pb2.GenerateStreamResponse, resumes: int) -> None:
    span.set_attributes({
        "specstream.resumes": resumes,
        "gen_ai.usage.output_tokens": chunk.usage.completion_tokens,
        "specstream.cached_tokens": chunk.usage.cached_tokens,
        "gen_ai.response.finish_reasons": [common_pb2.FinishReason.Name(chunk.finish_reason)],
        "specstream.time_to_first_chunk_s": chunk.timings.time_to_first_token_seconds,
        "specstream.queue_s": chunk.timings.queue_seconds,
        "specstream.draft_tokens": chunk.stats.draft_tokens, "specstream.accepted_tokens": chunk.stats.accepted_tokens})


def _beam_sequences(tokenizer: TextTokenizer, prompt_ids: list[int],
                    hypotheses: Iterable[BeamHypothesis]) -> list[common_pb2.BeamSequence]:
    """The target's hypotheses with their text, detokenized as the main text is (after the prompt,
    special tokens skipped alike), so the best one's text equals the response's."""
    out = []
    for hypothesis in hypotheses:
        detok = tokenizer.detokenizer(prompt_ids)
        sequence = hypothesis_to_pb(hypothesis)
        sequence.text = detok.push(list(hypothesis.token_ids)) + detok.flush()
        out.append(sequence)
    return out


def _flush(detok: IncrementalDetokenizer, stop: StopStringMatcher | None) -> tuple[str, bool]:
    """End of generation: release text held back for UTF-8 completion and for stop strings;
    (text, whether a stop string completed in it)."""
    text = detok.flush()
    if stop is None:
        return text, False
    text, matched = stop.push(text) if text else ("", False)
    return (text, True) if matched else (text + stop.flush(), False)


async def generate(req: ValidRequest, router: Router, tokenizer: TextTokenizer,
                   metrics: GatewayMetrics) -> generation_pb2.GenerateResponse:
    response = generation_pb2.GenerateResponse(request_id=req.request_id)
    async for chunk in stream_chunks(req, router, tokenizer, metrics):
        response.text += chunk.text
        response.token_ids.extend(chunk.token_ids)
        response.logprobs.extend(chunk.logprobs)
        response.tool_calls.extend(chunk.tool_calls)
        if chunk.finish_reason:
            response.finish_reason = chunk.finish_reason
            response.usage.CopyFrom(chunk.usage)
            response.stats.CopyFrom(chunk.stats)
            response.timings.CopyFrom(chunk.timings)
            response.seed = chunk.seed
            response.sequences.extend(chunk.sequences)
    return response
