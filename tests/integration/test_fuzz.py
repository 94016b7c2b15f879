"""The public API fuzzed through the three real processes (tiny models): a few thousand seeded
cases of broken and random gRPC requests, raw bytes and HTTP bodies, each with its expected code.
0 crashes and 0 wrong codes, and the stack serves afterwards; `specstream fuzz` is the same run
at scale on the default model (docs/reliability.md)."""

from __future__ import annotations

import asyncio

import pytest

from specstream.tools.reliability.fuzz import INVALID, OK, Case, Outcome, fuzz


@pytest.fixture(scope="module")
def stack(stack_factory, model_zoo):
    return stack_factory(model_zoo["target"], model_zoo["partial"], http_port=0,
                         extra_gateway_args=["--max-new-tokens-limit", "4"])


def test_thousands_of_fuzzed_requests_get_the_right_codes_and_crash_nothing(stack, capsys) -> None:
    report = asyncio.run(fuzz(stack.gateway_address, stack.http_address, cases=3000, seed=7, quiet=True))
    assert report.cases == 3000 and report.crashes == 0 and report.wrong == 0, report.examples
    assert report.serving_after
    # every kind ran, and the invalid ones were refused, not served
    assert set(report.by_kind) == {"grpc-invalid", "grpc-valid", "grpc-bytes", "http-invalid", "http-valid",
                                   "http-bytes"}
    assert report.outcomes.get("grpc-invalid OK", 0) == report.outcomes.get("http-invalid 200", 0) == 0
    assert report.outcomes["grpc-valid OK"] == report.by_kind["grpc-valid"]
    assert stack.alive()  # no process died
    # its progress: plain lines on stderr, the last one at every case
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fuzz: ")]
    assert progress[0].startswith("fuzz: 0/3000 cases (0%)") and progress[-1].startswith("fuzz: 3000/3000 cases (100%)")


def test_the_oracle_flags_wrong_codes_wrong_fields_and_crashes() -> None:
    invalid = Case("grpc-invalid", b"", frozenset([INVALID]), "top_p")
    assert not Outcome(invalid, INVALID, "top_p", 0.0).wrong
    assert Outcome(invalid, INVALID, "temperature", 0.0).wrong  # the wrong field named
    assert Outcome(invalid, OK, None, 0.0).wrong  # served what it should have refused
    assert Outcome(invalid, "INTERNAL", None, 0.0).crash
    assert Outcome(Case("http-valid", b"", frozenset(["200"])), "502", None, 0.0).crash
