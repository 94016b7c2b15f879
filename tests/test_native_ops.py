"""The native CPU ops (kernels/csrc/, one .cpp per op, built by kernels/native.py) against their torch
references, odd shapes and 1..16 rows, and their batch invariance: a row's result is the same bits
alone, among the positions of a verify window, or beside other sequences' rows, for every path that
serves (the whole model included)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.support.hardware import NEEDS_Q4_NATIVE, NEEDS_Q4_NATIVE_F32

from kernels import native
from kernels.int4 import Q4Weight
from kernels.int8 import Q8Weight, q8_linear, q8_linear_reference, rounded_rows
from specstream.models.random_init import write_random_checkpoint

DTYPES = (torch.float32, torch.bfloat16)


def test_the_library_builds_here() -> None:
    # This machine has a C++ compiler: if the build fails, every native path below would silently
    # be its torch reference. A failure here says why (the build's error is in the log).
    assert native.library() is not None


def _q8_matrix(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float32 matrix that is exactly Q8_0, its codes [n, k] int8, its scales [n, k/32])."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    codes[:, ::32] = 127  # each block's largest magnitude is 127 * d, as llama.cpp quantizes
    scale = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()  # half-precision scales
    scale[0, 0] = 0.0  # an all-zero block
    codes[0, :32] = 0
    dense = (codes.float().view(n, k // 32, 32) * scale[..., None]).view(n, k)
    return dense, codes, scale


def test_q8_blocks_are_recovered_exactly_and_only_from_q8_matrices() -> None:
    dense, codes, scale = _q8_matrix(40, 96, seed=1)
    weight = Q8Weight.from_exact(dense)
    assert weight is not None and torch.equal(weight.codes, codes) and torch.equal(weight.scale, scale)
    assert Q8Weight.from_exact(dense + 1e-4) is None  # not d * q any more
    assert Q8Weight.from_exact(torch.randn(40, 96)) is None
    assert Q8Weight.from_exact(dense[:, :90].contiguous()) is None  # not whole blocks


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 64), (123, 96), (1000, 576)])
def test_q8_matmul_matches_its_reference_for_1_to_16_rows(shape, dtype) -> None:
    n, k = shape
    dense, _, _ = _q8_matrix(n, k, seed=2)
    weight = Q8Weight.from_exact(dense)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, k, generator=gen).to(dtype)
    got = q8_linear(x, weight)  # [16, n] float32
    # With AVX-512 BF16 the op multiplies bfloat16 inputs by the matrix rounded to bfloat16 (as the
    # reference does for x in bfloat16); without it, it reads them as float32 rows and the matrix
    # unrounded: the reference for float32 inputs.
    bf16_kernel = dtype == torch.bfloat16 and native.library().has_avx512_bf16()
    want = q8_linear_reference(x if bf16_kernel else x.float(), weight)
    tol = 1e-3 if bf16_kernel else 1e-5
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < tol, f"max relative difference {err:.3g}"
    for m in range(1, 17):  # every row count: each row the same bits as alone
        assert torch.equal(q8_linear(x[:m], weight), got[:m]), m
    assert torch.equal(torch.cat([q8_linear(x[i:i + 1], weight) for i in range(16)]), got)


@pytest.mark.parametrize("shape", [(5, 64), (123, 96), (1000, 576)])
def test_q8_matmul_with_16_bit_inputs_matches_its_reference_and_keeps_rows_apart(shape) -> None:
    """The integer path (``q8_linear``'s ``bits`` 16, kernels/csrc/q8_matmul.cpp): against the rows
    rounded as the kernel rounds them times the matrix in float64, for 1..9 rows (passes of 4 and
    their tails), features that fill the last tile of 8 and features that do not, a zero block; each
    row the same bits alone; and the rounding shows."""
    if not native.library().has_avx2_fma():
        pytest.skip("this CPU (or SPECSTREAM_CPU_ISA) has no AVX2: the 16-bit input path cannot run here")
    n, k = shape
    dense, _, _ = _q8_matrix(n, k, seed=4)
    weight = Q8Weight.from_exact(dense)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, k, generator=gen) * torch.rand(9, k, generator=gen) * 4
    x[-1, :32] = 0  # a block of zeros: scale 0, codes 0
    got = q8_linear(x, weight, 16)  # [9, n] float32
    want = q8_linear_reference(x, weight, 16)
    magnitudes = x.double().abs() @ dense.double().abs().T  # [9, n]
    assert ((got.double() - want.double()).abs() <= 2 ** -20 * want.double().abs() + 1e-6 * magnitudes).all()
    for m in range(1, 10):
        assert torch.equal(q8_linear(x[:m], weight, 16), got[:m]), m
    assert torch.equal(torch.cat([q8_linear(x[i:i + 1], weight, 16) for i in range(9)]), got)
    assert not torch.equal(got, q8_linear(x, weight))  # the inputs' rounding shows
    with pytest.raises(ValueError, match="16 bits or not at all"):
        q8_linear(x, weight, 8)


def _tiny_model(tmp_path, dtype: str, weights: str = "dense", **overrides):
    from specstream.models.loader import load_model

    config = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, **overrides}
    return load_model(write_random_checkpoint(tmp_path / "m", config, seed=5), dtype=dtype, weights=weights)


def _logits(model, rows: list[tuple[list[int], int]], slots: list[int], cache) -> torch.Tensor:
    """One forward over rows of (tokens, start) of equal length, each in its slot -> [B, T, V]."""
    ids = torch.tensor([tokens for tokens, _ in rows])
    with torch.inference_mode():
        return model(ids, cache, torch.tensor(slots), torch.tensor([start for _, start in rows]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [None, 5])
def test_native_attention_matches_the_torch_path(tmp_path, dtype, window) -> None:
    overrides = {"sliding_window": window, "use_sliding_window": True, "max_window_layers": 0} if window else {}
    model = _tiny_model(tmp_path, dtype, **overrides)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 96, (3, 20), generator=gen).tolist()

    def run() -> torch.Tensor:
        cache = model.new_cache(3, 64)
        first = _logits(model, [(p[:12], 0) for p in prompt], [0, 1, 2], cache)
        then = _logits(model, [(p[12:], 12) for p in prompt], [0, 1, 2], cache)  # a verify-like window
        return torch.cat([first, then], dim=1).float()

    native_out = run()
    os.environ["SPECSTREAM_NATIVE"] = "0"
    try:
        torch_out = run()
    finally:
        os.environ.pop("SPECSTREAM_NATIVE")
    tol = 2e-4 if dtype == "float32" else 0.1
    assert (native_out - torch_out).abs().max().item() < tol * max(1.0, torch_out.abs().max().item())


@pytest.mark.parametrize("dtype, weights, bits", [("float32", "dense", 0), ("float32", "int4-rtn", 0),
                                                  ("float32", "int4-rtn", 8), ("float32", "int4-rtn", 16),
                                                  ("bfloat16", "dense", 0), ("bfloat16", "int4-rtn", 0),
                                                  ("bfloat16", "int4-rtn", 8)])
def test_a_rows_logits_are_the_same_bits_alone_in_a_verify_window_and_in_a_batch(tmp_path, monkeypatch, dtype,
                                                                                   weights, bits) -> None:
    """The model with the ops it serves with (the native attention; float32 dense and 4-bit; bfloat16
    dense with the 8-bit output layer; bfloat16 4-bit; and the 4-bit layers with 8-bit and 16-bit
    activations, the latter with the 8-bit output layer on 16-bit inputs): a position computed in a
    decode step, inside a verify window of 2..16 positions, and beside 1..32 other sequences gives the
    same logits, bit for bit."""
    from kernels.int4 import q4_rounded_native

    if bits and not q4_rounded_native(getattr(torch, dtype), bits):
        pytest.skip(f"no native {bits}-bit activation path for {dtype} on this CPU")
    # With 16-bit inputs the output layer is the (tied) embedding as 8-bit blocks, as SmolLM2's is.
    model = _tiny_model(tmp_path, dtype, weights, **({"tie_word_embeddings": True} if bits == 16 else {}))
    assert model.weights.startswith(weights)
    model.activation_bits = bits
    if (dtype == "bfloat16" and weights == "dense") or bits == 16:
        dense, _, _ = _q8_matrix(model.config.vocab_size, model.config.hidden_size, seed=11)
        assert model.use_q8_head(dense)  # the tiny model's output layer made an exact Q8_0 matrix
        assert model.output_head.bits == (16 if bits == 16 else 0)  # 16-bit inputs where the layers take them
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, 96, (24,), generator=gen).tolist()
    cache = model.new_cache(40, 64)
    _logits(model, [(prompt[:8], 0)], [0], cache)  # slot 0: an 8-token prefix
    alone = []
    for i in range(8, 24):  # decode steps, one position each
        alone.append(_logits(model, [([prompt[i]], i)], [0], cache)[0, 0])
    alone = torch.stack(alone)  # [16, V]
    for width in (2, 4, 8, 16):  # verify windows over the same positions, from slot 1's copy of the prefix
        _logits(model, [(prompt[:8], 0)], [1], cache)
        window = _logits(model, [(prompt[8:8 + width], 8)], [1], cache)[0]
        assert torch.equal(window, alone[:width]), width
    # Sequences of other lengths beside each other: each one's next position alone, then in
    # batches of 1..32 (tails of 1-3 rows included), every row compared.
    prefixes = [torch.randint(0, 96, (int(n),), generator=gen).tolist()
                for n in torch.randint(4, 20, (32,), generator=gen)]
    for slot, tokens in enumerate(prefixes, start=2):
        _logits(model, [(tokens[:-1], 0)], [slot], cache)
    single = [_logits(model, [([tokens[-1]], len(tokens) - 1)], [slot], cache)[0, 0]
              for slot, tokens in enumerate(prefixes, start=2)]
    for batch in (1, 2, 3, 5, 7, 9, 13, 32):
        rows = [([tokens[-1]], len(tokens) - 1) for tokens in prefixes[:batch]]
        together = _logits(model, rows, list(range(2, 2 + batch)), cache)[:, 0]  # [batch, V]
        for i in range(batch):
            assert torch.equal(together[i], single[i]), (batch, i)


def _rounded_activations_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                                   minimum: torch.Tensor, bits: int) -> torch.Tensor:
    """q4_matmul with 8-bit or 16-bit activations from its definition: each row's block of 32
    rounded to dx * nearest(x / dx), dx = max|x| / (2^(bits-1) - 1) and the quotient in float32 (a
    quotient's last bit decides a near-tie), times the dequantized weight d q + m, the products
    summed in float64."""
    rounded = rounded_rows(x, bits)  # [M, K] float64
    weight = codes.double() * scale.double().repeat_interleave(32, 1) + minimum.double().repeat_interleave(32, 1)
    return rounded @ weight.T  # [M, N]


@pytest.mark.parametrize("dtype, bits", [(torch.bfloat16, 8), (torch.float32, 8), (torch.float32, 16)])
@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (96, 576), (576, 1536)])
def test_q4_matmul_with_rounded_activations_matches_its_reference_for_1_to_16_rows(shape, dtype, bits) -> None:
    """The integer dot-product kernels (``q4_tile_i8``: bfloat16 inputs to 8 bits, AVX-512 VNNI;
    ``q4_tile_i8_f32`` and ``q4_tile_i16_f32``: float32 inputs to 8 and 16 bits, AVX2; passes of 4
    rows of 16 bits take the float32 kernel over the codes) against their definition, 1..16 rows
    (every row-block size of the kernels, tails included), a zero block among them; and a row's
    output is the same bits alone as beside the others."""
    from kernels.int4 import q4_dense, rtn_parts

    library = native.library()
    if dtype == torch.bfloat16 and not library.has_avx512_vnni():
        pytest.skip("this CPU has no AVX-512 VNNI: the bfloat16 8-bit activation kernel cannot run here")
    if dtype == torch.float32 and not library.has_avx2_fma():
        pytest.skip(f"this CPU (or SPECSTREAM_CPU_ISA) has no AVX2: the float32 {bits}-bit activation kernel cannot "
                    "run here")
    N, K = shape
    gen = torch.Generator().manual_seed(15)
    codes, scale, minimum = rtn_parts(torch.randn(N, K, generator=gen))
    weight = Q4Weight.from_parts(codes, scale, minimum, dtype, use_native=True)
    for M in (1, 3, 8, 9, 16):
        x = (torch.randn(M, K, generator=gen) * torch.rand(M, K, generator=gen) * 4).to(dtype)
        if M > 1:
            x[-1, :32] = 0  # a block of zeros: scale 0, codes 0
        got = library.q4_matmul(x, weight.packed, weight.d, weight.m, bits)  # [M, N] of dtype
        want = _rounded_activations_reference(x, codes, scale, minimum, bits)
        # the output rounded to bfloat16 (half a step: 2^-9 relative; float32: none) and float32 sums
        # (relative to the sum of the magnitudes added, where terms cancel)
        rounding = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -20
        magnitudes = x.double().abs() @ q4_dense(codes, scale, minimum, dtype).double().abs().T  # [M, N]
        assert ((got.double() - want).abs() <= rounding * want.abs() + 1e-5 * magnitudes).all(), M
        alone = torch.cat([library.q4_matmul(x[i:i + 1], weight.packed, weight.d, weight.m, bits) for i in range(M)])
        assert torch.equal(alone, got)
        # and it is not the bfloat16 kernel: the rounding of the inputs shows
        assert not torch.equal(got, library.q4_matmul(x, weight.packed, weight.d, weight.m))


def test_native_silu_mul_is_torchs_within_a_few_units_and_an_elements_bits_do_not_depend_on_its_place() -> None:
    """silu(gate) * up of float32 (kernels/csrc/layer_stack.cpp, as the native layers compute it):
    torch's values within a few units in the last place (its sigmoid from the softmax's e^x), zeros
    and large magnitudes included; and an element computed in a vector's lanes or in the tail one
    value at a time gives the same bits (the layers split a row's elements between threads)."""
    import torch.nn.functional as F

    from specstream.models.base import silu_mul

    library = native.library()
    gen = torch.Generator().manual_seed(17)
    gate_up = torch.randn(5, 2 * 75, generator=gen) * 6  # I = 75: 9 vectors of 8, then a tail of 3
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 30.0, -30.0, 100.0, -100.0])
    got = library.silu_mul(gate_up)  # [5, 75]
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert got.shape == want.shape and ((got - want).abs() <= 1e-6 * want.abs() + 1e-30).all()
    assert torch.equal(silu_mul(gate_up), got)
    for shift in range(1, 8):  # every element through the vector lanes and the tail
        rolled = torch.cat([gate.roll(shift, -1), up.roll(shift, -1)], dim=-1)
        assert torch.equal(library.silu_mul(rolled), got.roll(shift, -1)), shift
    assert torch.equal(torch.cat([library.silu_mul(gate_up[i:i + 1]) for i in range(5)]), got)


