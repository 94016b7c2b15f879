"""Chat: the sandboxed template rendering (against transformers' apply_chat_template), the gateway's
`messages` validation and what a chat request sends to the target, and the SDK's request building."""

from __future__ import annotations

import pytest

from gateway.validation import Limits, validate
from specstream.data.config import GatewayConfig
from specstream.data.errors import InvalidArgumentError
from specstream.text.chat import ChatError, ChatTemplate
from specstream.text.tokenizer import TextTokenizer
from specstream_client._request import build_chat_request
from specstream_pb import generation_pb2, target_pb2
from tests.support.gguf_files import CHATML, chatml_tokenizer

STRICT = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
          "[{{ m['role'] }}]{{ m['content'] | tojson }}{% endfor %}")


def test_render_matches_transformers_apply_chat_template(tmp_path) -> None:
    from transformers import PreTrainedTokenizerFast

    tok = chatml_tokenizer()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    hf.chat_template = CHATML
    messages = [{"role": "system", "content": "Be <brief> & \"exact\"."}, {"role": "user", "content": "héllo"},
                {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "2+2?"}]
    for add in (True, False):
        ours = ChatTemplate(CHATML).render(messages, add_generation_prompt=add)
        assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)


def test_tojson_does_not_escape_html_and_raise_exception_is_a_chat_error() -> None:
    template = ChatTemplate(STRICT)
    assert template.render([{"role": "user", "content": "<a & b>"}]) == '[user]"<a & b>"'
    with pytest.raises(ChatError, match="roles must alternate"):
        template.render([{"role": "assistant", "content": "first"}])


def test_the_sandbox_refuses_python_internals() -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatError):
        ChatTemplate(escape).render([{"role": "user", "content": "x"}])
    mutate = "{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}"
    with pytest.raises(ChatError):
        ChatTemplate(mutate).render([{"role": "user", "content": "x"}])


def test_a_broken_template_fails_at_load() -> None:
    with pytest.raises(ChatError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_end_of_turn_is_found_by_rendering() -> None:
    assert ChatTemplate(CHATML).end_of_turn == "<|im_end|>"
    assert ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}").end_of_turn is None


# ----- the gateway ------------------------------------------------------------------------------

_TOK = chatml_tokenizer()
CHAT_TT = TextTokenizer(_TOK, eos_token_ids=[0], bos_token_id=1, chat_template=ChatTemplate(CHATML))
PLAIN_TT = TextTokenizer(_TOK, eos_token_ids=[0], bos_token_id=1)
INFO = target_pb2.TargetInfo(vocab_size=CHAT_TT.vocab_size, max_context_length=256, max_gamma=8, default_gamma=4)
LIMITS = Limits.build(GatewayConfig("t:1", "m", max_messages=4), INFO)


def _chat(messages: list[tuple[str, str]], tokenizer: TextTokenizer = CHAT_TT, **fields):
    req = generation_pb2.GenerateRequest(max_new_tokens=8, **fields)
    for role, content in messages:
        req.messages.messages.add(role=role, content=content)
    req.messages.SetInParent()
    return validate(req, LIMITS, tokenizer)


def test_messages_are_rendered_and_end_at_the_end_of_turn_token() -> None:
    valid = _chat([("system", "Be brief."), ("user", "Hi")])
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert valid.prompt_ids == _TOK.encode(text, add_special_tokens=False).ids
    seq = valid.sequence
    assert valid.chat and _TOK.token_to_id("<|im_end|>") in seq.eos_token_ids
    assert set(seq.eos_token_ids) == {0, 2} and set(seq.stop_token_ids) >= {0, 2}
    assert not set(_chat([("user", "Hi")], ignore_eos=True).sequence.eos_token_ids)


def test_a_text_prompt_does_not_stop_at_the_end_of_turn() -> None:
    req = generation_pb2.GenerateRequest(prompt="hello", max_new_tokens=8)
    valid = validate(req, LIMITS, CHAT_TT)
    assert not valid.chat and list(valid.sequence.eos_token_ids) == [0]


@pytest.mark.parametrize(("messages", "field", "reason"), [
    ([], "messages", "at least one message"),
    ([("user", "a")] * 5, "messages", "at most 4 allowed"),
    ([("user", "a"), ("robot", "b")], "messages[1].role", "must be one of"),
    ([("", "a")], "messages[0].role", "must be one of"),
])
def test_bad_messages_are_named(messages, field, reason) -> None:
    with pytest.raises(InvalidArgumentError, match=reason) as info:
        _chat(messages)
    assert info.value.field == field


def test_a_model_without_a_chat_template_refuses_messages() -> None:
    with pytest.raises(InvalidArgumentError, match="no chat template") as info:
        _chat([("user", "Hi")], tokenizer=PLAIN_TT)
    assert info.value.field == "messages"


def test_a_template_error_is_invalid_argument_naming_messages() -> None:
    strict = TextTokenizer(_TOK, eos_token_ids=[0], chat_template=ChatTemplate(STRICT))
    with pytest.raises(InvalidArgumentError, match="roles must alternate") as info:
        _chat([("assistant", "first")], tokenizer=strict)
    assert info.value.field == "messages"


def test_a_chat_prompt_longer_than_the_context_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="longer than the context length") as info:
        _chat([("user", "word " * 400)])
    assert info.value.field == "messages"


# ----- the SDK's request ------------------------------------------------------------------------

def test_sdk_builds_a_messages_request_with_the_generate_options() -> None:
    req = build_chat_request([{"role": "user", "content": "Hi"}], max_new_tokens=5, temperature=0.5, seed=3)
    assert req.WhichOneof("input") == "messages"
    assert [(m.role, m.content) for m in req.messages.messages] == [("user", "Hi")]
    assert req.max_new_tokens == 5 and req.seed == 3 and req.temperature == 0.5


@pytest.mark.parametrize(("messages", "error", "text"), [
    ("Hi", TypeError, "sequence of"),
    ({"role": "user", "content": "Hi"}, TypeError, "sequence of"),
    ([("user", "Hi")], TypeError, r"messages\[0\] must be a mapping"),
    ([{"role": "user", "content": 3}], TypeError, r"messages\[0\]\['content'\] must be a str"),
    ([{"role": "user", "content": "x", "name": "bob"}], ValueError, "unsupported keys"),
])
def test_sdk_checks_message_types_before_any_rpc(messages, error, text) -> None:
    with pytest.raises(error, match=text):
        build_chat_request(messages)


def test_sdk_rejects_an_unknown_option() -> None:
    with pytest.raises(TypeError, match="unexpected keyword"):
        build_chat_request([{"role": "user", "content": "x"}], temprature=0.5)
