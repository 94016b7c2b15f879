"""Between OpenAI's JSON and the gateway's public messages, both ways.

In: `to_generate_request` turns a completion or chat body into a `GenerateRequest`, refusing by
name what it cannot honour exactly; `param_name` maps a field named by gateway/validation.py back
to the OpenAI parameter the caller sent. Out: `CompletionEncoder` / `ChatEncoder` turn the core's
`GenerateStreamResponse` chunks into OpenAI's stream chunks, and a `GenerateResponse` into the
unary object, with usage, `metrics` (speculative decoding shaped like vLLM's counters, plus our
timings) and the seed used.

Defaults are OpenAI's where they differ from gRPC's: temperature 1 (gRPC: 0, greedy), completions
max_tokens 16, chat: as many tokens as fit. Knows nothing about HTTP status codes or routes.
"""

from __future__ import annotations

import json
import time
from typing import Any

from gateway import samples
from gateway.http import tool_calls
from gateway.http.schema import ChatCompletionRequest, CompletionRequest
from specstream.data.errors import InvalidArgumentError
from specstream.text.tokenizer import TextTokenizer
from specstream_pb import common_pb2, generation_pb2

UINT32, INT32, UINT64 = 2**32 - 1, 2**31 - 1, 2**64 - 1
FINISH_REASONS = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_STOP: "stop",
                  common_pb2.FINISH_REASON_EOS: "stop", common_pb2.FINISH_REASON_CANCELLED: "abort",
                  common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls"}
CHAT_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role

Body = CompletionRequest | ChatCompletionRequest


# --- in ---------------------------------------------------------------------------------------

def to_generate_request(body: Body, traceparent: str = "") -> generation_pb2.GenerateRequest:
    """The body as the public request both fronts validate; InvalidArgumentError (naming the
    OpenAI parameter) for what only an OpenAI body can get wrong."""
    _refuse_unsupported(body)
    req = generation_pb2.GenerateRequest(traceparent=traceparent)
    if body.n is not None:  # its rule, for both fronts: gateway/samples.py
        req.n = _int("n", body.n, 1, UINT32)
    if isinstance(body, CompletionRequest):
        _set_prompt(req, body.prompt)
        req.max_new_tokens = _int("max_tokens", body.max_tokens, 1, INT32) if body.max_tokens is not None else 0
        if body.logprobs is not None:
            req.logprobs, req.top_logprobs = True, _int("logprobs", body.logprobs, 0, INT32)
    else:
        _set_messages(req, body)
        tool_calls.set_tools(req, body)
        chosen = _max_tokens_param(body)
        value = getattr(body, chosen)
        req.max_new_tokens = _int(chosen, value, 1, INT32) if value is not None else 0
        req.logprobs = bool(body.logprobs)
        if body.top_logprobs is not None:
            req.top_logprobs = _int("top_logprobs", body.top_logprobs, 0, INT32)
    if isinstance(body.stop, str):
        req.stop.append(body.stop)
    elif body.stop:
        req.stop.extend(body.stop)
    req.stop_token_ids.extend(_int("stop_token_ids", t, 0, UINT32) for t in body.stop_token_ids or ())
    req.ignore_eos = bool(body.ignore_eos)
    if body.min_tokens is not None:
        req.min_tokens = _int("min_tokens", body.min_tokens, 0, UINT32)
    req.temperature = 1.0 if body.temperature is None else body.temperature
    if body.top_p is not None:
        req.top_p = body.top_p
    req.top_k = _int("top_k", 0 if body.top_k in (None, -1) else body.top_k, 0, INT32)  # vLLM's -1: off
    if body.seed is not None:
        req.seed = _int("seed", body.seed, 0, UINT64)
    req.speculation.CopyFrom(_speculation(body))
    req.cache_salt = body.cache_salt or ""
    penalties = _penalties(body)
    if penalties is not None:
        req.penalties.CopyFrom(penalties)
    constraint = _constraint(body)
    if constraint is not None:
        req.constraint.CopyFrom(constraint)
    return req


GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _constraint(body: Body) -> common_pb2.Constraint | None:
    """What the output must match: OpenAI's response_format (chat) or one of vLLM's guided_*
    fields; at most one of them. The JSON schema goes on as its JSON text (key order kept: it is
    the order the model writes the properties in); strict is how every schema is honoured here.
    Tools bring their own grammar (gateway/tools.py), which a format given beside them may replace
    only with tool_choice "none"."""
    given = [name for name in (*GUIDED, "response_format") if getattr(body, name, None) is not None]
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.get("type", "text") == "text":
        given.remove("response_format")
    if len(given) > 1:
        raise InvalidArgumentError(given[1], "<set>", f"cannot be combined with {given[0]}")
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        return _response_format(fmt)
    value = getattr(body, name)
    if name == "guided_json":
        return common_pb2.Constraint(json_schema=value if isinstance(value, str) else json.dumps(value))
    if name == "guided_choice":
        return common_pb2.Constraint(choice=common_pb2.Choices(choices=value))
    return common_pb2.Constraint(**{GUIDED[name]: value})


def _response_format(fmt: dict[str, Any]) -> common_pb2.Constraint:
    kind = fmt.get("type")
    if kind == "json_object":
        return common_pb2.Constraint(json_object=True)
    if kind != "json_schema":
        raise InvalidArgumentError("response_format.type", kind, "must be text, json_object or json_schema")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidArgumentError("response_format.json_schema", spec, "must be an object with name and schema")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError("response_format.json_schema.name", name, "must be a non-empty string")
    schema = spec.get("schema")
    if schema is None:  # OpenAI allows it out: any JSON object
        return common_pb2.Constraint(json_object=True)
    if not isinstance(schema, dict):
        raise InvalidArgumentError("response_format.json_schema.schema", schema, "must be a JSON schema (an object)")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidArgumentError("response_format.json_schema.strict", strict, "must be true or false")
    return common_pb2.Constraint(json_schema=json.dumps(schema))


def _penalties(body: Body) -> common_pb2.Penalties | None:
    """presence_penalty, frequency_penalty, logit_bias (keys: token ids as strings of digits) and
    vLLM's repetition_penalty; their ranges are validation's (specstream/data/penalties.py)."""
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit() or int(key) > UINT32:
            raise InvalidArgumentError("logit_bias", key, "keys must be token ids (strings of digits)")
        bias[int(key)] = value
    if body.repetition_penalty is not None and body.repetition_penalty == 0:  # the wire's 0 means "off"
        raise InvalidArgumentError("repetition_penalty", 0, "must be in (0, 2] (1: off)")
    if not (body.presence_penalty or body.frequency_penalty or bias or body.repetition_penalty not in (None, 1.0)):
        return None
    return common_pb2.Penalties(presence_penalty=body.presence_penalty or 0.0,
                                frequency_penalty=body.frequency_penalty or 0.0,
                                repetition_penalty=body.repetition_penalty or 0.0, logit_bias=bias)


def fills_max_new_tokens(body: Body) -> bool:
    """No token budget given (an explicit null; a completion left out gets OpenAI's 16): as many
    tokens as fit the context and the server's limit."""
    return body.max_tokens is None and getattr(body, "max_completion_tokens", None) is None


def _max_tokens_param(body: ChatCompletionRequest) -> str:
    return "max_tokens" if body.max_completion_tokens is None and body.max_tokens is not None else "max_completion_tokens"


def param_name(field: str, body: Body) -> str:
    """The OpenAI parameter behind a field of `GenerateRequest` that validation named."""
    head = field.split("[", 1)[0].split(".", 1)[0]
    named = tool_calls.param_name(field, body) if isinstance(body, ChatCompletionRequest) else None
    if named is not None:
        return named
    if head == "max_new_tokens":
        return "max_tokens" if isinstance(body, CompletionRequest) else _max_tokens_param(body)
    if head in ("prompt", "prompt_token_ids"):
        return "prompt"
    if head == "top_logprobs" and isinstance(body, CompletionRequest):
        return "logprobs"
    if field == "speculation.max_gamma":
        return "max_gamma"
    if head in ("stop", "stop_token_ids", "speculation"):
        return head
    if head == "penalties":  # penalties.presence_penalty, penalties.logit_bias[5], ...
        return field.split(".", 1)[1].split("[", 1)[0]
    if head == "constraint":  # the parameter that carried it
        given = [name for name in (*GUIDED, "response_format") if getattr(body, name, None) is not None]
        if given:
            return given[0]
        return "tools" if isinstance(body, ChatCompletionRequest) and body.tools else "response_format"
    return field  # messages[2].role, temperature, top_p, top_k, seed, logprobs: the same names


