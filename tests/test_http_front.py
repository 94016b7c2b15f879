"""The OpenAI-compatible HTTP front (gateway/http/) over loopback, in front of a scripted target.

The gateway is the real one (`Gateway` core, `Router`, a `TargetClient` with its `Connect` stream
to a target on a loopback port) and so is the HTTP server (uvicorn on this test's event loop); the
client is the official `openai` package, or raw HTTP where a client would not send the bytes. The
target streams a fixed text, one token per step, and records what it is sent and cancelled, so
these tests can check what the three real processes cannot cheaply: a client that disconnects
cancels its sequence on the target (streamed and unary), an error after the first chunk arrives
as an `error` event, overload is 429 with Retry-After, and the translation of every parameter.
The harness: tests/support/http_front.py; bearer tokens and HTTPS: tests/test_http_front_security.py.
The model itself, through the three real processes: tests/integration/test_openai_api.py.
"""

from __future__ import annotations

import asyncio
import json
import socket

import openai
import pytest

from gateway.http.app import build_app
from gateway.http.server import HttpServer
from tests.support.http_front import raw_http, run, served
from tests.support.scripted_target import MODEL, REPLY, TOKENS, TT


def test_completions_unary_and_streamed_agree_with_usage_and_speculation_metrics() -> None:
    async def main():
        async with served() as front:
            unary = await front.client.completions.create(model=MODEL, prompt="Capital?", max_tokens=10,
                                                          extra_body={"return_token_ids": True})
            stream = await front.client.completions.create(model=MODEL, prompt="Capital?", max_tokens=10, stream=True,
                                                           stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            return unary, chunks

    unary, chunks = run(main())
    assert unary.choices[0].text == REPLY[:len(unary.choices[0].text)] and unary.choices[0].text
    assert unary.choices[0].model_extra["token_ids"] == TOKENS[:10]
    assert unary.usage.completion_tokens == 10 and unary.usage.total_tokens == unary.usage.prompt_tokens + 10
    assert unary.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == unary.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10  # include_usage: the last chunk
    assert all(c.usage is None for c in chunks[:-1])
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "length"
    spec = unary.model_extra["metrics"]["speculative_decoding"]
    assert spec == finishing[0].model_extra["metrics"]["speculative_decoding"]
    assert spec["num_drafts"] == 4 and spec["num_draft_tokens"] == 12 and spec["num_accepted_tokens"] == 7
    assert spec["num_accepted_tokens_per_pos"] == [4, 2, 1, 0]  # padded to the largest γ given (4)
    assert spec["mean_acceptance_length"] == pytest.approx(1 + 7 / 4)
    assert spec["draft_acceptance_rate"] == pytest.approx(7 / 12)
    timings = unary.model_extra["metrics"]["timings"]
    assert timings["queue_seconds"] >= 0.125 and timings["total_seconds"] >= timings["time_to_first_token_seconds"] > 0


def test_chat_streams_role_then_content_and_renders_the_template() -> None:
    async def main():
        async with served() as front:
            messages = [{"role": "developer", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "Capital"}, {"type": "text", "text": "?"}]}]
            unary = await front.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                               logprobs=True, top_logprobs=2)
            stream = await front.client.chat.completions.create(model=MODEL, messages=messages, stream=True)
            chunks = [chunk async for chunk in stream]
            return unary, chunks, front.target.requests

    unary, chunks, requests = run(main())
    assert unary.object == "chat.completion" and unary.choices[0].message.role == "assistant"
    assert unary.choices[0].message.content == TT.decode(TOKENS[:6])
    content = unary.choices[0].logprobs.content
    assert [c.token for c in content] == [TT.token_text(t) for t in TOKENS[:6]]
    assert all(c.logprob == -0.5 and len(c.top_logprobs) == 2 for c in content)
    # As OpenAI streams: the role with empty content, the content, then an empty delta that finishes.
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.choices[0].delta.role is None and c.choices[0].delta.content for c in chunks[1:-1])
    assert chunks[-1].choices[0].delta.content is None and chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == REPLY  # no max_tokens: all that fits
    # developer -> system; text parts joined; the chat template rendered the prompt.
    assert TT.decode(requests[0].prompt_token_ids) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital?<|im_end|>\n<|im_start|>assistant\n"
    assert requests[1].max_new_tokens == 256 - len(requests[1].prompt_token_ids)  # as many as fit the context
    assert requests[0].sampling.temperature == 1.0  # OpenAI's default, not gRPC's greedy 0


