"""Gateway request validation without a running stack: the sampling and logprob rules, the seed
the gateway picks, and what reaches the target's SequenceRequest."""

from __future__ import annotations

import dataclasses
import math

import grpc
import pytest

from gateway.validation import Limits, validate
from specstream.data.beam import BeamOptions
from specstream.data.config import GatewayConfig
from specstream.data.engine import Speculation, TargetInfo
from specstream.data.engine_wire import request_to_pb
from specstream.data.errors import InvalidArgumentError
from specstream.text.tokenizer import TextTokenizer, build_byte_level_tokenizer
from specstream_pb import common_pb2, generation_pb2

TT = TextTokenizer(build_byte_level_tokenizer(), eos_token_ids=[1], bos_token_id=0)
INFO = TargetInfo(vocab_size=TT.vocab_size, max_context_length=256, max_gamma=8, default_gamma=4, eos_token_ids=[1])
LIMITS = Limits.build(GatewayConfig("t:1", "m"), INFO)


def _validate(**fields):
    return validate(generation_pb2.GenerateRequest(prompt="def f():", max_new_tokens=4, **fields), LIMITS, TT)


@pytest.mark.parametrize(("field", "fields"), [
    ("temperature", dict(temperature=-1.0)),
    ("temperature", dict(temperature=-1e-30)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=math.inf)),
    ("top_k", dict(temperature=1.0, top_k=-1)),
    ("top_p", dict(temperature=1.0, top_p=0.0)),
    ("top_p", dict(temperature=1.0, top_p=-0.5)),
    ("top_p", dict(temperature=1.0, top_p=1.5)),
    ("top_p", dict(temperature=1.0, top_p=math.nan)),
    ("top_p", dict(temperature=1.0, top_p=math.inf)),
    ("top_p", dict(top_p=0.0)),  # greedy ignores top_p, but a malformed one is still an error
    ("top_logprobs", dict(logprobs=True, top_logprobs=-1)),
    ("top_logprobs", dict(logprobs=True, top_logprobs=21)),
    ("top_logprobs", dict(top_logprobs=2)),
])
def test_bad_sampling_fields_are_named(field, fields):
    with pytest.raises(InvalidArgumentError) as info:
        _validate(**fields)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}=")


def test_top_logprobs_without_logprobs_says_why():
    with pytest.raises(InvalidArgumentError, match="requires logprobs=true"):
        _validate(top_logprobs=1)


def test_top_logprobs_limit_comes_from_the_config_and_the_vocab():
    config = GatewayConfig("t:1", "m", max_top_logprobs=3)
    limits = Limits.build(config, INFO)
    assert limits.max_top_logprobs == 3
    req = generation_pb2.GenerateRequest(prompt="x", max_new_tokens=1, logprobs=True, top_logprobs=4)
    with pytest.raises(InvalidArgumentError, match="must be in 0..3"):
        validate(req, limits, TT)
    tiny_vocab = TargetInfo(vocab_size=5, max_context_length=256, max_gamma=8)
    assert Limits.build(GatewayConfig("t:1", "m"), tiny_vocab).max_top_logprobs == 5


@pytest.mark.parametrize("fields", [
    dict(),
    dict(top_k=50, top_p=0.5),  # greedy: allowed, and ignored by the engine
    dict(temperature=0.8, top_k=1, top_p=1.0),
    dict(temperature=2.0, top_p=1e-6),
    dict(logprobs=True),
    dict(logprobs=True, top_logprobs=20),
])
def test_good_sampling_fields_pass(fields):
    _validate(**fields)


def test_sequence_request_carries_the_sampling_settings():
    valid = _validate(temperature=0.7, top_k=40, top_p=0.9, seed=2**64 - 1, logprobs=True, top_logprobs=5)
    seq = valid.sequence
    assert seq.sampling.temperature == pytest.approx(0.7)
    assert seq.sampling.top_k == 40
    assert seq.sampling.top_p == pytest.approx(0.9)
    assert seq.sampling.seed == 2**64 - 1
    assert seq.logprobs == 5  # the chosen tokens' log-probabilities, with 5 alternatives each


