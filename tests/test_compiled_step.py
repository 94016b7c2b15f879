"""The compiled decode step that `bench step --compiled` measures (tools/bench/compiled.py):
the static-cache forward gives the served model's logits, eager and compiled."""

from __future__ import annotations

import pytest
import torch
from tests.support.hardware import NEEDS_Q4_NATIVE

from specstream.models.loader import load_model
from specstream.models.random_init import write_random_checkpoint
from tools.bench.compiled import StaticDecoder, compiled_curve

CONFIG = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


@pytest.mark.parametrize("dtype, weights, matmul", [
    ("float32", "dense", "native"),
    *[pytest.param("bfloat16", "int4-rtn", matmul, marks=NEEDS_Q4_NATIVE) for matmul in ("native", "int4", "dense")]])
def test_the_static_cache_forward_gives_the_served_logits(tmp_path, dtype, weights, matmul) -> None:
    """A prefill, then decode steps and a verify window over the static cache, against the served
    model over its own cache: float32 to float rounding; bfloat16 to a few of its steps (the
    attention's float32 softmax is summed in another order; ATen's int4 kernel rounds its scales)."""
    model = load_model(write_random_checkpoint(tmp_path / "m", CONFIG, seed=5), dtype=dtype, weights=weights)
    decoder = StaticDecoder(model, 64, matmul)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 96, (30,), generator=gen)
    cache = model.new_cache(1, 64)
    slot = torch.tensor([cache.alloc()])
    tol = 1e-4 if dtype == "float32" else 0.1
    with torch.inference_mode():
        for start, end in ((0, 20), (20, 21), (21, 22), (22, 30)):  # prefill, two steps, a window of 8
            want = model(tokens[None, start:end], cache, slot, torch.tensor([start]))[0].float()  # [n, V]
            got = decoder(tokens[start:end], torch.arange(start, end))  # [n, V]
            assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item()), (start, end)


def test_a_compiled_bucket_is_timed_and_agrees(tmp_path) -> None:
    model = load_model(write_random_checkpoint(tmp_path / "m", {**CONFIG, "num_hidden_layers": 1}, seed=5),
                       dtype="float32")
    out = compiled_curve(model, context=12, positions=(2,), repeats=2)
    assert out["compile_s"][2] > 0 and out["compiled"][2] > 0 and out["eager"][2] > 0
    assert out["agreement"][2]["same_greedy"] and out["agreement"][2]["max_abs"] < 1e-3


def test_layers_it_does_not_write_are_refused(tmp_path) -> None:
    model = load_model(write_random_checkpoint(tmp_path / "m", {**CONFIG, "attention_bias": True}, seed=5),
                       dtype="float32")
    assert model.layers[0].qkv_b is not None
    with pytest.raises(ValueError, match="biases"):
        StaticDecoder(model, 64)