def test_parameters_reach_the_target_as_sent() -> None:
    async def main():
        async with served() as front:
            await front.client.completions.create(
                model=MODEL, prompt=[[5, 6, 7]], max_tokens=3, temperature=0.5, top_p=0.9, seed=11, stop=["zz"],
                logprobs=1, user="u",
                extra_body={"top_k": 7, "speculation": 3, "stop_token_ids": [9], "ignore_eos": True, "min_tokens": 2,
                            "unknown": 1})
            await front.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=2, temperature=0,
                stop="x", extra_body={"speculation": "auto", "max_gamma": 2})
            await front.client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                                  extra_body={"speculation": "off", "top_k": -1})
            return front.target.requests

    first, chat, off = run(main())
    assert first.prompt_token_ids == [5, 6, 7] and first.max_new_tokens == 3
    assert (first.sampling.temperature, first.sampling.top_k, first.sampling.seed) == (0.5, 7, 11)
    assert first.sampling.top_p == pytest.approx(0.9)
    assert first.logprobs == 1
    assert first.stop_token_ids == {9} and not first.eos_token_ids  # ignore_eos: EOS is neither
    assert first.speculation.mode == "fixed" and first.speculation.gamma == 3 and first.min_tokens == 2
    assert chat.max_new_tokens == 2 and chat.sampling.temperature == 0.0
    assert chat.speculation.mode == "auto" and chat.speculation.max_gamma == 2
    assert off.speculation.mode == "off" and off.sampling.top_k == 0  # vLLM's top_k=-1: no cut


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

