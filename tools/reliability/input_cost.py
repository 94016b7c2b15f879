"""What one maximal prompt costs everyone else: `prompt_gaps` runs a few greedy streams through the
gateway, sends the largest prompt the gateway accepts for tokenizing while they run, and measures
the gaps between the running streams' chunks (the issue's target: the worst gap < 100 ms).
`stream_gaps` is the measurement for any costly requests (tools/bench/constraint_cost.py sends
hostile constraints).

The big prompt is words of random letters, the costly case for a BPE tokenizer (few merges), and
as long as the gateway's character limit allows, so it is tokenized in full (and then refused if
it is more tokens than the context holds: the work is the same either way).
"""

from __future__ import annotations

import asyncio
import random
import string
import time
from dataclasses import asdict, dataclass, field

from tools.progress import Progress


def random_words(chars: int, seed: int = 0) -> str:
    """`chars` characters of space-separated lowercase words of 2-9 letters."""
    rng = random.Random(seed)
    words, size = [], 0
    while size < chars:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:chars]


@dataclass
class PromptGaps:
    prompt_chars: int  # the big prompt's length
    streams: int  # greedy streams running meanwhile
    big_seconds: float  # the slowest big request: sent -> answered (or refused)
    big_outcome: str  # "served" or the error code it got (the last one's)
    worst_gap_ms: float  # the longest wait between two chunks of a running stream while the big prompt was in
    baseline_worst_gap_ms: float  # the same before it was sent
    gaps_during: int  # chunk gaps measured while the big prompt was in
    gap_ms: list[float] = field(default_factory=list)  # every gap while it was in

    def to_dict(self) -> dict:
        return asdict(self)


async def prompt_gaps(address: str, prompt_chars: int, streams: int = 4, max_new_tokens: int = 64,
                      prompt: str = "Once upon a time", warmup_chunks: int = 3, timeout: float = 300.0,
                      big_prompts: int = 1, progress: Progress | None = None) -> PromptGaps:
    """Starts `streams` greedy streams of `prompt` (ignore_eos, `max_new_tokens` each); once each
    has sent `warmup_chunks` chunks, sends `big_prompts` requests with a `prompt_chars`-character
    prompt, one after the other, and records, for every running stream, the gaps between its
    chunks before and while one is in. ``progress`` counts the streams' tokens as they arrive."""
    text = random_words(prompt_chars)  # before the clock starts: making it is not the server's cost

    async def big(client) -> str:
        return await answer_of(client.generate(text, max_new_tokens=1, speculation="off"))

    gaps = await stream_gaps(address, [big] * big_prompts, streams, max_new_tokens, prompt, warmup_chunks, timeout,
                             progress)
    return PromptGaps(prompt_chars=prompt_chars, streams=streams, big_seconds=max(gaps.seconds),
                      big_outcome=gaps.outcomes[-1], worst_gap_ms=gaps.worst_gap_ms,
                      baseline_worst_gap_ms=gaps.baseline_worst_gap_ms, gaps_during=len(gaps.gap_ms),
                      gap_ms=gaps.gap_ms)


async def answer_of(call) -> str:
    """"served", or the error code a request got (an invalid argument's with the field it names)."""
    from specstream_client.errors import InvalidArgument, SpecstreamError

    try:
        await call
        return "served"
    except InvalidArgument as exc:
        return f"{exc.code.name} ({exc.details.split('=', 1)[0]})"
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
