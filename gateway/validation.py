"""Validation of public GenerateRequest fields, in one place.

Every rule raises InvalidArgumentError naming the field and the value, before anything reaches
the target. Tokenization happens here too, since the prompt's token count is what is checked.
Sampling settings are only range-checked here (and an unset seed is picked here, so it can be
returned); what they mean is the target engine's business. The public request is read here, once:
a `ValidRequest` holds plain values, and becomes the engine's `SequenceRequest` (`to_sequence`).
"""

from __future__ import annotations

import math
import re
import secrets
import time
import uuid
from dataclasses import dataclass

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from specstream.data.beam import BeamOptions, check_combination
from specstream.data.config import GatewayConfig
from specstream.data.engine import SequenceRequest, Speculation, TargetInfo
from specstream.data.engine_wire import speculation_from_pb
from specstream.data.errors import InvalidArgumentError
from specstream.data.sampling import SamplingParams
from specstream.text.chat import ChatError
from specstream.text.tokenizer import TextTokenizer
from specstream_pb import common_pb2, generation_pb2

TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


@dataclass(frozen=True)
class Limits:
    """What the gateway enforces: its own config plus what the target reported."""

    vocab_size: int
    max_context_length: int
    max_new_tokens: int
    max_gamma: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_request_id_chars: int
    max_top_logprobs: int
    max_messages: int
    # A text prompt (or a chat's contents) longer than this is refused before tokenizing; 0: the
    # context length × the tokenizer's longest token (`prompt_chars`).
    max_prompt_chars: int

    @classmethod
    def build(cls, config: GatewayConfig, info: TargetInfo) -> Limits:
        return cls(vocab_size=info.vocab_size, max_context_length=info.max_context_length,
                   max_new_tokens=min(config.max_new_tokens_limit, info.max_context_length - 1),
                   max_gamma=info.max_gamma, max_stop_strings=config.max_stop_strings,
                   max_stop_string_chars=config.max_stop_string_chars,
                   max_request_id_chars=config.max_request_id_chars,
                   max_top_logprobs=min(config.max_top_logprobs, info.vocab_size),
                   max_messages=config.max_messages, max_prompt_chars=config.max_prompt_chars)

    def prompt_chars(self, tokenizer: TextTokenizer) -> int:
        return self.max_prompt_chars or self.max_context_length * tokenizer.max_token_chars


@dataclass
class ValidRequest:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    speculation: Speculation
    temperature: float  # 0: greedy (top_k, top_p then have no effect)
    top_k: int  # 0: off
    top_p: float  # in (0, 1]; 1: off
    seed: int  # the caller's, or one picked here; returned with the result
    logprobs: bool
    top_logprobs: int  # alternatives per token; 0 unless logprobs
    traceparent: str
    received: float  # time.monotonic() at receipt
    model: str = ""  # the served model's name (set by the servicer; for traces)
    chat: bool = False  # the prompt came as `messages`, rendered with the chat template
    end_of_turn: int | None = None  # chat requests: the template's end-of-turn token ends generation
    beam: BeamOptions | None = None  # beam search

    def to_sequence(self, eos_ids: tuple[int, ...], traceparent: str | None = None) -> SequenceRequest:
        """What the target engine is asked for: `eos_ids` (and a chat's end of turn) end it unless
        ignore_eos; `traceparent`: the span its spans join (None: the caller's)."""
        ends = (*eos_ids, self.end_of_turn) if self.end_of_turn is not None else eos_ids
        eos = frozenset() if self.ignore_eos else frozenset(ends)
        return SequenceRequest(
            id=self.request_id, prompt_token_ids=self.prompt_ids, max_new_tokens=self.max_new_tokens,
            stop_token_ids=frozenset(self.stop_token_ids) | eos, eos_token_ids=eos, speculation=self.speculation,
            sampling=SamplingParams.from_settings(self.temperature, self.top_k, self.top_p, self.seed),
            logprobs=self.top_logprobs if self.logprobs else None,
            traceparent=self.traceparent if traceparent is None else traceparent, beam=self.beam)


