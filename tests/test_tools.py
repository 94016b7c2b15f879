"""Tool calling as text (specstream/text/tools.py) on SmolLM2's real tokenizer: the grammar of each
tool_choice lets through what it should and refuses the rest, masked random decoding under it
always yields calls whose arguments their tool's schema validates (``jsonschema``), a required
call's opening is forced, and the parser reads calls back however the text is chunked."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from specstream.text.tools import Tool, ToolCall, ToolCallParser, render_calls, tool_constraint, tools_system_text
from tests.support.smollm2_grammar import compiler, tokenizer  # noqa: F401 - fixtures

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [Tool("get_weather", "The weather in a city", json.dumps(WEATHER)), Tool("add", "a + b", json.dumps(ADD))]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name":"add","arguments":{"a":2,"b":3}}\n</tool_call>'


def _passes(tokenizer, compiler, choice: str, text: str, parallel: bool = True) -> bool:
    """Whether the whole text is accepted and the answer may end there."""
    matcher = compiler.compile(tool_constraint(TOOLS, choice, parallel)).matcher()
    ids = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    return matcher.consume(ids) == len(ids) and matcher.accepting


@pytest.mark.parametrize("choice, text, ok", [
    ("required", CALL, True),
    ("required", f"{CALL}\n{CALL2}", True),
    ("required", "The weather is fine.", False),
    ("required", "Sure. " + CALL, False),
    ("required", CALL.replace('"celsius"', '"kelvin"'), False),  # not in the enum
    ("required", CALL.replace("get_weather", "get_time"), False),  # no such tool
    ("auto", "The weather is fine.", True),
    ("auto", "Let me look. " + CALL, True),
    ("auto", f"{CALL}\n{CALL2}", True),
    ("auto", 'x <tool_call>\n{"name":"add"}', False),  # a started call must be well formed
    ("auto", "x <tool_call>\n" + '{"name":"add","arguments":{"a":1}}\n</tool_call>', False),  # b missing
    ("none", "No tools today.", True),
    ("none", "Here: " + CALL, False),
    ("add", CALL2, True),
    ("add", CALL, False),  # only the named function
])
def test_each_tool_choice_lets_through_what_it_should(tokenizer, compiler, choice, text, ok) -> None:
    assert _passes(tokenizer, compiler, choice, text) is ok


def test_parallel_tool_calls_false_allows_one_call(tokenizer, compiler) -> None:
    assert _passes(tokenizer, compiler, "required", CALL, parallel=False)
    assert not _passes(tokenizer, compiler, "required", f"{CALL}\n{CALL2}", parallel=False)
    assert not _passes(tokenizer, compiler, "auto", f"{CALL}\n{CALL2}", parallel=False)


def test_a_named_calls_opening_is_forced(tokenizer, compiler) -> None:
    """Nothing is the model's to choose before the first argument's value: all of it is forced (up
    to the first key: the tokens after it depend on how the value starts)."""
    matcher = compiler.compile(tool_constraint(TOOLS, "get_weather")).matcher()
    assert tokenizer.decode(matcher.forced()) == '<tool_call>\n{"name":"get_weather","arguments":{"city'


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_masked_random_decoding_gives_calls_their_schema_validates(tokenizer, compiler, choice) -> None:
    """Random logits, masked, until the grammar lets EOS win (under "auto", after some text and a
    call's opening tag): every call read back names a tool and its arguments validate against that
    tool's schema (no model: the mask alone makes it so)."""
    grammar = compiler.compile(tool_constraint(TOOLS, choice))
    gen = torch.Generator().manual_seed(2)
    eos = list(tokenizer.eos_token_ids)
    opening = tokenizer.tokenizer.encode("Let me see. <tool_call>", add_special_tokens=False).ids
    for _ in range(12):
        matcher, out = grammar.matcher(), opening if choice == "auto" else []
        assert matcher.consume(out) == len(out)
        for _ in range(600):
            allowed = torch.from_numpy(matcher.allowed())
            logits = torch.randn(matcher.vocab_size, generator=gen)
            logits[eos] += 6.0 if matcher.accepting else 0.0  # end soon once it may
            token = int(torch.where(allowed, logits, -torch.inf).argmax())
            if token in eos:
                break
            assert matcher.consume([token]) == 1
            out = out + [token]
        else:
            pytest.fail(f"no end within 600 tokens: {tokenizer.decode(out)!r}")
        parser = ToolCallParser()
        parser.feed(tokenizer.decode(out))
        assert parser.calls
        for call in parser.calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_the_parser_reads_the_same_however_the_text_is_chunked() -> None:
    text = f"Let me check.\n{CALL}\n{CALL2}"
    whole = ToolCallParser()
    content, calls = whole.feed(text)
    assert (content + whole.finish(), [(c.name, c.arguments) for c in calls]) == (
        "Let me check.", [("get_weather", '{"city":"Paris","unit":"celsius"}'), ("add", '{"a":2,"b":3}')])
    rng = random.Random(0)
    for _ in range(50):
        parser, pieces, at = ToolCallParser(), [], 0
        while at < len(text):
            step = rng.randint(1, 9)
            pieces.append(parser.feed(text[at:at + step]))
            at += step
        assert "".join(c for c, _ in pieces) + parser.finish() == "Let me check."
        assert [(c.name, c.arguments) for _, cs in pieces for c in cs] == [(c.name, c.arguments) for c in calls]
    unfinished = ToolCallParser()
    assert unfinished.feed("Hi <tool_c") == ("Hi ", [])  # a possible tag is held back
    assert unfinished.feed('all>\n{"name":"add"') == ("", [])
    assert unfinished.finish() == '<tool_call>\n{"name":"add"'  # cut by its budget: given back as written


def test_earlier_calls_are_written_as_the_model_writes_them() -> None:
    calls = [ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}', "call_1"), ToolCall("add", '{"a":2,"b":3}')]
    assert render_calls(calls) == f"{CALL}\n{CALL2}"
    text = tools_system_text(TOOLS)
    assert all(json.dumps(t.spec()) in text for t in TOOLS) and "<tool_call>" in text


# ----- a public request's tools (gateway/tools.py, through gateway/validation.py: both fronts) -------------
def _chat_request(messages=None, **fields):
    from specstream_pb import generation_pb2

    req = generation_pb2.GenerateRequest(max_new_tokens=32, **fields)
    req.messages.SetInParent()
    for message in messages or [{"role": "user", "content": "Weather in Paris?"}]:
        req.messages.messages.add(**message)
    return req


def _grpc_tools(*tools):
    from specstream_pb import generation_pb2

    return [generation_pb2.Tool(name=t.name, description=t.description, parameters=t.parameters) for t in tools]


@pytest.fixture(scope="module")
def limits(tokenizer):
    from gateway.validation import Limits
    from specstream.data.config import GatewayConfig
    from specstream.data.engine import TargetInfo

    info = TargetInfo(vocab_size=tokenizer.vocab_size, max_context_length=2048, max_gamma=8, default_gamma=4,
                      eos_token_ids=list(tokenizer.eos_token_ids))
    return Limits.build(GatewayConfig("t:1", "m"), info)


@pytest.mark.parametrize("fields, messages, field", [
    (dict(tools=_grpc_tools(Tool("a b"))), None, "tools[0].name"),
    (dict(tools=_grpc_tools(TOOLS[0], TOOLS[0])), None, "tools[1].name"),
    (dict(tools=_grpc_tools(Tool("f", "", '{"type": "nope"}'))), None, "tools[0].parameters"),  # the compiler's reason
    (dict(tools=_grpc_tools(Tool("f", "", "{not json"))), None, "tools[0].parameters"),
    (dict(tools=_grpc_tools(Tool("f", "", "[1]"))), None, "tools[0].parameters"),
    (dict(tools=_grpc_tools(*TOOLS), tool_choice="sometimes"), None, "tool_choice"),
    (dict(tools=_grpc_tools(*TOOLS), tool_choice="get_time"), None, "tool_choice"),
    (dict(tool_choice="required"), None, "tool_choice"),  # no tools
    (dict(tools=_grpc_tools(*TOOLS), constraint={"json_object": True}), None, "constraint"),
    (dict(), [{"role": "user", "content": "hi", "tool_calls": [{"name": "add", "arguments": "{}"}]}],
     "messages[0].tool_calls"),
    (dict(), [{"role": "assistant", "content": "", "tool_calls": [{"name": "", "arguments": "{}"}]}],
     "messages[0].tool_calls[0].name"),
])
def test_a_requests_bad_tools_are_refused_naming_the_field(tokenizer, limits, fields, messages, field) -> None:
    from gateway.validation import validate
    from specstream.data.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError) as info:
        validate(_chat_request(messages, **fields), limits, tokenizer)
    assert info.value.field == field, str(info.value)


