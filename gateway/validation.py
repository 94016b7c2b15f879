"""Validation of public GenerateRequest fields, in one place.

Every rule raises InvalidArgumentError naming the field and the value, before anything reaches
the target. Tokenization happens here too, since the prompt's token count is what is checked.
The public request is read here, once, into the engine's own `SequenceRequest` (EOS, stop ids,
sampling and speculation settings resolved), which every request rule then checks
(specstream/data/request_rules.py: the same functions the target engine runs on what it is
sent). What only the public encoding can get wrong is checked here alone: unknown fields, the
request id, stop strings, chat messages, the prompt's characters, `top_logprobs` without
`logprobs`, the traceparent, and tools (gateway/tools.py: they become the chat's system text and
the request's constraint). An unset seed is picked here, so it can be returned.
"""

from __future__ import annotations

import re
import secrets
import time
import uuid
from dataclasses import dataclass

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from gateway.tools import ToolRequest, conversation, read_tools
from specstream.data.beam import BeamOptions
from specstream.data.config import GatewayConfig
from specstream.data.constraint import Constraint
from specstream.data.penalties import Penalties
from specstream.data.engine import SequenceRequest, TargetInfo
from specstream.data.engine_wire import speculation_from_pb
from specstream.data.errors import InvalidArgumentError
from specstream.data.request_rules import RequestLimits, check_request, check_stop_ids
from specstream.data.sampling import SamplingParams
from specstream.text.chat import ChatError
from specstream.text.grammar import GrammarCompiler
from specstream.text.tokenizer import TextTokenizer
from specstream_pb import generation_pb2

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
    eos_token_ids: tuple[int, ...] = ()  # the target's EOS ids (the tokenizer's are added to them)

    @classmethod
    def build(cls, config: GatewayConfig, info: TargetInfo) -> Limits:
        return cls(vocab_size=info.vocab_size, max_context_length=info.max_context_length,
                   max_new_tokens=min(config.max_new_tokens_limit, info.max_context_length - 1),
                   max_gamma=info.max_gamma, max_stop_strings=config.max_stop_strings,
                   max_stop_string_chars=config.max_stop_string_chars,
                   max_request_id_chars=config.max_request_id_chars,
                   max_top_logprobs=min(config.max_top_logprobs, info.vocab_size),
                   max_messages=config.max_messages, max_prompt_chars=config.max_prompt_chars,
                   eos_token_ids=tuple(info.eos_token_ids))

    @property
    def request(self) -> RequestLimits:
        """The limits every request rule reads (the target's slots are the target's to check)."""
        return RequestLimits(vocab_size=self.vocab_size, max_context_length=self.max_context_length,
                             max_new_tokens=self.max_new_tokens, max_gamma=self.max_gamma,
                             max_top_logprobs=self.max_top_logprobs)

    def prompt_chars(self, tokenizer: TextTokenizer) -> int:
        return self.max_prompt_chars or self.max_context_length * tokenizer.max_token_chars


@dataclass
class ValidRequest:
    """A public request that keeps every rule: the engine's request it is (`sequence`, sent on as
    it is but for the traceparent of the gateway's span), and what only the gateway needs."""

    sequence: SequenceRequest
    stop: list[str]  # stop strings (matched in the text here; not sent to the target)
    received: float  # time.monotonic() at receipt
    chat: bool = False  # the prompt came as `messages`, rendered with the chat template
    model: str = ""  # the served model's name (set by the servicer; for traces)
    reads_calls: bool = False  # tools offered with a tool_choice other than "none": the answer is read for calls

    @property
    def request_id(self) -> str:
        return self.sequence.id

    @property
    def prompt_ids(self) -> list[int]:
        return self.sequence.prompt_token_ids

    @property
    def seed(self) -> int:
        """The caller's seed, or the one picked here; returned with the result."""
        return self.sequence.sampling.seed


def validate(req: generation_pb2.GenerateRequest, limits: Limits, tokenizer: TextTokenizer,
             fill_max_new_tokens: bool = False, grammars: GrammarCompiler | None = None) -> ValidRequest:
    """`fill_max_new_tokens`: a max_new_tokens of 0 means as many as the context and the limit
    allow after the prompt (the HTTP front's unset max_tokens); otherwise 0 is refused.
    `grammars`: compiles a constraint here, so a bad schema, regex or grammar is refused (naming
    the field and the compiler's reason) before any target sees it; the compiled grammar is not
    sent, the constraint's source is."""
    received = time.monotonic()
    _reject_unknown_fields(req, "request")
    if len(req.request_id) > limits.max_request_id_chars:
        raise InvalidArgumentError("request_id", req.request_id, f"longer than {limits.max_request_id_chars} characters")
    _check_stop_strings(req, limits)
    _check_logprobs_pair(req)
    if req.traceparent and not TRACEPARENT.match(req.traceparent):
        raise InvalidArgumentError("traceparent", req.traceparent, "not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)")
    for i, tool in enumerate(req.tools):
        _reject_unknown_fields(tool, f"tools[{i}]")
    tools = read_tools(req)
    prompt_field, prompt_ids = _prompt_ids(req, limits, tokenizer, tools)
    max_new_tokens = req.max_new_tokens
    if fill_max_new_tokens and max_new_tokens == 0:
        max_new_tokens = min(limits.max_new_tokens, limits.max_context_length - len(prompt_ids))
    # As written, every setting checked (a greedy request's cuts too, though decoding ignores them).
    asked = SamplingParams(req.temperature, req.top_k, req.top_p if req.HasField("top_p") else 1.0,
                           req.seed if req.HasField("seed") else secrets.randbits(64))
    chat = req.WhichOneof("input") == "messages"
    sequence = SequenceRequest(
        id=req.request_id or uuid.uuid4().hex, prompt_token_ids=prompt_ids, max_new_tokens=max_new_tokens,
        **_stop_ids(req, limits, tokenizer, chat), speculation=speculation_from_pb(req.speculation),
        sampling=asked.effective(), logprobs=req.top_logprobs if req.logprobs else None,
        traceparent=req.traceparent, beam=BeamOptions.from_pb(req.beam) if req.HasField("beam") else None,
        min_tokens=req.min_tokens,
        constraint=_constraint(req, tools),
        penalties=Penalties.from_pb(req.penalties) if req.HasField("penalties") else None,
        cache_salt=req.cache_salt)
    check_request(sequence, limits.request, prompt_field, stop_strings=len(req.stop), asked=asked)
    if sequence.constraint is not None and grammars is not None:
        grammars.compile(sequence.constraint)
    return ValidRequest(sequence, stop=list(req.stop), received=received, chat=chat,
                        reads_calls=tools is not None and tools.reads_calls)


