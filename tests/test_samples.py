"""`n` samples (gateway/samples.py): the rule both fronts share, and how the samples' results
come back as one response or one stream."""

from __future__ import annotations

import asyncio

import pytest

from gateway import samples
from specstream.data.errors import InvalidArgumentError
from specstream_pb import common_pb2, generation_pb2


def _request(**fields) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt="hi", max_new_tokens=4, **fields)


def test_samples_are_the_request_with_seed_plus_i():
    copies = samples.split(_request(n=3, temperature=0.7, seed=2**64 - 2))
    assert [c.seed for c in copies] == [2**64 - 2, 2**64 - 1, 0] and all(c.n == 0 for c in copies)
    assert all(c.prompt == "hi" and c.temperature == pytest.approx(0.7) for c in copies)
    unseeded = samples.split(_request(n=2, temperature=1.0))
    assert not any(c.HasField("seed") for c in unseeded)  # each gets its own from the gateway
    one = _request(temperature=0.0)
    assert samples.split(one) == [one] and samples.split(_request(n=1)) == [_request(n=1)]


@pytest.mark.parametrize("fields, reason", [
    (dict(n=17, temperature=1.0), "must be in 1..16"),
    (dict(n=2), "temperature 0"),
    (dict(n=2, temperature=1.0, beam=common_pb2.BeamSearch(num_beams=2)), "beam"),
])
def test_n_outside_the_rule_is_refused_naming_it(fields, reason):
    with pytest.raises(InvalidArgumentError) as err:
        samples.split(_request(**fields))
    assert err.value.field == "n" and reason in str(err.value)


def test_one_response_holds_every_sample_and_counts_the_prompt_once():
    parts = [generation_pb2.GenerateResponse(text=t, token_ids=ids, seed=s,
                                             usage=common_pb2.Usage(prompt_tokens=10, completion_tokens=len(ids),
                                                                    cached_tokens=c))
             for t, ids, s, c in (("a", [1, 2], 5, 0), ("b", [3], 6, 0), ("c", [4, 5, 6], 7, 0))]
    merged = samples.response(parts)
    assert (merged.text, list(merged.token_ids), merged.seed) == ("a", [1, 2], 5)
    assert (merged.usage.prompt_tokens, merged.usage.completion_tokens) == (10, 6)
    assert [(s.index, s.text, s.seed, s.usage.completion_tokens) for s in merged.samples] == \
           [(0, "a", 5, 2), (1, "b", 6, 1), (2, "c", 7, 3)]


def test_streams_interleave_and_every_one_is_closed_on_an_error():
    closed = []

    async def chunks(i: int, n: int, fail: bool = False):
        try:
            for k in range(n):
                await asyncio.sleep(0.001 * (i + 1))
                yield generation_pb2.GenerateStreamResponse(token_ids=[10 * i + k])
            if fail:
                raise InvalidArgumentError("prompt", "x", "refused")
        finally:
            closed.append(i)

    async def read(streams):
        return [(i, list(c.token_ids)) async for i, c in samples.interleaved(streams)]

    got = asyncio.run(read([chunks(0, 3), chunks(1, 2)]))
    assert sorted(got) == [(0, [0]), (0, [1]), (0, [2]), (1, [10]), (1, [11])]
    assert [t for i, t in got if i == 0] == [[0], [1], [2]]  # each stream's own order
    closed.clear()
    with pytest.raises(InvalidArgumentError):
        asyncio.run(read([chunks(0, 50), chunks(1, 1, fail=True)]))
    assert sorted(closed) == [0, 1]  # the one still running was closed too
