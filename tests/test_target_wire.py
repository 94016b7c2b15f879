"""The target's protobuf edge (`specstream/data/engine_wire.py`) for beam search, without an engine.

In: a `SequenceRequest`'s `beam` becomes `messages.BeamOptions` with the wire's defaults filled in
(unset length_penalty = 1, unset beam_threshold = infinity, num_return_sequences 0 = 1, each
`EarlyStopping` value its literal); a bad option is INVALID_ARGUMENT naming `beam.<field>`; what the
gateway builds for a validated beam request arrives as the same options after a trip through bytes.
Out: a beam request's last event carries its hypotheses (no text on this hop) and `beam_expansions`.
"""

from __future__ import annotations

import math

import grpc
import pytest

from gateway.validation import Limits, validate
from specstream.data.batch_stats import BatchStats
from specstream.data.config import GatewayConfig
from specstream.data.engine import (
    BeamHypothesis,
    BeamOptions,
    EngineMessage,
    Load,
    SequenceEvent,
    SequenceStats,
    TargetInfo,
)
from specstream.data.engine_wire import message_to_pb, request_from_pb, request_to_pb
from specstream.data.errors import InvalidArgumentError
from specstream.text.tokenizer import TextTokenizer, build_byte_level_tokenizer
from specstream_pb import common_pb2, generation_pb2, target_pb2

TT = TextTokenizer(build_byte_level_tokenizer(), eos_token_ids=[1], bos_token_id=0)
LOAD = Load(max_slots=8, free_slots=8, running=0, queued=0, draft_sequences=0, draft_connected=False,
            batch=BatchStats("static", 8))


def _sequence_pb(beam: common_pb2.BeamSearch | None = None) -> target_pb2.SequenceRequest:
    pb = target_pb2.SequenceRequest(id="s1", prompt_token_ids=[5, 6, 7], max_new_tokens=9, stop_token_ids=[1],
                                    eos_token_ids=[1], sampling=common_pb2.Sampling(top_p=1.0, seed=3),
                                    speculation=common_pb2.Speculation(mode=common_pb2.SPECULATION_MODE_OFF))
    if beam is not None:
        pb.beam.CopyFrom(beam)
    return pb


def _through_bytes(pb: target_pb2.SequenceRequest) -> target_pb2.SequenceRequest:
    return target_pb2.SequenceRequest.FromString(pb.SerializeToString())


# --- requests in ----------------------------------------------------------------------------------------


def test_every_beam_field_crosses_the_edge() -> None:
    # Values a float32 holds exactly, so the comparison is exact.
    beam = common_pb2.BeamSearch(num_beams=6, num_return_sequences=4, length_penalty=-0.5,
                                 early_stopping=common_pb2.EARLY_STOPPING_NEVER, beam_threshold=2.25,
                                 max_candidates_per_parent=3)
    req = request_from_pb(_through_bytes(_sequence_pb(beam)))
    assert req.beam == BeamOptions(num_beams=6, num_return_sequences=4, length_penalty=-0.5, early_stopping="never",
                                   beam_threshold=2.25, max_candidates_per_parent=3)
    assert (req.id, req.prompt_token_ids, req.max_new_tokens, req.speculation.mode) == ("s1", [5, 6, 7], 9, "off")


def test_unset_beam_fields_take_the_wire_defaults() -> None:
    req = request_from_pb(_through_bytes(_sequence_pb(common_pb2.BeamSearch(num_beams=3))))
    assert req.beam == BeamOptions(num_beams=3, num_return_sequences=1, length_penalty=1.0,
                                   early_stopping="heuristic", beam_threshold=math.inf, max_candidates_per_parent=0)
    # A length_penalty set to 0 is 0 (no normalisation), not "unset".
    zero = request_from_pb(_sequence_pb(common_pb2.BeamSearch(num_beams=3, length_penalty=0.0)))
    assert zero.beam is not None and zero.beam.length_penalty == 0.0


def test_a_request_without_beam_is_ordinary_decoding() -> None:
    assert request_from_pb(_through_bytes(_sequence_pb())).beam is None


@pytest.mark.parametrize(("value", "literal"), [
    (common_pb2.EARLY_STOPPING_UNSPECIFIED, "heuristic"),
    (common_pb2.EARLY_STOPPING_HEURISTIC, "heuristic"),
    (common_pb2.EARLY_STOPPING_FIRST_K, "first_k"),
    (common_pb2.EARLY_STOPPING_NEVER, "never"),
])
def test_each_early_stopping_value_maps_to_its_literal(value: int, literal: str) -> None:
    req = request_from_pb(_sequence_pb(common_pb2.BeamSearch(num_beams=2, early_stopping=value)))
    assert req.beam is not None and req.beam.early_stopping == literal


