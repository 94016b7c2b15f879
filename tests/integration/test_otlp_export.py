"""OTLP export from the three real processes to a real receiver, over gRPC and over HTTP/protobuf.

No collector binary is to be had in a test (no image registry, none on PyPI), so the receivers are
tests/support/otlp_receiver.py: the OTLP TraceService (gRPC) and `POST /v1/traces` (HTTP), decoding what
the exporters send with the `opentelemetry-proto` messages. The services get nothing but the
standard variables, as deploy/ gives them (docs/observability.md): endpoint, protocol, headers and
resource attributes. One request with a caller's W3C traceparent must arrive as one trace with
spans from all three services, told apart by their `service.name`, linked gateway -> target ->
draft; and the services must still exit cleanly, flushing to the receiver on the way out.
"""

from __future__ import annotations

import time

import pytest

from specstream_client import Client
from tests.support.otlp_receiver import GrpcReceiver, HttpReceiver, ReceivedSpan

TRACE, PARENT = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
SERVICES = {"specstream-gateway", "specstream-target", "specstream-draft"}
HEADER = ("x-otlp-test", "specstream-otlp")
RECEIVERS = {"grpc": GrpcReceiver, "http/protobuf": HttpReceiver}


def _wait_for_trace(receiver, timeout_s: float = 30.0) -> list[ReceivedSpan]:
    """The trace's spans once every service has sent its part of it (spans go out in batches every
    200 ms, each service on its own)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [s for s in receiver.spans() if s.trace_id == TRACE]
        names = {s.name for s in spans}
        if {"gen_ai.generate", "specstream.sequence", "specstream.draft_propose_sequence"} <= names:
            return spans
        if time.monotonic() > deadline:
            raise TimeoutError(f"trace {TRACE} incomplete after {timeout_s:.0f} s: got {sorted(names)} "
                               f"from {sorted({s.service for s in spans})}")
        time.sleep(0.2)


@pytest.mark.parametrize("protocol", list(RECEIVERS))
def test_one_trace_across_the_three_services_reaches_an_otlp_receiver(protocol, stack_factory, model_zoo,
                                                                        monkeypatch) -> None:
    with RECEIVERS[protocol]() as receiver:
        # The launcher hands its environment to the three processes.
        for name in ("OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                     "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_SDK_DISABLED"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "=".join(HEADER))
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", f"deployment.environment=otlp-test-{protocol}")
        stack = stack_factory(model_zoo["target"], model_zoo["partial"], max_slots=4)
        with Client(stack.gateway_address, timeout=120) as client:
            result = client.generate("def main():", max_new_tokens=16, speculation=4, ignore_eos=True,
                                     request_id="otlp", traceparent=f"00-{TRACE}-{PARENT}-01")
        _wait_for_trace(receiver)
        codes = stack.stop()  # the exporters flush and shut down with their services
        assert all(code == 0 for code in codes.values()), codes
        exports = list(receiver.exports)
        # Read after the shutdown flush: a draft span can still be in a later batch when the first
        # spans of each kind have arrived.
        spans = [s for s in receiver.spans() if s.trace_id == TRACE]

    assert {s.service for s in spans} == SERVICES
    (root,) = [s for s in spans if s.name == "gen_ai.generate"]
    assert (root.service, root.kind, root.parent_span_id) == ("specstream-gateway", "SPAN_KIND_SERVER", PARENT)
    assert root.attributes["specstream.request_id"] == "otlp"
    assert root.attributes["gen_ai.usage.output_tokens"] == len(result.token_ids) == 16
    (sequence,) = [s for s in spans if s.name == "specstream.sequence"]
    assert (sequence.service, sequence.parent_span_id) == ("specstream-target", root.span_id)
    assert sequence.attributes["specstream.accepted_tokens"] == result.stats.accepted_tokens
    drafts = [s for s in spans if s.name == "specstream.draft_propose_sequence"]
    assert drafts and all((s.service, s.parent_span_id) == ("specstream-draft", sequence.span_id) for s in drafts)
    assert sum(s.attributes["specstream.proposed_tokens"] for s in drafts) == result.stats.draft_tokens > 0

    # Each service exported as itself, with the deployment's resource attributes and the exporter
    # headers from the environment, on every export (including those of the shutdown flush).
    assert {s.service for export in exports for s in export.spans} == SERVICES
    for export in exports:
        assert export.headers.get(HEADER[0]) == HEADER[1], export.headers
        assert {s.resource["deployment.environment"] for s in export.spans} == {f"otlp-test-{protocol}"}
    if protocol == "http/protobuf":
        assert receiver.rejected == 0
