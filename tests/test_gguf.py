"""GGUF checkpoints: dequantization, name mapping, the Q/K permutation, the tokenizer from metadata,
the converted-copy cache, and bad files -- on tiny files written with the gguf package's writer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from specstream.models.config import ModelLoadError
from specstream.models.gguf import GGUFFile, convert_gguf
from specstream.models.gguf_dequant import DEQUANTIZERS, dequantize
from specstream.models.loader import load_model
from specstream.text.tokenizer import TextTokenizer
from tests.support.checkpoints import load_hf_model, make_hf_checkpoint
from tests.support.gguf_files import CHATML, chatml_tokenizer, permute, write_gguf

gguf = pytest.importorskip("gguf")

QUANTIZED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
ALL_TYPES = ("F32", "F16", "BF16", *QUANTIZED)
# Largest error of one element relative to its 32-block's range (max - min), from each format's
# rounding step: half a quantization step, plus fp16 rounding of the scales. Floats: relative.
STEP_FRACTION = {"Q8_0": 1 / 254 * 2 + 1e-3, "Q4_0": 1 / 16 + 1e-3, "Q4_1": 1 / 30 + 1e-3,
                 "Q5_0": 1 / 32 + 1e-3, "Q5_1": 1 / 62 + 1e-3}
RELATIVE = {"F32": 0.0, "F16": 2**-11, "BF16": 2**-8}
ABSOLUTE = {"F32": 0.0, "F16": 2**-25, "BF16": 0.0}  # half of F16's subnormal step


def test_every_listed_type_has_a_dequantizer() -> None:
    assert set(ALL_TYPES) == set(DEQUANTIZERS)


@pytest.mark.parametrize("kind", ALL_TYPES)
@pytest.mark.parametrize("shape", [(5, 32), (123, 64), (7, 4096)])
def test_dequantize_round_trip_within_the_format_error(kind: str, shape: tuple[int, int]) -> None:
    qt = gguf.GGMLQuantizationType[kind]
    x = (np.random.default_rng(shape[0]).standard_normal(shape) * 3).astype(np.float32)
    data = gguf.quants.quantize(x, qt) if kind not in ("F32",) else x
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    ours = dequantize(raw, kind, shape, "x")
    assert ours.dtype == torch.float32 and tuple(ours.shape) == shape
    err = (ours - torch.from_numpy(x)).abs()
    if kind in RELATIVE:
        bound = torch.from_numpy(np.abs(x)) * RELATIVE[kind] + ABSOLUTE[kind]
        assert bool((err <= bound).all()), f"{kind}: max rel err {float((err / bound).max()):.3g}x the bound"
    else:
        blocks = torch.from_numpy(x).reshape(-1, 32)
        spread = (blocks.amax(1) - blocks.amin(1)).clamp_min(blocks.abs().amax(1))[:, None]  # [n, 1]
        worst = float((err.reshape(-1, 32) / spread).max())
        assert worst <= STEP_FRACTION[kind], f"{kind}: worst error {worst:.4f} of the block range"


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_dequantize_is_bit_identical_to_the_gguf_reference(kind: str) -> None:
    qt = gguf.GGMLQuantizationType[kind]
    x = np.random.default_rng(1).standard_normal((48, 96)).astype(np.float32)
    data = gguf.quants.quantize(x, qt) if kind != "F32" else x
    reference = np.asarray(gguf.quants.dequantize(data, qt), dtype=np.float32).reshape(48, 96)
    ours = dequantize(np.ascontiguousarray(data).reshape(-1).view(np.uint8), kind, (48, 96), "x")
    assert torch.equal(ours, torch.from_numpy(reference)), f"max diff {float((ours - torch.from_numpy(reference)).abs().max())}"


def test_dequantize_rejects_an_unknown_type_and_a_wrong_size() -> None:
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.0.x': quantization type Q6_K is not supported"):
        dequantize(np.zeros(210, np.uint8), "Q6_K", (256,), "blk.0.x")
    with pytest.raises(ModelLoadError, match=r"tensor 'w': 100 bytes of Q8_0 data, expected 68"):
        dequantize(np.zeros(100, np.uint8), "Q8_0", (2, 32), "w")


# ----- whole files ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return chatml_tokenizer()


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory, tok) -> Path:
    # GQA (4 heads, 2 KV heads) so the permutation of q and k differ; untied head.
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf") / "llama", "llama", vocab_size=tok.get_vocab_size(),
                              num_key_value_heads=2, hidden_size=64, intermediate_size=128, tie_word_embeddings=False)


@pytest.fixture()
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


def _logits(model, ids: list[int]) -> torch.Tensor:
    c = model.new_cache(1, 64)
    slot = c.alloc()
    with torch.inference_mode():
        return model(torch.tensor([ids]), c, torch.tensor([slot]), torch.tensor([0]))[0]  # [T, V]


def test_llama_gguf_matches_the_unquantized_checkpoint_and_undoes_the_qk_permutation(tmp_path, hf_llama, tok,
                                                                                     cache) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_llama, tok, qtype="F32")
    out = convert_gguf(path, cache)
    from safetensors.torch import load_file

    ours, original = load_file(str(out / "model.safetensors")), load_file(str(hf_llama / "model.safetensors"))
    assert set(ours) == set(original)
    for name, w in original.items():
        assert torch.equal(ours[name], w.float()), name  # F32: exact, so q/k came back un-permuted
    ids = tok.encode("The quick brown fox").ids
    reference = load_hf_model(hf_llama)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    got = _logits(load_model(out), ids)
    assert (got - expected).abs().max().item() < 1e-4


def test_the_permutation_is_llama_cpps() -> None:
    # Rows [a0 a1 a2 a3 | b0 b1 b2 b3] per head (rotary halves) are stored interleaved: a0 b0 a1 b1 ...
    w = np.arange(16, dtype=np.float32).reshape(8, 2)  # one head of 8 rows
    assert permute(w, 1)[:, 0].tolist() == [0, 8, 2, 10, 4, 12, 6, 14]
    from specstream.models.gguf import _unpermute

    assert torch.equal(_unpermute(torch.from_numpy(permute(w, 1)), 1), torch.from_numpy(w))


@pytest.mark.parametrize("qtype", QUANTIZED + ("F16", "BF16"))
def test_quantized_gguf_logits_match_transformers_loading_the_same_file(tmp_path, hf_llama, tok, cache,
                                                                       qtype) -> None:
    """transformers dequantizes with its own code: both must read the same numbers from the file."""
    from transformers import AutoModelForCausalLM

    path = write_gguf(tmp_path / f"m-{qtype}.gguf", hf_llama, tok, qtype=qtype)
    ours = load_model(convert_gguf(path, cache))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ids = tok.encode("def f(x):\n    return x * 2").ids
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    assert (_logits(ours, ids) - expected).abs().max().item() < 1e-4


def test_qwen2_gguf_with_biases_is_not_permuted(tmp_path, tok, cache) -> None:
    hf = make_hf_checkpoint(tmp_path / "qwen2", "qwen2", vocab_size=tok.get_vocab_size())
    out = convert_gguf(write_gguf(tmp_path / "q.gguf", hf, tok, arch="qwen2", pre="qwen2"), cache)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    ids = tok.encode("héllo wörld").ids
    with torch.no_grad():
        expected = load_hf_model(hf)(torch.tensor([ids])).logits[0]
    assert (_logits(load_model(out), ids) - expected).abs().max().item() < 1e-4


def test_tied_embeddings_when_the_file_has_no_output_tensor(tmp_path, tok, cache) -> None:
    hf = make_hf_checkpoint(tmp_path / "tied", "llama", vocab_size=tok.get_vocab_size(), tie_word_embeddings=True)
    out = convert_gguf(write_gguf(tmp_path / "t.gguf", hf, tok, tensors={"output.weight": None}), cache)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    ids = tok.encode("lazy dog").ids
    with torch.no_grad():
        expected = load_hf_model(hf)(torch.tensor([ids])).logits[0]
    assert (_logits(load_model(out), ids) - expected).abs().max().item() < 1e-4


# ----- tokenizer and chat template -------------------------------------------------------------

CORPUS = ["Hello 12345 world", "héllo wörld 你好 🤖🎉 ", "def f(x):\n\treturn x**2  # sq\n\n\n   ",
          "<|im_start|>user\nhi<|im_end|>\n", "  leading   spaces\t\ttabs\r\n", "I'm you'll DON'T",
          "<|endoftext|>tail", "3.14159 1,000,000 0x1F", ""]


@pytest.mark.parametrize("add_bos", [False, True])
def test_tokenizer_from_metadata_matches_transformers_and_the_original(tmp_path, hf_llama, tok, cache,
                                                                       add_bos) -> None:
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "m.gguf", hf_llama, tok, add_bos=add_bos)
    ours = TextTokenizer.from_dir(convert_gguf(path, cache))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        original = tok.encode(text).ids
        assert ids == ([1] + original if add_bos else original), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.bos_token_id == 1 and 2 in ours.eos_token_ids


def test_chat_template_comes_from_the_file(tmp_path, hf_llama, tok, cache) -> None:
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "m.gguf", hf_llama, tok)
    ours = TextTokenizer.from_dir(convert_gguf(path, cache))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 123"}]
    assert ours.chat_template is not None and ours.chat_template.source == CHATML
    assert ours.encode_chat(messages) == theirs.apply_chat_template(messages, add_generation_prompt=True,
                                                                    tokenize=True, return_dict=False)
    assert ours.end_of_turn_id == tok.token_to_id("<|im_end|>")


def test_a_file_without_a_chat_template_has_none(tmp_path, hf_llama, tok, cache) -> None:
    ours = TextTokenizer.from_dir(convert_gguf(write_gguf(tmp_path / "m.gguf", hf_llama, tok, chat_template=None), cache))
    assert ours.chat_template is None and ours.end_of_turn_id is None


# ----- the converted-copy cache ----------------------------------------------------------------


def test_conversion_is_cached_by_content_hash(tmp_path, hf_llama, tok, cache) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_llama, tok)
    first = convert_gguf(path, cache)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(path, cache) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
    moved = tmp_path / "elsewhere.gguf"
    os.rename(path, moved)
    assert convert_gguf(moved, cache) == first  # same bytes, same entry
    other = convert_gguf(write_gguf(tmp_path / "q.gguf", hf_llama, tok, qtype="Q8_0"), cache)
    assert other != first
    assert json.loads((first / "config.json").read_text())["specstream"]["name"] == "m"
    assert not list(cache.glob("gguf/*.tmp-*"))


def test_the_converted_copy_is_readable_as_the_umask_allows(tmp_path, hf_llama, tok, cache) -> None:
    # An image converts as root at build time and serves as another user: safetensors' own 0600
    # would leave that user a cache it cannot read.
    previous = os.umask(0o022)
    try:
        out = convert_gguf(write_gguf(tmp_path / "m.gguf", hf_llama, tok, qtype="Q4_0"), cache)
    finally:
        os.umask(previous)
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert {"model.safetensors", "weights.q4.safetensors", "config.json"} <= set(modes)
    assert set(modes.values()) == {0o644}, modes


# ----- bad files: each error names what is wrong ------------------------------------------------


def test_unknown_quantization_type(tmp_path, hf_llama, tok, cache) -> None:
    q6 = gguf.GGMLQuantizationType.Q6_K
    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((64, 210), np.uint8), raw_dtype=q6)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.0.attn_q.weight': quantization type Q6_K is not supported"):
        GGUFFile(path)


def test_unknown_architecture(tmp_path, hf_llama, tok, cache) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_llama, tok)
    data = path.read_bytes().replace(b"llama", b"mamba")  # the architecture and its key prefixes
    (tmp_path / "mamba.gguf").write_bytes(data)
    with pytest.raises(ModelLoadError, match=r"'general.architecture' = 'mamba' is not supported"):
        convert_gguf(tmp_path / "mamba.gguf", cache)


def test_truncated_file_names_the_tensor(tmp_path, hf_llama, tok, cache) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_llama, tok)
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match=r"cut.gguf: tensor '[\w.]+': data ends at byte \d+ but the file has "
                                             r"\d+ bytes \(truncated file\?\)"):
        convert_gguf(tmp_path / "cut.gguf", cache)
    (tmp_path / "head.gguf").write_bytes(data[:200])
    with pytest.raises(ModelLoadError, match=r"head.gguf: not a readable GGUF file"):
        convert_gguf(tmp_path / "head.gguf", cache)
    assert not list(cache.glob("gguf/*-v*/config.json"))  # nothing half-converted is left as a cache entry


def test_inconsistent_shapes_name_the_tensor(tmp_path, hf_llama, tok, cache) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_llama, tok,
                      tensors={"blk.1.ffn_up.weight": np.zeros((96, 64), np.float32)})
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.1.ffn_up.weight' has shape \[96, 64\], expected \[128, 64\]"):
        convert_gguf(path, cache)


def test_missing_hyperparameter_names_the_key(tmp_path, hf_llama, tok, cache) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_llama, tok, metadata={"llama.feed_forward_length": ("uint32", None)})
    with pytest.raises(ModelLoadError, match=r"metadata 'llama.feed_forward_length' is missing"):
        convert_gguf(path, cache)


def test_unsupported_tokenizer_names_the_key(tmp_path, hf_llama, tok, cache) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_llama, tok, pre="no-such-pre")
    with pytest.raises(ModelLoadError, match=r"'tokenizer.ggml.pre' = 'no-such-pre' is not supported"):
        convert_gguf(path, cache)
    path = write_gguf(tmp_path / "m2.gguf", hf_llama, tok, metadata={"tokenizer.ggml.model": ("string", "llama")})
    with pytest.raises(ModelLoadError, match=r"'tokenizer.ggml.model' = 'llama' is not supported"):
        convert_gguf(path, cache)


def test_an_unknown_tensor_is_an_error_not_ignored(tmp_path, hf_llama, tok, cache) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_llama, tok, tensors={"blk.0.attn_q_norm.weight": np.ones(64, np.float32)})
    with pytest.raises(ModelLoadError, match=r"tensor 'blk.0.attn_q_norm.weight' is not part of a supported llama model"):
        convert_gguf(path, cache)


def test_a_missing_layer_tensor_is_named(tmp_path, hf_llama, tok, cache) -> None:
    path = write_gguf(tmp_path / "m.gguf", hf_llama, tok, tensors={"blk.1.ffn_gate.weight": None})
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\) 'blk.1.ffn_gate.weight'"):
        convert_gguf(path, cache)


def test_a_converter_killed_midway_leaves_nothing_that_is_used(tmp_path, hf_llama, tok, cache) -> None:
    from specstream.models.cache import file_sha256, gguf_cache_dir

    path = write_gguf(tmp_path / "m.gguf", hf_llama, tok)
    out = gguf_cache_dir(file_sha256(path), cache)
    stale = out.parent / f"{out.name}.tmp-99999"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half written")
    assert convert_gguf(path, cache) == out and (out / "config.json").is_file()
    assert not stale.exists()


def test_resolving_a_converted_model_needs_no_torch(tmp_path, hf_llama, tok) -> None:
    """The gateway resolves its tokenizer's model and must stay torch-free."""
    import subprocess
    import sys

    path = write_gguf(tmp_path / "m.gguf", hf_llama, tok)
    convert_gguf(path, tmp_path / "home")
    code = ("import sys; sys.modules['torch'] = None\n"
            "import gateway.server\n"
            "from specstream.models.registry import resolve_model\n"
            f"print(resolve_model({str(path)!r}))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "SPECSTREAM_HOME": str(tmp_path / "home")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(tmp_path / "home" / "gguf"))
