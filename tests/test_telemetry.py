"""Tracing setup: the JSON-lines exporter, W3C context in messages, and tracing off by default."""

from __future__ import annotations

import json
import subprocess
import sys

from specstream.serving import telemetry

SCRIPT = """
import sys
from specstream.serving import telemetry
telemetry.configure("svc", sys.argv[1])
tracer = telemetry.tracer("t")
with tracer.start_as_current_span("parent", attributes={"a": 1}) as parent:
    carrier = telemetry.traceparent_of(parent)
with tracer.start_as_current_span("child", context=telemetry.context_from(carrier)) as child:
    child.add_event("step", {"rows": 3})
telemetry.shutdown()
"""


def test_spans_cross_a_traceparent_and_land_one_per_line(tmp_path):
    path = tmp_path / "spans.jsonl"
    subprocess.run([sys.executable, "-c", SCRIPT, str(path)], check=True, timeout=60)
    subprocess.run([sys.executable, "-c", SCRIPT, str(path)], check=True, timeout=60)  # appends
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(spans) == 4
    parent, child = (next(s for s in spans[:2] if s["name"] == n) for n in ("parent", "child"))
    assert child["trace_id"] == parent["trace_id"] and child["parent_span_id"] == parent["span_id"]
    assert parent["service"] == "svc" and parent["attributes"] == {"a": 1}
    assert child["events"][0]["name"] == "step" and child["events"][0]["attributes"] == {"rows": 3}
    assert spans[2]["trace_id"] != parent["trace_id"]  # the second run is another trace


def test_bad_or_empty_traceparent_gives_no_parent():
    assert telemetry.context_from("") is None
    assert telemetry.context_from("00-zz-11-01") is None
    assert telemetry.context_from("00-" + "0" * 32 + "-" + "0" * 16 + "-01") is None  # all-zero ids are invalid


def test_tracing_is_off_without_configuration():
    import opentelemetry.trace as trace

    span = telemetry.tracer("x").start_span("nothing")
    assert not span.get_span_context().is_valid  # the no-op tracer: nothing recorded, nothing exported
    assert telemetry.traceparent_of(span) == ""
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
