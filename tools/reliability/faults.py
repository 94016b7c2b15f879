"""`specstream faults`: the failures the services must ride out, staged on a real stack of the
chosen models with 8 concurrent greedy streams, each scenario on a stack of its own:

- **hung-draft**: SIGSTOP of the draft. Every stream must finish with plain greedy decoding's
  tokens; what is measured is the worst wait between two chunks of any stream after the stop (the
  target falls back to γ=0 after one propose deadline) and how soon after SIGCONT the draft is used
  again.
- **hung-target**: SIGSTOP of the only target. Its streams must end with UNAVAILABLE and new
  requests be refused; measured: the time to each (the gateway's keepalive drops the connection),
  and how soon after SIGCONT it serves again.
- **kill-target**: kill -9 of one of two targets. No started request may be lost and every output
  must equal an uninterrupted greedy run; measured: how soon the killed replica's streams continue
  on the other one.
- **max-prompt**: the largest prompt the gateway accepts arrives while the streams run; measured:
  the worst chunk gap of the streams (tools.reliability.input_cost).

Each scenario returns plain figures and raises FaultCheckError when an exactness or loss
condition fails (a wrong token, a lost request), which is a bug rather than a figure.
"""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field

from specstream.text.tokenizer import TextTokenizer
from tools.launcher import Stack, StackSpec, wait_healthy
from tools.progress import Progress
from tools.reliability import FAULT_SCENARIOS
from tools.reliability.input_cost import prompt_gaps

PROMPTS = ["def main():", "The weather today", "x = 1", "import os", "Hello, world", "for i in range(3):",
           "She said", "class A:"]


PROMPTS_AT_ONCE = 4  # max-prompt: streams running beside the big prompts
MAX_PROMPT_TOKENS = 400  # max-prompt: each stream's budget


class FaultCheckError(RuntimeError):
    """A scenario broke a promise (tokens differ, a request was lost), not merely slow."""


@dataclass
class Streams:
    """What the callers saw: per stream its tokens, chunk arrival times and how it ended."""

    tokens: list[list[int]] = field(default_factory=lambda: [[] for _ in PROMPTS])
    stamps: list[list[float]] = field(default_factory=lambda: [[] for _ in PROMPTS])
    errors: list[str | None] = field(default_factory=lambda: [None] * len(PROMPTS))
    ended: list[float] = field(default_factory=lambda: [0.0] * len(PROMPTS))
    fault_at: float = 0.0

    def worst_gap_after(self, t: float) -> float:
        gaps = [b - a for times in self.stamps for a, b in zip([t, *times], times) if b > t]
        return max(gaps, default=0.0)


async def run_streams(address: str, max_new_tokens: int, speculation="auto", fault=None,
                      after_tokens: int = 16, progress: Progress | None = None) -> Streams:
    """The 8 prompts as concurrent greedy streams; `fault()` runs once each has `after_tokens`.
    ``progress`` counts each stream's tokens as they arrive, and what is left of its budget when it
    ends short (an error)."""
    from specstream_client import AsyncClient
    from specstream_client.errors import SpecstreamError

    out = Streams()

    async def one(client, i: int) -> None:
        try:
            async for chunk in client.generate_stream(PROMPTS[i], max_new_tokens=max_new_tokens, ignore_eos=True,
                                                      speculation=speculation):
                if chunk.token_ids:
                    out.tokens[i] += chunk.token_ids
                    out.stamps[i].append(time.monotonic())
                    if progress is not None:
                        progress.update(len(chunk.token_ids))
                if fault is not None and not out.fault_at and all(len(t) >= after_tokens for t in out.tokens):
                    out.fault_at = time.monotonic()
                    fault()
        except SpecstreamError as exc:
            out.errors[i] = exc.code.name
        out.ended[i] = time.monotonic()
        if progress is not None:
            progress.update(max(max_new_tokens - len(out.tokens[i]), 0))

    async with AsyncClient(address, timeout=600) as client:
        await asyncio.gather(*(one(client, i) for i in range(len(PROMPTS))))
    return out


def _progress(scenario: str, runs: int, max_new_tokens: int, quiet: bool) -> Progress:
    """A scenario's progress on stderr (tools.progress), counted in the tokens of its
    `runs` runs of the streams."""
    return Progress(runs * len(PROMPTS) * max_new_tokens, "tokens", f"faults: {scenario}", quiet=quiet)


def _spec(models, **kwargs) -> StackSpec:
    return StackSpec(str(models.target), str(models.draft) if models.draft else None, dtype=models.dtype,
                     weights=models.weights, **(models.proposing if models.draft else {}), **kwargs)


