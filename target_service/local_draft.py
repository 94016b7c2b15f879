"""A proposer in the target's own process, as a ``DraftSource`` (target_service/drafting.py).

For colocated deployments that want no gRPC hop to the draft, and for driving the engine in one
process (tests, benchmarks, training). Takes any proposer with the draft service's interface: a
draft model (``DraftProposer``), the n-gram ones, the synthetic one. Proposals run on ``compute``,
by default the process's torch thread (``specstream.serving.compute``), which is where an in-process
engine's forwards run too: torch work from a second thread would slow both down.

Working ahead (``work_ahead`` "idle" or "normal", a draft model's; draft_service/work_ahead.py): once
the engine has verified a pass (``after_verify``), the torch thread is free while the engine's event
loop does the pass's host work, and the draft drafts the next round of its latest reply's
chains there, on the same thread, stopping before its next forward as soon as any other call waits
for the thread (the next proposal, a prefill). Not on a second thread: two OpenMP teams on the
cores the target's forward fills slowed that forward severalfold (docs/benchmarks.md, "Overlap
on two cores").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from specstream.data.propose import Proposal, ProposeItem, Proposer
from specstream.serving.compute import run_at_idle_priority, torch_thread
from target_service.drafting import DraftSource


class LocalDraft(DraftSource):
    url = "in-process"
    epoch = 1  # the proposer's state is never lost
    connected = True

    def __init__(self, proposer: Proposer, compute: ThreadPoolExecutor | None = None, work_ahead: str = "off") -> None:
        self.proposer = proposer
        self._compute = compute or torch_thread()
        self.work_ahead = work_ahead if proposer.works_ahead else "off"
        self._calls = 0  # this draft's calls submitted to the torch thread and not done
        self._replied = False  # a reply since the work last ran: its chains are the next round's
        self.model_name = proposer.name
        self.max_context_length = proposer.max_len
        self.vocab_size = proposer.vocab_size
        # A feature draft's: the engine checks them against its model when it is built.
        self.feature_layers = tuple(proposer.feature_layers)
        self.feature_width = proposer.feature_width
        self.acceptance = dict(proposer.acceptance)  # its card's α per (source, greedy)
        self.lookup = proposer.lookup  # the model-free lookup it asks first ("": none)
        self.prefix_cache = proposer.prefix_cache  # it keeps released sequences' state

    @property
    def held_sequences(self) -> int:
        return self.proposer.held

    async def ready(self) -> bool:
        return True

    def watch(self, callback) -> None:
        pass  # always connected

    async def propose(self, step: int, items: list[ProposeItem], traceparent: str = "",
                      item_traceparents: list[str] | None = None) -> list[Proposal]:
        proposals = await self._call(self.proposer.propose, items)
        self._replied = bool(items)
        return proposals

    async def release(self, keys: list[int]) -> None:
        await self._call(self.proposer.release, keys)

    @property
    def ahead_counts(self) -> Mapping[str, int]:
        """The work's running counts (prepared, hit, miss, ...; empty unless it works ahead)."""
        return self.proposer.ahead_counts if self.work_ahead != "off" else {}

    def after_verify(self, engine_waiting: Callable[[], bool]) -> None:
        """The engine has verified a pass and does its host work now: with ``work_ahead``, the torch
        thread drafts the next round of the latest reply's chains until this draft or the engine
        (``engine_waiting()``) has a call waiting for it. Returns at once."""
        if self.work_ahead == "off" or not self._replied:
            return
        self._replied = False

        def waiting() -> bool:
            return self._calls > 0 or engine_waiting()

        self._compute.submit(run_at_idle_priority, lambda: self.proposer.work_ahead(waiting),
                             self.work_ahead == "idle")

    async def _call(self, fn, *args):
        self._calls += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)
        finally:
            self._calls -= 1

    async def close(self) -> None:
        pass
