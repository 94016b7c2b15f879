"""The OpenAI-compatible HTTP API of `specstream serve --http-port`, through the three real
processes on the default model pair (SmolLM2-135M-Instruct + its draft), with the official
`openai` package as the client (raw HTTP where a client would not send the bytes).

Checked: completions and chat, unary and streamed (deltas concatenate to the unary text, usage
and the speculative-decoding metrics right), greedy through HTTP equals greedy through gRPC and
plain target decoding token for token (and so under `min_tokens`), bad input -> 400 naming `param`, unknown model -> 404,
overload -> 429 with Retry-After, a disconnected client's sequences cancelled on the target, the
server carrying on after all of it, and the caller's `traceparent` header as the root of one
trace across the three services.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request

import openai
import pytest

from specstream.models.registry import PAIRS
from specstream_client import Client

MODEL = "SmolLM2-135M-Instruct.Q4_1"
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]
PROMPTS = ["The three laws of motion are", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
MAX_IN_FLIGHT = 3
TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def stack(stack_factory, tmp_path_factory):
    pair = PAIRS["smollm2"]
    trace_file = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    stack = stack_factory(pair.target, pair.draft, dtype="auto", gamma=4, proposer=pair.proposer,
                          ngram_min=pair.ngram_min, http_port=0, metrics=True, trace_file=str(trace_file),
                          extra_gateway_args=["--max-in-flight", str(MAX_IN_FLIGHT)])
    stack.trace_file = trace_file
    return stack


@pytest.fixture
def client(stack):
    with openai.OpenAI(base_url=f"http://{stack.http_address}/v1", api_key="none", max_retries=0,
                       timeout=300) as client:
        yield client


def _get(url: str) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _post(url: str, body: bytes) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_the_model_health_and_metrics_are_on_the_http_port(stack, client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    with Client(stack.gateway_address, timeout=30) as grpc_client:
        context = grpc_client.model_info().max_context_length
    assert client.models.retrieve(MODEL).model_extra["max_model_len"] == context > 256
    status, _, body = _get(f"http://{stack.http_address}/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, headers, body = _get(f"http://{stack.http_address}/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert b"specstream:time_to_first_token_seconds" in body


def test_chat_streamed_deltas_concatenate_to_the_unary_reply(client) -> None:
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    # γ 4 every pass: under automatic γ a loaded machine may price every guess out, and the
    # speculation metrics below would have nothing to count.
    fixed = {"speculation": 4}
    unary = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                           extra_body=fixed)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=fixed))
    text = unary.choices[0].message.content
    assert "Paris" in text and unary.choices[0].finish_reason == "stop"  # ended on <|im_end|>
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
        (unary.usage.prompt_tokens, unary.usage.completion_tokens)
    # The stream's prompt is the unary call's: the target's prefix cache served its full blocks.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (unary.usage.prompt_tokens - 1) // 16 * 16
    assert unary.usage.completion_tokens < 48 and unary.usage.prompt_tokens > 10
    assert unary.usage.total_tokens == unary.usage.prompt_tokens + unary.usage.completion_tokens
    spec = unary.model_extra["metrics"]["speculative_decoding"]
    assert spec["num_draft_tokens"] > 0 and 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert sum(spec["num_accepted_tokens_per_pos"]) == spec["num_accepted_tokens"]
    assert spec["num_drafts"] >= 1 and spec["mean_acceptance_length"] == pytest.approx(
        1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    # The final streamed chunk carries the stream's own statistics (γ is chosen per step from
    # measured costs, so the two runs may guess differently; the tokens are the same).
    finishing = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    streamed = finishing.model_extra["metrics"]["speculative_decoding"]
    assert sum(streamed["num_accepted_tokens_per_pos"]) == streamed["num_accepted_tokens"]
    assert streamed["target_passes"] >= 1 and chunks[-1].model_extra["metrics"]["speculative_decoding"] == streamed
    assert unary.model_extra["metrics"]["timings"]["total_seconds"] > 0


def test_a_repeated_conversation_is_served_from_the_prefix_cache_only_under_its_salt(stack, client) -> None:
    """The next turn reports its cached prompt tokens (usage.prompt_tokens_details, as OpenAI's),
    a request with vLLM's cache_salt shares nothing with it, and both answer the same; the target
    counts the queries and hits by vLLM's metric names."""
    first = [{"role": "system", "content": "You answer travel questions in one short sentence."},
             {"role": "user", "content": QUESTIONS[0]}]
    one = client.chat.completions.create(model=MODEL, messages=first, max_tokens=24, temperature=0)
    second = [*first, {"role": "assistant", "content": one.choices[0].message.content},
              {"role": "user", "content": "And of Italy?"}]
    cached = client.chat.completions.create(model=MODEL, messages=second, max_tokens=24, temperature=0)
    salted = client.chat.completions.create(model=MODEL, messages=second, max_tokens=24, temperature=0,
                                            extra_body={"cache_salt": "another tenant"})
    assert cached.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens // 16 * 16 > 0
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert cached.choices[0].message.content == salted.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=second, max_tokens=4,
                                       extra_body={"cache_salt": "s" * 257})
    assert bad.value.body["param"] == "cache_salt"
    _, _, body = _get(f"http://{stack.metrics_addresses['target']}/metrics")
    hits = float(re.search(rb"^specstream:prefix_cache_hits_total (\S+)$", body, re.M).group(1))
    queries = float(re.search(rb"^specstream:prefix_cache_queries_total (\S+)$", body, re.M).group(1))
    assert queries >= hits >= cached.usage.prompt_tokens_details.cached_tokens


