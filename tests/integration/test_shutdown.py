"""SIGTERM while requests stream: in-flight requests finish within the grace period or end with
a clear UNAVAILABLE, nothing hangs, and every process exits 0."""

from __future__ import annotations

import signal
import threading

import pytest

from specstream_client import Client, Unavailable


def _stream_in_background(address: str, outcome: dict) -> tuple[threading.Thread, threading.Event]:
    started = threading.Event()

    def consume() -> None:
        try:
            with Client(address, timeout=120) as client:
                tokens = 0
                for chunk in client.generate_stream("def main():", max_new_tokens=400, ignore_eos=True):
                    tokens += len(chunk.token_ids)
                    started.set()
                    if chunk.finish_reason:
                        outcome["finished"] = tokens
        except Unavailable as exc:
            outcome["unavailable"] = str(exc)
        except Exception as exc:  # noqa: BLE001 - the test reports anything else
            outcome["other"] = repr(exc)
        finally:
            started.set()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    return thread, started


@pytest.mark.parametrize("victim", ["gateway", "target"])
def test_sigterm_during_streaming(stack_factory, model_zoo, victim):
    stack = stack_factory(model_zoo["target"], model_zoo["partial"], max_slots=2)
    outcome: dict = {}
    thread, started = _stream_in_background(stack.gateway_address, outcome)
    assert started.wait(60)
    stack.procs[victim].send_signal(signal.SIGTERM)
    thread.join(60)
    assert not thread.is_alive(), "the stream hung after SIGTERM"
    assert set(outcome) <= {"finished", "unavailable"} and outcome, outcome
    if "finished" in outcome:
        assert outcome["finished"] == 400  # finished within the grace period: complete, not cut short
    assert stack.procs[victim].wait(30) == 0
