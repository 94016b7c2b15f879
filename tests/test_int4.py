"""4-bit weights served as stored (kernels/int4.py): the kernel against its torch reference,
its rows' independence (exact greedy speculation needs it), the GGUF parts, and load_model's choice."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tests.support.hardware import NEEDS_Q4_NATIVE, NEEDS_Q4_NATIVE_F32
from test_models import assert_verify_equals_steps

from kernels.int4 import (
    GROUP,
    Q4_FILE,
    Q4Weight,
    native_layout,
    pack_codes,
    q4_dense,
    q4_linear,
    q4_linear_reference,
    q4_native,
    q4_rounded_native,
    rtn_parts,
    unpack_codes,
)
from specstream.data.config import ModelSpec
from specstream.models import llama
from specstream.models.base import rms_norm
from specstream.models.config import ModelLoadError
from specstream.models.gguf import convert_gguf
from specstream.models.gguf_dequant import dequantize, q4_parts
from specstream.models.loader import load_model
from tests.support.checkpoints import make_hf_checkpoint
from tests.support.gguf_files import chatml_tokenizer, write_gguf

gguf = pytest.importorskip("gguf")


def _parts(kind: str, shape: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(codes, scale, min) of a random matrix quantized by the gguf package, and its raw bytes."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.1
    raw = np.ascontiguousarray(gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind])).reshape(-1).view(np.uint8)
    return (*q4_parts(raw, kind, shape, "w"), raw)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_parts_are_exactly_the_dequantized_values(kind: str) -> None:
    codes, scale, minimum, raw = _parts(kind, (48, 96))
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    dense = codes.float() * scale.repeat_interleave(GROUP, 1) + minimum.repeat_interleave(GROUP, 1)
    assert torch.equal(dense, dequantize(raw, kind, (48, 96), "w"))


def test_parts_reject_other_types_and_wrong_sizes() -> None:
    with pytest.raises(ModelLoadError, match=r"tensor 'w': Q8_0 \[2, 32\] is not a 4-bit matrix"):
        q4_parts(np.zeros(68, np.uint8), "Q8_0", (2, 32), "w")
    with pytest.raises(ModelLoadError, match=r"tensor 'w': 10 bytes of Q4_1 data do not hold a \[2, 32\] matrix"):
        q4_parts(np.zeros(10, np.uint8), "Q4_1", (2, 32), "w")


def test_pack_codes_round_trips() -> None:
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = pack_codes(codes)
    assert packed.shape == (7, 32)
    assert torch.equal(unpack_codes(packed), codes)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_float32_kernel_weights_are_ggmls_bit_for_bit(kind: str) -> None:
    """Multiplying by the identity reads the kernel's weights back: in float32 they are ggml's values."""
    codes, scale, minimum, raw = _parts(kind, (64, 128), seed=1)
    w = Q4Weight.from_parts(codes, scale, minimum, torch.float32)
    read_back = q4_linear(torch.eye(128), w).t()  # [N, K]
    assert torch.equal(read_back, dequantize(raw, kind, (64, 128), "w"))
    assert torch.equal(q4_dense(codes, scale, minimum, torch.float32), read_back)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(96, 64), (3072, 576), (576, 1536)])
def test_kernel_matches_its_torch_reference(dtype: torch.dtype, tol: float, shape: tuple[int, int]) -> None:
    codes, scale, minimum, _ = _parts("Q4_1", shape, seed=2)
    w = Q4Weight.from_parts(codes, scale, minimum, dtype)
    bias = torch.randn(shape[0]).to(dtype)
    x = torch.randn(3, 5, shape[1]).to(dtype)  # [B, T, K]
    got = q4_linear(x, w, bias)
    want = q4_linear_reference(x, codes, scale, minimum, bias)
    assert got.shape == (3, 5, shape[0]) and got.dtype == dtype
    scale_of = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= tol * scale_of


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_row_is_the_same_bits_however_many_rows_the_call_has(dtype: torch.dtype) -> None:
    codes, scale, minimum, _ = _parts("Q4_1", (3072, 576), seed=3)
    w = Q4Weight.from_parts(codes, scale, minimum, dtype)
    x = torch.randn(40, 576).to(dtype)
    full = q4_linear(x, w)  # [40, N]
    for rows, start in [(1, 0), (1, 13), (2, 5), (3, 1), (4, 8), (5, 0), (9, 30), (17, 3)]:
        part = q4_linear(x[start : start + rows].contiguous(), w)
        assert torch.equal(part, full[start : start + rows]), f"{rows} rows from {start}"


needs_native = NEEDS_Q4_NATIVE


def test_native_layout_round_trips() -> None:
    from kernels.int4 import _from_native_layout

    codes, scale, minimum, _ = _parts("Q4_1", (48, 96), seed=4)
    assert all(torch.equal(a, b) for a, b in zip(_from_native_layout(*native_layout(codes, scale, minimum)),
                                                   (codes, scale, minimum)))


@needs_native
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (80, 160), (3072, 576), (576, 1536)])
def test_native_kernel_matches_the_dense_matrix_for_1_to_16_rows(kind: str, shape: tuple[int, int]) -> None:
    """The weight-stationary kernel against float32 products with the exact dequantized matrix (the
    file's values), for every row count it meets in a verify, odd shapes included; and every row the
    same bits as the row alone."""
    codes, scale, minimum, raw = _parts(kind, shape, seed=5)
    w = Q4Weight.from_parts(codes, scale, minimum, torch.bfloat16)
    assert w.native
    dense = dequantize(raw, kind, shape, "w")  # [N, K] float32, ggml's values
    x = torch.randn(16, shape[1]).to(torch.bfloat16)
    alone = torch.cat([q4_linear(x[i : i + 1], w) for i in range(16)])  # [16, N]
    for rows in range(1, 17):
        got = q4_linear(x[:rows], w)
        want = (x[:rows].float() @ dense.T)  # [rows, N]
        assert got.dtype == torch.bfloat16 and torch.equal(got, alone[:rows]), rows
        # bfloat16 output: within half a unit in the last place of the largest, plus float32 sums
        assert (got.float() - want).abs().max() <= 2 ** -8 * want.abs().max() + 1e-6, rows


@NEEDS_Q4_NATIVE_F32
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (80, 160), (3072, 576), (576, 1536)])
def test_native_float32_kernel_matches_the_dense_matrix_for_1_to_16_rows(kind: str, shape: tuple[int, int]) -> None:
    """The float32 kernel (AVX2) against float64 products with the file's exact values, within the
    bound of K float32 roundings, for every row count it meets in a verify (its passes of 4 rows and
    their tails), odd shapes included; and every row the same bits as the row alone."""
    codes, scale, minimum, raw = _parts(kind, shape, seed=5)
    w = Q4Weight.from_parts(codes, scale, minimum, torch.float32)
    assert w.native
    dense = dequantize(raw, kind, shape, "w").double()  # [N, K] ggml's values
    steps = (codes.double() * scale.double().repeat_interleave(GROUP, 1)).abs()  # [N, K] |d q|
    mins = minimum.double().repeat_interleave(GROUP, 1).abs()  # [N, K] |m|
    x = torch.randn(16, shape[1])
    want = x.double() @ dense.T  # [16, N]
    bound = 2 * (shape[1] + 2) * 2.0 ** -24 * (x.double().abs() @ (steps + mins).T)  # [16, N]
    alone = torch.cat([q4_linear(x[i : i + 1], w) for i in range(16)])  # [16, N]
    for rows in range(1, 17):
        got = q4_linear(x[:rows], w)
        assert got.dtype == torch.float32 and torch.equal(got, alone[:rows]), rows
        assert ((got.double() - want[:rows]).abs() <= bound[:rows]).all(), rows


@needs_native
def test_both_kernels_serve_bfloat16_and_agree() -> None:
    codes, scale, minimum, _ = _parts("Q4_1", (576, 1536), seed=6)
    new, old = (Q4Weight.from_parts(codes, scale, minimum, torch.bfloat16, use_native=flag) for flag in (True, False))
    assert new.native and not old.native
    x = torch.randn(5, 1536).to(torch.bfloat16)
    a, b = q4_linear(x, new).float(), q4_linear(x, old).float()
    assert (a - b).abs().max() <= 2e-2 * b.abs().max()
    for rows in (1, 3, 5):  # ATen's kernel keeps its own rows independent too
        assert torch.equal(q4_linear(x[:rows], old), q4_linear(x, old)[:rows])


def test_from_parts_rejects_shapes_the_kernel_cannot_take() -> None:
    codes = torch.zeros(8, 48, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"codes \[8, 48\] need N a multiple of 16, K of 32"):
        Q4Weight.from_parts(codes, torch.ones(8, 1), torch.zeros(8, 1), torch.float32)


# ----- whole models from GGUF files --------------------------------------------------------------


@pytest.fixture(scope="module")
def q4_checkpoint(tmp_path_factory) -> tuple:
    """A converted Q4_1 GGUF llama (GQA, untied head) and the tokenizer."""
    tok = chatml_tokenizer()
    root = tmp_path_factory.mktemp("q4")
    hf = make_hf_checkpoint(root / "hf", "llama", vocab_size=tok.get_vocab_size(), num_key_value_heads=2,
                            hidden_size=64, intermediate_size=128, tie_word_embeddings=False)
    return convert_gguf(write_gguf(root / "m.gguf", hf, tok, qtype="Q4_1"), root / "cache"), tok


def _logits(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, 64)
    with torch.inference_mode():
        return model(torch.tensor([ids]), cache, torch.tensor([cache.alloc()]), torch.tensor([0]))[0]  # [T, V]


def test_a_converted_q4_file_serves_its_matrices_in_4_bits(q4_checkpoint) -> None:
    out, tok = q4_checkpoint
    assert (out / Q4_FILE).is_file()
    # 2 layers x (q, k, v, o, gate, up, down); the output layer's 300 rows do not fit the kernel's
    # 16-row tiles, so it stays dense.
    model = load_model(out, "float32", weights="int4")
    assert model.weights == "int4 (14 matrices)"
    assert isinstance(model.layers[0].qkv_w, Q4Weight) and isinstance(model.lm_head, torch.nn.Parameter)
    dense = load_model(out, "float32", weights="dense")
    assert dense.weights == "dense" and isinstance(dense.layers[0].qkv_w, torch.nn.Parameter)
    ids = tok.encode("def f(x):\n    return x * 2").ids
    # Same weights bit for bit (float32); only the order of the sums differs.
    assert (_logits(model, ids) - _logits(dense, ids)).abs().max().item() < 1e-4


def test_an_untied_output_layer_runs_in_4_bits_when_it_fits(tmp_path) -> None:
    path = make_hf_checkpoint(tmp_path, "llama", vocab_size=320, tie_word_embeddings=False)
    model = load_model(path, "float32")
    codes, scale, minimum, _ = _parts("Q4_1", (320, 64), seed=4)
    assert model.use_q4(lambda name: (codes, scale, minimum) if name == "lm_head.weight" else None) == 1
    assert isinstance(model.lm_head, Q4Weight)
    hidden = torch.randn(1, 3, 64)  # [B, T, H]
    normed = rms_norm(hidden, model.norm, model.config.norm_eps)  # [B, T, H]
    expected = torch.nn.functional.linear(normed, q4_dense(codes, scale, minimum, torch.float32))  # [B, T, V]
    assert (model.output_head.logits(normed) - expected).abs().max().item() < 1e-5


def test_auto_picks_int4_for_bfloat16_on_cpu_and_for_float32_where_the_native_kernel_takes_it(q4_checkpoint) -> None:
    out, _ = q4_checkpoint
    bfloat16 = load_model(out, "bfloat16", weights="auto")
    assert bfloat16.weights.startswith("int4 (14 matrices)") and bfloat16.activation_bits == 0
    float32 = load_model(out, "float32", weights="auto")
    if q4_native(torch.float32):  # AVX2: the native kernel, inputs to 16 bits (int4-a8 only when asked)
        assert float32.weights.startswith("int4-a16 (14 matrices)") and float32.layers[0].qkv_w.native
        assert float32.activation_bits == 16
    else:  # ATen's kernel, slower than dense in float32
        assert float32.weights == "dense"


@pytest.mark.parametrize("weights, bits, within", [("int4-a8", 8, 0.05), ("int4-a16", 16, 0.001)])
def test_rounded_inputs_stay_near_the_exact_ones_and_batch_invariant(q4_checkpoint, monkeypatch, weights, bits,
                                                                     within) -> None:
    """weights int4-a8 and int4-a16: the 4-bit matrices with inputs rounded to 8 or 16 bits per
    block (q4_tile_i8_f32, q4_tile_i16_f32 on AVX2); the logits are near the exact-input ones (16
    bits: 50x nearer than 8 allow) but not the same, and a verify window equals single steps bit for bit."""
    out, tok = q4_checkpoint
    if not q4_rounded_native(torch.float32, bits):
        pytest.skip(f"no native {bits}-bit activation path for float32 on this CPU (it needs AVX2)")
    model = load_model(out, "float32", weights=weights)
    assert model.weights.startswith(f"{weights} (14 matrices)") and model.activation_bits == bits
    exact = load_model(out, "float32", weights="int4")
    assert model.weights.removeprefix(weights) == exact.weights.removeprefix("int4")  # the same output layer
    ids = tok.encode("The quick brown fox jumps over the lazy dog").ids
    rounded, plain = _logits(model, ids), _logits(exact, ids)
    assert not torch.equal(rounded, plain)
    assert (rounded - plain).abs().max().item() < within * plain.abs().max().item()
    assert_verify_equals_steps(model, f"{weights} llama")
    # the layers op by op round the same inputs: the same bits as the one native call
    assert all(layer.activation_bits == bits for layer in model.layers)
    monkeypatch.setattr(llama, "FUSED_LAYERS", False)
    assert torch.equal(_logits(model, ids), rounded)


def test_bfloat16_int4_logits_are_as_close_to_the_file_as_dense_bfloat16(q4_checkpoint) -> None:
    """Against the exact (float32) values of the file, 4-bit serving in bfloat16 errs no more than
    dequantizing to bfloat16 does, within a margin."""
    out, tok = q4_checkpoint
    ids = tok.encode("The quick brown fox jumps over the lazy dog").ids
    exact = _logits(load_model(out, "float32", weights="dense"), ids)
    err_dense = (_logits(load_model(out, "bfloat16", weights="dense"), ids) - exact).abs().max().item()
    err_q4 = (_logits(load_model(out, "bfloat16", weights="int4"), ids) - exact).abs().max().item()
    assert err_q4 <= 1.5 * err_dense, f"int4 {err_q4:.4g} vs dense {err_dense:.4g}"


def test_verify_forward_equals_single_steps_bitwise_with_int4_weights(q4_checkpoint) -> None:
    out, _ = q4_checkpoint
    assert_verify_equals_steps(load_model(out, "bfloat16", weights="int4"), "int4 llama")


def test_a_group_with_a_part_not_in_4_bits_stays_dense(tmp_path, q4_checkpoint) -> None:
    _, tok = q4_checkpoint
    hf = make_hf_checkpoint(tmp_path / "hf", "llama", vocab_size=tok.get_vocab_size(), hidden_size=64,
                            intermediate_size=128)
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", hf, tok, qtype="Q4_0",
                                  tensor_types={"blk.0.attn_k.weight": "Q8_0"}), tmp_path / "cache")
    model = load_model(out, "bfloat16", weights="int4")
    assert isinstance(model.layers[0].qkv_w, torch.nn.Parameter)  # q, k, v are one matmul: all or none
    assert isinstance(model.layers[0].o_w, Q4Weight) and isinstance(model.layers[1].qkv_w, Q4Weight)


def test_int4_is_refused_where_it_cannot_run(tmp_path, q4_checkpoint) -> None:
    out, _ = q4_checkpoint
    plain = make_hf_checkpoint(tmp_path / "plain", "llama", vocab_size=300)
    with pytest.raises(ModelLoadError, match=rf"weights='int4' needs {Q4_FILE}"):
        load_model(plain, "bfloat16", weights="int4")
    assert load_model(plain, "bfloat16", weights="auto").weights == "dense"
    with pytest.raises(ModelLoadError, match=r"weights='int4' runs on the CPU only, got device 'cuda:0'"):
        load_model(out, "bfloat16", device="cuda:0", weights="int4")
    if not q4_rounded_native(torch.float16, 8):
        with pytest.raises(ModelLoadError, match=r"weights='int4-a8' needs the native library and dtype float32 on "
                                                 r"a CPU with AVX2, or bfloat16 with AVX-512 BF16 and VNNI"):
            load_model(out, "float16", weights="int4-a8")
    with pytest.raises(ModelLoadError, match=r"weights='int4-a16' needs the native library and dtype float32 on "
                                             r"a CPU with AVX2; got dtype 'bfloat16'"):
        load_model(out, "bfloat16", weights="int4-a16")
    with pytest.raises(ValueError, match=r"weights 'int8' is not one of"):
        load_model(out, "bfloat16", weights="int8")
    with pytest.raises(ValueError, match=r"weights='int8': must be one of"):
        ModelSpec("smollm2", weights="int8")


def test_a_bad_q4_file_names_the_tensor(tmp_path, q4_checkpoint) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    out, _ = q4_checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    parts = load_file(str(copy / Q4_FILE))
    name = "model.layers.0.mlp.down_proj.weight"
    parts[f"{name}.q4_scale"] = parts[f"{name}.q4_scale"].half()
    save_file(parts, str(copy / Q4_FILE))
    with pytest.raises(ModelLoadError, match=rf"tensor '{name}': 4-bit parts must be uint8 codes and float32"):
        load_model(copy, "bfloat16", weights="int4")
    parts[f"{name}.q4_scale"] = parts[f"{name}.q4_scale"].float()[:-1]
    parts[f"{name}.q4_min"] = parts[f"{name}.q4_min"][:-1]
    parts[f"{name}.q4_codes"] = parts[f"{name}.q4_codes"][:-1]
    save_file(parts, str(copy / Q4_FILE))
    with pytest.raises(ModelLoadError, match=rf"4-bit data for {name}: shape \[63, 128\], expected \[64, 128\]"):
        load_model(copy, "bfloat16", weights="int4")
    assert json.loads((copy / "config.json").read_text())["hidden_size"] == 64


# ----- drafts rounded to 4 bits at load -------------------------------------------------------------


def test_round_to_nearest_parts_are_within_half_a_step() -> None:
    w = torch.randn(48, 96) * 0.05
    w[3, :32] = 0.25  # a constant block: scale 0, every code 0, exact
    codes, scale, minimum = rtn_parts(w)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    back = q4_dense(codes, scale, minimum, torch.float32)  # [N, K]
    step = scale.repeat_interleave(GROUP, 1)
    assert bool(((back - w).abs() <= step / 2 + 1e-7).all())
    assert torch.equal(back[3, :32], w[3, :32])


def test_a_draft_is_rounded_to_4_bits_by_auto_and_a_target_refuses_it(tmp_path) -> None:
    from specstream.data.config import TargetConfig

    path = make_hf_checkpoint(tmp_path, "llama", vocab_size=320, tie_word_embeddings=False)
    draft = load_model(path, "bfloat16", weights="auto", draft=True)
    assert draft.weights == "int4-rtn (9 matrices)"  # 2 layers x 4 fused projections + the head
    assert isinstance(draft.lm_head, Q4Weight)
    assert load_model(path, "bfloat16", weights="auto").weights == "dense"  # not a draft: never rounded
    assert load_model(path, "float32", weights="auto", draft=True).weights == "dense"  # rounded in bfloat16 only
    dense = load_model(path, "bfloat16", weights="dense")
    ids = list(range(5, 25))
    # Rounding moves the logits a little relative to their spread, not arbitrarily.
    got, want = _logits(draft, ids), _logits(dense, ids)
    moved = (got - want).abs().mean().item()
    assert moved <= 0.2 * want.std().item(), (moved, want.std().item())
    with pytest.raises(ValueError, match=r"weights='int4-rtn': must be the checkpoint's own"):
        TargetConfig(model=ModelSpec(str(path), weights="int4-rtn"))
