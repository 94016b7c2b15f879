"""Where a decode pass's time goes, by the target engine's own clock, read from its Prometheus
``/metrics`` (``specstream:decode_pass_seconds{part}`` and ``specstream:decode_passes``,
specstream/serving/metrics.py): the compute call (``target``: the layers, the output layer,
verification), waiting for the draft's proposals (``draft``) and the engine's host work around
them (``host``), over the passes that prefilled nothing.

``read_counters(address)`` takes one reading; ``per_pass_ms(before, after)`` the mean ms per pass
of each part between two readings. What it does not know: which requests ran between them.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from specstream.serving.metrics import PASS_PARTS, PREFIX

__all__ = ["metric_samples", "per_pass_ms", "read_counters"]


def metric_samples(address: str, name: str, timeout_s: float = 10.0) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called ``name`` that the process at ``address`` (host:port of
    its /metrics) exports now."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as reply:
        text = reply.read().decode()
    return [(sample.labels, sample.value) for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name]


def read_counters(address: str) -> dict[str, float]:
    """{"passes": n, part: seconds for each PASS_PARTS} from the target at ``address`` (host:port of its /metrics)."""
    counters = dict.fromkeys(("passes", *PASS_PARTS), 0.0)
    for _, value in metric_samples(address, f"{PREFIX}decode_passes_total"):
        counters["passes"] = value
    for labels, value in metric_samples(address, f"{PREFIX}decode_pass_seconds_total"):
        if labels.get("part") in PASS_PARTS:
            counters[labels["part"]] = value
    return counters


def per_pass_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """Mean ms per pass of each part between two readings, with "passes" (how many); None without a pass."""
    passes = after["passes"] - before["passes"]
    if passes <= 0:
        return None
    return {"passes": passes, **{part: 1000 * (after[part] - before[part]) / passes for part in PASS_PARTS}}
