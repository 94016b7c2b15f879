"""specstream.models against transformers: parity, KV-cache decoding, loading formats and load errors.

Every model here is a tiny random-init transformers checkpoint (tests/support/checkpoints.py) whose logits have
std ~0.8, so the 1e-4 parity bound is tight relative to the signal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.support.checkpoints import load_hf_model, make_hf_checkpoint
from safetensors.torch import load_file, save_file

from specstream.models.base import CausalLM
from specstream.models.config import ModelLoadError
from specstream.models.kv_cache import KVCache
from specstream.models.loader import load_model, read_config
from specstream.models.random_init import write_random_checkpoint

VOCAB = 128
TOL = 1e-4

# name -> (arch for make_hf_checkpoint, overrides)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama_bias": ("llama", {"attention_bias": True, "mlp_bias": True, "head_dim": 8}),
    "llama3_gqa": ("llama3_gqa", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen2_sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    "gpt2": ("gpt2", {}),
}


@dataclass
class Pair:
    name: str
    path: Path
    ours: CausalLM
    ref: Any  # transformers PreTrainedModel


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    arch, overrides = VARIANTS[request.param]
    path = make_hf_checkpoint(tmp_path_factory.mktemp(request.param), arch, vocab_size=VOCAB, seed=7, **overrides)
    return Pair(request.param, path, load_model(path), load_hf_model(path))


def tokens(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, n), generator=g)  # [batch, n]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = TOL) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual.float() - expected.float()).abs().max().item()
    assert diff <= tol, f"{what}: max abs diff {diff:.3g} > {tol}"


def ref_logits(ref: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return ref(ids).logits.float()  # [B, T, V]


def run(
    model: CausalLM, cache: KVCache, ids: torch.Tensor, slots: list[int], starts: list[int], last_only: bool = False
) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids, cache, torch.tensor(slots), torch.tensor(starts), last_only=last_only)


def full(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a fresh, from-scratch forward over whole sequences."""
    B, T = ids.shape
    cache = model.new_cache(B, T)
    return run(model, cache, ids, list(range(B)), [0] * B)


# -- parity with transformers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 7, 23])
def test_parity_full_prompt_batch1(pair: Pair, T: int) -> None:
    ids = tokens(T, seed=T)
    out = full(pair.ours, ids)
    assert out.dtype == torch.float32
    assert_close(out, ref_logits(pair.ref, ids), f"{pair.name} T={T}")


def test_parity_batch_same_start(pair: Pair) -> None:
    ids = tokens(11, seed=1, batch=3)
    cache = pair.ours.new_cache(4, 16)
    # Non-consecutive slots take the gather path.
    out = run(pair.ours, cache, ids, [2, 0, 3], [0, 0, 0])
    assert_close(out, ref_logits(pair.ref, ids), f"{pair.name} batch 3")


@pytest.mark.parametrize("T", [1, 4])
def test_parity_batch_different_starts(pair: Pair, T: int) -> None:
    prefixes = [0, 5, 13]
    slots = [1, 3, 0]
    seqs = [tokens(p + T, seed=10 + i) for i, p in enumerate(prefixes)]
    cache = pair.ours.new_cache(4, 32)
    for seq, p, s in zip(seqs, prefixes, slots):
        if p:
            run(pair.ours, cache, seq[:, :p], [s], [0])
    chunk = torch.cat([seq[:, p:] for seq, p in zip(seqs, prefixes)])  # [3, T]
    out = run(pair.ours, cache, chunk, slots, prefixes)
    for b, (seq, p) in enumerate(zip(seqs, prefixes)):
        expected = ref_logits(pair.ref, seq)[:, p:]
        assert_close(out[b : b + 1], expected, f"{pair.name} row {b} start {p} T={T}")


def test_last_only(pair: Pair) -> None:
    ids = tokens(9, seed=3, batch=2)
    cache = pair.ours.new_cache(2, 9)
    out = run(pair.ours, cache, ids, [0, 1], [0, 0], last_only=True)
    assert out.shape == (2, 1, VOCAB) and out.dtype == torch.float32
    assert_close(out, ref_logits(pair.ref, ids)[:, -1:], f"{pair.name} last_only")