def _constraint(req: generation_pb2.GenerateRequest, tools: ToolRequest | None) -> Constraint | None:
    """The request's constraint, or with tools the tool-call grammar (gateway/tools.py)."""
    given = Constraint.from_pb(req.constraint) if req.HasField("constraint") else None
    return given if tools is None else tools.constraint(given)


def _stop_ids(req: generation_pb2.GenerateRequest, limits: Limits, tokenizer: TextTokenizer,
              chat: bool) -> dict[str, frozenset[int]]:
    """The request's stop ids and, unless ignore_eos, the EOS ids (the target's and the
    tokenizer's, and a chat's end of turn) among them: what ends generation, and what of it
    reports as "eos"."""
    # Checked as written before the EOS ids join them, so an error's index is the client's.
    check_stop_ids(req.stop_token_ids, limits.request)
    eos = set(limits.eos_token_ids) | set(tokenizer.eos_token_ids)
    # A template whose end of turn is not one token (rare) ends on EOS only.
    if chat and tokenizer.end_of_turn_id is not None:
        eos.add(tokenizer.end_of_turn_id)
    eos_ids = frozenset() if req.ignore_eos else frozenset(eos)
    return {"stop_token_ids": frozenset(req.stop_token_ids) | eos_ids, "eos_token_ids": eos_ids}


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


def _chat_ids(req: generation_pb2.GenerateRequest, limits: Limits, tokenizer: TextTokenizer,
              tools: ToolRequest | None) -> list[int]:
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
        for j, call in enumerate(m.tool_calls):
            _reject_unknown_fields(call, f"messages[{i}].tool_calls[{j}]")
        if m.role not in CHAT_ROLES:
            raise InvalidArgumentError(f"messages[{i}].role", m.role, f"must be one of {list(CHAT_ROLES)}")
    written, native_tools = conversation(list(messages), tools, native=tokenizer.chat_template.renders_tools)
    chars = sum(len(m["content"]) for m in written)  # the template's tool text: their schemas at least
    chars += sum(len(t.parameters) for t in (tools.tools if native_tools else ()))
    _check_prompt_chars("messages", chars, limits.prompt_chars(tokenizer), limits)
    try:
        return tokenizer.encode_chat(written, tools=native_tools)
    except ChatError as exc:
        raise InvalidArgumentError("messages", f"<{len(messages)} messages>",
                                   f"the model's chat template rejected them: {exc}") from exc


def _prompt_ids(req: generation_pb2.GenerateRequest, limits: Limits, tokenizer: TextTokenizer,
                tools: ToolRequest | None) -> tuple[str, list[int]]:
    """(the field the prompt came in, its token ids): text is refused when it is too long to fit
    before it is tokenized; the ids' own rules are the request rules' (check_prompt)."""
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidArgumentError("prompt", "", "must be set (text prompt, prompt_token_ids or messages)")
    if kind == "messages":
        return kind, _chat_ids(req, limits, tokenizer, tools)
    if kind == "prompt":
        if not req.prompt:
            raise InvalidArgumentError("prompt", req.prompt, "must not be empty")
        _check_prompt_chars("prompt", len(req.prompt), limits.prompt_chars(tokenizer), limits)
        ids = tokenizer.encode(req.prompt)
        if not ids:
            raise InvalidArgumentError("prompt", req.prompt, "encodes to no tokens")
        return kind, ids
    return kind, list(req.prompt_token_ids.ids)


def _check_prompt_chars(field: str, chars: int, most: int, limits: Limits) -> None:
    """Before tokenizing: a text this long cannot fit the context, so it costs nothing to refuse."""
    if chars > most:
        raise InvalidArgumentError(field, f"<{chars} characters>",
                                   f"longer than {most} characters (more than the context of "
                                   f"{limits.max_context_length} tokens can hold)")


def _check_stop_strings(req: generation_pb2.GenerateRequest, limits: Limits) -> None:
    if len(req.stop) > limits.max_stop_strings:
        raise InvalidArgumentError("stop", f"<{len(req.stop)} strings>", f"at most {limits.max_stop_strings} allowed")
    for i, stop in enumerate(req.stop):
        if not stop:
            raise InvalidArgumentError(f"stop[{i}]", stop, "must not be empty")
        if len(stop) > limits.max_stop_string_chars:
            raise InvalidArgumentError(f"stop[{i}]", stop, f"longer than {limits.max_stop_string_chars} characters")


def _check_logprobs_pair(req: generation_pb2.GenerateRequest) -> None:
    """The public request says logprobs and top_logprobs apart; the engine's, one number or None."""
    if req.top_logprobs and not req.logprobs:
        raise InvalidArgumentError("top_logprobs", req.top_logprobs, "requires logprobs=true")
