"""TextTokenizer loading, the byte-level demo tokenizer, and IncrementalDetokenizer."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, normalizers, trainers
from tokenizers.implementations import SentencePieceBPETokenizer

from specstream.text.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    IncrementalDetokenizer,
    TextTokenizer,
    build_byte_level_tokenizer,
    save_tokenizer_files,
)

_BYTE_TOK = build_byte_level_tokenizer()
TT = TextTokenizer(_BYTE_TOK, eos_token_ids=[1], bos_token_id=0)

# Text that stresses multi-byte splits: accents, CJK, emoji (4-byte, ZWJ sequences, flags).
_PIECES = [
    "a", "the ", " ", "\n", "caf\u00e9", "na\u00efve", "e\u0301", "\u4f60\u597d", "\u4e16\u754c", "\u3002",
    "\U0001f600", "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\U0001f1fa\U0001f1f8", "\u00df", "\u0416",
    "\u05e9\u05dc\u05d5\u05dd", "def f(x):", "\u00a0", "\ud7a3", "\U00010348",
]
mixed_text = st.one_of(
    st.lists(st.sampled_from(_PIECES), max_size=30).map("".join),
    st.text(max_size=60),
)


def _no_specials(text: str) -> bool:
    # A literal "<s>" in the input is parsed as the special token, which decode skips.
    return BOS_TOKEN not in text and EOS_TOKEN not in text


def detokenize(decode, prompt: Sequence[int], ids: Sequence[int], sizes: Sequence[int]) -> list[str]:
    d = IncrementalDetokenizer(decode, prompt)
    out: list[str] = []
    i = 0
    k = 0
    while i < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        k += 1
        out.append(d.push(ids[i : i + n]))
        i += n
    out.append(d.flush())
    assert d.text == "".join(out)
    return out


# --- the byte-level tokenizer -------------------------------------------------------------


def test_byte_level_layout_and_determinism() -> None:
    tok = build_byte_level_tokenizer()
    assert tok.get_vocab_size() == 320
    assert tok.token_to_id(BOS_TOKEN) == 0
    assert tok.token_to_id(EOS_TOKEN) == 1
    assert tok.to_str() == _BYTE_TOK.to_str()
    assert build_byte_level_tokenizer(vocab_size=500).get_vocab_size() == 500
    # The post-processor prepends BOS.
    assert tok.encode("hi").ids[0] == 0


def test_byte_level_custom_corpus_and_limits() -> None:
    tok = build_byte_level_tokenizer(["aaaa bbbb aaaa bbbb"] * 3, vocab_size=300)
    # Too few merges in this corpus to fill 300: callers must read the real size.
    assert 258 <= tok.get_vocab_size() <= 300
    assert tok.decode(tok.encode("zzz \u00e9\U0001f600").ids) == "zzz \u00e9\U0001f600"
    with pytest.raises(ValueError, match="vocab_size"):
        build_byte_level_tokenizer(vocab_size=100)


@settings(max_examples=200, deadline=None)
@given(text=mixed_text.filter(_no_specials))
def test_byte_level_round_trips_any_text(text: str) -> None:
    ids = TT.encode(text)
    assert ids[0] == 0
    assert max(ids) < TT.vocab_size
    assert TT.decode(ids) == text


def test_multibyte_characters_split_across_tokens() -> None:
    ids = TT.encode("\U0001f600")[1:]
    assert len(ids) > 1  # 4 bytes, no merge for them in the English sample
    assert TT.decode(ids[:-1]).endswith("\ufffd")


# --- loading from a model directory ----------------------------------------------------------


def test_from_dir_with_tokenizer_config(tmp_path: Path) -> None:
    save_tokenizer_files(_BYTE_TOK, tmp_path, bos=BOS_TOKEN, eos=EOS_TOKEN)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == BOS_TOKEN and cfg["eos_token"] == EOS_TOKEN
    tt = TextTokenizer.from_dir(tmp_path)
    assert tt.vocab_size == 320
    assert tt.eos_token_ids == (1,)
    assert tt.bos_token_id == 0
    assert tt.decode(tt.encode("hello \u4f60")) == "hello \u4f60"


def test_from_dir_merges_eos_sources(tmp_path: Path) -> None:
    save_tokenizer_files(_BYTE_TOK, tmp_path, bos=BOS_TOKEN, eos=EOS_TOKEN)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5, "bos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9], "bos_token_id": 8}))
    tt = TextTokenizer.from_dir(str(tmp_path))
    assert tt.eos_token_ids == (5, 9, 1)
    assert tt.bos_token_id == 7


def test_from_dir_added_token_dict_and_unknown_token(tmp_path: Path) -> None:
    _BYTE_TOK.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": EOS_TOKEN}, "bos_token": "<not-a-token>"})
    )
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    tt = TextTokenizer.from_dir(tmp_path)
    assert tt.eos_token_ids == (1,)
    assert tt.bos_token_id is None


def test_from_dir_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        TextTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        TextTokenizer.from_dir(tmp_path)
    _BYTE_TOK.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="config.json"):
        TextTokenizer.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": "two"}))
    with pytest.raises(ValueError, match="config.json"):
        TextTokenizer.from_dir(tmp_path)


def test_truncation_in_tokenizer_json_is_ignored(tmp_path: Path) -> None:
    tok = tokenizers.Tokenizer.from_str(_BYTE_TOK.to_str())
    tok.enable_truncation(max_length=4)
    save_tokenizer_files(tok, tmp_path, bos=BOS_TOKEN, eos=EOS_TOKEN)
    tt = TextTokenizer.from_dir(tmp_path)
    assert len(tt.encode("a much longer prompt than four tokens")) > 4


def test_save_rejects_unknown_special_tokens(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="eos"):
        save_tokenizer_files(_BYTE_TOK, tmp_path, bos=BOS_TOKEN, eos="<|end|>")


# --- incremental detokenization ----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(text=mixed_text.filter(_no_specials), sizes=st.lists(st.integers(min_value=1, max_value=7), max_size=8))
def test_deltas_concatenate_to_decode(text: str, sizes: list[int]) -> None:
    ids = TT.encode(text)
    out = detokenize(TT.decode, [], ids, sizes)
    assert "".join(out) == TT.decode(ids) == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in piece for piece in out)


@settings(max_examples=150, deadline=None)
@given(
    prompt=mixed_text.filter(_no_specials),
    text=mixed_text.filter(_no_specials),
    sizes=st.lists(st.integers(min_value=1, max_value=5), max_size=6),
)
def test_deltas_in_prompt_context(prompt: str, text: str, sizes: list[int]) -> None:
    prompt_ids = TT.encode(prompt)
    gen = TT.encode(text)[1:]  # no BOS in the middle
    out = detokenize(TT.decode, prompt_ids, gen, sizes)
    # Token boundaries differ from encoding prompt+text together, but the bytes are the same.
    assert "".join(out) == TT.decode(prompt_ids + gen)[len(TT.decode(prompt_ids)) :] == text


def test_split_character_is_held_until_complete() -> None:
    ids = TT.encode("a\U0001f600b")[1:]
    d = TT.detokenizer([])
    out = [d.push([i]) for i in ids]
    assert out[0] == "a"
    assert out[1:-2] == [""] * (len(ids) - 3)
    assert out[-2:] == ["\U0001f600", "b"]
    assert d.flush() == ""
    assert d.text == "a\U0001f600b"


def test_valid_text_before_a_split_character_is_not_held() -> None:
    # One push containing "x" and the first byte of an emoji releases "x" at once.
    ids = TT.encode("x\U0001f600")[1:]
    d = TT.detokenizer([])
    assert d.push(ids[:2]) == "x"
    assert d.push(ids[2:]) == "\U0001f600"


def test_invalid_bytes_come_out_on_flush() -> None:
    lone = TT.encode("\u00e9")[1:]  # two byte tokens: C3 A9
    assert len(lone) == 2
    d = TT.detokenizer(TT.encode("ok"))
    assert d.push(lone[:1]) == ""
    assert d.flush() == "\ufffd"
    with pytest.raises(RuntimeError):
        d.push(lone[1:])
    # A real U+FFFD followed by more text is released without waiting for the end.
    d = TT.detokenizer([])
    assert d.push(lone[1:]) == ""
    assert d.push(TT.encode("z")[1:]) == "\ufffdz"
    # An actual U+FFFD in the text is held only until something follows it.
    d = TT.detokenizer([])
    assert d.push(TT.encode("\ufffd")[1:]) == ""
    assert d.flush() == "\ufffd"


def test_special_tokens_are_skipped() -> None:
    d = TT.detokenizer(TT.encode("hi"))
    assert d.push(TT.encode(" there")[1:]) == " there"
    assert d.push([1]) == ""
    assert d.flush() == ""


def test_prompt_ending_inside_a_character() -> None:
    # Token-id prompts can end mid-character; the generated bytes that complete it emit it.
    ids = TT.encode("ab\u4f60")
    d = TT.detokenizer(ids[:-1])
    assert d.push(ids[-1:]) + d.flush() == "\u4f60"


def test_decode_work_is_linear_in_tokens() -> None:
    # Count decoded tokens instead of timing: a re-decode-everything bug is quadratic.
    rng = random.Random(0)
    text = "".join(rng.choice(_PIECES) for _ in range(600))
    ids = TT.encode(text)
    decoded = 0

    def counting_decode(window: Sequence[int]) -> str:
        nonlocal decoded
        decoded += len(window)
        return TT.decode(window)

    for sizes in ([1], [3], [1, 5, 2]):
        decoded = 0
        out = detokenize(counting_decode, [], ids, sizes)
        assert "".join(out) == text
        assert decoded < 40 * len(ids), (sizes, decoded, len(ids))


def test_long_run_of_split_characters_keeps_window_small() -> None:
    # Byte-level CJK with one byte per token: after a first push of 1 token, pushes of 3 tokens
    # all end inside a character, so the end of a push is never a clean place to move the window;
    # the boundaries inside the pushes are.
    text = "\u4f60\u597d\u4e16\u754c" * 200
    ids = TT.encode(text)[1:]
    assert len(ids) == 3 * len(text)
    d = TT.detokenizer([])
    out = [d.push(ids[:1])]
    longest = 0
    for i in range(1, len(ids), 3):
        out.append(d.push(ids[i : i + 3]))
        assert out[-1]  # each push completes a character
        longest = max(longest, len(d._ids))
    out.append(d.flush())
    assert "".join(out) == text
    assert longest < 30


# --- SentencePiece-style tokenizers ---------------------------------------------------------------


_SP_CORPUS = ["Hello world, the quick brown fox jumps over the lazy dog and the world says hello"] * 5


def test_metaspace_leading_spaces_survive() -> None:
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(_SP_CORPUS, vocab_size=120, show_progress=False, special_tokens=["<unk>"])
    tok = sp._tokenizer
    decode = lambda ids: tok.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    prompt = tok.encode("Hello there").ids
    gen = tok.encode(" the world fox jumps").ids
    # Decoding one token alone drops its "\u2581" space: the naive approach would fail.
    assert decode(gen[:1]) == "the"
    expected = decode(prompt + gen)[len(decode(prompt)) :]
    assert expected == " the world fox jumps"
    for sizes in ([1], [2], [3, 1]):
        assert "".join(detokenize(decode, prompt, gen, sizes)) == expected
    # Without a prompt the first token's space is dropped, exactly as a one-shot decode does.
    assert "".join(detokenize(decode, [], gen, [1])) == decode(gen) == "the world fox jumps"


def _llama2_style_tokenizer() -> tokenizers.Tokenizer:
    """A Llama-2-like tokenizer: SentencePiece BPE with <0xXX> byte fallback, decoded with
    Replace/ByteFallback/Fuse/Strip."""
    base = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    norm = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    base.normalizer = norm
    base.train_from_iterator(
        _SP_CORPUS,
        trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False),
    )
    model = json.loads(base.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.normalizer = norm
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def test_llama2_style_byte_fallback() -> None:
    tok = _llama2_style_tokenizer()
    decode = lambda ids: tok.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    prompt = tok.encode("Hello").ids
    gen = tok.encode("the world \u4f60\u597d \U0001f600! lazy \u00e9").ids
    assert "<0xE4>" in tok.encode("\u4f60").tokens
    expected = decode(prompt + gen)[len(decode(prompt)) :]
    assert expected == " the world \u4f60\u597d \U0001f600! lazy \u00e9"
    for sizes in ([1], [2], [5, 1, 3]):
        out = detokenize(decode, prompt, gen, sizes)
        assert "".join(out) == expected
        assert not any("\ufffd" in piece for piece in out)


def test_token_bytes_are_the_raw_bytes_even_inside_a_character() -> None:
    text = "caf\u00e9 \u4f60\u597d \U0001f600 <s>"
    ids = TT.encode(text)[1:]
    split = [i for i in ids if TT.token_text(i) == "\ufffd"]
    assert split, "the sample must hold tokens that are part of a character"
    assert all(TT.token_bytes(i) != "\ufffd".encode() for i in split)
    assert b"".join(TT.token_bytes(i) for i in ids).decode("utf-8") == text  # the special <s> as its text
    sp = TextTokenizer(_llama2_style_tokenizer())
    (byte,) = [i for i in sp.encode("\u4f60") if sp.tokenizer.id_to_token(i) == "<0xE4>"]
    assert sp.token_bytes(byte) == b"\xe4"