def test_tools_on_a_text_prompt_are_refused(tokenizer, limits) -> None:
    from gateway.validation import validate
    from specstream.data.errors import InvalidArgumentError
    from specstream_pb import generation_pb2

    with pytest.raises(InvalidArgumentError, match="need a chat") as info:
        validate(generation_pb2.GenerateRequest(prompt="hi", max_new_tokens=4, tools=_grpc_tools(*TOOLS)), limits, tokenizer)
    assert info.value.field == "tools"


def test_a_requests_tools_become_the_system_text_and_the_constraint(tokenizer, limits, compiler) -> None:
    from gateway.validation import validate

    earlier = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "name": "get_weather",
                                                                    "arguments": '{"city": "Paris", "unit": "celsius"}'}]},
               {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "call_1"}]
    valid = validate(_chat_request(earlier, tools=_grpc_tools(*TOOLS), tool_choice="add", parallel_tool_calls=False),
                     limits, tokenizer, grammars=compiler)
    assert valid.reads_calls and valid.sequence.constraint == tool_constraint(TOOLS, "add", parallel=False)
    prompt = tokenizer.decode(valid.prompt_ids)
    assert tools_system_text(TOOLS) in prompt and CALL in prompt  # the earlier call, as the model writes it
    # tool_choice "none": the answer is not read for calls, and a format given beside the tools is kept.
    quiet = validate(_chat_request(tools=_grpc_tools(*TOOLS), tool_choice="none", constraint={"json_object": True}),
                     limits, tokenizer)
    assert not quiet.reads_calls and quiet.sequence.constraint.kind == "json_object"
    auto = validate(_chat_request(tools=_grpc_tools(*TOOLS)), limits, tokenizer)
    assert auto.reads_calls and auto.sequence.constraint == tool_constraint(TOOLS, "auto")