def validate(req: generation_pb2.GenerateRequest, limits: Limits, tokenizer: TextTokenizer,
             fill_max_new_tokens: bool = False) -> ValidRequest:
    """`fill_max_new_tokens`: a max_new_tokens of 0 means as many as the context and the limit
    allow after the prompt (the HTTP front's unset max_tokens); otherwise 0 is refused."""
    received = time.monotonic()
    _reject_unknown_fields(req, "request")
    if len(req.request_id) > limits.max_request_id_chars:
        raise InvalidArgumentError("request_id", req.request_id, f"longer than {limits.max_request_id_chars} characters")
    prompt_ids = _prompt_ids(req, limits, tokenizer)
    max_new_tokens = req.max_new_tokens
    if fill_max_new_tokens and max_new_tokens == 0:
        max_new_tokens = min(limits.max_new_tokens, limits.max_context_length - len(prompt_ids))
    _check_max_new_tokens(max_new_tokens, len(prompt_ids), limits)
    _check_stop(req, limits)
    _check_speculation(req.speculation, limits)
    _check_sampling(req)
    _check_logprobs(req, limits)
    beam = _check_beam(req)
    if req.traceparent and not TRACEPARENT.match(req.traceparent):
        raise InvalidArgumentError("traceparent", req.traceparent, "not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)")
    return ValidRequest(
        request_id=req.request_id or uuid.uuid4().hex, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
        stop=list(req.stop), stop_token_ids=list(req.stop_token_ids), ignore_eos=req.ignore_eos,
        speculation=speculation_from_pb(req.speculation), temperature=req.temperature, top_k=req.top_k,
        top_p=req.top_p if req.HasField("top_p") else 1.0,
        seed=req.seed if req.HasField("seed") else secrets.randbits(64),
        logprobs=req.logprobs, top_logprobs=req.top_logprobs, traceparent=req.traceparent, received=received,
        chat=req.WhichOneof("input") == "messages",
        # A template whose end of turn is not one token (rare) ends on EOS only.
        end_of_turn=tokenizer.end_of_turn_id if req.WhichOneof("input") == "messages" else None,
        beam=beam)


def _reject_unknown_fields(message: Message, path: str) -> None:
    """Fields this server does not know (a newer client?) must not be silently ignored."""
    unknown = UnknownFieldSet(message)
    if len(unknown):
        raise InvalidArgumentError(path, f"field number {unknown[0].field_number}",
                                   "unknown field; this server does not support that option")
    for field, value in message.ListFields():
        if field.message_type is not None and not field.is_repeated:
            _reject_unknown_fields(value, f"{path}.{field.name}" if path != "request" else field.name)


CHAT_ROLES = ("system", "user", "assistant", "tool")


def _chat_ids(req: generation_pb2.GenerateRequest, limits: Limits, tokenizer: TextTokenizer) -> list[int]:
    messages = req.messages.messages
    if tokenizer.chat_template is None:
        raise InvalidArgumentError("messages", f"<{len(messages)} messages>",
                                   "this model has no chat template; send a text prompt instead")
    if not messages:
        raise InvalidArgumentError("messages", [], "must hold at least one message")
    if len(messages) > limits.max_messages:
        raise InvalidArgumentError("messages", f"<{len(messages)} messages>", f"at most {limits.max_messages} allowed")
    for i, m in enumerate(messages):
        _reject_unknown_fields(m, f"messages[{i}]")
        if m.role not in CHAT_ROLES:
            raise InvalidArgumentError(f"messages[{i}].role", m.role, f"must be one of {list(CHAT_ROLES)}")
    _check_prompt_chars("messages", sum(len(m.content) for m in messages), limits.prompt_chars(tokenizer), limits)
    try:
        return tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in messages])
    except ChatError as exc:
        raise InvalidArgumentError("messages", f"<{len(messages)} messages>",
                                   f"the model's chat template rejected them: {exc}") from exc


def _prompt_ids(req: generation_pb2.GenerateRequest, limits: Limits, tokenizer: TextTokenizer) -> list[int]:
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidArgumentError("prompt", "", "must be set (text prompt, prompt_token_ids or messages)")
    if kind == "messages":
        ids = _chat_ids(req, limits, tokenizer)
        field = "messages"
    elif kind == "prompt":
        if not req.prompt:
            raise InvalidArgumentError("prompt", req.prompt, "must not be empty")
        _check_prompt_chars("prompt", len(req.prompt), limits.prompt_chars(tokenizer), limits)
        ids = tokenizer.encode(req.prompt)
        if not ids:
            raise InvalidArgumentError("prompt", req.prompt, "encodes to no tokens")
        field = "prompt"
    else:
        ids = list(req.prompt_token_ids.ids)
        if not ids:
            raise InvalidArgumentError("prompt_token_ids", [], "must not be empty")
        bad = next((t for t in ids if t >= limits.vocab_size), None)
        if bad is not None:
            raise InvalidArgumentError("prompt_token_ids", bad, f"token id must be < vocab size {limits.vocab_size}")
        field = "prompt_token_ids"
    if len(ids) >= limits.max_context_length:
        raise InvalidArgumentError(field, f"<{len(ids)} tokens>",
                                   f"prompt is longer than the context length {limits.max_context_length} "
                                   "(leave room for at least one new token)")
    return ids