def _wait(condition, timeout_s: float) -> float:
    """Seconds until `condition()` holds (TimeoutError after `timeout_s`)."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"not within {timeout_s:.0f} s")
        time.sleep(0.05)
    return time.monotonic() - start


def _same(streams: Streams, reference: Streams, what: str) -> None:
    differ = [i for i in range(len(PROMPTS)) if streams.tokens[i] != reference.tokens[i]]
    if differ or any(streams.errors):
        raise FaultCheckError(f"{what}: streams {differ} differ from the reference, errors {streams.errors}")


def _speculates(address: str) -> bool:
    from specstream_client import Client

    with Client(address, timeout=60) as client:
        return client.generate("import os", max_new_tokens=8, speculation=4, ignore_eos=True).stats.draft_tokens > 0


def hung_draft(models, max_new_tokens: int = 200, stopped_s: float = 5.0, quiet: bool = False) -> dict:
    """SIGSTOP of the draft under 8 streams (the module docstring). ``quiet``: progress as plain
    lines, never a bar."""
    with _progress("hung-draft", 2, max_new_tokens, quiet) as progress, \
            tempfile.TemporaryDirectory() as logs, Stack(_spec(models, log_dir=logs)) as stack:
        reference = asyncio.run(run_streams(stack.gateway_address, max_new_tokens, speculation="off",
                                            progress=progress))
        draft = stack.procs["draft"]
        progress.phase("faults: hung-draft, draft stopped")
        streams = asyncio.run(run_streams(stack.gateway_address, max_new_tokens, speculation=4,
                                          fault=lambda: os.kill(draft.pid, signal.SIGSTOP), progress=progress))
        try:
            _same(streams, reference, "hung draft")
            time.sleep(max(0.0, stopped_s - (time.monotonic() - streams.fault_at)))
        finally:
            os.kill(draft.pid, signal.SIGCONT)
        back = _wait(lambda: _speculates(stack.gateway_address), 60)
    normal = [b - a for times in streams.stamps for a, b in zip(times, times[1:]) if b <= streams.fault_at]
    return {"scenario": "hung-draft", "streams": len(PROMPTS), "tokens_each": max_new_tokens,
            "identical_to_plain": len(PROMPTS),
            "worst_gap_ms": 1000 * streams.worst_gap_after(streams.fault_at),
            "worst_gap_before_ms": 1000 * max(normal, default=0.0),
            "speculating_again_s": back}


def hung_target(models, max_new_tokens: int = 400, quiet: bool = False) -> dict:
    """SIGSTOP of the only target under 8 streams (the module docstring). ``quiet``: progress as
    plain lines, never a bar."""
    from specstream_client import Client
    from specstream_client.errors import SpecstreamError

    with _progress("hung-target", 1, max_new_tokens, quiet) as progress, \
            tempfile.TemporaryDirectory() as logs, Stack(_spec(models, log_dir=logs)) as stack:
        target = stack.procs["target"]
        streams = asyncio.run(run_streams(stack.gateway_address, max_new_tokens,
                                          fault=lambda: os.kill(target.pid, signal.SIGSTOP), progress=progress))
        try:
            failed = [end - streams.fault_at for end in streams.ended]
            if any(error != "UNAVAILABLE" for error in streams.errors):
                raise FaultCheckError(f"hung target: the streams ended with {streams.errors}")
            start = time.monotonic()
            try:
                with Client(stack.gateway_address, timeout=30) as client:
                    client.generate("late", max_new_tokens=2)
                refused = "served"
            except SpecstreamError as exc:
                refused = exc.code.name
            refused_s = time.monotonic() - start
            try:
                wait_healthy(stack.gateway_address, timeout_s=0.0)
                health = "SERVING"
            except (TimeoutError, RuntimeError):
                health = "NOT_SERVING"
        finally:
            os.kill(target.pid, signal.SIGCONT)
        back = _wait(lambda: _serves(stack.gateway_address), 60)
    return {"scenario": "hung-target", "streams": len(PROMPTS), "unavailable_after_s": [min(failed), max(failed)],
            "new_request": refused, "refused_in_ms": 1000 * refused_s, "gateway_health": health,
            "serving_again_s": back}


def _serves(address: str) -> bool:
    from specstream_client import Client
    from specstream_client.errors import SpecstreamError

    try:
        with Client(address, timeout=10) as client:
            return client.generate("x", max_new_tokens=1).usage.completion_tokens == 1
    except SpecstreamError:
        return False


def kill_target(models, max_new_tokens: int = 300, quiet: bool = False) -> dict:
    """kill -9 of one of two targets under 8 streams (the module docstring). ``quiet``: progress as
    plain lines, never a bar."""
    with _progress("kill-target", 2, max_new_tokens, quiet) as progress, tempfile.TemporaryDirectory() as logs, \
            Stack(_spec(models, log_dir=logs, target_replicas=2)) as stack:
        reference = asyncio.run(run_streams(stack.gateway_address, max_new_tokens, progress=progress))
        before = _resumed(stack.gateway_address)
        victim = stack.procs["target-1"]
        progress.phase("faults: kill-target, a target killed")
        streams = asyncio.run(run_streams(stack.gateway_address, max_new_tokens, fault=victim.kill, progress=progress))
        victim.wait(10)
        moved = _resumed(stack.gateway_address) - before
    lost = sum(error is not None for error in streams.errors)
    identical = sum(streams.tokens[i] == reference.tokens[i] for i in range(len(PROMPTS)))
    _same(streams, reference, "kill -9 of a target")
    # The moved streams are the ones that waited longest after the kill.
    pauses = sorted((_longest_pause(times, streams.fault_at) for times in streams.stamps), reverse=True)[:moved]
    return {"scenario": "kill-target", "streams": len(PROMPTS), "replicas": 2, "lost": lost,
            "identical_to_uninterrupted": identical, "moved_streams": moved,
            "resumed_after_s": [min(pauses), max(pauses)] if pauses else None}


def _resumed(address: str) -> int:
    """Requests the gateway has moved from one replica to another after they started."""
    import grpc

    from specstream_pb import generation_pb2, generation_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        info = generation_pb2_grpc.GenerationStub(channel).GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    return sum(replica.resumed for replica in info.replicas)


def _longest_pause(times: list[float], t: float) -> float:
    points = [t, *(x for x in times if x > t)]
    return max((b - a for a, b in zip(points, points[1:])), default=0.0)


def max_prompt(models, big_prompts: int = 5, quiet: bool = False) -> dict:
    """The longest prompt the gateway would tokenize for this model (the target serves the model's
    whole context: a sequence length past it is capped there), `big_prompts` times while 4 streams
    run, twice: with all three processes sharing every core, and with the gateway on a core of its
    own (target and draft on the others, one torch thread each), as where it runs in a pod of its
    own. On a machine this small the first mostly measures the cores' contention: the engine's
    threads wait for each other, so any process that takes a core for a third of a second (even
    at the lowest priority) stretches the steps meanwhile. ``quiet``: progress as plain lines,
    never a bar (counted in the streams' tokens)."""
    tokenizer = TextTokenizer.from_dir(models.target)
    result: dict = {"scenario": "max-prompt", "big_prompts": big_prompts}
    cores = sorted(os.sched_getaffinity(0))
    layouts = [layout for layout in ("shared cores", "gateway on its own core")
               if layout == "shared cores" or len(cores) >= 2]
    with Progress(len(layouts) * PROMPTS_AT_ONCE * MAX_PROMPT_TOKENS, "tokens", "faults: max-prompt",
                  quiet=quiet) as progress:
        for layout in layouts:
            pinned = layout != "shared cores"
            progress.phase(f"faults: max-prompt, {layout}")
            threads = {"target_threads": 1, "draft_threads": 1} if pinned else {}
            with tempfile.TemporaryDirectory() as logs, Stack(_spec(models, log_dir=logs, max_seq_len=1 << 20,
                                                                    **threads)) as stack:
                if pinned:
                    for name, proc in stack.procs.items():
                        os.sched_setaffinity(proc.pid, cores[-1:] if name == "gateway" else cores[:-1])
                gaps = _prompt_gaps(stack, tokenizer, big_prompts, progress)
            result[layout] = {k: v for k, v in gaps.items() if k != "gap_ms"}
    return result


def _prompt_gaps(stack: Stack, tokenizer, big_prompts: int, progress: Progress) -> dict:
    from specstream_client import Client

    with Client(stack.gateway_address, timeout=60) as client:
        context = client.model_info().max_context_length
    gaps = asyncio.run(prompt_gaps(stack.gateway_address, context * tokenizer.max_token_chars, streams=PROMPTS_AT_ONCE,
                                   max_new_tokens=MAX_PROMPT_TOKENS, big_prompts=big_prompts, progress=progress))
    return {"context_tokens": context, **gaps.to_dict()}


RUNNERS = {"hung-draft": hung_draft, "hung-target": hung_target, "kill-target": kill_target,
           "max-prompt": max_prompt}
assert tuple(RUNNERS) == FAULT_SCENARIOS
