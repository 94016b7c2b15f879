"""A proposer in the target's own process, as a ``DraftSource`` (target_service/drafting.py).

For colocated deployments that want no gRPC hop to the draft, and for driving the engine in one
process (tests, benchmarks, training). Takes any proposer with the draft service's interface: a
draft model (``DraftProposer``), the n-gram ones, the synthetic one. Proposals run on ``compute``,
by default the process's torch thread (``specstream.serving.compute``), which is where an in-process
engine's forwards run too: torch work from a second thread would slow both down.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from specstream.data.propose import Proposal, ProposeItem
from specstream.serving.compute import torch_thread


class LocalDraft:
    url = "in-process"
    epoch = 1  # the proposer's state is never lost
    connected = True

    def __init__(self, proposer, compute: ThreadPoolExecutor | None = None) -> None:
        self.proposer = proposer
        self._compute = compute or torch_thread()
        self.model_name = proposer.name
        self.max_context_length = proposer.max_len
        self.vocab_size = proposer.vocab_size
        # A feature draft's: the engine checks them against its model when it is built.
        self.feature_layers = tuple(getattr(proposer, "feature_layers", ()))
        self.feature_width = getattr(proposer, "feature_width", 0)
        self.acceptance = dict(getattr(proposer, "acceptance", {}))  # its card's α per (source, greedy)

    @property
    def held_sequences(self) -> int:
        return self.proposer.held

    async def ready(self) -> bool:
        return True

    def watch(self, callback) -> None:
        pass  # always connected

    async def propose(self, step: int, items: list[ProposeItem], traceparent: str = "",
                      item_traceparents: list[str] | None = None) -> list[Proposal]:
        return await asyncio.get_running_loop().run_in_executor(self._compute, self.proposer.propose, items)

    async def release(self, keys: list[int]) -> None:
        await asyncio.get_running_loop().run_in_executor(self._compute, self.proposer.release, keys)

    async def close(self) -> None:
        pass