# -- incremental decoding through the KV cache ----------------------------------------------------------------


def test_incremental_matches_full_forward(pair: Pair) -> None:
    model = pair.ours
    seq = tokens(24, seed=4)
    expected = full(model, seq)  # [1, 24, V]
    cache = model.new_cache(3, 40)
    a = cache.alloc()
    assert a is not None

    out = run(model, cache, seq[:, :9], [a], [0])
    assert_close(out, expected[:, :9], f"{pair.name} prefill")
    cache.set_length(a, 9)
    for i in range(9, 15):  # token-by-token decode, past the sliding windows
        out = run(model, cache, seq[:, i : i + 1], [a], [i])
        assert cache.length(a) == i, "forward must not change cache lengths"
        assert_close(out, expected[:, i : i + 1], f"{pair.name} decode pos {i}")
        cache.set_length(a, i + 1)
    out = run(model, cache, seq[:, 15:19], [a], [15])
    assert_close(out, expected[:, 15:19], f"{pair.name} chunk 15..19")
    cache.set_length(a, 19)

    # Roll back to 12 and extend with different tokens: the stale K/V at 12..18 must be overwritten.
    cache.set_length(a, 12)
    alt = tokens(5, seed=5)
    seq_alt = torch.cat([seq[:, :12], alt], dim=1)  # [1, 17]
    out = run(model, cache, alt, [a], [12])
    assert_close(out, full(model, seq_alt)[:, 12:], f"{pair.name} rollback + re-extend")
    cache.set_length(a, 17)

    # Fork: b gets a's first 10 positions, then diverges; a continues unaffected.
    b = cache.alloc()
    assert b is not None
    cache.copy_prefix(a, b, 10)
    assert cache.length(b) == 10
    other = tokens(6, seed=6)
    seq_b = torch.cat([seq[:, :10], other], dim=1)  # [1, 16]
    expected_b = full(model, seq_b)
    out = run(model, cache, other[:, :3], [b], [10])
    assert_close(out, expected_b[:, 10:13], f"{pair.name} forked slot")
    cache.set_length(b, 13)
    nxt = tokens(1, seed=8)
    out = run(model, cache, nxt, [a], [17])
    assert_close(out, full(model, torch.cat([seq_alt, nxt], dim=1))[:, 17:], f"{pair.name} original after fork")
    cache.set_length(a, 18)

    # Batched step over both slots at different lengths, chunked (speculative verify shape).
    seq_a2 = torch.cat([seq_alt, nxt, tokens(2, seed=9)], dim=1)  # [1, 20]
    chunk = torch.cat([seq_a2[:, 18:20], seq_b[:, 13:15]])  # [2, 2]
    out = run(model, cache, chunk, [a, b], [18, 13])
    assert_close(out[0:1], full(model, seq_a2)[:, 18:20], f"{pair.name} batched row a")
    assert_close(out[1:2], expected_b[:, 13:15], f"{pair.name} batched row b")
    assert (cache.length(a), cache.length(b)) == (18, 13)


def test_forward_input_errors(pair: Pair) -> None:
    model = pair.ours
    cfg = model.config
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.new_cache(1, cfg.max_position_embeddings + 1)
    cache = model.new_cache(2, 8)
    with pytest.raises(ValueError, match="max_len"):
        run(model, cache, tokens(3, seed=0), [0], [6])
    with pytest.raises(ValueError, match="distinct"):
        run(model, cache, tokens(1, seed=0, batch=2), [1, 1], [0, 0])
    with pytest.raises(ValueError, match="out of range"):
        run(model, cache, tokens(1, seed=0), [2], [0])


