"""The gateway surviving failing targets, over the real processes: a target killed with SIGKILL
or stopped with SIGSTOP while 8 greedy streams run.

- kill -9 one of two replicas: every stream completes, token for token what an uninterrupted
  greedy run gives, none duplicated or missing, usage right; the killed replica's streams
  continue on the other one;
- SIGSTOP one of two: its streams finish on the other replica once its connection's keepalive
  ping goes unanswered (1 s + 1 s); SIGCONT: it takes traffic again;
- SIGSTOP the only replica: within ~2 s its streams fail with UNAVAILABLE, new requests are
  refused at once, the gateway reports NOT_SERVING (gRPC health and HTTP /health); SIGCONT: it
  serves again.

Each test prints what it measured (detection latency, time to resume) for `pytest -s`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specstream_client import AsyncClient, Unavailable
from specstream_pb import generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.timeout(240)

MAX_NEW = 400  # long enough that every stream is mid-generation when its replica fails
STREAMS = 8
IN_FLIGHT_S = 1.0  # a chunk already on its way when a replica fails reaches the caller within this


@dataclass
class Stream:
    """What one caller saw: tokens, when each chunk came, and how it ended."""

    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # time.monotonic() of each chunk with tokens
    final: object = None  # the last chunk (finish_reason, usage)
    error: Exception | None = None
    ended: float = 0.0

    def pause_after(self, t: float) -> tuple[float, float]:
        """(seconds from `t` to the chunk that ended the longest pause beginning at most
        IN_FLIGHT_S after `t`, that pause): for a stream whose replica failed at `t`, when it
        resumed. A chunk already on its way at `t` may come first, so the first chunk after `t`
        would not tell; and a pause that begins later is not the failure's (a loaded machine once
        held the replica the streams had moved to for 0.4 s, 5.8 s after the kill: counted, it
        read as a 6.2-s resumption)."""
        points = [t, *(x for x in self.times if x > t)]
        assert len(points) > 1, "no chunk after the failure"
        starts = [k for k in range(len(points) - 1) if points[k] - t <= IN_FLIGHT_S]
        i = max(starts, key=lambda k: points[k + 1] - points[k])
        return points[i + 1] - t, points[i + 1] - points[i]


async def _consume(client: AsyncClient, prompt: str, out: Stream) -> None:
    try:
        async for chunk in client.generate_stream(prompt, max_new_tokens=MAX_NEW, ignore_eos=True):
            if chunk.token_ids:
                out.tokens += chunk.token_ids
                out.times.append(time.monotonic())
            if chunk.finish_reason:
                out.final = chunk
    except Unavailable as exc:
        out.error = exc
    out.ended = time.monotonic()


async def _model_info(address: str) -> generation_pb2.ModelInfo:
    async with grpc.aio.insecure_channel(address) as channel:
        return await generation_pb2_grpc.GenerationStub(channel).GetModelInfo(generation_pb2.GetModelInfoRequest(),
                                                                              timeout=10)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _http_health(address: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


async def _reference(address: str, prompts: list[str]) -> list[tuple[list[int], int]]:
    """Uninterrupted plain greedy (speculation off): (token ids, prompt tokens) per prompt."""
    async with AsyncClient(address, timeout=120) as client:
        results = await asyncio.gather(*[client.generate(p, max_new_tokens=MAX_NEW, speculation="off",
                                                         ignore_eos=True) for p in prompts])
    return [(r.token_ids, r.usage.prompt_tokens) for r in results]


async def _run_and_fail(address: str, prompts: list[str], fail, min_tokens: int = 8):
    """Streams every prompt; once each has `min_tokens` tokens and both replicas run some, calls
    `fail()` and returns (streams, when it was called, ModelInfo just before)."""
    streams = [Stream() for _ in prompts]
    async with AsyncClient(address, timeout=120) as client:
        tasks = [asyncio.create_task(_consume(client, p, s)) for p, s in zip(prompts, streams)]
        deadline = time.monotonic() + 60
        while True:
            info = await _model_info(address)
            if all(len(s.tokens) >= min_tokens for s in streams) and all(r.running for r in info.replicas):
                break
            assert not any(s.final for s in streams), "a stream finished before the failure: make them longer"
            assert time.monotonic() < deadline, f"streams never all started: {[len(s.tokens) for s in streams]}"
            await asyncio.sleep(0.01)
        failed_at = time.monotonic()
        fail()
        await asyncio.gather(*tasks)
    return streams, failed_at, info


def _assert_exact(streams: list[Stream], reference: list[tuple[list[int], int]]) -> None:
    for i, (stream, (want, prompt_tokens)) in enumerate(zip(streams, reference)):
        assert stream.error is None, f"stream {i} failed: {stream.error}"
        assert stream.tokens == want, f"stream {i}: first difference at token " \
            f"{next((k for k, (a, b) in enumerate(zip(stream.tokens, want)) if a != b), min(len(stream.tokens), len(want)))}"
        assert stream.final.finish_reason == "length"
        assert (stream.final.usage.prompt_tokens, stream.final.usage.completion_tokens) == (prompt_tokens, MAX_NEW)


def _split_pauses(streams: list[Stream], failed_at: float, moved: int) -> tuple[list[float], float]:
    """The `moved` streams are those with the longest pause the failure caused (``Stream.pause_after``):
    (seconds from the failure to each one's resumption, the longest such pause of any other stream)."""
    pauses = sorted((s.pause_after(failed_at) for s in streams), key=lambda p: p[1])
    return [p[0] for p in pauses[len(pauses) - moved:]], max((p[1] for p in pauses[:len(pauses) - moved]), default=0.0)


def _wait_back(address: str, index: int, timeout_s: float = 60) -> float:
    """Seconds until replica `index` is connected and serving again in the gateway's view, and
    reports none of the sequences it held when it failed (a target that resumes drops them when it
    sees its old stream gone; until its Load says so the router counts them against its room)."""
    start = time.monotonic()
    while True:
        replica = asyncio.run(_model_info(address)).replicas[index]
        if replica.connected and replica.serving and replica.running == 0:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, f"replica {index} not back after {timeout_s}s: {replica}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def pair(stack_factory, model_zoo):
    """Two targets sharing one draft, each with slots for all 8 streams, so the survivor of a
    failure takes the moved streams at once (with fewer, they would wait for its slots)."""
    return stack_factory(model_zoo["target"], model_zoo["partial"], max_slots=STREAMS, target_replicas=2,
                         calibrate=False)


def test_kill_9_of_a_replica_loses_no_stream_and_changes_no_token(pair):
    prompts = [f"def kill{i}(x):" for i in range(STREAMS)]
    reference = asyncio.run(_reference(pair.gateway_address, prompts))
    victim = pair.procs["target-1"]
    try:
        streams, killed_at, before = asyncio.run(_run_and_fail(pair.gateway_address, prompts, victim.kill))
        victim.wait(10)
        _assert_exact(streams, reference)
        after = asyncio.run(_model_info(pair.gateway_address))
        moved = after.replicas[1].resumed - before.replicas[1].resumed
        assert moved >= 1 and moved == before.replicas[1].running, (before.replicas[1], after.replicas[1])
        resumed, others = _split_pauses(streams, killed_at, moved)
        print(f"\nkill -9: {moved} streams resumed on the other replica {min(resumed) * 1000:.0f}-"
              f"{max(resumed) * 1000:.0f} ms after the kill (the other streams' longest pause: {others * 1000:.0f} ms)")
        assert max(resumed) < 10, resumed
    finally:  # back on its old address, for the next test and a clean stop, whatever this test found
        try:
            victim.wait(10)
        except subprocess.TimeoutExpired:
            pass  # never killed (the streams failed to start): it still serves
        else:
            pair.restart("target-1")
    _wait_back(pair.gateway_address, 1)


def test_sigstop_of_a_replica_moves_its_streams_and_sigcont_brings_it_back(pair):
    _wait_back(pair.gateway_address, 1)
    prompts = [f"def stop{i}(x):" for i in range(STREAMS)]
    reference = asyncio.run(_reference(pair.gateway_address, prompts))
    victim = pair.procs["target-1"]
    try:
        streams, stopped_at, before = asyncio.run(
            _run_and_fail(pair.gateway_address, prompts, lambda: os.kill(victim.pid, signal.SIGSTOP)))
        _assert_exact(streams, reference)
        after = asyncio.run(_model_info(pair.gateway_address))
        assert _health(pair.gateway_address) == health_pb2.HealthCheckResponse.SERVING  # target still serves
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    # Dropped by keepalive (a ping every 1 s, unanswered for 1 s); the step watchdog, whose floor is
    # 5 s, is for an engine that stops stepping in a live process (test_gateway_failover.py).
    assert after.replicas[1].resumed - before.replicas[1].resumed == before.replicas[1].running
    moved = after.replicas[1].resumed - before.replicas[1].resumed
    resumed, others = _split_pauses(streams, stopped_at, moved)
    print(f"\nSIGSTOP: {moved} streams of the stopped replica continued on the other {min(resumed):.2f}-"
          f"{max(resumed):.2f} s after the stop (the other streams' longest pause: {others * 1000:.0f} ms)")
    assert max(resumed) < 6, resumed  # ~1-2 s by design (gRPC's own ping timeout alone would take 60 s)
    back_s = _wait_back(pair.gateway_address, 1)
    routed = asyncio.run(_model_info(pair.gateway_address)).replicas[1].routed
    again = asyncio.run(_reference(pair.gateway_address, prompts[:4]))
    assert again == reference[:4]
    assert asyncio.run(_model_info(pair.gateway_address)).replicas[1].routed > routed, "not used again"
    print(f"SIGCONT: replica back in use after {back_s:.1f} s")


@pytest.fixture(scope="module")
def single(stack_factory, model_zoo):
    return stack_factory(model_zoo["target"], model_zoo["partial"], max_slots=4, http_port=0, calibrate=False)


def test_sigstop_of_the_only_replica_fails_fast_and_sigcont_recovers(single):
    prompts = [f"def only{i}(x):" for i in range(4)]
    victim = single.procs["target"]
    streams = [Stream() for _ in prompts]

    async def main():
        async with AsyncClient(single.gateway_address, timeout=120) as client:
            tasks = [asyncio.create_task(_consume(client, p, s)) for p, s in zip(prompts, streams)]
            deadline = time.monotonic() + 60
            while not all(len(s.tokens) >= 8 for s in streams):
                assert time.monotonic() < deadline and not any(s.final for s in streams)
                await asyncio.sleep(0.01)
            stopped_at = time.monotonic()
            os.kill(victim.pid, signal.SIGSTOP)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            refused_at = time.monotonic()
            with pytest.raises(Unavailable) as refused:
                await client.generate("late", max_new_tokens=4)
            return stopped_at, time.monotonic() - refused_at, refused.value

    try:
        stopped_at, refusal_s, refusal = asyncio.run(main())
        grpc_health = _health(single.gateway_address)
        http_health = _http_health(single.http_address)
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    detection = [s.ended - stopped_at for s in streams]
    print(f"\nSIGSTOP of the only target: streams failed with UNAVAILABLE after {min(detection):.2f}-"
          f"{max(detection):.2f} s; a new request refused in {refusal_s * 1000:.0f} ms")
    for s in streams:  # the watchdog or keepalive (a ping every 1 s, unanswered for 1 s), whichever is first
        assert isinstance(s.error, Unavailable), s.error
        assert "hung" in s.error.details or "ping timeout" in s.error.details, s.error.details
    assert max(detection) < 5, detection  # ~1-2 s by design (a ping every 1 s, unanswered for 1 s)
    # Refused at once, not queued for capacity that is not there (one round trip; a loaded machine's slack)
    assert refusal_s < 3 and "no target replica is serving" in refusal.details
    assert grpc_health == health_pb2.HealthCheckResponse.NOT_SERVING and http_health == 503
    back_s = _wait_back(single.gateway_address, 0)
    assert _health(single.gateway_address) == health_pb2.HealthCheckResponse.SERVING
    assert _http_health(single.http_address) == 200

    async def after():
        async with AsyncClient(single.gateway_address, timeout=60) as client:
            return await client.generate(prompts[0], max_new_tokens=16, ignore_eos=True)

    assert asyncio.run(after()).usage.completion_tokens == 16
    print(f"SIGCONT: serving again after {back_s:.1f} s")
