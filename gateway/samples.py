"""`n` samples of one prompt (GenerateRequest.n; HTTP's `n`): one request a sample, sent together.

The rule, for both fronts: n is 1..MAX_SAMPLES; above 1 it needs a temperature above 0 (greedy
samples would be n copies of one answer: refused rather than computed n times) and no beam search
(whose num_return_sequences already returns several hypotheses). Sample i is the request with
seed + i (each its own seed from the gateway where the request gave none), so each is exactly the
single request with that seed. Sent together, they reach one target at once: it prefills the
prompt once and the others fork it (docs/architecture.md §5.1), and each may speculate.

How their results come back: one response whose `samples` holds each (``response``; usage counts
the prompt once), or one stream of their chunks as they come, each marked with its sample's index
(``interleaved``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from specstream.data.errors import InvalidArgumentError
from specstream_pb import common_pb2, generation_pb2

__all__ = ["MAX_SAMPLES", "gather", "interleaved", "response", "split", "usage"]

MAX_SAMPLES = 16  # the most samples (n) one request may ask for
UINT64 = (1 << 64) - 1
T = TypeVar("T")


def split(request: generation_pb2.GenerateRequest) -> list[generation_pb2.GenerateRequest]:
    """The request of each of its ``n`` samples (the request itself for one); InvalidArgumentError
    naming ``n`` where it breaks the rule."""
    n = request.n or 1
    if not 1 <= n <= MAX_SAMPLES:
        raise InvalidArgumentError("n", request.n, f"must be in 1..{MAX_SAMPLES}")
    if n == 1:
        return [request]
    if request.HasField("beam"):
        raise InvalidArgumentError("n", n, "not with beam search (beam.num_return_sequences returns several "
                                           "hypotheses)")
    if request.temperature == 0:
        raise InvalidArgumentError("n", n, "with temperature 0 every sample would be the same answer: set a "
                                           "temperature above 0, or n=1")
    out = []
    for i in range(n):
        copy = generation_pb2.GenerateRequest()
        copy.CopyFrom(request)
        copy.n = 0
        if request.HasField("seed"):
            copy.seed = (request.seed + i) % (UINT64 + 1)
        out.append(copy)
    return out


def usage(usages: list[common_pb2.Usage]) -> common_pb2.Usage:
    """The usage of a request's samples: the prompt once (it was prefilled once), the first's cached
    tokens, every sample's completion tokens."""
    out = common_pb2.Usage()
    out.CopyFrom(usages[0])
    out.completion_tokens = sum(u.completion_tokens for u in usages)
    return out


def response(responses: list[generation_pb2.GenerateResponse]) -> generation_pb2.GenerateResponse:
    """One response for a request's samples: sample 0's fields, every sample in ``samples``, and
    their ``usage`` together."""
    out = generation_pb2.GenerateResponse()
    out.CopyFrom(responses[0])
    out.usage.CopyFrom(usage([r.usage for r in responses]))
    for i, r in enumerate(responses):
        out.samples.add(index=i, text=r.text, token_ids=r.token_ids, finish_reason=r.finish_reason, usage=r.usage,
                        stats=r.stats, logprobs=r.logprobs, seed=r.seed, tool_calls=r.tool_calls)
    return out


async def gather(works: list[Awaitable[T]]) -> list[T]:
    """Every result, in order; when one fails, the others are cancelled and its error raised."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def interleaved(streams: list[AsyncIterator[generation_pb2.GenerateStreamResponse]]
                      ) -> AsyncIterator[tuple[int, generation_pb2.GenerateStreamResponse]]:
    """Every stream's chunks as they come, with the number of the stream each is from; the first
    error of any ends it (raised). Every stream is closed when it ends, or is left early."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for chunk in streams[i]:
                await queue.put((i, chunk, None))
            await queue.put((i, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            await queue.put((i, None, exc))

    pumps = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    try:
        running = len(pumps)
        while running:
            i, chunk, exc = await queue.get()
            if exc is not None:
                raise exc
            if chunk is None:
                running -= 1
                continue
            yield i, chunk
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for chunks in streams:
            await chunks.aclose()
