"""A draft proposer in the target's own process, behind the same interface as DraftClient.

For colocated deployments that want no gRPC hop to the draft, and for driving the engine in one
process (tests, benchmarks). Proposals run on the calling thread.
"""

from __future__ import annotations

from draft_service.proposer import DraftProposer
from draft_service.synthetic import SyntheticProposer
from draft_service.wire import item_from_pb, proposal_to_pb
from specstream_pb import draft_pb2


class LocalDraft:
    epoch = 1
    connected = True

    def __init__(self, proposer: DraftProposer | SyntheticProposer) -> None:
        self.proposer = proposer
        self.model_name = proposer.name
        self.url = "in-process"
        self.max_context_length = proposer.max_len
        self.vocab_size = proposer.vocab_size

    @property
    def held_sequences(self) -> int:
        return self.proposer.held

    async def ready(self) -> bool:
        return True

    async def propose(self, step: int, items: list[draft_pb2.ProposeItem],
                      traceparent: str = "") -> list[draft_pb2.Proposal]:
        proposals = self.proposer.propose([item_from_pb(it.seq_id, it) for it in items])
        return [proposal_to_pb(it.seq_id, p) for it, p in zip(items, proposals)]

    async def release(self, seq_ids: list[int]) -> None:
        self.proposer.release(seq_ids)

    async def close(self) -> None:
        pass
