"""The public API fuzzed through the three real processes (tiny models): a few thousand seeded
cases of broken and random gRPC requests, raw bytes and HTTP bodies, each with its expected code.
0 crashes and 0 wrong codes, and the stack serves afterwards; `specstream fuzz` is the same run
at scale on the default model (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from tools.reliability.fuzz import INVALID, OK, Case, Outcome, fuzz


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def stack(stack_factory, model_zoo, tmp_path_factory):
    """The tiny target with a chat template (ChatML), so chats and tools are fuzzed too."""
    target = tmp_path_factory.mktemp("fuzz") / "target"
    shutil.copytree(model_zoo["target"], target)
    (target / "chat_template.jinja").write_text(CHATML)
    return stack_factory(target, model_zoo["partial"], http_port=0, extra_gateway_args=["--max-new-tokens-limit", "4"])


def test_thousands_of_fuzzed_requests_get_the_right_codes_and_crash_nothing(stack, capsys) -> None:
    report = asyncio.run(fuzz(stack.gateway_address, stack.http_address, cases=3000, seed=7, quiet=True))
    assert report.cases == 3000 and report.crashes == 0 and report.wrong == 0, report.examples
    assert report.serving_after
    # every kind ran, and the invalid ones were refused, not served
    assert set(report.by_kind) == {"grpc-invalid", "grpc-valid", "grpc-bytes", "grpc-constraint", "grpc-tools",
                                   "http-invalid", "http-valid", "http-bytes", "http-tools"}
    # random constraints and tools were both served and refused
    assert report.outcomes["grpc-constraint OK"] > 0 and report.outcomes["grpc-constraint INVALID_ARGUMENT"] > 0
    assert report.outcomes["http-tools 200"] > 0 and report.outcomes["http-tools 400"] > 0
    assert report.outcomes["grpc-tools OK"] > 0 and report.outcomes["grpc-tools INVALID_ARGUMENT"] > 0
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


def test_a_hostile_draft_costs_nothing_but_plain_passes(model_zoo, tmp_path) -> None:
    """`specstream fuzz --draft-side` on the tiny pair: a draft corrupting 40% of its replies (every
    cause: another sequence's id, too many tokens, ids outside the vocabulary, a held length it
    cannot have, malformed trees, sampled rows' q tables that are not distributions) behind a real target and
    gateway. Every answer equals speculation=off (coupled sampling: sampled ones too), the target
    refused exactly the corrupted replies per cause, the clean ones were still accepted, and the
    stack serves afterwards."""
    import json
    import subprocess
    import sys

    from specstream.serving.metrics import MALFORMED_CAUSES

    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "tools.cli", "fuzz", "--draft-side", "--target",
                             str(model_zoo["target"]), "--draft", str(model_zoo["partial"]), "--dtype", "float32",
                             "--cases", "48", "--corrupt", "0.4", "--concurrency", "4", "--seed", "3", "--quiet",
                             "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "fuzz_draft_side.json").read_text())
    assert report["ok"] and report["requests"] == 48 and report["mismatches"] == report["failures"] == 0
    assert 0 < report["sampled"] < 48 and report["accepted_tokens"] > 0 and report["serving_after"]
    assert set(report["injected"]) == set(MALFORMED_CAUSES), report["injected"]  # every cause was tried
    assert report["refused"] == report["injected"]
    assert "refused by the target" in result.stdout