def test_native_silu_mul_in_bfloat16_rounds_where_torchs_two_ops_round() -> None:
    """silu(gate) * up of bfloat16, as the native layers compute it where torch's silu then its
    product ran: within one rounding of torch's result everywhere (each of its two roundings can
    meet a sigmoid a few float32 units from torch's), equal on nearly every element, and an
    element's bits independent of its place (vector lanes, the masked last ones, other rows). On
    the AVX-512 path here, and on the portable one where the file runs capped (below)."""
    import torch.nn.functional as F

    from specstream.models.base import silu_mul

    library = native.library()
    gen = torch.Generator().manual_seed(23)
    gate_up = (torch.randn(400, 2 * 1000, generator=gen) * 4).bfloat16()  # I = 1000: 62 vectors of 16, 8 masked
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 30.0, -30.0, 100.0, -100.0]).bfloat16()
    got = library.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    differ = got != want
    assert differ.sum() <= got.numel() // 1000  # 0 of 400,000 on an AMD EPYC (Zen 5)
    assert ((got.float() - want.float()).abs() <= 2 ** -7 * want.float().abs() + 1e-30)[differ].all()
    assert torch.equal(silu_mul(gate_up), got)
    for shift in (1, 5, 8, 15):
        rolled = torch.cat([gate.roll(shift, -1), up.roll(shift, -1)], dim=-1)
        assert torch.equal(library.silu_mul(rolled), got.roll(shift, -1)), shift
    assert torch.equal(torch.cat([library.silu_mul(gate_up[i:i + 1]) for i in range(0, 400, 37)]), got[::37])