def test_defaults_reach_the_target_as_greedy_with_top_p_1():
    seq = _validate().sequence
    assert seq.sampling.greedy and seq.sampling.top_k == 0
    assert seq.sampling.top_p == 1.0  # unset means off, not 0
    assert seq.logprobs is None  # not requested
    assert seq.speculation == Speculation("auto") and seq.beam is None
    assert seq.stop_token_ids == seq.eos_token_ids == frozenset({1})


def test_ignore_eos_and_the_eos_ids_set_the_stop_ids():
    """The target's EOS ids and the tokenizer's end generation and report as "eos", unless
    ignore_eos (a chat's end of turn joins them: tests/test_chat.py)."""
    two_eos = Limits.build(GatewayConfig("t:1", "m"), dataclasses.replace(INFO, eos_token_ids=[1, 2]))
    quiet = validate(generation_pb2.GenerateRequest(prompt="x", max_new_tokens=4, ignore_eos=True, stop_token_ids=[9]),
                     two_eos, TT)
    assert quiet.sequence.stop_token_ids == {9} and not quiet.sequence.eos_token_ids
    valid = validate(generation_pb2.GenerateRequest(prompt="x", max_new_tokens=4, stop_token_ids=[9],
                                                    traceparent="00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"), two_eos, TT)
    seq = valid.sequence
    assert seq.stop_token_ids == {1, 2, 9} and seq.eos_token_ids == {1, 2}
    assert seq.traceparent.startswith("00-abab") and seq.id == valid.request_id and not valid.chat


def test_seed_zero_is_kept_and_an_unset_seed_is_picked():
    assert _validate(temperature=1.0, seed=0).seed == 0
    valid = _validate(temperature=1.0)
    assert valid.sequence.sampling.seed == valid.seed
    picked = {_validate(temperature=1.0).seed for _ in range(8)}
    assert all(0 <= s < 2**64 for s in picked)
    # 64 random bits: eight draws colliding has probability ~ 28 / 2**64.
    assert len(picked) == 8


@pytest.mark.parametrize(("fields", "message"), [
    (dict(speculation=dict(mode=0, max_gamma=9)), "speculation.max_gamma=9: must be in 0..8"),
    (dict(speculation=dict(mode=2, gamma=2, max_gamma=3)), "speculation.max_gamma=3: only applies with mode"),
    (dict(speculation=dict(mode=1, max_gamma=3)), "speculation.max_gamma=3: only applies with mode"),
])
def test_max_gamma_is_checked_against_the_mode_and_the_limit(fields, message):
    with pytest.raises(InvalidArgumentError) as info:
        _validate(**fields)
    assert info.value.field == "speculation.max_gamma" and str(info.value).startswith(message)


def test_max_gamma_reaches_the_target_with_auto():
    validated = _validate(speculation=dict(mode=0, max_gamma=3))
    assert validated.sequence.speculation == Speculation("auto", gamma=0, max_gamma=3)
    fixed = _validate(speculation=dict(mode=2, gamma=5))
    assert fixed.sequence.speculation == Speculation("fixed", gamma=5)


# -- beam search -----------------------------------------------------------------------------------------------
def _beam(**fields):
    return common_pb2.BeamSearch(**{"num_beams": 3, **fields})


