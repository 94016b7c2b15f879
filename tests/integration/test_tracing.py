"""Tracing across the three real processes: every request is ONE trace, gateway -> target ->
draft, with the documented parent/child links and attributes (JSON-lines file export)."""

from __future__ import annotations

import json
from collections import defaultdict

from specstream_client import Client

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = "b7ad6b7169203331"


def test_one_trace_per_request_across_the_three_services(stack_factory, model_zoo, tmp_path):
    trace_file = tmp_path / "spans.jsonl"
    stack = stack_factory(model_zoo["target"], model_zoo["partial"], max_slots=4, trace_file=str(trace_file))
    with Client(stack.gateway_address, timeout=120) as client:
        traced = client.generate("def main():", max_new_tokens=16, speculation=4, ignore_eos=True,
                                 request_id="traced", traceparent=f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01")
        other = client.generate("import os", max_new_tokens=16, speculation=4, ignore_eos=True,
                                request_id="other", temperature=0.9, seed=3)
        auto = client.generate("class A:", max_new_tokens=16, ignore_eos=True, request_id="auto")  # speculation=auto
    stack.stop()  # the services flush their spans on shutdown
    spans = [json.loads(line) for line in trace_file.read_text().splitlines()]
    by_trace = defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)

    requests = {s["attributes"]["specstream.request_id"]: s for s in spans if s["name"] == "gen_ai.generate"}
    assert set(requests) == {"traced", "other", "auto"}
    assert requests["traced"]["trace_id"] == CLIENT_TRACE and requests["traced"]["parent_span_id"] == CLIENT_PARENT
    assert requests["other"]["parent_span_id"] is None  # no caller context: the gateway starts the trace
    for result, root in ((traced, requests["traced"]), (other, requests["other"])):
        trace = by_trace[root["trace_id"]]
        assert {s["service"] for s in trace} == {"specstream-gateway", "specstream-target", "specstream-draft"}
        (sequence,) = [s for s in trace if s["name"] == "specstream.sequence"]
        assert sequence["parent_span_id"] == root["span_id"]
        assert [e["name"] for e in sequence["events"]][:2] == ["admitted", "prefilled"]
        drafts = [s for s in trace if s["name"] == "specstream.draft_propose_sequence"]
        assert drafts and all(s["parent_span_id"] == sequence["span_id"] for s in drafts)
        attrs = root["attributes"]
        assert attrs["gen_ai.usage.output_tokens"] == len(result.token_ids) == 16
        assert attrs["gen_ai.request.model"] and attrs["gen_ai.request.max_tokens"] == 16 and attrs["gen_ai.response.finish_reasons"] == ["FINISH_REASON_LENGTH"]
        assert sequence["attributes"]["specstream.accepted_tokens"] == result.stats.accepted_tokens
        assert root["start_ns"] <= sequence["start_ns"] and sequence["end_ns"] <= root["end_ns"] + 10**9

    steps = [s for s in spans if s["name"] == "specstream.engine_step"]
    assert steps and all(s["service"] == "specstream-target" for s in steps)
    sequence_ids = {s["span_id"] for s in spans if s["name"] == "specstream.sequence"}
    assert all({link["span_id"] for link in s["links"]} <= sequence_ids and s["links"] for s in steps)
    assert all(len(s["attributes"]["specstream.gammas"]) == s["attributes"]["specstream.batch_size"] for s in steps)
    # The γ controller's prediction beside the measured step time: made for the auto request's steps.
    assert all(s["attributes"]["specstream.step_s"] >= s["attributes"]["specstream.verify_s"] for s in steps)
    assert sum(s["attributes"]["specstream.predicted_step_s"] > 0 for s in steps) >= len(auto.token_ids) // 4
    step_ids = {s["span_id"] for s in steps}
    batches = [s for s in spans if s["name"] == "specstream.draft_propose"]
    assert batches and all(s["parent_span_id"] in step_ids for s in batches)
    assert not any("health" in s["name"].lower() for s in spans)  # health checks are never traced


def test_experiment_breaks_requests_down_from_real_traces(model_zoo, tmp_path):
    from tools import experiment
    from tools.bench.models import BenchModels

    models = BenchModels("zoo", model_zoo["target"], model_zoo["partial"], "float32")
    data = experiment.run(models, tmp_path, workload="single")
    assert data["requests"] == 16
    for row in data["per_request"]:
        parts = sum(row[c] for c in experiment.COMPONENTS)
        assert all(row[c] >= 0 for c in experiment.COMPONENTS)
        assert abs(parts - row["total"]) < 0.05 * row["total"] + 0.005  # the parts account for the total
        assert row["prefill"] > 0
        assert (row["verify"] > 0) == (row["tokens"] > 1)  # one token comes from prefill alone
    assert "gateway + network" in data["table_markdown"]
    assert (tmp_path / "experiment_single.png").stat().st_size > 1000
