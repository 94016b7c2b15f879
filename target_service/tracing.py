"""The target's spans (docs/architecture.md §9, Tracing): one per sequence, one per engine step.

A sequence's span is a child of the gateway's request span (the `traceparent` in its
SequenceRequest) and records the phases as events: admitted (with the queue time), prefilled,
finished. A step's span is a root of its own with links to the sequences it advanced, and carries
the step's batch size, tokens, γ per row (and which proposer made them), acceptance, verify time, and
the step time the γ controller predicted beside the measured one; the draft's propose span is
its child (the traceparent in ProposeRequest). With tracing off every call here is a no-op on
OpenTelemetry's non-recording span.
"""

from __future__ import annotations

from opentelemetry.trace import Link, Span

from specstream.serving import telemetry

_tracer = telemetry.tracer("specstream.target")


def start_sequence(seq, traceparent: str) -> Span:
    return _tracer.start_span("specstream.sequence", context=telemetry.context_from(traceparent),
                              attributes={"specstream.seq_id": seq.seq_id, "specstream.prompt_tokens": seq.prompt_len,
                                          "specstream.max_new_tokens": seq.max_new_tokens,
                                          "specstream.gamma": "auto" if seq.gamma < 0 else seq.gamma,
                                          "gen_ai.request.temperature": seq.sampling.temperature})


def sequence_traceparent(seq) -> str:
    """For the draft's per-sequence span; "" when not tracing (no string built)."""
    return telemetry.traceparent_of(seq.span) if seq.span.is_recording() else ""


def finish_sequence(seq, error: str = "") -> None:
    span = seq.span
    if not span.is_recording():
        return
    span.set_attributes({"specstream.finish_reason": seq.finish_reason or "error",
                         "gen_ai.usage.output_tokens": seq.generated, "specstream.draft_tokens": seq.draft_tokens,
                         "specstream.accepted_tokens": seq.accepted_tokens,
                         "specstream.target_passes": seq.target_passes})
    if seq.beam is not None:
        span.set_attributes({"specstream.beam.num_beams": seq.beam.k, "specstream.beam.steps": seq.beam.generated,
                             "specstream.beam.expansions": seq.beam.expansions,
                             "specstream.beam.returned": len(seq.sequences)})
    if error:
        span.set_status(telemetry.StatusCode.ERROR, error)
    span.end()


def start_step(step: int, rows: list) -> Span:
    links = [Link(seq.span.get_span_context()) for seq in rows if seq.span.is_recording()]
    return _tracer.start_span("specstream.engine_step", links=links,
                              attributes={"specstream.step": step, "specstream.batch_size": len(rows)})


def end_step(span: Span, checks: list, verdicts: list, verify_seconds: float, predicted_seconds: float,
             step_seconds: float, beam_widths: list[int] = ()) -> None:
    """`predicted_seconds`: the γ controller's prediction for the step (0: none was made);
    `beam_widths`: the hypotheses each beam request in the step expanded."""
    if not span.is_recording():
        return
    span.set_attributes({
        "specstream.gammas": [len(c.proposals) for c in checks],  # a tree's nodes, branches included
        "specstream.branches": [len(c.proposals) - c.chain for c in checks],
        "specstream.proposers": [c.source if c.proposals else "" for c in checks],
        "specstream.step_s": step_seconds,
        "specstream.predicted_step_s": predicted_seconds,
        "specstream.tokens_processed": sum(1 + len(c.proposals) for c in checks),
        "specstream.accepted": [v.accepted for v in verdicts],
        "specstream.emitted_tokens": sum(len(v.tokens) for v in verdicts),
        "specstream.verify_s": verify_seconds,
        "specstream.beam_widths": list(beam_widths),
        "specstream.beam_expansions": sum(beam_widths)})
    span.end()
