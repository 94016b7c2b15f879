"""Drive a target ``Engine`` inside this process: submit sequences, wait for each to finish.

For training pipelines and benchmarks that want the real engine (batching, speculation,
verification) without gRPC. ``run_requests(engine, requests)`` starts the engine loop, submits the
requests on one in-process connection, collects every sequence's tokens and log-probabilities from
the per-step events, and stops the loop when all have finished. It speaks the engine's own
dataclasses (specstream/data/engine.py); it knows nothing about text or protobuf. Tests, the demo-pair trainer and the draft
distillation all drive engines through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from specstream.data.engine import FinishReason, SequenceEvent, SequenceRequest, TokenLogprob
from target_service.connection import Connection
from target_service.engine import Engine

__all__ = ["Finished", "generate", "run_requests"]


@dataclass
class Finished:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    final: SequenceEvent | None = None  # the last event: finish reason, stats, error
    steps: list[int] = field(default_factory=list)  # engine steps whose events carried its tokens
    cached_tokens: int = 0  # prompt tokens the prefix cache served (reported on its first event)

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.final.finish_reason if self.final is not None else None


async def generate(engine: Engine, requests: list[SequenceRequest], timeout_s: float = 600.0,
                   on_finished: Callable[[Finished], None] | None = None) -> list[Finished]:
    """Every request's result, in request order; the engine loop must be running. ``timeout_s``
    bounds the wait for any one step's events; ``on_finished`` sees each result as it completes."""
    results = {r.id: Finished(r.id) for r in requests}
    if len(results) != len(requests):
        raise ValueError("run_requests: request ids must be distinct")
    conn = Connection()
    engine.attach(conn)
    engine.submit(conn, list(requests))
    pending = set(results)
    try:
        while pending:
            message = await asyncio.wait_for(conn.outbox.get(), timeout_s)
            if message is None:
                raise RuntimeError("the engine closed the connection")
            for event in message.events:
                result = results[event.id]
                if event.token_ids and (not result.steps or result.steps[-1] != message.step):
                    result.steps.append(message.step)  # a step may send a prompt's first token early
                result.token_ids.extend(event.token_ids)
                result.cached_tokens += event.cached_tokens
                result.logprobs.extend(event.logprobs)
                if event.finish_reason is not None:
                    result.final = event
                    pending.discard(event.id)
                    if on_finished is not None:
                        on_finished(result)
    finally:
        engine.detach(conn)
    return [results[r.id] for r in requests]


def run_requests(engine: Engine, requests: list[SequenceRequest], timeout_s: float = 600.0,
                 on_finished: Callable[[Finished], None] | None = None) -> list[Finished]:
    """``generate`` with the engine loop started and stopped around it (synchronous callers).
    Call it once per engine: the engine's wake-up event belongs to the first event loop that runs it."""

    async def main() -> list[Finished]:
        loop_task = asyncio.create_task(engine.run())
        work = asyncio.create_task(generate(engine, requests, timeout_s, on_finished))
        try:
            # The engine loop never returns; if it does (a crash), fail now rather than at the timeout.
            done, _ = await asyncio.wait({loop_task, work}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                raise RuntimeError(f"the engine loop stopped: {loop_task.exception() or 'returned'}")
            return work.result()
        finally:
            work.cancel()
            loop_task.cancel()

    return asyncio.run(main())