def test_native_rms_norm_matches_the_torch_formula_and_keeps_rows_apart() -> None:
    library = native.library()
    gen = torch.Generator().manual_seed(12)
    x = (torch.randn(40, 576, generator=gen) * 3).to(torch.bfloat16)
    weight = torch.randn(576, generator=gen).to(torch.bfloat16)
    got = library.rms_norm(x, weight, 1e-5)
    xf = x.float()
    want = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    # the same formula; only the order of the float32 sum of squares differs: where that moves the
    # normalised value by a bfloat16 unit, the product with the weight moves by two at most
    assert ((got.float() - want.float()).abs() <= 2 ** -6 * want.float().abs() + 1e-6).all()
    assert (got != want).float().mean() < 0.01
    assert torch.equal(torch.cat([library.rms_norm(x[i:i + 1], weight, 1e-5) for i in range(40)]), got)


def test_native_float32_rms_norm_matches_torchs_and_keeps_rows_apart() -> None:
    """The float32 op (models/base.py serves it in place of F.rms_norm on a CPU): torch's values up
    to the order of the sum of squares and 1/sqrt against rsqrt (a few units in the last place)."""
    library = native.library()
    gen = torch.Generator().manual_seed(16)
    x = torch.randn(40, 576, generator=gen) * 3
    weight = torch.randn(576, generator=gen)
    got = library.rms_norm(x, weight, 1e-5)
    want = torch.nn.functional.rms_norm(x, weight.shape, weight, 1e-5)
    assert got.dtype == torch.float32 and ((got - want).abs() <= 4e-6 * want.abs() + 1e-7).all()
    assert torch.equal(torch.cat([library.rms_norm(x[i:i + 1], weight, 1e-5) for i in range(40)]), got)
    with pytest.raises(RuntimeError, match="both bfloat16 or both float32"):
        library.rms_norm(x, weight.to(torch.bfloat16), 1e-5)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=NEEDS_Q4_NATIVE),
                                   pytest.param(torch.float32, marks=NEEDS_Q4_NATIVE_F32)], ids=str)
