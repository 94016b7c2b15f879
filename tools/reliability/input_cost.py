"""What one maximal prompt costs everyone else: `prompt_gaps` runs a few greedy streams through the
gateway, sends the largest prompt the gateway accepts for tokenizing while they run, and measures
the gaps between the running streams' chunks (the issue's target: the worst gap < 100 ms).

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
    from specstream_client import AsyncClient
    from specstream_client.errors import SpecstreamError

    text = random_words(prompt_chars)  # before the clock starts: making it is not the server's cost
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    started = asyncio.Event()
    windows: list[tuple[float, float]] = []  # (sent, answered) per big prompt

    async with AsyncClient(address, timeout=timeout) as client:
        async def stream(i: int) -> None:
            async for chunk in client.generate_stream(prompt, max_new_tokens=max_new_tokens, ignore_eos=True,
                                                      speculation="off"):
                arrivals[i].append(time.monotonic())
                if progress is not None:
                    progress.update(len(chunk.token_ids))
                if all(len(a) >= warmup_chunks for a in arrivals):
                    started.set()

        async def big() -> str:
            await started.wait()
            outcome = ""
            for _ in range(big_prompts):
                sent = time.monotonic()
                try:
                    await client.generate(text, max_new_tokens=1, speculation="off")
                    outcome = "served"
                except SpecstreamError as exc:
                    outcome = exc.code.name
                windows.append((sent, time.monotonic()))
            return outcome

        *_, outcome = await asyncio.gather(*(stream(i) for i in range(streams)), big())
    first_sent = windows[0][0]
    during, before = [], []
    for times in arrivals:
        for a, b in zip(times, times[1:]):
            if any(b > sent and a < answered for sent, answered in windows):
                during.append(b - a)
            elif b <= first_sent:
                before.append(b - a)
    if not during:
        raise RuntimeError("no stream sent a chunk while a big prompt was in: raise max_new_tokens")
    return PromptGaps(prompt_chars=prompt_chars, streams=streams,
                      big_seconds=max(answered - sent for sent, answered in windows), big_outcome=outcome,
                      worst_gap_ms=1000 * max(during), baseline_worst_gap_ms=1000 * max(before, default=0.0),
                      gaps_during=len(during), gap_ms=[round(1000 * g, 3) for g in during])