def test_n_choices_are_the_requests_of_seeds_seed_plus_i_and_share_one_prefill(stack, client) -> None:
    """n=3 at a fixed γ: each choice is token for token the single request with seed 5 + i (sent
    apart, under another salt), and the three requests, sent together, prefilled their prompt once:
    the target's prefix cache served the other two their prompt's full blocks."""
    def hits() -> float:
        _, _, body = _get(f"http://{stack.metrics_addresses['target']}/metrics")
        return float(re.search(rb"^specstream:prefix_cache_hits_total (\S+)$", body, re.M).group(1))

    prompt = (PROMPTS[2] + " the baker, the smith, the teacher and the tailor met at the well every morning to "
              "talk about the weather, the harvest and the travellers who had come through the night before. One")
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.9)
    before = hits()
    many = client.completions.create(**kwargs, n=3, seed=5,
                                     extra_body={"speculation": 4, "cache_salt": "n", "return_token_ids": True})
    shared = hits() - before
    ones = [client.completions.create(**kwargs, seed=5 + i, extra_body={"speculation": 4, "cache_salt": f"one {i}",
                                                                         "return_token_ids": True})
            for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in many.choices] == [o.choices[0].model_extra["token_ids"] for o in ones]
    assert len({c.text for c in many.choices}) > 1  # three seeds, not one answer three times
    assert many.usage.completion_tokens == sum(o.usage.completion_tokens for o in ones)
    assert shared >= 2 * ((many.usage.prompt_tokens - 1) // 16 * 16) > 0


def test_seeded_sampled_completions_stream_what_the_unary_call_returns(client) -> None:
    # A fixed γ: the seed keys the draws of one run's sequence of accept/reject decisions, and γ=auto
    # chooses per step from measured costs, so a re-run may draw differently (the same distribution).
    kwargs = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=40, temperature=0.8, top_p=0.95, seed=5,
                  extra_body={"speculation": 4})
    unary = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    other = client.completions.create(**{**kwargs, "seed": 6})
    assert unary.choices[0].text == again.choices[0].text == "".join(c.choices[0].text for c in chunks)
    assert other.choices[0].text != unary.choices[0].text
    assert unary.model_extra["seed"] == 5


def test_greedy_through_http_equals_greedy_through_grpc_and_plain_decoding(stack, client) -> None:
    with Client(stack.gateway_address, timeout=300) as grpc_client:
        for prompt in PROMPTS:
            http = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0,
                                             extra_body={"return_token_ids": True})
            grpc_auto = grpc_client.generate(prompt, max_new_tokens=48)
            plain = grpc_client.generate(prompt, max_new_tokens=48, speculation="off")
            assert http.choices[0].model_extra["token_ids"] == grpc_auto.token_ids == plain.token_ids
            assert http.choices[0].text == plain.text
            assert (http.usage.prompt_tokens, http.usage.completion_tokens) == \
                (plain.usage.prompt_tokens, plain.usage.completion_tokens)
            spec = http.model_extra["metrics"]["speculative_decoding"]
            assert spec["target_passes"] >= 1 and spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
        for question in QUESTIONS[1:]:
            messages = [{"role": "user", "content": question}]
            http = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=64,
                                                  temperature=0, extra_body={"speculation": 4,
                                                                             "return_token_ids": True})
            plain = grpc_client.chat(messages, max_new_tokens=64, speculation="off")
            assert http.choices[0].model_extra["token_ids"] == plain.token_ids
            assert http.choices[0].message.content == plain.text
            assert http.usage.prompt_tokens == plain.usage.prompt_tokens  # the same chat template


def test_min_tokens_through_http_and_grpc_with_speculation_equals_plain_decoding(stack, client) -> None:
    """A reply that ends on its end of turn early, asked again with min_tokens past that end: the
    end of turn is masked until then, through the openai client and the SDK, speculative and plain
    alike, token for token."""
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    with Client(stack.gateway_address, timeout=300) as grpc_client:
        free = grpc_client.chat(messages, max_new_tokens=64, speculation="off")
        assert free.finish_reason == "eos" and free.usage.completion_tokens < 40, free
        floor = free.usage.completion_tokens + 8
        plain = grpc_client.chat(messages, max_new_tokens=64, min_tokens=floor, speculation="off")
        grpc_auto = grpc_client.chat(messages, max_new_tokens=64, min_tokens=floor)
    http = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=64, temperature=0,
                                          extra_body={"min_tokens": floor, "speculation": 4,
                                                      "return_token_ids": True})
    assert plain.usage.completion_tokens >= floor
    # Up to the end of turn the masked reply is the free one; after it, something else.
    shared = free.usage.completion_tokens - 1
    assert plain.token_ids[:shared] == free.token_ids[:shared] and plain.token_ids != free.token_ids
    assert grpc_auto.token_ids == plain.token_ids == http.choices[0].model_extra["token_ids"]
    assert http.choices[0].message.content == plain.text
    assert http.usage.completion_tokens == plain.usage.completion_tokens


