"""Structured outputs and tool calls through the three real processes on the default model pair
(SmolLM2-135M-Instruct + its draft), with the official `openai` package as the client: a JSON
schema answer that `jsonschema` validates, equal token for token to constrained plain decoding (and
to the SDK's over gRPC); tool calls, unary and streamed, whose arguments their function's schema
validates, with `finish_reason: "tool_calls"`, over HTTP and with the SDK over gRPC (sync and
async); a tool's result sent back in the conversation; the server carrying on after a bad tool."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from specstream.models.registry import PAIRS
from specstream_client import AsyncClient, Client, InvalidArgument

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "maxLength": 30}},
          "required": ["name", "age", "city"], "additionalProperties": False}
EXTRACT = [{"role": "user", "content": "Extract the person as JSON: Marie Curie, 66 years old, lived in Paris."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def stack(stack_factory):
    pair = PAIRS["smollm2"]
    return stack_factory(pair.target, pair.draft, dtype="auto", gamma=4, proposer=pair.proposer,
                         ngram_min=pair.ngram_min, http_port=0)


@pytest.fixture
def client(stack):
    with openai.OpenAI(base_url=f"http://{stack.http_address}/v1", api_key="none", max_retries=0,
                       timeout=300) as client:
        yield client


def test_a_json_schema_answer_is_valid_and_equals_constrained_plain_decoding(stack, client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answers = {}
    for speculation in (4, "off"):
        reply = client.chat.completions.create(model=MODEL, messages=EXTRACT, temperature=0, max_tokens=80,
                                               response_format=fmt,
                                               extra_body={"speculation": speculation, "return_token_ids": True})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        answers[speculation] = choice.model_extra["token_ids"]
    assert answers[4] == answers["off"]
    with Client(stack.gateway_address, timeout=300) as sdk:
        over_grpc = sdk.chat(EXTRACT, max_new_tokens=80, json_schema=PERSON)
    assert over_grpc.token_ids == answers["off"]


def _stream(client, **kwargs) -> tuple[str, list[dict], str]:
    """A streamed chat's content, its calls (deltas put together by index) and finish_reason."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_unary_and_streamed(client, tool_choice) -> None:
    request = dict(messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=80)
    replies = {}
    for speculation in (4, "off"):
        reply = client.chat.completions.create(model=MODEL, **request, extra_body={"speculation": speculation})
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and not choice.message.content
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        replies[speculation] = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert replies[4] == replies["off"]  # greedy: speculation changes nothing
    content, calls, reason = _stream(client, **request)
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == replies["off"]
    assert all(c["id"].startswith("call_") for c in calls)


def test_tool_calls_over_grpc_with_the_sdk_sync_and_async_unary_and_streamed(stack, client) -> None:
    """The SDK's tools (gRPC): the same call as the HTTP front's, unary and streamed, with and
    without speculation; the call goes back in the conversation as a ToolCall."""
    over_http = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                               temperature=0, max_tokens=80).choices[0].message.tool_calls
    expected = [(c.function.name, c.function.arguments) for c in over_http]
    with Client(stack.gateway_address, timeout=300) as sdk:
        for speculation in (4, "off"):
            result = sdk.chat(ASK, max_new_tokens=80, tools=TOOLS, tool_choice="required", speculation=speculation)
            assert result.finish_reason == "tool_calls" and result.text == ""
            assert [(c.name, c.arguments) for c in result.tool_calls] == expected
        chunks = list(sdk.chat_stream(ASK, max_new_tokens=80, tools=[t["function"] for t in TOOLS],
                                      tool_choice="required"))
        assert chunks[-1].finish_reason == "tool_calls" and "".join(c.text for c in chunks) == ""
        streamed = [call for chunk in chunks for call in chunk.tool_calls]
        assert [(c.name, c.arguments) for c in streamed] == expected and streamed[0].id.startswith("call_")
        named = sdk.chat(ASK, max_new_tokens=80, tools=TOOLS, tool_choice="get_weather")  # one call, that one
        assert [(c.name, c.arguments) for c in named.tool_calls] == expected[:1]
        for call in streamed:
            jsonschema.validate(call.parsed_arguments(), WEATHER)
        answer = sdk.chat([*ASK, {"role": "assistant", "content": None, "tool_calls": streamed},
                           {"role": "tool", "tool_call_id": streamed[0].id, "content": '{"temperature": 21}'}],
                          max_new_tokens=24, tools=TOOLS, tool_choice="none")
        assert answer.text and not answer.tool_calls and answer.finish_reason in ("eos", "length")

    async def main():
        async with AsyncClient(stack.gateway_address, timeout=300) as sdk:
            result = await sdk.chat(ASK, max_new_tokens=80, tools=TOOLS, tool_choice="required")
            chunks = [chunk async for chunk in sdk.chat_stream(ASK, max_new_tokens=80, tools=TOOLS,
                                                               tool_choice="required")]
            return result, chunks

    result, chunks = asyncio.run(main())
    assert [(c.name, c.arguments) for c in result.tool_calls] == expected and result.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for chunk in chunks for c in chunk.tool_calls] == expected
    with Client(stack.gateway_address, timeout=300) as sdk, pytest.raises(InvalidArgument, match=r"tools\[0\].name"):
        sdk.chat(ASK, max_new_tokens=8, tools=[{"name": "no spaces allowed"}])


def test_a_tool_result_goes_back_into_the_conversation(client) -> None:
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=80).choices[0].message
    call = first.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=48).choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content
    assert not answer.message.tool_calls and "<tool_call>" not in answer.message.content
    # "auto": the model chooses; whatever it wrote is well formed.
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                          max_tokens=80).choices[0]
    for made in auto.message.tool_calls or []:
        jsonschema.validate(json.loads(made.function.arguments), WEATHER)
    assert auto.finish_reason == ("tool_calls" if auto.message.tool_calls else auto.finish_reason)


def test_a_bad_tool_is_a_400_naming_it_and_the_server_carries_on(client) -> None:
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "wrong"}}}}}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=bad, max_tokens=8)
    assert refused.value.body["param"] == "tools[0].function.parameters"
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_penalties_and_logit_bias_under_speculation_equal_plain_decoding(client) -> None:
    """OpenAI's presence/frequency penalties and logit_bias, and vLLM's repetition_penalty, through
    the draft service: the same tokens as plain decoding under the same request, and not the free
    answer's."""
    messages = [{"role": "user", "content": "List five fruits, one per line."}]
    free = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=48,
                                          extra_body={"speculation": "off", "return_token_ids": True})
    banned = free.choices[0].model_extra["token_ids"][2]  # a token the free answer uses early
    answers = {}
    for speculation in (4, "off"):
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=48, presence_penalty=0.5,
            frequency_penalty=0.75, logit_bias={str(banned): -100},
            extra_body={"speculation": speculation, "repetition_penalty": 1.25, "return_token_ids": True})
        answers[speculation] = reply.choices[0].model_extra["token_ids"]
    assert answers[4] == answers["off"] != free.choices[0].model_extra["token_ids"]
    assert banned not in answers["off"]