def test_the_fused_layer_gives_the_bits_of_the_layer_op_by_op(tmp_path, monkeypatch, dtype) -> None:
    """A bfloat16 or float32 model with 4-bit projections runs each layer as one native call; op by
    op (``FUSED_LAYERS`` off) it must give the same logits bit for bit: in a prefill, decode steps,
    verify windows of 2..16, rows of different lengths together, and after a rollback."""
    from specstream.models import llama

    model = _tiny_model(tmp_path, str(dtype).removeprefix("torch."), "int4-rtn", num_hidden_layers=3)
    assert all(layer.native_weights(dtype) is not None for layer in model.layers)
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (9, 14, 20)]

    def run() -> list[torch.Tensor]:
        cache = model.new_cache(4, 64)
        slots = [cache.alloc() for _ in prompts]
        out = [_logits(model, [(p[:8 + i], 0)], [s], cache) for i, (s, p) in enumerate(zip(slots, prompts))]
        for width in (1, 2, 4, 8, 16):  # decode step and verify windows, three rows of different starts
            rows = [(torch.randint(0, 96, (width,), generator=gen).tolist(), 8 + i) for i in range(3)]
            out.append(_logits(model, rows, slots, cache))
            for slot, (_, start) in zip(slots, rows):  # roll back: the window's positions are rejected
                cache.set_length(slot, start)
        return out

    gen.manual_seed(14)
    runs = model.native_runs(dtype)
    assert len(runs) == 1 and runs[0][1].layers == (0, 1, 2)  # all three layers in one call
    fused = run()
    assert model.native_runs(dtype) is runs  # built once, kept between forwards
    monkeypatch.setattr(llama, "FUSED_LAYERS", False)
    assert model.layers[0].native_weights(dtype) is None
    assert [stack for _, stack in model.native_runs(dtype)] == [None]
    gen.manual_seed(14)
    op_by_op = run()
    assert all(torch.equal(a, b) for a, b in zip(fused, op_by_op))
    # One layer's matrix moved off the native kernel: the other layers run as stacks of one and the
    # middle one op by op, with the bits of the reference path (the
    # moved matrix computes the same values on ATen's kernel only up to its sums' order, so the
    # reference here is the model with that same matrix, op by op).
    monkeypatch.setattr(llama, "FUSED_LAYERS", True)
    middle = model.layers[1]
    middle.o_w = Q4Weight.from_parts(*middle.o_w.parts(), dtype, use_native=False)
    assert [(list(layers), stack is None) for layers, stack in model.native_runs(dtype)] == \
        [([0], False), ([1], True), ([2], False)]
    gen.manual_seed(14)
    mixed = run()
    monkeypatch.setattr(llama, "FUSED_LAYERS", False)
    gen.manual_seed(14)
    assert all(torch.equal(a, b) for a, b in zip(mixed, run()))