def test_the_call_reader_gives_content_and_whole_calls_as_the_answer_streams() -> None:
    from gateway.tools import CallReader

    reader, text = CallReader(), f"Let me check.\n{CALL}\n{CALL2}"
    pieces = [reader.feed(text[at:at + 7], final=at + 7 >= len(text)) for at in range(0, len(text), 7)]
    assert "".join(content for content, _ in pieces) == "Let me check."
    calls = [call for _, made in pieces for call in made]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                                                  ("add", {"a": 2, "b": 3})]
    assert reader.called and len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


# A chat template with tool support in the <tool_call> format (Qwen2.5's layout, shortened): it
# lists the tools and writes earlier calls itself.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'Helpful.' }}"
    "\n\n# Tools (template)\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>"
    "\nCall with <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'system' and tools %}{% continue %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls', []) %}<tool_call>\n"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_with_tool_support_renders_the_tools_and_earlier_calls_itself(tokenizer, limits) -> None:
    """Where the chat template writes tools in the <tool_call> format, the gateway hands it the
    tools and earlier calls (OpenAI's form) instead of writing its default system text; SmolLM2's
    template has no tool support, so it gets the default."""
    from gateway.validation import validate
    from specstream.text.chat import ChatTemplate
    from specstream.text.tokenizer import TextTokenizer

    assert not tokenizer.chat_template.renders_tools
    native = TextTokenizer(tokenizer.tokenizer, eos_token_ids=tokenizer.eos_token_ids,
                           chat_template=ChatTemplate(HERMES_TEMPLATE))
    assert native.chat_template.renders_tools
    earlier = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "name": "get_weather",
                                                                    "arguments": '{"city":"Paris","unit":"celsius"}'}]},
               {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "call_1"}]
    valid = validate(_chat_request(earlier, tools=_grpc_tools(*TOOLS)), limits, native)
    prompt = native.decode(valid.prompt_ids)
    assert "# Tools (template)" in prompt and tools_system_text(TOOLS) not in prompt
    assert all(json.dumps(t.spec(), ensure_ascii=False) in prompt for t in TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in prompt
    assert valid.sequence.constraint == tool_constraint(TOOLS, "auto")  # the answer is held to the same format
    default = tokenizer.decode(validate(_chat_request(earlier, tools=_grpc_tools(*TOOLS)), limits, tokenizer).prompt_ids)
    assert tools_system_text(TOOLS) in default and CALL in default
