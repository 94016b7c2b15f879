"""What one maximal prompt costs everyone else: `prompt_gaps` runs a few greedy streams through the
gateway, sends the largest prompt the gateway accepts for tokenizing while they run, and measures
the gaps between the running streams' chunks (the issue's target: the worst gap < 100 ms).
The measurement itself is tools/bench/stream_gaps.py's (`bench constraint-cost` sends hostile
constraints through it).

The big prompt is words of random letters, the costly case for a BPE tokenizer (few merges), and
as long as the gateway's character limit allows, so it is tokenized in full (and then refused if
it is more tokens than the context holds: the work is the same either way).
"""

from __future__ import annotations

import random
import string
from dataclasses import asdict, dataclass, field

from tools.bench.stream_gaps import answer_of, stream_gaps
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
