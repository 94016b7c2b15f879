"""Prometheus /metrics of the three real processes: every documented name is there, the counters
move in step with what the requests report, and the gauges follow a request in flight."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specstream_client import AsyncClient, Client

# What each service must expose, with its Prometheus type (docs/observability.md).
EXPECTED = {
    "gateway": {
        "specstream:time_to_first_token_seconds": "histogram",
        "specstream:inter_token_latency_seconds": "histogram",
        "specstream:e2e_request_latency_seconds": "histogram",
        "specstream:request_queue_time_seconds": "histogram",
        "specstream:num_requests_running": "gauge",
        "specstream:num_requests_waiting": "gauge",
        "specstream:generation_tokens_total": "counter",
        "specstream:prompt_tokens_total": "counter",
        "specstream:request_success_total": "counter",
    },
    "target": {
        "specstream:num_requests_running": "gauge",
        "specstream:num_requests_waiting": "gauge",
        "specstream:spec_decode_num_drafts_total": "counter",
        "specstream:spec_decode_num_draft_tokens_total": "counter",
        "specstream:spec_decode_num_accepted_tokens_total": "counter",
        "specstream:spec_decode_num_accepted_tokens_per_pos_total": "counter",
        "specstream:batch_occupancy": "histogram",
        "specstream:engine_steps_total": "counter",
        "specstream:decode_pass_seconds_total": "counter",
        "specstream:decode_passes_total": "counter",
        "specstream:draft_replies_malformed_total": "counter",
        "specstream:spec_decode_gamma": "histogram",
        "specstream:spec_decode_branches": "histogram",
        "specstream:spec_decode_num_branch_tokens_total": "counter",
        "specstream:gamma_controller_alpha": "gauge",
        "specstream:gamma_controller_cost_seconds": "gauge",
        "specstream:gamma_controller_predicted_step_seconds": "gauge",
        "specstream:gamma_controller_measured_step_seconds": "gauge",
    },
    "draft": {
        "specstream:draft_propose_seconds": "histogram",
        "specstream:draft_sequences": "gauge",
    },
}
MAX_GAMMA = 8  # stack_factory's


class Scrape:
    """One GET of a service's /metrics: sample values by name and labels, and family types."""

    def __init__(self, address: str) -> None:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
            assert reply.status == 200
            text = reply.read().decode()
        self.types: dict[str, str] = {}
        self.samples: dict[tuple[str, frozenset], float] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name + ("_total" if family.type == "counter" else "")] = family.type
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def __call__(self, name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        assert key in self.samples, f"{name}{labels} not exported"
        return self.samples[key]


def _scrape_all(stack) -> dict[str, Scrape]:
    return {name: Scrape(address) for name, address in stack.metrics_addresses.items()}


@pytest.fixture(scope="module")
def stack(stack_factory, model_zoo):
    return stack_factory(model_zoo["target"], model_zoo["partial"], max_slots=4, metrics=True)


def test_every_service_exposes_its_documented_metrics(stack):
    assert set(stack.metrics_addresses) == {"draft", "target", "gateway"}
    assert len(set(stack.metrics_addresses.values())) == 3
    scrapes = _scrape_all(stack)
    for service, expected in EXPECTED.items():
        types = scrapes[service].types
        missing = {name: kind for name, kind in expected.items() if types.get(name) != kind}
        assert not missing, f"{service} lacks {missing}; has {sorted(types)}"
    target = scrapes["target"]
    for position in range(1, MAX_GAMMA + 1):
        target("specstream:spec_decode_num_accepted_tokens_per_pos_total", position=str(position))
    for reason in ("length", "stop", "eos"):
        scrapes["gateway"]("specstream:request_success_total", finish_reason=reason)


def test_counters_move_with_the_requests(stack):
    prompts = ["def main():", "import os", "class A:", "x = 1", "for i in range(3):", "The weather"]
    with Client(stack.gateway_address, timeout=60) as client:
        probe = client.generate("return None", max_new_tokens=24, speculation=4, ignore_eos=True)
    stop_id = probe.token_ids[5]

    before = _scrape_all(stack)

    async def run():
        async with AsyncClient(stack.gateway_address, timeout=120) as client:
            plain = [client.generate(p, max_new_tokens=24 + i, speculation=4, ignore_eos=True)
                     for i, p in enumerate(prompts)]
            stopped = client.generate("return None", max_new_tokens=24, speculation=4, ignore_eos=True,
                                      stop_token_ids=[stop_id])
            return await asyncio.gather(*plain, stopped)

    results = asyncio.run(run())
    after = _scrape_all(stack)

    def delta(service: str, name: str, **labels: str) -> float:
        return after[service](name, **labels) - before[service](name, **labels)

    assert [r.finish_reason for r in results] == ["length"] * len(prompts) + ["stop"]
    assert results[-1].token_ids == probe.token_ids[: probe.token_ids.index(stop_id) + 1]

    # Gateway: tokens and requests as the callers got them; the histograms saw the same timings.
    n = len(results)
    completion = sum(r.usage.completion_tokens for r in results)
    assert delta("gateway", "specstream:generation_tokens_total") == completion
    assert delta("gateway", "specstream:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in results)
    assert delta("gateway", "specstream:request_success_total", finish_reason="length") == len(prompts)
    assert delta("gateway", "specstream:request_success_total", finish_reason="stop") == 1
    assert delta("gateway", "specstream:request_success_total", finish_reason="eos") == 0
    for name, field in [("e2e_request_latency_seconds", "total_seconds"),
                        ("time_to_first_token_seconds", "time_to_first_token_seconds"),
                        ("request_queue_time_seconds", "queue_seconds")]:
        assert delta("gateway", f"specstream:{name}_count") == n
        assert delta("gateway", f"specstream:{name}_sum") == pytest.approx(
            sum(getattr(r.timings, field) for r in results), rel=1e-6, abs=1e-9)
    # One inter-token observation per token after each request's first chunk, covering the time
    # from the first chunk to the last.
    itl_count = delta("gateway", "specstream:inter_token_latency_seconds_count")
    assert 0 < itl_count <= completion - n
    assert delta("gateway", "specstream:inter_token_latency_seconds_sum") == pytest.approx(
        sum(r.timings.total_seconds - r.timings.time_to_first_token_seconds for r in results), rel=1e-6)

    # Target: speculation counters equal the sums of the per-request stats.
    draft_tokens = delta("target", "specstream:spec_decode_num_draft_tokens_total")
    accepted = delta("target", "specstream:spec_decode_num_accepted_tokens_total")
    assert draft_tokens == sum(r.stats.draft_tokens for r in results) > 0
    assert accepted == sum(r.stats.accepted_tokens for r in results) > 0
    assert accepted <= draft_tokens
    per_pos = [delta("target", "specstream:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(1, MAX_GAMMA + 1)]
    assert sum(per_pos) == accepted
    assert per_pos[0] > 0 and all(later == 0 for later in per_pos[4:])  # gamma 4: positions 1-4 only
    assert per_pos == sorted(per_pos, reverse=True)
    drafts = delta("target", "specstream:spec_decode_num_drafts_total")
    assert 0 < drafts <= sum(r.stats.target_passes - 1 for r in results)
    # Every decode pass of every request is one row of one step.
    steps = delta("target", "specstream:engine_steps_total")
    assert delta("target", "specstream:batch_occupancy_count") == steps > 0
    assert delta("target", "specstream:batch_occupancy_sum") == sum(r.stats.target_passes - 1 for r in results)
    assert delta("target", "specstream:batch_occupancy_bucket", le="4.0") == steps  # max_slots 4
    # The γ of every row of every decode step, and the requests' own γ histograms, agree.
    passes = sum(r.stats.target_passes - 1 for r in results)
    assert delta("target", "specstream:spec_decode_gamma_count") == passes
    assert delta("target", "specstream:spec_decode_gamma_sum") == draft_tokens
    assert sum(sum(r.stats.gamma_histogram) for r in results) == passes
    assert sum(g * n for r in results for g, n in enumerate(r.stats.gamma_histogram)) == draft_tokens
    # Trees (the controller buys branches where a verify position is cheap): the same on both sides.
    assert delta("target", "specstream:spec_decode_branches_sum") == sum(
        b * n for r in results for b, n in enumerate(r.stats.branch_histogram))
    assert delta("target", "specstream:spec_decode_num_branch_tokens_total") == sum(r.stats.branch_tokens
                                                                                   for r in results)
    assert 0 < after["target"]("specstream:gamma_controller_alpha", proposer="model", kind="greedy") < 1

    # Draft: at most one ProposeBatch per step; everything released once the requests finished.
    assert 0 < delta("draft", "specstream:draft_propose_seconds_count") <= steps
    assert after["draft"]("specstream:draft_sequences") == 0
    assert after["target"]("specstream:num_requests_running") == 0
    # the forwards' thread count: between 1 and a thread per core (thread_governor.py)
    assert 1 <= after["target"]("specstream:forward_threads") <= (os.cpu_count() or 1)


def _wait_for(stack, check, timeout_s: float = 10.0) -> dict[str, Scrape]:
    deadline = time.monotonic() + timeout_s
    while True:
        scrapes = _scrape_all(stack)
        if check(scrapes) or time.monotonic() > deadline:
            return scrapes
        time.sleep(0.05)


def _idle(s: dict[str, Scrape]) -> bool:
    return (s["gateway"]("specstream:num_requests_running") == 0 and s["target"]("specstream:num_requests_running") == 0
            and s["draft"]("specstream:draft_sequences") == 0)


def test_gauges_follow_a_request_in_flight(stack):
    assert _idle(_wait_for(stack, _idle))
    with Client(stack.gateway_address, timeout=60) as client:
        stream = client.generate_stream("def main():", max_new_tokens=400, speculation=4, ignore_eos=True)
        next(iter(stream))
        next(iter(stream))
        busy = _scrape_all(stack)
        stream.cancel()
    assert busy["gateway"]("specstream:num_requests_running") == 1
    assert busy["gateway"]("specstream:num_requests_waiting") == 0
    assert busy["target"]("specstream:num_requests_running") == 1
    assert busy["target"]("specstream:num_requests_waiting") == 0
    assert busy["draft"]("specstream:draft_sequences") == 1
    assert _idle(_wait_for(stack, _idle))


def test_services_run_in_the_callers_session_in_a_process_group_of_their_own(stack):
    """A process group of their own keeps a terminal's Ctrl-C for the launcher, which stops them in
    order; the caller's session keeps them in its scheduling group (autogroup), where `nice` ranks a
    low-priority neighbour below them (docs/benchmarks.md, "A noisy host")."""
    import os

    for name, proc in stack.procs.items():
        assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0), name
        assert os.getsid(proc.pid) == os.getsid(0), name
