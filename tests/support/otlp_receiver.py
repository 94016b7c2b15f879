"""OTLP trace receivers on loopback ports, for tests: what an OpenTelemetry Collector's `otlp`
receiver does with traces, minus the pipeline. Both decode the wire format with the
`opentelemetry-proto` messages, so a test sees exactly what an exporter sent:

- `GrpcReceiver`: a gRPC server implementing `opentelemetry.proto.collector.trace.v1.TraceService`
  (OTLP/gRPC, the collector's :4317);
- `HttpReceiver`: `POST /v1/traces` with an `application/x-protobuf` body, gzip or not
  (OTLP/HTTP, the collector's :4318).

Each keeps every export it accepted (`exports`: the request's headers, lower-cased, and the
decoded spans) and answers success. Knows nothing about specstream.
"""

from __future__ import annotations

import gzip
import http.server
import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanPb


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # 16 hex digits, "" for a root span
    kind: str  # "SPAN_KIND_SERVER", ...
    attributes: dict
    resource: dict  # the resource's attributes: service.name, ...

    @property
    def service(self) -> str:
        return self.resource.get("service.name", "")


@dataclass
class Export:
    headers: dict[str, str]  # lower-case names
    spans: list[ReceivedSpan]


def _value(value: AnyValue):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex(), kind=SpanPb.SpanKind.Name(span.kind),
                    attributes={kv.key: _value(kv.value) for kv in span.attributes}, resource=resource))
    return spans


@dataclass
class _Store:
    exports: list[Export] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, headers: dict[str, str], request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            self.exports.append(Export(headers, decode(request)))

    def spans(self) -> list[ReceivedSpan]:
        with self.lock:
            return [span for export in self.exports for span in export.spans]


class GrpcReceiver(_Store):
    """OTLP/gRPC on 127.0.0.1; `endpoint` is what OTEL_EXPORTER_OTLP_ENDPOINT should say."""

    def __init__(self) -> None:
        super().__init__()
        store = self

        class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the generated name
                store.add({k.lower(): v for k, v in context.invocation_metadata()}, request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"

    def __enter__(self) -> GrpcReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)


class HttpReceiver(_Store):
    """OTLP/HTTP (protobuf) on 127.0.0.1; `endpoint` is what OTEL_EXPORTER_OTLP_ENDPOINT should say
    (the exporter appends /v1/traces). Anything but a protobuf POST to /v1/traces is refused, and
    `rejected` counts it, so a test sees a wrong path or body instead of silently missing spans."""

    def __init__(self) -> None:
        super().__init__()
        self.rejected = 0
        store = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    store.rejected += 1
                    self.send_error(404 if self.path != "/v1/traces" else 415)
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                store.add({k.lower(): v for k, v in self.headers.items()},
                          trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:  # quiet
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> HttpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