def test_rope_table_grows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RoPE tables start short and grow in new_cache, or in forward for a cache built by hand."""
    import specstream.models.llama as llama

    monkeypatch.setattr(llama, "_INITIAL_ROPE_LEN", 4)
    path = make_hf_checkpoint(tmp_path, "llama3_gqa", vocab_size=VOCAB, seed=1)
    ids = tokens(20, seed=0)
    expected = ref_logits(load_hf_model(path), ids)
    assert_close(full(load_model(path), ids), expected, "rope grown by new_cache")
    model = load_model(path)
    c = model.config
    cache = KVCache(c.num_layers, 1, c.num_kv_heads, 32, c.head_dim, torch.float32)
    assert_close(run(model, cache, ids, [0], [0]), expected, "rope grown in forward")


# -- loading formats ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama3_gqa", "gpt2"])
def test_sharded_equals_single_file(tmp_path: Path, arch: str) -> None:
    single = make_hf_checkpoint(tmp_path / "single", arch, vocab_size=VOCAB, seed=3)
    sharded = make_hf_checkpoint(tmp_path / "sharded", arch, vocab_size=VOCAB, seed=3, sharded=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) >= 2
    ids = tokens(12, seed=2)
    a, b = full(load_model(single), ids), full(load_model(sharded), ids)
    assert torch.equal(a, b), f"sharded vs single: max abs diff {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["llama3_gqa", "gpt2"])
def test_half_precision_close_to_fp32(tmp_path: Path, arch: str, dtype: str) -> None:
    path = make_hf_checkpoint(tmp_path, arch, vocab_size=VOCAB, seed=5)
    fp32, half = load_model(path), load_model(path, dtype=dtype)
    assert half.dtype == {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    seq = tokens(12, seed=1)
    expected = full(fp32, seq)
    cache = half.new_cache(1, 16)
    assert cache.k[0].dtype == half.dtype and cache.alloc() == 0
    prefill = run(half, cache, seq[:, :8], [0], [0])
    cache.set_length(0, 8)
    step = run(half, cache, seq[:, 8:12], [0], [8])
    assert prefill.dtype == torch.float32
    got = torch.cat([prefill, step], dim=1)
    # Loose: bf16 keeps ~3 significant digits, fp16 ~4; the logits here have std ~0.8 (observed ~0.03 / ~0.005).
    assert_close(got, expected, f"{arch} {dtype} vs fp32", tol={"bfloat16": 0.1, "float16": 0.02}[dtype])


# Wide enough that a 1-row bfloat16 product takes a different kernel from a multi-row one.
_WIDE = {"llama3_gqa": {"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4, "head_dim": 64},
         "gpt2": {"n_embd": 256, "n_head": 4}}


@pytest.mark.parametrize("arch", ["llama3_gqa", "gpt2"])
def test_verify_forward_equals_single_steps_bitwise_in_bfloat16(tmp_path: Path, arch: str) -> None:
    """Exact greedy speculation needs the logits of a (γ+1)-token verify forward to be the very bits
    that γ+1 one-token decode steps give, in the serving dtype (bfloat16 on CPU), for every row of a
    batch with different starts."""
    path = make_hf_checkpoint(tmp_path, arch, vocab_size=1024, seed=3, **_WIDE[arch])
    assert_verify_equals_steps(load_model(path, dtype="bfloat16"), arch)


def assert_verify_equals_steps(model: CausalLM, what: str) -> None:
    """Verify forwards over T = 2, 5, 9 positions give the bits of T decode steps, per row of a batch."""
    seq = tokens(60, seed=2, batch=2) % model.config.vocab_size  # [2, 60]
    starts = [40, 47]

    def prefilled() -> KVCache:
        cache = model.new_cache(2, 64)
        for row, start in enumerate(starts):
            assert cache.alloc() == row
            run(model, cache, seq[row : row + 1, :start], [row], [0])
            cache.set_length(row, start)
        return cache

    for T in (2, 5, 9):
        cache = prefilled()
        window = torch.stack([seq[row, s : s + T] for row, s in enumerate(starts)])  # [2, T]
        verify = run(model, cache, window, [0, 1], starts)  # [2, T, V]
        cache = prefilled()
        for row, start in enumerate(starts):  # decode steps, one row at a time (batch 1, one token)
            steps = torch.cat([run(model, cache, window[row : row + 1, t : t + 1], [row], [start + t])
                               for t in range(T)], dim=1)  # [1, T, V]
            diff = (steps[0] - verify[row]).abs().max().item()
            assert torch.equal(steps[0], verify[row]), f"{what} T={T} row {row}: max |difference| {diff}"


def test_gpt2_unprefixed_hub_layout(tmp_path: Path) -> None:
    """Old hub GPT-2 files have bare names and attn.bias mask buffers; both must load the same model."""
    path = make_hf_checkpoint(tmp_path, "gpt2", vocab_size=VOCAB, seed=2)
    ref = load_hf_model(path)
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    for i in range(2):
        renamed[f"h.{i}.attn.bias"] = torch.ones(1, 1, 128, 128).tril()
    save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    ids = tokens(10, seed=0)
    assert_close(full(load_model(path), ids), ref_logits(ref, ids), "gpt2 unprefixed")


def test_old_style_rope_scaling_linear(tmp_path: Path) -> None:
    """Pre-transformers-5 configs: top-level rope_theta plus rope_scaling {"type": ...}."""
    path = make_hf_checkpoint(tmp_path, "llama", vocab_size=VOCAB, seed=4)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 5000.0
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
    (path / "config.json").write_text(json.dumps(cfg))
    ours = load_model(path)
    assert ours.config.rope is not None and ours.config.rope.rope_type == "linear"
    ids = tokens(20, seed=1)
    assert_close(full(ours, ids), ref_logits(load_hf_model(path), ids), "old-style linear rope")


def test_config_fields(tmp_path: Path) -> None:
    path = make_hf_checkpoint(tmp_path / "tiny-llama3", "llama3_gqa", vocab_size=VOCAB, seed=0)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 9]
    (path / "generation_config.json").write_text(json.dumps(gen))
    cfg = read_config(path)
    assert cfg.name == "tiny-llama3"
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (4, 2, 16, 2)
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2, 9)
    assert cfg.rope is not None and cfg.rope.rope_type == "llama3" and cfg.rope.original_max_position_embeddings == 32
    assert load_model(path).config == cfg


def test_write_random_checkpoint_loads_in_both(tmp_path: Path) -> None:
    config = {
        "vocab_size": 96,
        "hidden_size": 48,
        "intermediate_size": 80,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "initializer_range": 0.1,  # larger than the default so the parity check sees real logits
    }
    path = write_random_checkpoint(tmp_path / "rand", config, seed=11)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    ours = load_model(path)
    assert ours.config.vocab_size == 96 and ours.config.num_kv_heads == 2
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (2, 14), generator=g)
    assert_close(full(ours, ids), ref_logits(load_hf_model(path), ids), "write_random_checkpoint")

    again = load_file(str(write_random_checkpoint(tmp_path / "again", config, seed=11) / "model.safetensors"))
    first = load_file(str(path / "model.safetensors"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first), "same seed"
    other = load_file(str(write_random_checkpoint(tmp_path / "other", config, seed=12) / "model.safetensors"))
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])

    tied = {**config, "tie_word_embeddings": True}
    bf16 = load_model(write_random_checkpoint(tmp_path / "bf16", tied, 11, "bfloat16"))
    assert bf16.config.tie_word_embeddings and full(bf16, ids).isfinite().all()


# -- load errors ----------------------------------------------------------------------------------------------


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    return make_hf_checkpoint(tmp_path / "ckpt", "llama", vocab_size=VOCAB, seed=1)


def edit_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, drop: str | None = None, add: dict[str, torch.Tensor] | None = None) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    if drop is not None:
        del tensors[drop]
    tensors.update(add or {})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_error_unknown_architecture(llama_dir: Path) -> None:
    edit_config(llama_dir, architectures=["FalconForCausalLM"])
    with pytest.raises(ModelLoadError, match=r"config\.json.*'architectures'.*FalconForCausalLM"):
        load_model(llama_dir)


def test_error_missing_tensor(llama_dir: Path) -> None:
    edit_tensors(llama_dir, drop="model.layers.1.mlp.up_proj.weight")
    pattern = r"model\.safetensors.*missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"
    with pytest.raises(ModelLoadError, match=pattern):
        load_model(llama_dir)


def test_error_missing_lm_head_when_untied(llama_dir: Path) -> None:
    edit_tensors(llama_dir, drop="lm_head.weight")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*'lm_head\.weight'"):
        load_model(llama_dir)


def test_error_missing_tensor_sharded(tmp_path: Path) -> None:
    path = make_hf_checkpoint(tmp_path, "llama", vocab_size=VOCAB, seed=1, sharded=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors\.index\.json.*'model\.norm\.weight'"):
        load_model(path)


def test_error_shape_mismatch(llama_dir: Path) -> None:
    edit_config(llama_dir, intermediate_size=80)
    pattern = r"model\.safetensors.*'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \[96, 64\], expected \[80, 64\]"
    with pytest.raises(ModelLoadError, match=pattern):
        load_model(llama_dir)


def test_error_unexpected_tensor(llama_dir: Path) -> None:
    edit_config(llama_dir, num_hidden_layers=1)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*unexpected tensor.*'model\.layers\.1\."):
        load_model(llama_dir)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            r"rope_parameters\.rope_type.*'yarn'",
        ),
        (
            {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
            r"rope_scaling\.rope_type.*'dynamic'",
        ),
    ],
)
def test_error_unsupported_rope_type(llama_dir: Path, changes: dict[str, Any], pattern: str) -> None:
    edit_config(llama_dir, **changes)
    with pytest.raises(ModelLoadError, match=r"config\.json.*" + pattern):
        load_model(llama_dir)


def test_error_missing_config_field(llama_dir: Path) -> None:
    edit_config(llama_dir, hidden_size=None)
    with pytest.raises(ModelLoadError, match=r"config\.json.*'hidden_size' is missing"):
        load_model(llama_dir)


def test_error_only_pickle_weights(llama_dir: Path) -> None:
    (llama_dir / "model.safetensors").unlink()
    # Not even a valid pickle: any attempt to unpickle would fail differently from the error we expect.
    (llama_dir / "pytorch_model.bin").write_bytes(b"\x80\x04 not a pickle")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin.*refusing to unpickle"):
        load_model(llama_dir)


def test_error_missing_config_json(llama_dir: Path) -> None:
    (llama_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(llama_dir)


def test_error_missing_shard_file(tmp_path: Path) -> None:
    path = make_hf_checkpoint(tmp_path, "gpt2", vocab_size=VOCAB, seed=1, sharded=True)
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors\.index\.json.*{shard.name}.*does not exist"):
        load_model(path)


def test_error_bad_dtype(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="dtype 'int8'"):
        load_model(llama_dir, dtype="int8")


@pytest.mark.parametrize("arch", ["llama3_gqa", "gpt2"])
def test_prefill_in_chunks_equals_one_chunk_bitwise_in_bfloat16(tmp_path: Path, arch: str) -> None:
    """How a prompt is split into prefill chunks depends on what else the engine is admitting, so a
    plain and a speculative run split it differently; the cache and the logits must not care."""
    path = make_hf_checkpoint(tmp_path, arch, vocab_size=1024, seed=4, **_WIDE[arch])
    model = load_model(path, dtype="bfloat16")
    seq = tokens(50, seed=5)  # [1, 50]

    def prefill(splits: list[int]) -> torch.Tensor:
        cache = model.new_cache(1, 64)
        cache.alloc()
        bounds = [0, *splits, seq.shape[1]]
        for a, b in zip(bounds, bounds[1:]):
            logits = run(model, cache, seq[:, a:b], [0], [a])
            cache.set_length(0, b)
        return logits[0, -1]  # [V]

    whole = prefill([])
    for splits in ([12], [7, 30], [49]):
        parts = prefill(splits)
        assert torch.equal(parts, whole), f"{arch} splits {splits}: max |difference| {(parts - whole).abs().max()}"
