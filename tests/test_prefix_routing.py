"""Cache-aware routing (gateway/prefix_routing.py): a request goes to the replica believed to hold
the longest prefix of its prompt, unless that replica is loaded past the imbalance allowed."""

from __future__ import annotations

import random

from gateway.prefix_routing import PrefixRouting
from gateway.router import Router
from specstream.data.engine import SequenceRequest
from tests.test_gateway_router import replica, run_async, written

RNG = random.Random(2)
SYSTEM = [RNG.randrange(1, 250) for _ in range(64)]  # a shared system prompt: 4 blocks


def _request(rid: str, tail_len: int = 9, prompt: list[int] | None = None, salt: str = "") -> SequenceRequest:
    prompt = prompt if prompt is not None else SYSTEM + [RNG.randrange(1, 250) for _ in range(tail_len)]
    return SequenceRequest(rid, prompt, 4, cache_salt=salt)


def test_the_index_knows_the_blocks_routed_to_each_replica_and_forgets_the_oldest():
    routing = PrefixRouting(capacity=6)
    keys = routing.keys(_request("a"))
    assert len(keys) == 4  # 73 tokens: the 4 full blocks before the last token
    assert routing.matched("a:1", keys) == 0
    routing.routed("a:1", keys)
    assert routing.matched("a:1", keys) == 64 and routing.matched("b:1", keys) == 0
    assert routing.matched("a:1", routing.keys(_request("x", salt="other"))) == 0  # salted apart, as on the target
    other = routing.keys(_request("o", prompt=[7] * 60))  # 3 blocks: 7 keys in all, one too many
    routing.routed("a:1", other)
    assert routing.matched("a:1", other) == 48 and routing.matched("a:1", keys) == 0  # its first key went first
    routing.forget("a:1")
    assert routing.matched("a:1", other) == 0


@run_async
async def test_a_shared_prompt_follows_its_cache_until_the_load_is_too_uneven():
    a, b = replica("a", 8), replica("b", 8)
    router = Router([a, b], max_queue=8, prefixes=PrefixRouting(imbalance=2))
    first = router.submit(_request("0"))
    home, away = (a, b) if first.replica is a else (b, a)
    assert first.expected_cached == 0  # nothing cached anywhere: by load (a tie: the first)
    tickets = [router.submit(_request(str(i))) for i in range(1, 4)]
    assert [t.replica for t in tickets] == [home, home, away]  # home until it holds 3 more than away
    assert [t.expected_cached for t in tickets] == [64, 64, 0]
    unrelated = router.submit(_request("u", prompt=[9] * 40))
    assert unrelated.replica is away  # no prefix anywhere: the least loaded
    assert (len(written(home)[0]), len(written(away)[0])) == (3, 2)  # what each replica's stream was sent


@run_async
async def test_without_the_index_routing_is_by_load_alone():
    a, b = replica("a", 8), replica("b", 8)
    router = Router([a, b], max_queue=8)
    placed = [router.submit(_request(str(i))).replica for i in range(4)]
    assert placed == [a, b, a, b]  # the trickle alternates, shared prompt or not