def _refuse_unsupported(body: Body) -> None:
    """OpenAI parameters this server does not implement: refused by name rather than ignored,
    since ignoring them would change the output the caller asked for."""
    checks: list[tuple[str, Any, bool, str]] = [
        ("stream_options", "<set>", body.stream_options is None or bool(body.stream),
         "stream_options is only allowed when stream is true"),
    ]
    if isinstance(body, CompletionRequest):
        checks += [
            ("best_of", body.best_of, body.best_of in (None, 1), "only best_of=1 is supported"),
            ("suffix", body.suffix, not body.suffix, "suffix (insertion) is not supported"),
            ("echo", body.echo, not (body.echo and body.logprobs is not None),
             "echo with logprobs is not supported (prompt log-probabilities are not computed)"),
        ]
    for param, value, ok, reason in checks:
        if not ok:
            raise InvalidArgumentError(param, value, reason)


def _int(param: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise InvalidArgumentError(param, value, f"must be in {low}..{high}")
    return value


def _set_prompt(req: generation_pb2.GenerateRequest, prompt: Any) -> None:
    """A string, one token-id list, or a list holding one of either (OpenAI's batch forms with
    one element); batches of several prompts are refused."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidArgumentError("prompt", f"<{len(prompt)} prompts>",
                                       "one prompt per request; send several requests")
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.SetInParent()  # an empty list is still "token ids" (refused by validation)
        req.prompt_token_ids.ids.extend(_int("prompt", t, 0, UINT32) for t in prompt)


def _set_messages(req: generation_pb2.GenerateRequest, body: ChatCompletionRequest) -> None:
    req.messages.SetInParent()
    for i, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise InvalidArgumentError(f"messages[{i}].content[{j}].type", part.type,
                                               "only text parts are supported")
            content = "".join(part.text for part in content)
        req.messages.messages.add(
            role=CHAT_ROLES.get(message.role, message.role), content=content or "",
            tool_calls=[tool_calls.earlier_call(f"messages[{i}].tool_calls[{j}]", c)
                        for j, c in enumerate(message.tool_calls or [])],
            tool_call_id=message.tool_call_id or "")


def _speculation(body: Body) -> common_pb2.Speculation:
    value = body.speculation
    spec = common_pb2.Speculation()
    if isinstance(value, bool) or (isinstance(value, str) and value not in ("auto", "off")):
        raise InvalidArgumentError("speculation", value, "'auto', 'off' or a number of proposals per step (0 = off)")
    if value == "off" or value == 0:
        spec.mode = common_pb2.SPECULATION_MODE_OFF
    elif isinstance(value, int):
        spec.mode, spec.gamma = common_pb2.SPECULATION_MODE_FIXED, _int("speculation", value, 0, UINT32)
    if body.max_gamma is not None:
        spec.max_gamma = _int("max_gamma", body.max_gamma, 0, UINT32)
    return spec


# --- out --------------------------------------------------------------------------------------

def usage(pb: common_pb2.Usage) -> dict[str, int]:
    return {"prompt_tokens": pb.prompt_tokens, "completion_tokens": pb.completion_tokens,
            "total_tokens": pb.prompt_tokens + pb.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": pb.cached_tokens}}


def metrics(stats: common_pb2.SpeculationStats, timings: common_pb2.Timings) -> dict[str, Any]:
    """Per-request speculation counters under vLLM's names (num_drafts: decode passes given at
    least one proposal; mean_acceptance_length: tokens per such pass, 1 + accepted / drafts),
    our own beside them, and the request's timings."""
    drafts = sum(stats.gamma_histogram[1:])
    per_position = list(stats.accepted_per_position)
    per_position += [0] * (max(len(stats.gamma_histogram) - 1, 0) - len(per_position))
    return {
        "speculative_decoding": {
            "num_drafts": drafts,
            "num_draft_tokens": stats.draft_tokens,
            "num_accepted_tokens": stats.accepted_tokens,
            "num_accepted_tokens_per_pos": per_position,
            "mean_acceptance_length": 1 + stats.accepted_tokens / drafts if drafts else None,
            "draft_acceptance_rate": stats.accepted_tokens / stats.draft_tokens if stats.draft_tokens else None,
            "target_passes": stats.target_passes,
            "tokens_per_target_pass": stats.mean_accepted_length,
            "gamma_histogram": list(stats.gamma_histogram),
            "alpha_estimate": stats.alpha_estimate,
            "branch_histogram": list(stats.branch_histogram),
            "branch_tokens": stats.branch_tokens,
        },
        "timings": {"queue_seconds": timings.queue_seconds,
                    "time_to_first_token_seconds": timings.time_to_first_token_seconds,
                    "total_seconds": timings.total_seconds},
    }


