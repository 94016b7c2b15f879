"""What costly requests cost the streams running beside them: ``stream_gaps`` runs greedy streams
through the gateway, sends the costly requests one after the other while they run, and measures the
gaps between the running streams' chunks before and while each is in. The big-prompt check
(tools/reliability/input_cost.py) and `bench constraint-cost` (tools/bench/constraint_cost.py) use it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from tools.progress import Progress

__all__ = ["StreamGaps", "answer_of", "stream_gaps"]


async def answer_of(call, field: bool = False) -> str:
    """"served", or the error code a request got; ``field``: an invalid argument's with the field
    it names."""
    from specstream_client.errors import InvalidArgument, SpecstreamError

    try:
        await call
        return "served"
    except InvalidArgument as exc:
        return f"{exc.code.name} ({exc.details.split('=', 1)[0]})" if field else exc.code.name
    except SpecstreamError as exc:
        return exc.code.name


@dataclass
class StreamGaps:
    seconds: list[float]  # each costly request: sent -> answered (or refused)
    outcomes: list[str]  # each one's: "served" or the error code
    worst_gap_ms: float  # the longest wait between two chunks of a running stream while one was in
    baseline_worst_gap_ms: float  # the same before the first was sent
    gap_ms: list[float]  # every gap while one was in
    worst_gap_ms_each: list[float]  # per costly request, the worst gap that overlapped it (0: none did)


async def stream_gaps(address: str, costly: list, streams: int = 4, max_new_tokens: int = 64,
                      prompt: str = "Once upon a time", warmup_chunks: int = 3, timeout: float = 300.0,
                      progress: Progress | None = None) -> StreamGaps:
    """What costly requests cost the streams running beside them: starts `streams` greedy streams
    of `prompt` (ignore_eos, `max_new_tokens` each); once each has sent `warmup_chunks` chunks,
    sends each of ``costly`` (``async (client) -> outcome``) one after the other, and records, for
    every running stream, the gaps between its chunks before and while one is in."""
    from specstream_client import AsyncClient

    arrivals: list[list[float]] = [[] for _ in range(streams)]
    started = asyncio.Event()
    windows: list[tuple[float, float]] = []  # (sent, answered) per costly request
    outcomes: list[str] = []

    async with AsyncClient(address, timeout=timeout) as client:
        async def stream(i: int) -> None:
            async for chunk in client.generate_stream(prompt, max_new_tokens=max_new_tokens, ignore_eos=True,
                                                      speculation="off"):
                arrivals[i].append(time.monotonic())
                if progress is not None:
                    progress.update(len(chunk.token_ids))
                if all(len(a) >= warmup_chunks for a in arrivals):
                    started.set()

        async def send() -> None:
            await started.wait()
            for request in costly:
                sent = time.monotonic()
                outcomes.append(await request(client))
                windows.append((sent, time.monotonic()))

        await asyncio.gather(*(stream(i) for i in range(streams)), send())
    first_sent = windows[0][0]
    during, before = [], []
    for times in arrivals:
        for a, b in zip(times, times[1:]):
            if any(b > sent and a < answered for sent, answered in windows):
                during.append(b - a)
            elif b <= first_sent:
                before.append(b - a)
    if not during:
        raise RuntimeError("no stream sent a chunk while a costly request was in: raise max_new_tokens")
    each = [1000 * max((b - a for times in arrivals for a, b in zip(times, times[1:]) if b > sent and a < answered),
                       default=0.0) for sent, answered in windows]
    return StreamGaps(seconds=[answered - sent for sent, answered in windows], outcomes=outcomes,
                      worst_gap_ms=1000 * max(during), baseline_worst_gap_ms=1000 * max(before, default=0.0),
                      gap_ms=[round(1000 * g, 3) for g in during], worst_gap_ms_each=each)