def test_bad_input_gets_openai_errors_and_the_server_carries_on(stack, client) -> None:
    cases = [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"), (dict(top_p=2), "top_p"),
             (dict(n=17), "n"), (dict(logprobs=1000), "logprobs"), (dict(stop=[""]), "stop"),
             (dict(extra_body={"speculation": "sometimes"}), "speculation"),
             (dict(max_tokens=100_000), "max_tokens")]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(**{"model": MODEL, "prompt": "hi", "max_tokens": 4, **kwargs})
        assert bad.value.status_code == 400 and bad.value.body["param"] == param, (kwargs, bad.value.body)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "beep"}])
    assert bad.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["code"] == "model_not_found"
    url = f"http://{stack.http_address}/v1/chat/completions"
    status, _, body = _post(url, b'{"model": "' + MODEL.encode() + b'", "messages": [')
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_json"
    status, _, body = _post(url, json.dumps({"model": MODEL, "messages": "hi"}).encode())
    assert status == 400 and json.loads(body)["error"]["param"] == "messages"
    reply = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3


def test_overload_is_429_and_disconnected_clients_are_cancelled_on_the_target(stack) -> None:
    async def main() -> tuple:
        async with openai.AsyncOpenAI(base_url=f"http://{stack.http_address}/v1", api_key="none",
                                      max_retries=0, timeout=300) as client:
            streams = [await client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=400,
                                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
                       for _ in range(MAX_IN_FLIGHT)]
            for stream in streams:  # all three are generating
                await stream.__anext__()
            with pytest.raises(openai.RateLimitError) as limited:
                await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            with Client(stack.gateway_address, timeout=30) as grpc_client:
                busy = grpc_client.model_info()
                for stream in streams:
                    await stream.close()  # the client goes away mid-generation
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    idle = grpc_client.model_info()
                    if idle.running_sequences == 0 and idle.gateway_in_flight == 0:
                        break
                    await asyncio.sleep(0.05)
            after = await client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
            return limited.value, busy, idle, after

    limited, busy, idle, after = asyncio.run(main())
    assert limited.status_code == 429 and limited.response.headers["retry-after"] == "1"
    assert limited.body["code"] == "rate_limit_exceeded"
    assert busy.running_sequences == MAX_IN_FLIGHT and busy.gateway_in_flight == MAX_IN_FLIGHT
    # 400 tokens each would take most of a minute here: freed within seconds means cancelled, not finished.
    assert idle.running_sequences == 0 and idle.gateway_in_flight == 0, idle
    assert after.usage.completion_tokens == 2


def test_the_callers_traceparent_roots_one_trace_across_the_three_services(stack, client) -> None:
    # A fixed γ: the draft is asked on every step (under automatic γ a loaded machine may not ask it).
    client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                              extra_headers={"traceparent": f"00-{TRACE}-{PARENT}-01"},
                              extra_body={"speculation": 4})
    client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0,
                              extra_headers={"traceparent": "not-a-traceparent"})  # ignored, not refused
    spans: list[dict] = []
    deadline = time.monotonic() + 20  # the processes export in batches
    while time.monotonic() < deadline:
        spans = [json.loads(line) for line in stack.trace_file.read_text().splitlines()]
        trace = [s for s in spans if s["trace_id"] == TRACE]
        others = [s for s in spans if s["name"] == "POST /v1/completions" and s["trace_id"] != TRACE]
        if {s["service"] for s in trace} >= {"specstream-gateway", "specstream-target", "specstream-draft"} \
                and others:
            break
        time.sleep(0.5)
    trace = [s for s in spans if s["trace_id"] == TRACE]
    (http,) = [s for s in trace if s["name"] == "POST /v1/completions"]
    assert http["parent_span_id"] == PARENT and http["kind"] == "SERVER"
    assert http["attributes"]["http.response.status_code"] == 200
    (generate,) = [s for s in trace if s["name"] == "gen_ai.generate"]
    assert generate["parent_span_id"] == http["span_id"]
    assert {s["service"] for s in trace} == {"specstream-gateway", "specstream-target", "specstream-draft"}
    untraced = [s for s in spans if s["name"] == "POST /v1/completions" and s["trace_id"] != TRACE]
    assert untraced and all(s["parent_span_id"] is None for s in untraced)