class _Encoder:
    """One request's response objects; holds what successive stream chunks need (the id, the
    creation time, what has been sent)."""

    object_name: str
    chunk_object_name: str
    id_prefix: str

    def __init__(self, body: Body, request_id: str, tokenizer: TextTokenizer, include_usage: bool) -> None:
        self.body = body
        self.index = 0  # the choice this encoder writes (``n``: one encoder per choice, see ``for_choices``)
        self.id = self.id_prefix + request_id
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.include_usage = include_usage

    def _head(self, name: str) -> dict[str, Any]:
        return {"id": self.id, "object": name, "created": self.created, "model": self.body.model}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)

    def _with_ids(self, choice: dict[str, Any], pb) -> dict[str, Any]:
        if self.body.return_token_ids:
            choice["token_ids"] = list(pb.token_ids)
        return choice

    def _finish(self, out: dict[str, Any], pb) -> None:
        """The extensions of a last chunk / a response: metrics and the seed used."""
        out["metrics"] = metrics(pb.stats, pb.timings)
        out["seed"] = pb.seed

    def chunks(self, pb: generation_pb2.GenerateStreamResponse) -> list[dict[str, Any]]:
        """The stream chunks for one core chunk (with include_usage, a last one with usage)."""
        outs = []
        for choice in self._deltas(pb):
            out = self._head(self.chunk_object_name)
            out["choices"] = [choice]
            if self.include_usage:
                out["usage"] = None
            outs.append(out)
        if not pb.finish_reason:
            return outs
        self._finish(outs[-1], pb)
        if not self.include_usage:
            return outs
        return [*outs, self.usage_tail(pb, usage(pb.usage))]

    def response(self, pb: generation_pb2.GenerateResponse) -> dict[str, Any]:
        out = self._head(self.object_name)
        out["choices"] = [self._with_ids(self._choice(pb), pb)]
        out["usage"] = usage(pb.usage)
        self._finish(out, pb)
        return out

    def usage_tail(self, pb, counted: dict[str, int]) -> dict[str, Any]:
        """include_usage's last chunk: no choices, ``counted`` usage, the metrics and seed of ``pb``."""
        tail = {**self._head(self.chunk_object_name), "choices": [], "usage": counted}
        self._finish(tail, pb)
        return tail

    def _deltas(self, pb: generation_pb2.GenerateStreamResponse) -> list[dict[str, Any]]:
        """The choices of the stream chunks for one core chunk (the last one is the core's)."""
        raise NotImplementedError

    def _choice(self, pb: generation_pb2.GenerateResponse) -> dict[str, Any]:
        raise NotImplementedError


def for_choices(encoders: list[_Encoder]) -> list[_Encoder]:
    """One encoder per choice of a request with ``n`` > 1, writing into one response: the first's
    id, each its own index; none writes a usage chunk of its own (``samples_usage`` is the one)."""
    for i, encoder in enumerate(encoders):
        encoder.index, encoder.id, encoder.include_usage = i, encoders[0].id, False
    return encoders


