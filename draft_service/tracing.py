"""The draft's spans (docs/architecture.md §9, Tracing): one per propose batch, a child of the target's step span, and
one per sequence in it, a child of that sequence's span on the target, so the draft's share of a
request shows in the request's own trace. Both carry the batch's real start and end times. With
tracing off (no traceparents in the message) nothing is created."""

from __future__ import annotations

from opentelemetry.trace import Link

from specstream.serving import telemetry

_tracer = telemetry.tracer("specstream.draft")


def record_propose(request, proposals: list, start_ns: int, end_ns: int) -> None:
    items = request.propose.items
    if not request.traceparent and not any(item.traceparent for item in items):
        return
    batch = _tracer.start_span("specstream.draft_propose", context=telemetry.context_from(request.traceparent),
                               start_time=start_ns, attributes={"specstream.step": request.propose.step,
                                                                "specstream.batch_size": len(items)})
    batch.end(end_time=end_ns)
    for item, proposal in zip(items, proposals):
        if item.traceparent:
            span = _tracer.start_span(
                "specstream.draft_propose_sequence", context=telemetry.context_from(item.traceparent),
                start_time=start_ns, links=[Link(batch.get_span_context())],
                attributes={"specstream.gamma": item.gamma, "specstream.appended_tokens": len(item.append_token_ids),
                            "specstream.proposed_tokens": len(proposal.tokens),
                            "specstream.proposer": proposal.source})
            span.end(end_time=end_ns)
