"""A draft proposer in the target's own process, behind the same interface as DraftClient.

For colocated deployments that want no gRPC hop to the draft, and for driving the engine in one
process (tests, benchmarks). Proposals run on the calling thread.
"""

from __future__ import annotations

from draft_service.proposer import DraftProposer, ProposeItem
from draft_service.synthetic import SyntheticProposer
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
        proposals = self.proposer.propose(
            [ProposeItem(it.seq_id, it.rollback_to, list(it.append_token_ids), it.gamma) for it in items])
        return [draft_pb2.Proposal(seq_id=it.seq_id, token_ids=p.tokens, length=p.length)
                for it, p in zip(items, proposals)]

    async def release(self, seq_ids: list[int]) -> None:
        self.proposer.release(seq_ids)

    async def close(self) -> None:
        pass