def samples_usage(usages: list[common_pb2.Usage]) -> dict[str, Any]:
    """The usage of a request's choices (gateway/samples.py ``usage``), as OpenAI writes it."""
    return usage(samples.usage(usages))


def samples_response(encoders: list[_Encoder], pbs: list[generation_pb2.GenerateResponse]) -> dict[str, Any]:
    """The response of a request's ``n`` choices (``for_choices`` encoders): the first's metrics and seed."""
    out = encoders[0].response(pbs[0])
    out["choices"] = [encoder._with_ids(encoder._choice(pb), pb) for encoder, pb in zip(encoders, pbs)]
    out["usage"] = samples_usage([pb.usage for pb in pbs])
    return out


class CompletionEncoder(_Encoder):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, body: CompletionRequest, request_id: str, tokenizer: TextTokenizer, include_usage: bool,
                 prompt_text: str) -> None:
        super().__init__(body, request_id, tokenizer, include_usage)
        self.echo = prompt_text if body.echo else ""  # sent before the first chunk's text
        self.offset = 0  # characters of text sent so far (logprobs' text_offset)

    def _logprobs(self, token_ids, logprobs) -> dict[str, Any] | None:
        if self.body.logprobs is None:
            return None
        tokens = [self._token(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self._token(alt.token_id): alt.logprob for alt in lp.top} for lp in logprobs],
                "text_offset": offsets}

    def _deltas(self, pb):
        if not pb.text and not pb.token_ids and not pb.finish_reason and not self.echo:
            return []
        text, self.echo = self.echo + pb.text, ""
        return [self._with_ids({"index": self.index, "text": text,
                                "logprobs": self._logprobs(pb.token_ids, pb.logprobs),
                                "finish_reason": FINISH_REASONS.get(pb.finish_reason)}, pb)]

    def _choice(self, pb):
        return {"index": self.index, "text": self.echo + pb.text, "logprobs": self._logprobs(pb.token_ids, pb.logprobs),
                "finish_reason": FINISH_REASONS.get(pb.finish_reason)}


class ChatEncoder(_Encoder):
    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, body: ChatCompletionRequest, request_id: str, tokenizer: TextTokenizer,
                 include_usage: bool) -> None:
        super().__init__(body, request_id, tokenizer, include_usage)
        self.role_sent = False  # OpenAI's first delta carries the role
        self.calls_sent = 0  # tool calls streamed so far (each delta entry's index)

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(self.tokenizer.token_bytes(token_id))}

    def _logprobs(self, logprobs) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(alt.token_id, alt.logprob) for alt in lp.top]}
                            for lp in logprobs]}

    def _deltas(self, pb):
        """As OpenAI streams a chat: a first chunk with the role and empty content, then content
        chunks, then an empty delta with the finish_reason."""
        out = []
        if not self.role_sent:
            self.role_sent = True
            out.append({"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None})
        if pb.text or pb.token_ids:  # with tools, the text outside the calls (gateway/tools.py)
            out.append(self._with_ids({"index": self.index, "delta": {"content": pb.text},
                                       "logprobs": self._logprobs(pb.logprobs), "finish_reason": None}, pb))
        if pb.tool_calls:  # each call whole, in the chunk where it closed
            called = [{"index": self.calls_sent + k, **tool_calls.call_out(c)} for k, c in enumerate(pb.tool_calls)]
            self.calls_sent += len(called)
            out.append({"index": self.index, "delta": {"tool_calls": called}, "logprobs": None, "finish_reason": None})
        if pb.finish_reason:
            reason = FINISH_REASONS.get(pb.finish_reason)
            out.append({"index": self.index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return out

    def _choice(self, pb):
        message = {"role": "assistant", "content": pb.text}
        if pb.tool_calls:  # content null where only calls were written, as OpenAI
            message = {"role": "assistant", "content": pb.text.strip() or None,
                       "tool_calls": [tool_calls.call_out(c) for c in pb.tool_calls]}
        return {"index": self.index, "message": message, "logprobs": self._logprobs(pb.logprobs),
                "finish_reason": FINISH_REASONS.get(pb.finish_reason)}
