"""The three real processes over gRPC: losslessness, bad input, streaming, cancellation, the CLI,
and the draft going away. Runs `specstream` services as subprocesses on loopback ports."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time

import grpc
import pytest

from specstream.text.tokenizer import TextTokenizer
from specstream_client import AsyncClient, Client, DeadlineExceeded, InvalidArgument
from specstream_pb import generation_pb2, generation_pb2_grpc

MAX_NEW = 24


def _prompts(tokenizer: TextTokenizer) -> list[list[int]]:
    rng = random.Random(11)
    texts = ["def main():", "The weather", "x = 1", "import os", "Hello, world", "for i in range(3):",
             "She said", "return None", "class A:", "2 + 2 ="]
    return [tokenizer.encode(t) for t in texts] + [
        [rng.randrange(2, tokenizer.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(10)]


async def _generate_all(address: str, prompts, speculation) -> list:
    async with AsyncClient(address, timeout=120) as client:
        return await asyncio.gather(*[
            client.generate(p, max_new_tokens=MAX_NEW, speculation=speculation, ignore_eos=True) for p in prompts])


@pytest.fixture(scope="module")
def partial_stack(stack_factory, model_zoo):
    return stack_factory(model_zoo["target"], model_zoo["partial"], max_slots=4)


@pytest.mark.parametrize("draft_kind", ["same", "unrelated", "partial"])
def test_lossless_over_grpc(stack_factory, model_zoo, draft_kind, request):
    if draft_kind == "partial":  # the module's stack (the other tests' requests leave nothing behind)
        stack = request.getfixturevalue("partial_stack")
    else:
        stack = stack_factory(model_zoo["target"], model_zoo[draft_kind], max_slots=4)
    prompts = _prompts(TextTokenizer.from_dir(model_zoo["target"]))
    plain = asyncio.run(_generate_all(stack.gateway_address, prompts, "off"))
    assert all(r.stats.draft_tokens == 0 for r in plain)
    assert len({tuple(r.token_ids) for r in plain}) > 10
    for gamma in (1, 2, 4, 8):
        spec = asyncio.run(_generate_all(stack.gateway_address, prompts, gamma))
        for i, (s, p) in enumerate(zip(spec, plain)):
            assert s.token_ids == p.token_ids, f"{draft_kind} gamma={gamma} prompt {i}"
            assert s.text == p.text
        proposed = sum(r.stats.draft_tokens for r in spec)
        accepted = sum(r.stats.accepted_tokens for r in spec)
        assert proposed > 0
        if draft_kind == "same":
            assert accepted == proposed
        elif draft_kind == "unrelated":
            assert accepted < proposed / 2


BAD_REQUESTS = [
    ("prompt", dict(prompt="")),
    ("prompt", dict()),
    ("prompt_token_ids", dict(prompt_token_ids=generation_pb2.TokenIds(ids=[10**6]))),
    ("prompt", dict(prompt="a b c " * 400)),  # longer than the context
    ("max_new_tokens", dict(prompt="hi", max_new_tokens=0)),
    ("max_new_tokens", dict(prompt="hi", max_new_tokens=-5)),
    ("max_new_tokens", dict(prompt="hi", max_new_tokens=100000)),
    ("speculation.gamma", dict(prompt="hi", max_new_tokens=4, speculation={"mode": 2, "gamma": 99})),
    ("speculation.gamma", dict(prompt="hi", max_new_tokens=4, speculation={"mode": 2, "gamma": 0})),
    ("speculation.mode", dict(prompt="hi", max_new_tokens=4, speculation={"mode": 7})),
    ("stop[0]", dict(prompt="hi", max_new_tokens=4, stop=[""])),
    ("stop_token_ids[0]", dict(prompt="hi", max_new_tokens=4, stop_token_ids=[10**6])),
    ("traceparent", dict(prompt="hi", max_new_tokens=4, traceparent="not-a-trace")),
    ("temperature", dict(prompt="hi", max_new_tokens=4, temperature=-1.0)),
    ("temperature", dict(prompt="hi", max_new_tokens=4, temperature=float("nan"))),
    ("top_p", dict(prompt="hi", max_new_tokens=4, temperature=1.0, top_p=0.0)),
    ("top_p", dict(prompt="hi", max_new_tokens=4, temperature=1.0, top_p=1.5)),
    ("top_k", dict(prompt="hi", max_new_tokens=4, temperature=1.0, top_k=-1)),
    ("top_logprobs", dict(prompt="hi", max_new_tokens=4, logprobs=True, top_logprobs=-1)),
    ("top_logprobs", dict(prompt="hi", max_new_tokens=4, logprobs=True, top_logprobs=21)),  # default limit 20
    ("top_logprobs", dict(prompt="hi", max_new_tokens=4, top_logprobs=2)),  # without logprobs=true
]


@pytest.mark.parametrize("field,kwargs", BAD_REQUESTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_REQUESTS)])
def test_bad_input_names_the_field(partial_stack, field, kwargs):
    with grpc.insecure_channel(partial_stack.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for call in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw))):
            with pytest.raises(grpc.RpcError) as info:
                call(generation_pb2.GenerateRequest(**kwargs), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith(field), info.value.details()
    # ...and the service keeps serving everyone else.
    with Client(partial_stack.gateway_address, timeout=60) as client:
        assert client.generate("hello", max_new_tokens=3, ignore_eos=True).usage.completion_tokens == 3


def test_unknown_field_is_rejected(partial_stack):
    raw = generation_pb2.GenerateRequest(prompt="hi", max_new_tokens=3).SerializeToString() + bytes([0xA0, 0x01, 0x05])
    with grpc.insecure_channel(partial_stack.gateway_address) as channel:
        call = channel.unary_unary("/specstream.v1.Generation/Generate")
        with pytest.raises(grpc.RpcError) as info:
            call(raw, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "field number 20" in info.value.details()


def test_bad_request_in_a_batch_loses_nothing(partial_stack, model_zoo):
    async def main():
        async with AsyncClient(partial_stack.gateway_address, timeout=60) as client:
            good = [client.generate(f"prompt {i}", max_new_tokens=8, ignore_eos=True) for i in range(6)]
            bad = [client.generate("x", max_new_tokens=0), client.generate("", max_new_tokens=3)]
            return await asyncio.gather(*good, *bad, return_exceptions=True)

    results = asyncio.run(main())
    assert all(r.usage.completion_tokens == 8 for r in results[:6])
    assert all(isinstance(r, InvalidArgument) for r in results[6:])


def test_stream_concatenates_to_unary(partial_stack):
    with Client(partial_stack.gateway_address, timeout=60) as client:
        for prompt, gamma in [("def main():", 4), ("Über naïve café ✓", "off"), ("x", 2)]:
            unary = client.generate(prompt, max_new_tokens=40, speculation=gamma, ignore_eos=True)
            chunks = list(client.generate_stream(prompt, max_new_tokens=40, speculation=gamma, ignore_eos=True))
            assert "".join(c.text for c in chunks) == unary.text
            assert [t for c in chunks for t in c.token_ids] == unary.token_ids
            assert chunks[-1].finish_reason == unary.finish_reason == "length"
            assert sum(1 for c in chunks if c.finish_reason) == 1


def test_stop_string_ends_generation(partial_stack):
    with Client(partial_stack.gateway_address, timeout=60) as client:
        full = client.generate("The weather", max_new_tokens=40, ignore_eos=True)
        stop = full.text[10:13]
        assert stop and stop in full.text
        cut = client.generate("The weather", max_new_tokens=40, stop=[stop], ignore_eos=True)
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]


def _wait_idle(client: Client, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = client.model_info()
        if info.running_sequences == 0 and info.draft_sequences == 0 and info.queued_sequences == 0:
            return info
        time.sleep(0.05)
    return info


def test_cancel_mid_stream_frees_target_slot_and_draft_state(partial_stack):
    with Client(partial_stack.gateway_address, timeout=60) as client:
        idle = _wait_idle(client)
        assert idle.running_sequences == 0 and idle.draft_sequences == 0
        # the public API names replicas by position, not by their internal address
        with grpc.insecure_channel(partial_stack.gateway_address) as channel:
            info = generation_pb2_grpc.GenerationStub(channel).GetModelInfo(generation_pb2.GetModelInfoRequest())
        assert [r.address for r in info.replicas] == ["replica-0"] and info.replicas[0].connected
        stream = client.generate_stream("def main():", max_new_tokens=400, speculation=4, ignore_eos=True)
        next(iter(stream))
        next(iter(stream))
        busy = client.model_info()
        assert busy.running_sequences == 1 and busy.free_slots == idle.free_slots - 1
        assert busy.draft_sequences == 1
        stream.cancel()
        after = _wait_idle(client)
        assert after.running_sequences == 0
        assert after.draft_sequences == 0
        assert after.free_slots == idle.free_slots


def test_deadline_frees_the_sequence(partial_stack):
    with Client(partial_stack.gateway_address, timeout=60) as client:
        idle = _wait_idle(client)
        with pytest.raises(DeadlineExceeded):
            client.generate("def main():", max_new_tokens=450, ignore_eos=True, timeout=0.05)
        after = _wait_idle(client)
        assert after.free_slots == idle.free_slots and after.draft_sequences == 0


def test_cli_generate_gamma_0_and_4_identical(partial_stack):
    def run(*flags):
        out = subprocess.run([sys.executable, "-m", "tools.cli", "generate", "--url", partial_stack.gateway_address,
                              "--json", "--max-new-tokens", "32", *flags, "def main():"],
                             capture_output=True, text=True, timeout=120, check=True)
        return json.loads(out.stdout)

    off, spec = run("--gamma", "0"), run("--gamma", "4")
    assert off["token_ids"] == spec["token_ids"]
    assert off["stats"]["draft_tokens"] == 0
    assert spec["stats"]["accepted_tokens"] > 0
    for key in ("text", "finish_reason", "usage", "timings"):
        assert key in spec


def test_target_keeps_serving_when_the_draft_dies(stack_factory, model_zoo):
    stack = stack_factory(model_zoo["target"], model_zoo["partial"], max_slots=2)
    with Client(stack.gateway_address, timeout=60) as client:
        before = client.generate("import os", max_new_tokens=20, speculation=4, ignore_eos=True)
        assert before.stats.draft_tokens > 0
        stack.procs["draft"].terminate()
        stack.procs["draft"].wait(10)
        after = client.generate("import os", max_new_tokens=20, speculation=4, ignore_eos=True)
        assert after.token_ids == before.token_ids
        assert not client.model_info().draft_connected
    stack.procs.pop("draft")


def test_gateway_reports_target_loss(stack_factory, model_zoo):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specstream_client import Unavailable

    stack = stack_factory(model_zoo["target"], None, max_slots=2)
    with Client(stack.gateway_address, timeout=30) as client:
        assert client.generate("x", max_new_tokens=2).usage.completion_tokens >= 1
        stack.procs["target"].terminate()
        stack.procs["target"].wait(10)
        with grpc.insecure_channel(stack.gateway_address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 10
            while health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "gateway still SERVING with its target gone"
                time.sleep(0.1)
        with pytest.raises(Unavailable):
            client.generate("x", max_new_tokens=2)
        # The target comes back on its address: the gateway reconnects, and the very first request
        # on the new stream is served (nothing queued for the dead stream swallows it).
        stack.restart("target")
        with grpc.insecure_channel(stack.gateway_address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 10
            while health.Check(health_pb2.HealthCheckRequest()).status != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "gateway did not reconnect"
                time.sleep(0.1)
        assert client.generate("x", max_new_tokens=2, timeout=20).usage.completion_tokens >= 1


def test_cli_sampling_is_reproducible_and_speculates(partial_stack):
    def run(*flags):
        out = subprocess.run([sys.executable, "-m", "tools.cli", "generate", "--url", partial_stack.gateway_address,
                              "--json", "--max-new-tokens", "32", "--ignore-eos", "--gamma", "4", *flags, "def main():"],
                             capture_output=True, text=True, timeout=120, check=True)
        return json.loads(out.stdout)

    first = run("--temperature", "0.8", "--top-p", "0.95", "--seed", "7")
    second = run("--temperature", "0.8", "--top-p", "0.95", "--seed", "7")
    other = run("--temperature", "0.8", "--top-p", "0.95", "--seed", "8")
    assert first["text"] == second["text"] and first["token_ids"] == second["token_ids"]
    assert first["seed"] == 7 and other["seed"] == 8
    assert other["token_ids"] != first["token_ids"]
    assert first["stats"]["accepted_tokens"] > 0


def test_seeded_sampling_over_grpc_ignores_what_shares_the_batch(partial_stack):
    """With a fixed γ (or off) a seed's text does not depend on the batch. Under automatic γ the
    schedule follows the batch and the measured costs, and a seed's realisation follows the schedule
    (docs/architecture.md §4.1): the distribution is exact, the text is not pinned."""
    prompt = "The weather"

    async def together():
        async with AsyncClient(partial_stack.gateway_address, timeout=120) as client:
            others = [client.generate(p, max_new_tokens=MAX_NEW, ignore_eos=True, temperature=t, seed=s, speculation=4)
                      for p, t, s in [("x = 1", 0.0, 0), ("import os", 1.3, 5), ("class A:", 0.7, 9)]]
            return await asyncio.gather(client.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True, speculation=4,
                                                        temperature=1.0, top_k=40, seed=123), *others)

    with Client(partial_stack.gateway_address, timeout=120) as client:
        alone = client.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True, temperature=1.0, top_k=40, seed=123,
                                speculation=4)
        greedy_off = client.generate("x = 1", max_new_tokens=MAX_NEW, ignore_eos=True, speculation="off")
    results = asyncio.run(together())
    assert results[0].token_ids == alone.token_ids
    assert results[1].token_ids == greedy_off.token_ids  # temperature 0 in the mix is still exact greedy


def test_logprobs_over_grpc_stream_and_unary_agree(partial_stack):
    # A fixed γ: the three calls then take the same steps, so even float32 logprobs agree bit for bit
    # (under auto the schedule may differ, and a row's float32 logits with it in the last digit).
    kwargs = dict(max_new_tokens=MAX_NEW, ignore_eos=True, temperature=1.0, seed=3, logprobs=True, top_logprobs=3,
                  speculation=4)
    with Client(partial_stack.gateway_address, timeout=120) as client:
        unary = client.generate("def main():", **kwargs)
        chunks = list(client.generate_stream("def main():", **kwargs))
        without = client.generate("def main():", **{**kwargs, "logprobs": False, "top_logprobs": 0})
    assert [lp.token_id for lp in unary.logprobs] == list(unary.token_ids)
    assert [lp for c in chunks for lp in c.logprobs] == unary.logprobs
    assert chunks[-1].seed == unary.seed == 3
    for lp in unary.logprobs:
        assert lp.logprob <= 0.0 and len(lp.top) == 3
        assert [a.logprob for a in lp.top] == sorted((a.logprob for a in lp.top), reverse=True)
        assert lp.logprob <= lp.top[0].logprob
    assert without.token_ids == unary.token_ids and without.logprobs == []


def test_a_port_taken_before_its_process_binds_it_restarts_the_stack_on_new_ports(model_zoo, tmp_path, monkeypatch):
    """Ports are chosen free, then bound by the children: one taken in between fails its process to
    bind, and the stack starts again on new ports. Here the gateway's port is taken by another gRPC
    server that answers health checks SERVING, as another stack's gateway would: the launcher asks
    for its own process's health, so it never takes that server for its gateway (a client of the
    stack reached the other one before). A gRPC server never shares its port (SO_REUSEPORT off)."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from specstream.data.config import ServerConfig
    from tools import launcher
    from tools.launcher import Stack, StackSpec

    other = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=ServerConfig().grpc_options())
    serving = health.HealthServicer()
    serving.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(serving, other)
    taken = other.add_insecure_port("127.0.0.1:0")
    other.start()
    chosen = []
    real = launcher.free_port

    def free_port(host: str = "127.0.0.1") -> int:  # draft, target, then the gateway: its port is the taken one
        chosen.append(taken if len(chosen) == 2 else real(host))
        return chosen[-1]

    monkeypatch.setattr(launcher, "free_port", free_port)
    spec = StackSpec(str(model_zoo["target"]), str(model_zoo["partial"]), max_seq_len=256, log_dir=str(tmp_path))
    try:
        with Stack(spec) as stack, Client(stack.gateway_address, timeout=60) as client:
            assert stack.gateway_address != f"127.0.0.1:{taken}"
            assert client.generate("def f(x):", max_new_tokens=8, speculation=2).token_ids
    finally:
        other.stop(None)
    assert b"Failed to bind to address" in (tmp_path / "gateway.log").read_bytes()


def test_a_grpc_server_of_ours_does_not_share_its_port():
    import grpc

    from specstream.data.config import ServerConfig

    async def bind_twice() -> None:
        first = grpc.aio.server(options=ServerConfig().grpc_options())
        port = first.add_insecure_port("127.0.0.1:0")
        second = grpc.aio.server(options=ServerConfig().grpc_options())
        with pytest.raises(RuntimeError, match="Failed to bind"):
            second.add_insecure_port(f"127.0.0.1:{port}")

    asyncio.run(bind_twice())
