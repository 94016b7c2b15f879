"""One torch thread per process (specstream/serving/compute.py): in-process engines, LocalDraft and model
loading all run their torch work on it."""

from __future__ import annotations

import asyncio
import threading

from specstream.data.propose import Proposal, ProposeItem
from specstream.serving.compute import on_torch_thread, torch_thread
from target_service.local_draft import LocalDraft


def test_on_torch_thread_always_runs_on_the_one_shared_thread_and_nests() -> None:
    first = on_torch_thread(threading.get_ident)
    assert first != threading.get_ident()
    assert on_torch_thread(threading.get_ident) == first
    assert torch_thread().submit(threading.get_ident).result() == first
    # Called from the torch thread itself it runs inline (waiting on its own queue would deadlock).
    assert on_torch_thread(lambda: on_torch_thread(threading.get_ident)) == first


class _RecordingProposer:
    """A proposer that notes which thread each call ran on."""

    name, max_len, vocab_size, held = "recording", 64, 10, 0

    def __init__(self) -> None:
        self.threads: list[int] = []

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        self.threads.append(threading.get_ident())
        return [Proposal([1] * item.gamma, item.rollback_to + len(item.append)) for item in items]

    def release(self, keys) -> None:
        self.threads.append(threading.get_ident())


def test_local_draft_proposes_on_the_torch_thread_not_the_event_loop() -> None:
    proposer = _RecordingProposer()
    draft = LocalDraft(proposer)

    async def main() -> list[Proposal]:
        out = await draft.propose(1, [ProposeItem(("s", 1), 0, [5, 6], 2)])
        await draft.release([("s", 1)])
        return out

    assert asyncio.run(main())[0].tokens == [1, 1]
    assert proposer.threads == [on_torch_thread(threading.get_ident)] * 2