# (the field the error names, the request's fields): every bad beam option and every combination a
# beam refuses. tests/test_gateway_beam.py sends each through the served gateway as well.
BAD_BEAM_REQUESTS = [
    ("beam.num_beams", dict(beam=_beam(num_beams=0))),
    ("beam.num_beams", dict(beam=_beam(num_beams=-2))),
    ("beam.num_return_sequences", dict(beam=_beam(num_return_sequences=4))),
    ("beam.num_return_sequences", dict(beam=_beam(num_return_sequences=-1))),
    ("beam.length_penalty", dict(beam=_beam(length_penalty=math.nan))),
    ("beam.length_penalty", dict(beam=_beam(length_penalty=math.inf))),
    ("beam.beam_threshold", dict(beam=_beam(beam_threshold=0.0))),
    ("beam.beam_threshold", dict(beam=_beam(beam_threshold=-1.0))),
    ("beam.beam_threshold", dict(beam=_beam(beam_threshold=math.nan))),
    ("beam.max_candidates_per_parent", dict(beam=_beam(max_candidates_per_parent=4))),
    ("beam.max_candidates_per_parent", dict(beam=_beam(max_candidates_per_parent=-1))),
    ("beam.early_stopping", dict(beam=_beam(early_stopping=7))),
    # beam search is greedy only
    ("temperature", dict(beam=_beam(), temperature=0.8)),
    ("top_k", dict(beam=_beam(), top_k=5)),
    ("top_p", dict(beam=_beam(), top_p=0.9)),
    ("speculation.mode", dict(beam=_beam(), speculation=common_pb2.Speculation(mode=common_pb2.SPECULATION_MODE_FIXED,
                                                                                gamma=2))),
    ("logprobs", dict(beam=_beam(), logprobs=True)),
    ("stop", dict(beam=_beam(), stop=["\n"])),
    ("stop", dict(beam=_beam(), stop=["a", "b"])),
]


@pytest.mark.parametrize(("field", "fields"), BAD_BEAM_REQUESTS)
def test_bad_beam_options_and_combinations_are_named(field, fields):
    with pytest.raises(InvalidArgumentError) as info:
        _validate(**fields)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}=")


def test_a_beam_with_stop_strings_says_they_are_not_supported():
    with pytest.raises(InvalidArgumentError, match="not supported with beam"):
        _validate(beam=_beam(), stop=["\n"])


@pytest.mark.parametrize("fields", [
    dict(num_beams=1),  # greedy decoding as a beam
    dict(num_return_sequences=0),  # 0 = 1
    dict(num_return_sequences=3),  # all of them
    dict(max_candidates_per_parent=3),  # = num_beams: no cap
    dict(beam_threshold=math.inf),  # set to infinity: fixed width, as unset
    dict(beam_threshold=1e-3, length_penalty=-2.0),
    dict(early_stopping=common_pb2.EARLY_STOPPING_NEVER),
])
def test_beam_option_bounds_are_inclusive(fields):
    beam = _validate(beam=_beam(**fields)).sequence.beam
    assert isinstance(beam, BeamOptions) and beam.num_beams == fields.get("num_beams", 3)


@pytest.mark.parametrize("mode", [common_pb2.SPECULATION_MODE_AUTO, common_pb2.SPECULATION_MODE_OFF])
def test_a_beam_accepts_automatic_or_no_speculation(mode):
    assert _validate(beam=_beam(), speculation=common_pb2.Speculation(mode=mode)).sequence.beam.num_beams == 3


def test_beam_options_reach_the_target():
    beam = _beam(num_return_sequences=2, length_penalty=0.0, early_stopping=common_pb2.EARLY_STOPPING_FIRST_K,
                 beam_threshold=1.5, max_candidates_per_parent=2)
    seq = _validate(beam=beam, speculation=common_pb2.Speculation(mode=common_pb2.SPECULATION_MODE_OFF),
                    stop_token_ids=[7]).sequence
    assert seq.beam == BeamOptions(num_beams=3, num_return_sequences=2, length_penalty=0.0, early_stopping="first_k",
                                   beam_threshold=1.5, max_candidates_per_parent=2)
    wire = request_to_pb(seq).beam
    assert wire.HasField("length_penalty") and wire.length_penalty == 0.0  # set to 0, not unset
    assert seq.stop_token_ids == {1, 7} and seq.speculation.mode == "off"
    assert _validate().sequence.beam is None
    top_p_one = _validate(beam=_beam(), top_p=1.0)  # an explicit top_p of 1 is "off": allowed
    assert top_p_one.sequence.beam.num_beams == 3
