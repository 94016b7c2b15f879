"""OpenTelemetry tracing for the three services (docs/architecture.md §9, Tracing): setup, export, context in messages.

`configure(service, trace_file)` installs a tracer provider when tracing is asked for:
- the standard variables: `OTEL_TRACES_EXPORTER=otlp` (or an `OTEL_EXPORTER_OTLP_ENDPOINT` /
  `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` being set) exports over OTLP, gRPC by default or HTTP with
  `OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf`; the exporters read their own endpoint, headers
  and timeout variables; `OTEL_SERVICE_NAME` overrides the service name;
- `trace_file`: one JSON object per finished span per line, appended (several processes may share
  the file: each line is one `write` on an O_APPEND descriptor);
- neither: nothing is installed and every tracer is OpenTelemetry's no-op one, so tracing off
  costs a few attribute-free calls.

Context crosses processes inside the messages as W3C `traceparent` strings (`context_from` /
`traceparent_of`), never as per-request RPC metadata: the streams are multiplexed.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, StatusCode  # noqa: F401 - re-exported for the services
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None


def configure(service: str, trace_file: str | None = None) -> TracerProvider | None:
    """Installs tracing for this process if the environment or `trace_file` asks for it."""
    global _provider
    exporters: list[SpanExporter] = []
    if _otlp_wanted():
        exporters.append(_otlp_exporter())
    if trace_file:
        exporters.append(JsonLinesExporter(trace_file))
    if not exporters:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service)}))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown() -> None:
    """Flushes and stops export (call on service shutdown, after the last span ends)."""
    if _provider is not None:
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def context_from(traceparent: str) -> Context | None:
    """The remote parent a message's `traceparent` names; None when it is empty or malformed."""
    if not traceparent:
        return None
    ctx = _PROPAGATOR.extract({"traceparent": traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def traceparent_of(span: trace.Span) -> str:
    """The W3C traceparent naming `span` ("" for a no-op span)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def _otlp_wanted() -> bool:
    chosen = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if chosen:
        return "otlp" in chosen.split(",")
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def _otlp_exporter() -> SpanExporter:
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
        return HttpExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    return GrpcExporter()


class JsonLinesExporter(SpanExporter):
    """One JSON object per span per line: ids in hex, times in nanoseconds since the epoch."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            for span in spans:
                os.write(self._fd, (json.dumps(span_record(span), separators=(",", ":")) + "\n").encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def span_record(span: ReadableSpan) -> dict:
    ctx = span.get_span_context()
    return {
        "name": span.name,
        "service": span.resource.attributes.get("service.name", ""),
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                   for e in span.events],
        "links": [{"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
                  for link in span.links],
        "status": span.status.status_code.name,
    }
