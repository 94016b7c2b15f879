"""specstream/serving/metrics.py: the hooks count what they are told, the engine's counters agree with its
sequences' own stats, every exported metric is documented (and nothing documented is missing), and
the HTTP endpoint serves a service's registry."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import pytest
from tests.support.engine_harness import speculation
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from draft_service.proposer import DraftProposer
from specstream.data.config import ModelSpec, ServerConfig, TargetConfig
from specstream.data.engine import SequenceEvent, SequenceRequest
from specstream.models.loader import load_model
from specstream.serving.metrics import (
    DraftMetrics,
    GatewayMetrics,
    TargetMetrics,
    finish_reason_label,
    occupancy_buckets,
    start_metrics_server,
)
from specstream_pb import common_pb2, generation_pb2
from target_service.connection import Connection
from target_service.engine import Engine
from target_service.local_draft import LocalDraft

DOC = Path(__file__).resolve().parents[1] / "docs" / "observability.md"


def _exported(registry: CollectorRegistry) -> dict[str, str]:
    """Exposition name -> type, as a scrape shows them (counters end in _total)."""
    return {family.name + ("_total" if family.type == "counter" else ""): family.type
            for family in registry.collect()}


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, f"{name}{labels} not exported"
    return value


def test_target_hooks_count_steps_proposals_and_positions():
    m = TargetMetrics(max_gamma=4, max_batch=8)
    r = m.registry
    m.observe_accept(proposed=4, accepted=2)
    m.observe_accept(proposed=3, accepted=3)
    m.observe_accept(proposed=0, accepted=0)  # a plain pass: no draft
    m.observe_accept(proposed=4, accepted=0)
    for rows in (1, 3, 8):
        m.observe_step(rows)
    assert _value(r, "specstream:spec_decode_num_drafts_total") == 3
    assert _value(r, "specstream:spec_decode_num_draft_tokens_total") == 11
    assert _value(r, "specstream:spec_decode_num_accepted_tokens_total") == 5
    per_pos = [_value(r, "specstream:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(1, 5)]
    assert per_pos == [2, 2, 1, 0]  # position 4 exported at 0 before any acceptance there
    assert _value(r, "specstream:engine_steps_total") == 3
    assert _value(r, "specstream:batch_occupancy_count") == 3
    assert _value(r, "specstream:batch_occupancy_sum") == 12
    assert _value(r, "specstream:batch_occupancy_bucket", le="2.0") == 1
    assert _value(r, "specstream:batch_occupancy_bucket", le="3.0") == 2


def test_occupancy_buckets_are_exact_for_small_batches():
    assert occupancy_buckets(1) == (1,)
    assert occupancy_buckets(8) == tuple(range(1, 9))
    assert occupancy_buckets(100) == (*range(1, 17), 32, 64, 100)


def test_gateway_observer_per_token_gaps_and_finished_requests():
    m = GatewayMetrics()
    r = m.registry
    obs = m.request()
    obs.tokens(1, now=10.0)  # the first token: no gap yet
    obs.tokens(0, now=10.1)  # a chunk without tokens changes nothing
    obs.tokens(4, now=10.2)  # 0.2 s for 4 tokens: 0.05 s each
    obs.tokens(1, now=10.5)
    final = generation_pb2.GenerateStreamResponse(finish_reason=common_pb2.FINISH_REASON_EOS)
    final.usage.prompt_tokens, final.usage.completion_tokens = 7, 6
    final.timings.queue_seconds, final.timings.time_to_first_token_seconds, final.timings.total_seconds = 0.5, 1.0, 1.5
    obs.finished(final)
    assert _value(r, "specstream:generation_tokens_total") == 6
    assert _value(r, "specstream:prompt_tokens_total") == 7
    assert _value(r, "specstream:inter_token_latency_seconds_count") == 5
    assert _value(r, "specstream:inter_token_latency_seconds_sum") == pytest.approx(0.5)
    assert _value(r, "specstream:inter_token_latency_seconds_bucket", le="0.05") == 4
    assert _value(r, "specstream:request_success_total", finish_reason="eos") == 1
    assert _value(r, "specstream:request_success_total", finish_reason="length") == 0
    assert _value(r, "specstream:time_to_first_token_seconds_sum") == 1.0
    assert _value(r, "specstream:e2e_request_latency_seconds_sum") == 1.5
    assert _value(r, "specstream:request_queue_time_seconds_sum") == 0.5


def test_gateway_gauges_read_the_queue_when_scraped():
    m = GatewayMetrics()
    state = {"in_flight": 5, "queued": 2}
    m.watch_requests(in_flight=lambda: state["in_flight"], queued=lambda: state["queued"])
    assert _value(m.registry, "specstream:num_requests_running") == 3
    assert _value(m.registry, "specstream:num_requests_waiting") == 2
    state.update(in_flight=0, queued=0)
    assert _value(m.registry, "specstream:num_requests_running") == 0


def test_draft_times_each_batch_and_reads_held_sequences():
    m = DraftMetrics()
    held = [3]
    m.watch_sequences(held=lambda: held[0])
    with m.time_propose():
        pass
    with m.time_propose():
        pass
    assert _value(m.registry, "specstream:draft_propose_seconds_count") == 2
    assert _value(m.registry, "specstream:draft_sequences") == 3


def test_finish_reason_labels():
    assert [finish_reason_label(v) for v in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP,
                                             common_pb2.FINISH_REASON_EOS)] == ["length", "stop", "eos"]


def test_every_metric_is_documented_with_its_service_and_type():
    """docs/observability.md has one table row per metric: | `name` | type | labels | service |."""
    rows = re.findall(r"^\| `(specstream:[a-z0-9_]+)` \| (\w+) \| [^|]* \| (\w+) \|", DOC.read_text(), re.MULTILINE)
    documented = {(name, service): kind for name, kind, service in rows}
    exported = {}
    for service, metrics in [("gateway", GatewayMetrics()), ("target", TargetMetrics(8, 8)), ("draft", DraftMetrics())]:
        exported.update({(name, service): kind for name, kind in _exported(metrics.registry).items()})
    assert documented == exported


def test_engine_counters_agree_with_its_sequences(model_zoo):
    """Through the real engine and draft: the counters equal the sums of the sequences' own stats,
    also when a stop id cuts an accepted run short; per-position counts add up to the accepted."""
    model = load_model(model_zoo["target"])
    proposer = DraftProposer(load_model(model_zoo["partial"]), 8, 512)
    config = TargetConfig(model=ModelSpec(str(model_zoo["target"])), max_slots=2, max_seq_len=512, max_gamma=8)
    engine = Engine(model, config, LocalDraft(proposer))
    r = engine.metrics.registry
    requests = [SequenceRequest(str(i), [0, 5 + i, 6, 7 * i % 50 + 2], 30, speculation=speculation(gamma),
                                stop_token_ids=frozenset([17] if i % 2 else []))
                for i, gamma in enumerate([8, 4, 1, 0, 6])]

    async def main() -> dict[str, SequenceEvent]:
        conn = Connection()
        engine.attach(conn)
        engine.submit(conn, requests)
        # Five submitted, two slots, nothing admitted before the first step.
        assert _value(r, "specstream:num_requests_waiting") == 5
        assert _value(r, "specstream:num_requests_running") == 0
        task = asyncio.create_task(engine.run())
        final: dict[str, SequenceEvent] = {}
        while len(final) < len(requests):
            message = await asyncio.wait_for(conn.outbox.get(), 60)
            final.update({e.id: e for e in message.events if e.finish_reason})
        task.cancel()
        return final

    final = asyncio.run(main())
    stats = [e.stats for e in final.values()]
    assert _value(r, "specstream:spec_decode_num_draft_tokens_total") == sum(s.draft_tokens for s in stats) > 0
    accepted = _value(r, "specstream:spec_decode_num_accepted_tokens_total")
    assert accepted == sum(s.accepted_tokens for s in stats) > 0
    per_pos = [_value(r, "specstream:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(1, 9)]
    assert sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # position i+1 is accepted only after position i
    assert _value(r, "specstream:batch_occupancy_sum") == sum(s.target_passes - 1 for s in stats)
    assert _value(r, "specstream:engine_steps_total") == engine.stats.steps
    assert _value(r, "specstream:batch_occupancy_count") == engine.stats.steps
    # The per-pass breakdown: the engine's steady passes, whose parts add up to their time.
    timings = engine.timings
    assert _value(r, "specstream:decode_passes_total") == timings.decode_steps > 0
    parts = {part: _value(r, "specstream:decode_pass_seconds_total", part=part) for part in ("target", "draft", "host")}
    assert parts["target"] == pytest.approx(timings.decode_compute_s) and parts["target"] > 0
    assert parts["draft"] == pytest.approx(timings.decode_draft_s) and parts["draft"] > 0
    assert sum(parts.values()) == pytest.approx(timings.decode_s)
    assert _value(r, "specstream:num_requests_running") == 0
    assert _value(r, "specstream:num_requests_waiting") == 0


def test_metrics_endpoint_serves_the_registry_and_closes():
    m = GatewayMetrics()
    m.generation_tokens.inc(3)
    server = start_metrics_server(m.registry, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as reply:
            assert reply.status == 200
            text = reply.read().decode()
    finally:
        server.close()
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["specstream:generation_tokens_total"] == 3
    assert "specstream:draft_propose_seconds_count" not in samples  # another service's registry
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(metrics_port=70000), "metrics_port=70000"),
    (dict(metrics_port=-1), "metrics_port=-1"),
    (dict(port=9000, metrics_port=9000), "metrics_port=9000"),
])
def test_metrics_port_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerConfig(**kwargs)
    ServerConfig(metrics_port=0)
    ServerConfig(metrics_port=None)
