"""Protobuf edge of the draft proposer: ProposeItem / Proposal messages <-> dataclasses.

Shared by the gRPC servicer and the in-process draft, so both speak exactly the same protocol.
"""

from __future__ import annotations

from collections.abc import Hashable

from specstream.data.propose import Proposal, ProposeItem
from specstream.data.sampling import SamplingParams
from specstream_pb import draft_pb2


def item_from_pb(key: Hashable, item: draft_pb2.ProposeItem) -> ProposeItem:
    # The target validated the settings; a bad message here is a protocol error, not user input.
    # Features are checked by the proposer that reads them (draft_service/feature.py), which refuses
    # a wrong dtype, width or count naming the field.
    return ProposeItem(key, item.rollback_to, list(item.append_token_ids), item.gamma,
                       SamplingParams.from_pb(item.sampling), features=item.features,
                       feature_width=item.feature_width, feature_dtype=item.feature_dtype, branches=item.branches)


def proposal_to_pb(seq_id: int, proposal: Proposal) -> draft_pb2.Proposal:
    return draft_pb2.Proposal(seq_id=seq_id, token_ids=proposal.tokens, length=proposal.length,
                              q_width=proposal.q_width, q_ids=proposal.q_ids, q_probs=proposal.q_probs,
                              proposer=proposal.source, error=proposal.error, parents=proposal.parents)