def test_native_greedy_verify_is_the_reference_with_ties_nans_and_infinities() -> None:
    """One native call for CPU float32 logits (kernels/verify.py): the argmax by torch.argmax's
    rule (the first largest; a NaN above everything) and the accepted prefix, as the torch reference."""
    from kernels.verify import greedy_verify, greedy_verify_reference

    gen = torch.Generator().manual_seed(15)
    for trial in range(120):
        batch, gamma, vocab = [(1, 0, 49152), (3, 4, 1000), (32, 2, 300), (2, 1, 17)][trial % 4]
        logits = torch.randn(batch, gamma + 1, vocab, generator=gen)
        if trial % 3 == 0:  # a tie for the largest, far apart
            logits[0, 0, 5] = logits[0, 0].max() + 1
            logits[0, 0, vocab - 1] = logits[0, 0, 5]
        if trial % 5 == 0:
            logits[-1, 0, vocab // 2] = float("nan")
        if trial % 7 == 0:
            logits[0, -1] = float("-inf")
        if trial % 11 == 0:
            logits = logits.round()  # many ties
        draft = torch.randint(0, vocab, (batch, gamma), generator=gen)
        num_draft = torch.randint(0, gamma + 1, (batch,), generator=gen)
        if gamma:
            draft[:, 0] = logits[:, 0].argmax(-1)  # some proposals accepted
        got, want = greedy_verify(draft, num_draft, logits), greedy_verify_reference(draft, num_draft, logits)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), trial


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [2, 3, 4])
def test_query_heads_that_share_a_kv_head_get_the_bits_they_get_one_by_one(dtype, group) -> None:
    """The native attention runs the query heads of one kv head together (head_dim 64 on the AVX-512
    path, the AVX2 path's any multiple of 16): their outputs are the bits of each head computed alone. Alone here: the same keys and values
    given to every query head as its own kv head (no sharing, so no group), over a window of
    decode and verify positions after a 300-token prefix, a prefix shared from another slot
    included, and a tree."""
    library = native.library()
    if library is None or not (library.has_avx512() or library.has_avx2_fma()):
        pytest.skip("the grouped paths are the AVX-512 and AVX2 ones; this CPU runs the generic one (each head alone)")
    gen = torch.Generator().manual_seed(group)
    kv_heads, D, L, T = 2, 64, 320, 6
    heads = kv_heads * group
    cos, sin = (torch.randn(L, D, generator=gen).to(dtype) for _ in range(2))
    keys, values = (torch.randn(3, kv_heads, L, D, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(1, T, heads * D, generator=gen).to(dtype)
    k_new, v_new = (torch.randn(1, T, kv_heads * D, generator=gen).to(dtype) for _ in range(2))

    def run(repeat: int, sources, parents) -> torch.Tensor:
        """The op with each kv head given `repeat` times (repeat = group: one kv head per query head)."""
        per = kv_heads * repeat
        k_cache = keys.repeat_interleave(repeat, dim=1).contiguous()
        v_cache = values.repeat_interleave(repeat, dim=1).contiguous()
        widen = lambda t: t.view(1, T, kv_heads, D).repeat_interleave(repeat, dim=2).reshape(1, T, per * D)  # noqa: E731
        qkv = torch.cat([q, widen(k_new), widen(v_new)], dim=-1).contiguous()
        return library.attention(qkv, k_cache, v_cache, cos, sin, torch.tensor([1]), torch.tensor([300]), sources,
                                 parents, heads, per, D, 1 / 8.0, 0)

    sources = torch.ones(1, L, dtype=torch.int64)
    sources[0, :200] = 2  # the first 200 positions read from slot 2 (a shared prefix)
    tree = torch.tensor([[-1, 0, 0, 1, 1, 2]])
    for shared, parents in ((None, None), (sources, None), (None, tree)):
        grouped = run(1, shared, parents)
        alone = run(group, shared, parents)
        assert torch.equal(grouped, alone), (shared is not None, parents is not None)


_AVX2_PATHS_BITS = """
import hashlib, sys, torch
from kernels import native
library = native.library()
digest = hashlib.sha256()
for dtype, D in ((torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 128), (torch.float32, 32)):
    gen = torch.Generator().manual_seed(7)
    kv_heads, heads, L, T = 3, 9, 96, 5
    cos, sin = (torch.randn(L, D, generator=gen).to(dtype) for _ in range(2))
    k_cache, v_cache = (torch.randn(2, kv_heads, L, D, generator=gen).to(dtype) for _ in range(2))
    qkv = torch.randn(1, T, (heads + 2 * kv_heads) * D, generator=gen).to(dtype)
    for parents in (None, torch.tensor([[-1, 0, 0, 1, 2]])):
        out = library.attention(qkv, k_cache.clone(), v_cache.clone(), cos, sin, torch.tensor([1]),
                                torch.tensor([80]), None, parents, heads, kv_heads, D, 1 / 8.0, 0)
        digest.update(out.float().numpy().tobytes())
gen = torch.Generator().manual_seed(8)  # the 8-bit output layer: 203 features (a tail of 3 past fours)
codes, d = torch.randint(-127, 128, (203, 576), generator=gen, dtype=torch.int8), torch.rand(203, 18, generator=gen)
for rows in (1, 3):
    digest.update(library.q8_matmul(torch.randn(rows, 576, generator=gen), codes, d).numpy().tobytes())
print(library.has_avx512(), library.has_avx2_fma(), digest.hexdigest())
"""


def _capped(cap: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env={**os.environ, "SPECSTREAM_CPU_ISA": cap},
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent)


@pytest.mark.parametrize("cap", ["avx2", "generic"])
def test_this_cpu_runs_the_other_classes_paths_and_they_pass_these_tests(cap) -> None:
    """SPECSTREAM_CPU_ISA keeps this CPU on the AVX2 paths (as an AVX2-only CPU runs) or the generic
    ones: every other test of this file passes there too (the grouped heads on the AVX2 path among them)."""
    library = native.library()
    if library is None or (cap == "avx2" and not library.has_avx2_fma()):
        pytest.skip(f"this CPU cannot run the {cap} paths of the native library")
    done = _capped(cap, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", __file__,
                   "-k", "not other_classes and not same_bits_as_the_generic")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout


def test_the_avx2_attention_and_output_layer_give_the_same_bits_as_the_generic_ones() -> None:
    """The AVX2 attention (its heads grouped by kv head) and 8-bit output layer are the generic paths'
    arithmetic 8 lanes at a time: the same outputs, bit for bit, attention chains and a tree, float32
    and bfloat16, head_dim 64 (its own scores path) and 32 and 128, and the output layer for 1 and 3
    rows."""
    library = native.library()
    if library is None or not library.has_avx2_fma():
        pytest.skip("this CPU has no AVX2 path")
    avx2, generic = (_capped(cap, "-c", _AVX2_PATHS_BITS) for cap in ("avx2", "generic"))
    assert avx2.returncode == 0 and generic.returncode == 0, avx2.stderr[-2000:] + generic.stderr[-2000:]
    flags_avx2, flags_generic = avx2.stdout.split()[:2], generic.stdout.split()[:2]
    assert flags_avx2 == ["False", "True"] and flags_generic == ["False", "False"]  # the caps held
    assert avx2.stdout.split()[2] == generic.stdout.split()[2]


def test_an_unknown_cpu_class_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("SPECSTREAM_CPU_ISA", "avx1024")
    with pytest.raises(ValueError, match="SPECSTREAM_CPU_ISA='avx1024'"):
        native.library()
