"""The protobuf forms of the propose protocol (specstream/data/propose.py), both ways: the one place
where the plain messages of the ``Draft.Speculate`` stream and ``Draft.GetInfo`` meet ``draft_pb2``.

The target writes items (``item_to_pb``) and reads proposals and the draft's info
(``proposal_from_pb``, ``info_from_pb``); the draft reads items (``item_from_pb``) and writes
proposals and its info (``proposal_to_pb``, ``info_to_pb``). For every message,
``x_from_pb(x_to_pb(v)) == v`` (q probabilities as float32, the wire's). The key a proposal
answers travels as the item's ``seq_id``; on the draft's side every stream has its own key space,
so the draft names the key it reads an item under. Knows nothing about calls or streams.
"""

from __future__ import annotations

from collections.abc import Hashable

from specstream.data.constraint import Constraint
from specstream.data.penalties import Penalties
from specstream.data.propose import FEATURE_DTYPE, DraftInfo, Proposal, ProposeItem
from specstream.data.sampling import SamplingParams
from specstream_pb import common_pb2, draft_pb2

__all__ = ["info_from_pb", "info_to_pb", "item_from_pb", "item_to_pb", "proposal_from_pb", "proposal_to_pb"]


def item_to_pb(item: ProposeItem, traceparent: str = "") -> draft_pb2.ProposeItem:
    p = item.sampling
    features = {"features": item.features, "feature_width": item.feature_width,
                "feature_dtype": item.feature_dtype} if item.feature_width else {}
    if item.constraint is not None:
        features.update(constraint=item.constraint.to_pb())
    if item.penalties is not None:
        features.update(penalties=item.penalties.to_pb())
    return draft_pb2.ProposeItem(
        seq_id=item.key, rollback_to=item.rollback_to, append_token_ids=item.append, gamma=item.gamma,
        sampling=common_pb2.Sampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed),
        traceparent=traceparent, branches=item.branches, masked_token_ids=sorted(item.masked_ids),
        masked_until=item.masked_until, forced_token_ids=item.forced, output_start=item.output_start,
        cache_salt=item.cache_salt, lookup_only=item.lookup_only, cached_prefix=item.cached_prefix, **features)


def item_from_pb(key: Hashable, pb: draft_pb2.ProposeItem) -> ProposeItem:
    """The item as the draft holds it, under ``key``. The target validated the settings; a bad
    message here is a protocol error, not user input. Features are checked by the proposer that
    reads them (draft_service/feature.py), which refuses a wrong dtype, width or count naming the
    field."""
    # A token draft's item carries no feature fields at all; a feature draft's names its dtype.
    dtype = pb.feature_dtype if pb.feature_width else FEATURE_DTYPE
    return ProposeItem(key, pb.rollback_to, list(pb.append_token_ids), pb.gamma, SamplingParams.from_pb(pb.sampling),
                       features=pb.features, feature_width=pb.feature_width, feature_dtype=dtype,
                       branches=pb.branches, masked_ids=frozenset(pb.masked_token_ids), masked_until=pb.masked_until,
                       constraint=Constraint.from_pb(pb.constraint) if pb.HasField("constraint") else None,
                       penalties=Penalties.from_pb(pb.penalties) if pb.HasField("penalties") else None,
                       output_start=pb.output_start, cache_salt=pb.cache_salt, forced=list(pb.forced_token_ids),
                       lookup_only=pb.lookup_only, cached_prefix=pb.cached_prefix)


def proposal_to_pb(seq_id: int, proposal: Proposal) -> draft_pb2.Proposal:
    return draft_pb2.Proposal(seq_id=seq_id, token_ids=proposal.tokens, length=proposal.length,
                              q_width=proposal.q_width, q_ids=proposal.q_ids, q_probs=proposal.q_probs,
                              proposer=proposal.source, error=proposal.error, parents=proposal.parents)


def proposal_from_pb(pb: draft_pb2.Proposal) -> Proposal:
    """An untrusted reply, as it came (the target checks it: target_service/drafting.py ``malformed``);
    a draft older than ``proposer`` names none: its guesses are the model's."""
    return Proposal(list(pb.token_ids), pb.length, pb.q_width, list(pb.q_ids), list(pb.q_probs),
                    **({"source": pb.proposer} if pb.proposer else {}), error=pb.error, key=pb.seq_id,
                    parents=list(pb.parents))


def info_to_pb(info: DraftInfo) -> draft_pb2.DraftInfo:
    return draft_pb2.DraftInfo(
        model_name=info.model_name, vocab_size=info.vocab_size, max_context_length=info.max_context_length,
        held_sequences=info.held_sequences, free_slots=info.free_slots, feature_layers=list(info.feature_layers),
        feature_width=info.feature_width, lookup=info.lookup, prefix_cache=info.prefix_cache,
        acceptance=[draft_pb2.MeasuredAcceptance(source=source, greedy=greedy, alpha=alpha)
                    for (source, greedy), alpha in info.acceptance.items()])


def info_from_pb(pb: draft_pb2.DraftInfo, ignored: list[str] | None = None) -> DraftInfo:
    """The draft's info. Its acceptance entries are untrusted input: one without a source or with
    α not strictly between 0 and 1 is left out (described in ``ignored``, for the caller to log);
    of a repeated one, the last counts."""
    acceptance = {}
    for entry in pb.acceptance:
        if not entry.source or not 0.0 < entry.alpha < 1.0:  # NaN fails both comparisons
            if ignored is not None:
                ignored.append(f"(source={entry.source!r}, greedy={entry.greedy}, alpha={entry.alpha!r})")
            continue
        acceptance[(entry.source, entry.greedy)] = entry.alpha
    return DraftInfo(model_name=pb.model_name, vocab_size=pb.vocab_size, max_context_length=pb.max_context_length,
                     held_sequences=pb.held_sequences, free_slots=pb.free_slots,
                     feature_layers=tuple(pb.feature_layers), feature_width=pb.feature_width, acceptance=acceptance,
                     lookup=pb.lookup, prefix_cache=pb.prefix_cache)