BAD = [  # (endpoint, body changes, the param the 400 must name)
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": 10_000}, "max_tokens"),
    ("completions", {"temperature": -1}, "temperature"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"top_p": 0}, "top_p"),
    ("completions", {"top_p": 1.5}, "top_p"),
    ("completions", {"top_k": -2}, "top_k"),
    ("completions", {"seed": -1}, "seed"),
    ("completions", {"stop": [""]}, "stop"),
    ("completions", {"stop": ["x"] * 40}, "stop"),
    ("completions", {"n": 17}, "n"),
    ("completions", {"n": 0}, "n"),
    ("chat", {"n": 2, "temperature": 0}, "n"),  # n identical answers
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"logprobs": 500}, "logprobs"),
    ("completions", {"echo": True, "logprobs": 1}, "echo"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"logit_bias": {"5": 500}}, "logit_bias"),
    ("completions", {"logit_bias": {"five": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"100000000": 1}}, "logit_bias"),  # past the vocabulary
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"repetition_penalty": 3}, "repetition_penalty"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {"prompt": [1, 100000]}, "prompt"),
    ("completions", {"prompt": [-1]}, "prompt"),
    ("completions", {"prompt": None}, "prompt"),
    ("completions", {"speculation": "fast"}, "speculation"),
    ("completions", {"speculation": 99}, "speculation"),
    ("completions", {"speculation": "off", "max_gamma": 3}, "max_gamma"),
    ("completions", {"max_gamma": 99}, "max_gamma"),
    ("completions", {"stop_token_ids": [10**6]}, "stop_token_ids"),
    ("completions", {"min_tokens": 5}, "min_tokens"),  # more than max_tokens
    ("completions", {"min_tokens": -1}, "min_tokens"),
    ("completions", {"stream_options": {"include_usage": "yes please"}}, "stream_options.include_usage"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ("completions", {"speculation": True}, "speculation"),  # not γ = 1
    ("completions", {"speculation": "3"}, "speculation"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("chat", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"max_tokens": 100_000}, "max_tokens"),
    ("chat", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ("chat", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ("chat", {"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters"),  # the compiler's reason
    ("chat", {"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),  # no tools
    ("chat", {"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ("chat", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice.function.name"),
    ("chat", {"tools": [TOOL], "response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0].tool_calls"),
    ("chat", {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
     "response_format.json_schema.name"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),  # the compiler's reason
    ("completions", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ("completions", {"guided_choice": []}, "guided_choice"),
    ("chat", {"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ("chat", {"model": 5}, "model"),
]


def _body(endpoint: str, changes: dict) -> dict:
    body = {"model": MODEL, "max_tokens": 4}
    body |= {"prompt": "hi"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    return {k: v for k, v in (body | changes).items()}


def test_every_bad_parameter_is_a_400_naming_it_and_nothing_reaches_the_target() -> None:
    async def main():
        results = []
        async with served() as front:
            for endpoint, changes, _ in BAD:
                path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
                results.append(await raw_http(front.url, path, json.dumps(_body(endpoint, changes)).encode()))
            ok = await front.client.completions.create(model=MODEL, prompt="hi", max_tokens=2)  # carries on
            return results, front.target.requests, ok

    results, requests, ok = run(main())
    for (endpoint, changes, param), (status, headers, payload) in zip(BAD, results):
        error = json.loads(payload)["error"]
        assert status == 400, (endpoint, changes, status, payload)
        assert error["param"] == param, (endpoint, changes, error)
        assert error["type"] == "invalid_request_error" and error["message"]
        assert headers["content-type"] == "application/json"
    assert len(requests) == 1 and ok.usage.completion_tokens == 2


def test_the_openai_client_raises_bad_request_with_the_param() -> None:
    async def main():
        async with served() as front:
            with pytest.raises(openai.BadRequestError) as bad:
                await front.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                           temperature=-0.5)
            with pytest.raises(openai.NotFoundError) as missing:
                await front.client.completions.create(model="gpt-4o", prompt="hi")
            with pytest.raises(openai.BadRequestError) as streamed:  # refused before the stream starts
                await front.client.completions.create(model=MODEL, prompt="hi", top_p=7, stream=True)
            return bad.value, missing.value, streamed.value

    bad, missing, streamed = run(main())
    assert bad.status_code == 400 and bad.body["param"] == "temperature" and "-0.5" in bad.body["message"]
    assert missing.status_code == 404 and missing.body["code"] == "model_not_found" and missing.body["param"] == "model"
    assert streamed.status_code == 400 and streamed.body["param"] == "top_p"


def test_malformed_bodies_and_unknown_routes_get_openai_errors() -> None:
    async def main():
        async with served() as front:
            return [await raw_http(front.url, "/v1/completions", b'{"model": "scripted", "prompt": '),
                    await raw_http(front.url, "/v1/completions", b"[1, 2]"),
                    await raw_http(front.url, "/v1/completions", b'{"prompt": "hi"}'),
                    await raw_http(front.url, "/v1/embeddings", b"{}"),
                    await raw_http(front.url, "/v1/completions", None, method="GET"),
                    await raw_http(front.url, "/v1/models", None, method="GET"),
                    await raw_http(front.url, f"/v1/models/{MODEL}", None, method="GET"),
                    await raw_http(front.url, "/v1/models/other", None, method="GET"),
                    await raw_http(front.url, "/health", None, method="GET"),
                    await raw_http(front.url, "/metrics", None, method="GET")]

    (json_bad, not_object, no_model, route, method, models, card, other, health, metrics) = run(main())
    assert json_bad[0] == 400 and json.loads(json_bad[2])["error"]["code"] == "invalid_json"
    error = json.loads(not_object[2])["error"]
    assert not_object[0] == 400 and error["code"] == "invalid_body" and "JSON object" in error["message"], error
    assert no_model[0] == 400 and json.loads(no_model[2])["error"]["param"] == "model"
    assert route[0] == 404 and "error" in json.loads(route[2])
    assert method[0] == 405 and "error" in json.loads(method[2])
    assert models[0] == 200 and [m["id"] for m in json.loads(models[2])["data"]] == [MODEL]
    assert card[0] == 200 and json.loads(card[2])["max_model_len"] == 256
    assert other[0] == 404 and json.loads(other[2])["error"]["code"] == "model_not_found"
    assert health[0] == 200 and json.loads(health[2]) == {"status": "ok"}
    assert metrics[0] == 200 and b"specstream:time_to_first_token_seconds" in metrics[2]


def test_an_error_after_the_first_chunk_is_an_error_event_then_done() -> None:
    async def main():
        async with served() as front:
            body = json.dumps({"model": MODEL, "prompt": "FAIL", "max_tokens": 8, "stream": True}).encode()
            raw = await raw_http(front.url, "/v1/completions", body)
            stream = await front.client.completions.create(model=MODEL, prompt="FAIL", max_tokens=8, stream=True)
            texts = []
            with pytest.raises(openai.APIError) as failed:
                async for chunk in stream:
                    texts.append(chunk.choices[0].text)
            return raw, texts, failed.value

    (status, headers, payload), texts, failed = run(main())
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in payload.decode().split("\n\n") if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "scripted" in error["message"] and error["type"] == "invalid_request_error"
    # The target's error, known by its status and text only: its text as sent, no parameter named.
    assert (error["message"], error["param"], error["code"]) == ("prompt='FAIL': scripted", None, "invalid_value")
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-2]] == [TT.decode(TOKENS[:1]), TT.decode(TOKENS[1:2])]
    assert "".join(texts) == TT.decode(TOKENS[:2]) and "scripted" in str(failed)


def test_a_client_that_disconnects_cancels_its_request_on_the_target() -> None:
    """SLOW prompts take ~0.5 s per token: the client leaves mid-stream / before the unary reply."""

    async def main():
        async with served() as front:
            stream = await front.client.completions.create(model=MODEL, prompt="SLOW", max_tokens=20, stream=True)
            async for _ in stream:
                break  # one chunk, then go
            await stream.close()
            unary = asyncio.ensure_future(front.client.completions.create(model=MODEL, prompt="SLOW", max_tokens=20))
            for _ in range(500):  # until the unary request is on the target (not a fixed sleep: a loaded machine)
                if len(front.target.requests) == 2:
                    break
                await asyncio.sleep(0.01)
            unary.cancel()  # closes the connection
            await asyncio.gather(unary, return_exceptions=True)
            for _ in range(200):
                if len(front.target.cancelled) == 2 and front.gateway.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            return [r.id for r in front.target.requests], front.target.cancelled, front.gateway.in_flight

    sent, cancelled, in_flight = run(main())
    assert sorted(cancelled) == sorted(sent) and len(sent) == 2, (sent, cancelled)
    assert in_flight == 0


def test_overload_is_429_with_retry_after_and_the_server_carries_on() -> None:
    async def main():
        async with served(max_in_flight=1) as front:
            stream = await front.client.completions.create(model=MODEL, prompt="SLOW", max_tokens=3, stream=True)
            body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
            refused = await raw_http(front.url, "/v1/completions", body)
            with pytest.raises(openai.RateLimitError) as limited:
                await front.client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
            after = await front.client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            return refused, limited.value, text, after

    (status, headers, payload), limited, text, after = run(main())
    assert status == 429 and headers["retry-after"] == "1"
    assert json.loads(payload)["error"]["code"] == "rate_limit_exceeded"
    assert limited.status_code == 429
    assert text == TT.decode(TOKENS[:3]) and after.usage.completion_tokens == 2


def test_the_http_server_takes_a_free_port_and_refuses_a_taken_one() -> None:
    async def main():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            with pytest.raises(OSError):
                HttpServer(build_app(None), "127.0.0.1", taken.getsockname()[1], grace_s=0.1)  # type: ignore[arg-type]
            free = HttpServer(build_app(None), "127.0.0.1", 0, grace_s=0.1)  # type: ignore[arg-type]
            free.sock.close()
            assert free.port > 0 and free.port != taken.getsockname()[1]

    run(main())


def test_without_a_serving_replica_requests_get_503_and_health_says_so() -> None:
    async def main():
        async with served() as front:
            before = await raw_http(front.url, "/health", None, method="GET")
            await front.target_server.stop(None)  # the gateway's only replica is gone
            for _ in range(500):
                if not front.gateway.serving:
                    break
                await asyncio.sleep(0.01)
            body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
            return before, await raw_http(front.url, "/health", None, method="GET"), \
                await raw_http(front.url, "/v1/completions", body)

    before, health, refused = run(main())
    assert before[0] == 200
    assert health[0] == 503 and json.loads(health[2]) == {"status": "not_serving"}
    assert refused[0] == 503 and refused[1]["retry-after"] == "1"
    assert json.loads(refused[2])["error"]["type"] == "service_unavailable_error"


def test_a_body_over_the_limit_is_413_declared_or_chunked() -> None:
    async def main():
        async with served(max_body_bytes=4096) as front:
            host, port = front.url.removeprefix("http://").split(":")
            replies = []
            for chunked in (False, True):
                reader, writer = await asyncio.open_connection(host, int(port))
                body = json.dumps({"model": MODEL, "prompt": "x" * 5000, "max_tokens": 2}).encode()
                if chunked:
                    head = b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
                    payload = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 1000]), body[i:i + 1000])
                                       for i in range(0, len(body), 1000)) + b"0\r\n\r\n"
                else:
                    head = b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % len(body)
                    payload = body
                writer.write(head + payload)
                await writer.drain()
                replies.append(await reader.read())
                writer.close()
            small = await front.client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            return replies, small, front.target.requests

    replies, small, requests = run(main())
    for reply in replies:
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b'"request_too_large"' in reply
    assert small.usage.completion_tokens == 2 and len(requests) == 1  # refused ones never reached the target


def test_stop_strings_cut_the_text_and_finish_with_stop() -> None:
    async def main():
        async with served() as front:
            unary = await front.client.completions.create(model=MODEL, prompt="hi", max_tokens=20, stop=",")
            stream = await front.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=20, stop=["city", "light"],
                stream=True)
            return unary, [chunk async for chunk in stream]

    unary, chunks = run(main())
    assert unary.choices[0].text == " Paris" and unary.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " Paris, the "
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs_have_openais_shape() -> None:
    async def main():
        async with served() as front:
            unary = await front.client.completions.create(model=MODEL, prompt="hi", max_tokens=5, logprobs=1)
            stream = await front.client.completions.create(model=MODEL, prompt="hi", max_tokens=5, logprobs=1,
                                                           stream=True)
            return unary, [chunk async for chunk in stream]

    unary, chunks = run(main())
    logprobs = unary.choices[0].logprobs
    assert logprobs.tokens == [TT.token_text(t) for t in TOKENS[:5]]
    assert logprobs.token_logprobs == [-0.5] * 5
    assert logprobs.top_logprobs == [{TT.token_text(t): -0.5} for t in TOKENS[:5]]
    assert logprobs.text_offset == [len(TT.decode(TOKENS[:i])) for i in range(5)]
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((lp.tokens for lp in streamed), []) == logprobs.tokens
    assert sum((lp.text_offset for lp in streamed), []) == logprobs.text_offset


def test_explicit_nulls_are_the_defaults_and_max_completion_tokens_wins() -> None:
    async def main():
        async with served() as front:
            nulls = {"stream": None, "stream_options": None, "echo": None, "logprobs": None, "ignore_eos": None,
                     "return_token_ids": None, "seed": None, "stop": None, "temperature": None, "top_p": None,
                     "speculation": None, "n": None, "user": None}
            completion = await raw_http(front.url, "/v1/completions",
                                    json.dumps(_body("completions", nulls | {"max_tokens": 3})).encode())
            chat = await raw_http(front.url, "/v1/chat/completions", json.dumps(_body("chat", nulls | {
                "max_tokens": 9, "max_completion_tokens": 2, "top_logprobs": None})).encode())
            return completion, chat, front.target.requests

    completion, chat, requests = run(main())
    assert completion[0] == 200 and json.loads(completion[2])["usage"]["completion_tokens"] == 3, completion
    assert chat[0] == 200 and json.loads(chat[2])["choices"][0]["logprobs"] is None, chat
    assert requests[1].max_new_tokens == 2  # OpenAI's newer name takes precedence over max_tokens
    assert requests[0].sampling.temperature == 1.0 and requests[0].eos_token_ids  # nulls: OpenAI's defaults


def test_a_burst_never_passes_the_in_flight_bound() -> None:
    """Requests arriving together are admitted before any of them reaches the target: each holds
    its place from admission, so at most max_in_flight pass and the rest get 429 at once."""

    async def main():
        async with served(max_in_flight=2) as front:
            async def one():
                try:
                    return await front.client.completions.create(model=MODEL, prompt="SLOW", max_tokens=2)
                except openai.RateLimitError as exc:
                    return exc

            results = await asyncio.gather(*(one() for _ in range(8)))
            return results, front.target.requests, front.gateway.in_flight

    results, requests, in_flight = run(main())
    served_ = [r for r in results if not isinstance(r, openai.RateLimitError)]
    assert len(served_) == 2 and len(requests) == 2, (len(served_), len(requests))
    assert all(r.usage.completion_tokens == 2 for r in served_) and in_flight == 0


def test_while_shutting_down_health_and_new_requests_get_503() -> None:
    stopping = asyncio.Event()

    async def main():
        async with served(ready=lambda: not stopping.is_set()) as front:
            before = await front.client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            stopping.set()
            body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
            return before, await raw_http(front.url, "/health", None, method="GET"), \
                await raw_http(front.url, "/v1/completions", body), front.target.requests

    before, health, refused, requests = run(main())
    assert before.usage.completion_tokens == 2 and health[0] == 503
    assert refused[0] == 503 and refused[1]["retry-after"] == "1" and len(requests) == 1
    assert "shutting down" in json.loads(refused[2])["error"]["message"]


# ---- security: bearer tokens and HTTPS -------------------------------------------------------------


def test_n_choices_are_sent_together_with_their_own_seeds_unary_and_streamed() -> None:
    """n=3: three requests reach the target, with the body's seed + 0, 1, 2; the response has three
    choices (indices 0-2) and usage counts the prompt once and every choice's tokens; streamed,
    each choice's chunks carry its index and concatenate to its unary text, and include_usage
    sends one usage chunk for the three."""
    async def main():
        async with served() as front:
            unary = await front.client.completions.create(model=MODEL, prompt="Capital?", max_tokens=5, n=3,
                                                          seed=40)
            sent = list(front.target.requests)
            stream = await front.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Capital?"}], max_tokens=4, n=2, stream=True,
                stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            return unary, sent, chunks

    unary, sent, chunks = run(main())
    assert [r.sampling.seed for r in sent] == [40, 41, 42]
    assert [c.index for c in unary.choices] == [0, 1, 2]
    assert all(c.text == unary.choices[0].text and c.text for c in unary.choices)
    assert unary.usage.completion_tokens == 3 * 5
    assert unary.usage.total_tokens == unary.usage.prompt_tokens + 15
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] == REPLY[:len(texts[0])] and texts[0]
    finished = [choice.index for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert sorted(finished) == [0, 1]
    tails = [chunk for chunk in chunks if chunk.usage is not None]
    assert len(tails) == 1 and tails[0] is chunks[-1] and tails[0].usage.completion_tokens == 2 * 4
    assert len({chunk.id for chunk in chunks}) == 1