@pytest.mark.parametrize(("field", "fields"), [
    ("beam.num_beams", dict(num_beams=0)),
    ("beam.num_beams", dict(num_beams=-1)),
    ("beam.num_return_sequences", dict(num_return_sequences=4)),
    ("beam.num_return_sequences", dict(num_return_sequences=-1)),
    ("beam.length_penalty", dict(length_penalty=math.nan)),
    ("beam.length_penalty", dict(length_penalty=-math.inf)),
    ("beam.beam_threshold", dict(beam_threshold=0.0)),
    ("beam.beam_threshold", dict(beam_threshold=-2.0)),
    ("beam.beam_threshold", dict(beam_threshold=math.nan)),
    ("beam.max_candidates_per_parent", dict(max_candidates_per_parent=4)),
    ("beam.max_candidates_per_parent", dict(max_candidates_per_parent=-1)),
    ("beam.early_stopping", dict(early_stopping=9)),  # a value newer than this server
])
def test_bad_beam_options_are_invalid_argument_naming_the_field(field: str, fields: dict) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        request_from_pb(_through_bytes(_sequence_pb(common_pb2.BeamSearch(**{"num_beams": 3, **fields}))))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.field == field and str(info.value).startswith(f"{field}=")


def test_what_the_gateway_sends_for_a_beam_request_is_what_the_engine_gets() -> None:
    limits = Limits.build(GatewayConfig("t:1", "m"), TargetInfo(vocab_size=TT.vocab_size, max_context_length=256,
                                                                max_gamma=8))
    beam = common_pb2.BeamSearch(num_beams=4, num_return_sequences=2, length_penalty=0.0,
                                 early_stopping=common_pb2.EARLY_STOPPING_FIRST_K, max_candidates_per_parent=2)
    public = generation_pb2.GenerateRequest(prompt="x = ", max_new_tokens=6, beam=beam, stop_token_ids=[7],
                                            speculation=common_pb2.Speculation(mode=common_pb2.SPECULATION_MODE_AUTO))
    sent = request_to_pb(validate(public, limits, TT).sequence)
    req = request_from_pb(_through_bytes(sent))
    assert req.beam == BeamOptions(num_beams=4, num_return_sequences=2, length_penalty=0.0, early_stopping="first_k",
                                   beam_threshold=math.inf, max_candidates_per_parent=2)
    assert req.stop_token_ids == frozenset({1, 7}) and req.eos_token_ids == frozenset({1})
    assert req.sampling.temperature == 0.0 and req.logprobs is None  # greedy, as beams must be


# --- events out ------------------------------------------------------------------------------------------


HYPOTHESES = [
    BeamHypothesis(token_ids=[40, 41, 1], score=-0.25, logprob=-0.75, finish_reason="eos"),
    BeamHypothesis(token_ids=[40, 42, 43, 44], score=-0.5, logprob=-2.0, finish_reason="length"),
    BeamHypothesis(token_ids=[45, 7], score=-1.5, logprob=-3.0, finish_reason="stop"),
]


def test_a_beam_requests_events_cross_the_edge() -> None:
    step = message_to_pb(EngineMessage(LOAD, step=4, events=[SequenceEvent("s1", queue_seconds=0.5,
                                                                           stats=SequenceStats(target_passes=1))]))
    last = message_to_pb(EngineMessage(LOAD, step=9, events=[SequenceEvent(
        "s1", token_ids=list(HYPOTHESES[0].token_ids), finish_reason="eos",
        stats=SequenceStats(target_passes=6, beam_expansions=17), sequences=HYPOTHESES)]))
    step, last = (target_pb2.TargetMessage.FromString(m.SerializeToString()) for m in (step, last))

    (early,) = step.events.events
    assert not early.token_ids and not early.sequences and early.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert early.queue_seconds == 0.5

    (final,) = last.events.events
    assert final.finish_reason == common_pb2.FINISH_REASON_EOS and list(final.token_ids) == [40, 41, 1]
    assert final.stats.beam_expansions == 17 and final.stats.target_passes == 6
    assert [list(s.token_ids) for s in final.sequences] == [h.token_ids for h in HYPOTHESES]
    assert [(s.score, s.logprob) for s in final.sequences] == [(h.score, h.logprob) for h in HYPOTHESES]
    assert [s.finish_reason for s in final.sequences] == [common_pb2.FINISH_REASON_EOS, common_pb2.FINISH_REASON_LENGTH,
                                                         common_pb2.FINISH_REASON_STOP]
    assert all(s.text == "" for s in final.sequences)  # the gateway detokenizes


def test_an_ordinary_event_carries_no_beam_fields() -> None:
    pb = message_to_pb(EngineMessage(LOAD, step=1, events=[SequenceEvent("s2", token_ids=[5], finish_reason="length")]))
    (event,) = pb.events.events
    assert not event.sequences and event.stats.beam_expansions == 0 and list(event.token_ids) == [5]
