"""The OpenAI request bodies the HTTP front accepts (pydantic), named and typed as OpenAI's API
reference has them, plus the extensions clients send through `extra_body` (vLLM's `top_k`,
`ignore_eos`, `stop_token_ids`, `min_tokens`, `repetition_penalty`, `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`; our `speculation` and `max_gamma`).

Only the JSON types are checked here (a string where a number belongs is a 400 naming the field;
an explicit `null` is the same as leaving an optional field out, as OpenAI treats it);
ranges and limits are checked once, for both fronts, by gateway/validation.py. Unknown fields are
ignored, as OpenAI ignores them. Fields that OpenAI defines but this server cannot honour exactly
(n > 1, best_of, suffix, ...) are declared so that translate.py can refuse them by name
instead of silently changing what the model would have produced.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = None  # true: one more chunk before [DONE], with usage (and no choices)


class Extensions(BaseModel):
    """Fields beyond OpenAI's, in both request kinds."""

    model_config = ConfigDict(extra="ignore")

    top_k: int | None = None  # vLLM's: sample among the k most likely tokens (0, -1 or None: off)
    ignore_eos: bool | None = None  # vLLM's: keep generating past the end-of-sequence token
    stop_token_ids: list[int] | None = None  # vLLM's: stop at any of these token ids
    min_tokens: int | None = None  # vLLM's: EOS, stop ids and stop strings cannot end it before this many tokens
    # Ours: "auto" (the server's γ controller; the default), "off" (plain decoding) or a fixed γ (0 = off).
    # Strict: JSON true is not γ = 1, nor "3" a number.
    speculation: StrictStr | StrictInt | None = None
    max_gamma: int | None = None  # with speculation "auto": this request's cap on γ
    return_token_ids: bool | None = None  # vLLM's: each choice (and stream chunk) also carries its `token_ids`
    repetition_penalty: float | None = None  # vLLM's: (0, 2], 1 off; over the prompt's and the generated tokens
    # vLLM's structured outputs (at most one, and not with response_format): the output matches a JSON
    # schema (an object, or its JSON text), a regular expression, one of some strings, a Lark grammar.
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    cache_salt: StrictStr | None = None  # vLLM's: prompts share cached prefixes only with the same salt


class _Common(Extensions):
    model: str
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    n: int | None = None  # only 1
    stream: bool | None = None  # None: false
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None  # -2..2, over the generated tokens
    frequency_penalty: float | None = None  # -2..2, per occurrence among the generated tokens
    logit_bias: dict[str, float] | None = None  # token id (a string of digits) -> -100..100
    user: str | None = None  # accepted and ignored


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # log-probabilities of the chosen tokens plus this many alternatives
    echo: bool | None = None  # true: the prompt's text before the completion
    best_of: int | None = None  # only 1
    suffix: str | None = None  # not supported


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None  # accepted and ignored
    # An assistant's earlier calls ([{"id", "type": "function", "function": {"name", "arguments"}}]),
    # written back into the conversation as it writes them (gateway/tools.py).
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None  # a tool message's: accepted (the result follows its call)


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None  # None (both): as many as fit the context and the limit
    logprobs: bool | None = None  # None: false
    top_logprobs: int | None = None
    # [{"type": "function", "function": {"name", "description", "parameters"}}] (gateway/http/tool_calls.py)
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none", "auto" (the default with tools), "required", or {"type": "function", ...}
    # {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # None: true (several calls in one answer)
