"""The gateway's bounded queue and its routing across target replicas, over the real processes:
overload is refused at once and what is admitted is exact; two replicas share the traffic; killing
one mid-run loses no request (tests/integration/test_failover.py goes further)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from specstream_client import AsyncClient, Overloaded, Unavailable
from specstream_pb import generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.timeout(180)


async def _model_info(address: str) -> generation_pb2.ModelInfo:
    async with grpc.aio.insecure_channel(address) as channel:
        return await generation_pb2_grpc.GenerationStub(channel).GetModelInfo(generation_pb2.GetModelInfoRequest(),
                                                                              timeout=10)


async def _reference(address: str, prompts: list[str], max_new_tokens: int, at_once: int) -> list[list[int]]:
    """Plain greedy (speculation off) token ids, `at_once` requests at a time so none is refused."""
    ids = []
    async with AsyncClient(address, timeout=120) as client:
        for start in range(0, len(prompts), at_once):
            results = await asyncio.gather(*[client.generate(p, max_new_tokens=max_new_tokens, speculation="off",
                                                             ignore_eos=True) for p in prompts[start:start + at_once]])
            ids += [r.token_ids for r in results]
    return ids


def test_a_burst_beyond_slots_and_queue_is_refused_at_once_and_the_rest_is_exact(stack_factory, model_zoo):
    # 2 slots + a backlog of 2 on the target, 4 waiting in the gateway: 8 of the 20 get in.
    stack = stack_factory(model_zoo["target"], model_zoo["partial"], max_slots=2,
                          extra_gateway_args=["--max-queue", "4"])
    prompts = [f"request {i}: x = {i}" for i in range(20)]
    max_new = 128  # long enough that nothing admitted finishes while the burst arrives

    async def one(client: AsyncClient, prompt: str):
        start = time.monotonic()
        try:
            # A fixed γ: the check below is that the served requests really speculated (under
            # automatic γ the controller may rightly decide a full batch should not).
            result = await client.generate(prompt, max_new_tokens=max_new, ignore_eos=True, speculation=4)
        except Overloaded as exc:
            result = exc
        return result, time.monotonic() - start

    async def burst():
        async with AsyncClient(stack.gateway_address, timeout=120) as client:
            return await asyncio.gather(*[one(client, p) for p in prompts])

    outcomes = asyncio.run(burst())
    refused = [(i, seconds, r) for i, (r, seconds) in enumerate(outcomes) if isinstance(r, Overloaded)]
    served = [(i, seconds, r) for i, (r, seconds) in enumerate(outcomes) if not isinstance(r, Overloaded)]
    assert len(served) == 8 and len(refused) == 12, f"served {[i for i, _, _ in served]}"
    for _, seconds, exc in refused:
        assert "max_queue=4" in exc.details, exc.details
        assert seconds < min(s for _, s, _ in served), "a refusal waited for capacity"
    reference = asyncio.run(_reference(stack.gateway_address, [prompts[i] for i, _, _ in served], max_new, at_once=4))
    for (i, _, result), want in zip(served, reference):
        assert result.token_ids == want, f"request {i}"
        assert result.stats.draft_tokens > 0
    # Queue time is the gateway's wait plus the target's, so it is part of the time to first token,
    # and the four that waited in the gateway waited longer than the two that got slots at once.
    for _, _, r in served:
        assert 0 <= r.timings.queue_seconds <= r.timings.time_to_first_token_seconds
    waits = sorted(r.timings.queue_seconds for _, _, r in served)
    assert min(waits[4:]) > max(waits[:2])
    info = asyncio.run(_model_info(stack.gateway_address))
    assert info.gateway_queued == 0 and info.gateway_in_flight == 0
    assert [(r.routed, r.connected, r.serving, r.max_slots) for r in info.replicas] == [(8 + 8, True, True, 2)]


@pytest.fixture(scope="module")
def replica_pair(stack_factory, model_zoo):
    """Two targets of one slot each (a backlog of one more) and two kept for their prefix caches,
    one shared draft, one gateway; a target stopped with SIGTERM gets 2 s for its running requests."""
    return stack_factory(model_zoo["target"], model_zoo["partial"], max_slots=1, target_replicas=2,
                         extra_target_args=["--grace", "2", "--prefix-cache-slots", "2"],
                         extra_gateway_args=["--expose-replica-addresses"])


def test_two_replicas_share_the_traffic_exactly(replica_pair):
    prompts = [f"def f{i}(x):" for i in range(8)]

    async def main():
        async with AsyncClient(replica_pair.gateway_address, timeout=120) as client:
            return await asyncio.gather(*[client.generate(p, max_new_tokens=24, speculation=4, ignore_eos=True)
                                          for p in prompts])

    before = asyncio.run(_model_info(replica_pair.gateway_address))
    results = asyncio.run(main())
    after = asyncio.run(_model_info(replica_pair.gateway_address))
    routed = [a.routed - b.routed for a, b in zip(after.replicas, before.replicas)]
    assert len(routed) == 2 and sum(routed) == len(prompts) and min(routed) >= 2, routed
    assert [r.address for r in after.replicas] == [replica_pair.addresses[n] for n in ("target", "target-1")]
    assert after.free_slots == 2 and after.running_sequences == 0 and after.draft_connected
    reference = asyncio.run(_reference(replica_pair.gateway_address, prompts, 24, at_once=len(prompts)))
    assert [r.token_ids for r in results] == reference


def test_each_conversation_goes_back_to_the_replica_holding_its_history(replica_pair):
    """Two conversations, their turns interleaved, on two replicas: cache-aware routing sends every
    turn where its history is cached, so every turn after a conversation's first is served from
    the prefix cache (turn 1 of each is a miss); routed by load, turns would land where their
    history is not."""
    openers = ["In the beginning the universe was created, and this made a lot of people angry. ",
               "It was a bright cold day in April, and the clocks were striking thirteen. Winston "]

    async def main():
        async with AsyncClient(replica_pair.gateway_address, timeout=120) as client:
            prompts, cached = list(openers), [[], []]
            for turn in range(4):
                for c in range(2):
                    reply = await client.generate(prompts[c], max_new_tokens=8, speculation="off",
                                                  cache_salt="routing test")
                    cached[c].append((reply.usage.cached_tokens, reply.usage.prompt_tokens))
                    prompts[c] += reply.text + f" Then {turn}: "
            return cached

    cached = asyncio.run(main())
    for turns in cached:
        assert turns[0][0] == 0, turns  # a salt of its own: nothing before it
        for (hit, _), (_, earlier_prompt) in zip(turns[1:], turns):
            assert hit >= (earlier_prompt - 16) // 16 * 16 > 0, turns  # the last turn's prompt, at least


def test_killing_a_replica_loses_no_request(replica_pair):
    stack = replica_pair
    prompts = [f"class C{i}:" for i in range(12)]
    max_new = 64
    reference = asyncio.run(_reference(stack.gateway_address, prompts, max_new, at_once=4))

    async def one(client: AsyncClient, i: int):
        tokens = []
        try:
            async for chunk in client.generate_stream(prompts[i], max_new_tokens=max_new, ignore_eos=True):
                tokens += chunk.token_ids
        except Unavailable as exc:
            return exc
        return tokens

    async def main():
        async with AsyncClient(stack.gateway_address, timeout=120) as client:
            requests = [asyncio.create_task(one(client, i)) for i in range(len(prompts))]
            # Kill target-1 while it runs one request, holds another in its own queue, and more
            # wait in the gateway.
            deadline = time.monotonic() + 30
            while True:
                info = await _model_info(stack.gateway_address)
                victim = info.replicas[1]
                if victim.running >= 1 and victim.queued >= 1 and info.gateway_queued >= 2:
                    break
                assert time.monotonic() < deadline, f"never saw target-1 busy: {info}"
                await asyncio.sleep(0.005)
            stack.procs["target-1"].kill()
            return await asyncio.gather(*requests), info

    results, at_kill = asyncio.run(main())
    stack.procs["target-1"].wait(10)
    failed = [i for i, r in enumerate(results) if isinstance(r, Unavailable)]
    assert not failed, f"the one running on target-1 continues on target: {[results[i] for i in failed]}"
    for i, result in enumerate(results):
        assert result == reference[i], f"request {i}"
    after = asyncio.run(_model_info(stack.gateway_address))
    assert after.replicas[1].requeued >= 1, "target-1's unstarted request was not moved"
    assert after.replicas[1].resumed >= 1, "target-1's started request was not resumed"
    assert not after.replicas[1].connected and after.replicas[0].connected
    assert at_kill.gateway_queued >= 2

    # It comes back on its old address and gets traffic again.
    stack.restart("target-1")
    deadline = time.monotonic() + 30
    while not ((info := asyncio.run(_model_info(stack.gateway_address))).replicas[1].serving
               and info.replicas[1].connected):
        assert time.monotonic() < deadline, "gateway did not take target-1 back"
        time.sleep(0.05)
    routed = info.replicas[1].routed
    again = asyncio.run(_reference(stack.gateway_address, prompts[:4], max_new, at_once=4))
    assert again == reference[:4]
    assert asyncio.run(_model_info(stack.gateway_address)).replicas[1].routed > routed


def test_a_replica_shutting_down_hands_back_its_queue_and_finishes_what_runs(replica_pair):
    """SIGTERM: the target turns NOT_SERVING and then has its grace period. The gateway stops
    sending it requests, moves its unstarted ones at once, and lets the running one finish there."""
    stack = replica_pair
    prompts = [f"import m{i}" for i in range(12)]
    max_new = 64
    reference = asyncio.run(_reference(stack.gateway_address, prompts, max_new, at_once=4))

    async def main():
        async with AsyncClient(stack.gateway_address, timeout=120) as client:
            requests = [client.generate(p, max_new_tokens=max_new, ignore_eos=True) for p in prompts]
            requests = [asyncio.ensure_future(r) for r in requests]
            deadline = time.monotonic() + 30
            while True:
                info = await _model_info(stack.gateway_address)
                victim = info.replicas[1]
                if victim.running >= 1 and victim.queued >= 1 and info.gateway_queued >= 2:
                    break
                assert time.monotonic() < deadline, f"never saw target-1 busy: {info}"
                await asyncio.sleep(0.005)
            before = info.replicas[1].requeued
            stack.procs["target-1"].terminate()
            return await asyncio.gather(*requests, return_exceptions=True), before

    results, requeued_before = asyncio.run(main())
    assert [r.token_ids for r in results] == reference  # nothing failed, everything exact
    assert asyncio.run(_model_info(stack.gateway_address)).replicas[1].requeued > requeued_before
    assert stack.procs["target-1"].wait(30) == 0
    stack.restart("target-1")  # so the module's stacks stop cleanly