def _check_prompt_chars(field: str, chars: int, most: int, limits: Limits) -> None:
    """Before tokenizing: a text this long cannot fit the context, so it costs nothing to refuse."""
    if chars > most:
        raise InvalidArgumentError(field, f"<{chars} characters>",
                                   f"longer than {most} characters (more than the context of "
                                   f"{limits.max_context_length} tokens can hold)")


def _check_max_new_tokens(value: int, prompt_len: int, limits: Limits) -> None:
    if value <= 0:
        raise InvalidArgumentError("max_new_tokens", value, "must be >= 1")
    if value > limits.max_new_tokens:
        raise InvalidArgumentError("max_new_tokens", value, f"must be <= {limits.max_new_tokens}")
    if prompt_len + value > limits.max_context_length:
        raise InvalidArgumentError("max_new_tokens", value,
                                   f"prompt ({prompt_len} tokens) + max_new_tokens exceeds the context length "
                                   f"{limits.max_context_length}")


def _check_stop(req: generation_pb2.GenerateRequest, limits: Limits) -> None:
    if len(req.stop) > limits.max_stop_strings:
        raise InvalidArgumentError("stop", f"<{len(req.stop)} strings>", f"at most {limits.max_stop_strings} allowed")
    for i, stop in enumerate(req.stop):
        if not stop:
            raise InvalidArgumentError(f"stop[{i}]", stop, "must not be empty")
        if len(stop) > limits.max_stop_string_chars:
            raise InvalidArgumentError(f"stop[{i}]", stop, f"longer than {limits.max_stop_string_chars} characters")
    for i, tok in enumerate(req.stop_token_ids):
        if tok >= limits.vocab_size:
            raise InvalidArgumentError(f"stop_token_ids[{i}]", tok, f"token id must be < vocab size {limits.vocab_size}")


def _check_speculation(spec: common_pb2.Speculation, limits: Limits) -> None:
    modes = common_pb2.SpeculationMode
    if spec.mode not in modes.values():
        raise InvalidArgumentError("speculation.mode", spec.mode, f"unknown mode; use one of {list(modes.keys())}")
    if spec.mode == common_pb2.SPECULATION_MODE_FIXED:
        if not 1 <= spec.gamma <= limits.max_gamma:
            raise InvalidArgumentError("speculation.gamma", spec.gamma, f"must be in 1..{limits.max_gamma}")
    elif spec.gamma != 0:
        raise InvalidArgumentError("speculation.gamma", spec.gamma,
                                   f"only applies with mode SPECULATION_MODE_FIXED (mode is {modes.Name(spec.mode)})")
    if spec.mode == common_pb2.SPECULATION_MODE_AUTO:
        if spec.max_gamma > limits.max_gamma:
            raise InvalidArgumentError("speculation.max_gamma", spec.max_gamma,
                                       f"must be in 0..{limits.max_gamma} (0: the server's limit)")
    elif spec.max_gamma != 0:
        raise InvalidArgumentError("speculation.max_gamma", spec.max_gamma,
                                   f"only applies with mode SPECULATION_MODE_AUTO (mode is {modes.Name(spec.mode)})")


def _check_sampling(req: generation_pb2.GenerateRequest) -> None:
    # top_k / top_p are accepted with temperature 0 and ignored there (greedy is argmax).
    if not (math.isfinite(req.temperature) and req.temperature >= 0):
        raise InvalidArgumentError("temperature", req.temperature, "must be a finite number >= 0 (0 = greedy)")
    if req.top_k < 0:
        raise InvalidArgumentError("top_k", req.top_k, "must be >= 0 (0 = off)")
    if req.HasField("top_p") and not (math.isfinite(req.top_p) and 0 < req.top_p <= 1):
        raise InvalidArgumentError("top_p", req.top_p, "must be in (0, 1] (1 = off)")


def _check_logprobs(req: generation_pb2.GenerateRequest, limits: Limits) -> None:
    if not 0 <= req.top_logprobs <= limits.max_top_logprobs:
        raise InvalidArgumentError("top_logprobs", req.top_logprobs, f"must be in 0..{limits.max_top_logprobs}")
    if req.top_logprobs and not req.logprobs:
        raise InvalidArgumentError("top_logprobs", req.top_logprobs, "requires logprobs=true")


def _check_beam(req: generation_pb2.GenerateRequest) -> BeamOptions | None:
    """Beam options and what may go with them (greedy only); the target checks num_beams against
    its slots."""
    if not req.HasField("beam"):
        return None
    beam = BeamOptions.from_pb(req.beam)
    check_combination(temperature=req.temperature, top_k=req.top_k,
                      top_p=req.top_p if req.HasField("top_p") else 1.0,
                      fixed_speculation=req.speculation.mode == common_pb2.SPECULATION_MODE_FIXED,
                      logprobs=req.logprobs, stop_strings=len(req.stop))
    return beam
