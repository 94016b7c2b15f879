"""A Hugging Face ``tokenizers`` tokenizer built from a GGUF file's ``tokenizer.ggml.*`` metadata.

Contract: ``build_gguf_tokenizer(meta)`` takes the metadata as a plain dict (key -> value, arrays as
lists) and returns a ``GGUFTokenizerFiles``: the ``tokenizers.Tokenizer`` plus what belongs in
``tokenizer_config.json`` (bos/eos tokens, ``add_bos_token``, the chat template). Supported:
byte-level BPE (``tokenizer.ggml.model = gpt2``) with the pre-tokenizers of ``PRE_TOKENIZERS``
(llama.cpp's ``tokenizer.ggml.pre`` names). Tokens typed CONTROL become special added tokens and
USER_DEFINED ones plain added tokens, so both are matched whole in text, as llama.cpp does.
Anything unsupported or inconsistent raises ``ModelLoadError`` naming the key and its value.

What it does not know: model weights, the file format (``specstream.models.gguf`` reads the file),
chat rendering (``specstream.text.chat``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from specstream.models.config import ModelLoadError

__all__ = ["GGUFTokenizerFiles", "PRE_TOKENIZERS", "build_gguf_tokenizer", "byte_alphabet"]

# llama.cpp's token types (llama_token_type / gguf TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the spelling of byte-level BPE vocabularies)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


# Regexes of llama.cpp's pre-tokenizers (llama-vocab.cpp), by ``tokenizer.ggml.pre``.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # llama.cpp "smollm" / "starcoder": every digit on its own, then GPT-2's split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])

    return build


PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2,
    "gpt2": _gpt2,
    "gpt-2": _gpt2,
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "llama3": _split(_LLAMA3_SPLIT),
    "llama-v3": _split(_LLAMA3_SPLIT),
    "llama-bpe": _split(_LLAMA3_SPLIT),
    "qwen2": _split(_QWEN2_SPLIT),
}


@dataclass
class GGUFTokenizerFiles:
    tokenizer: tokenizers.Tokenizer
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    chat_template: str | None
    special_ids: list[int] = field(default_factory=list)  # CONTROL tokens

    def tokenizer_config(self) -> dict[str, Any]:
        """The ``tokenizer_config.json`` transformers and ``TextTokenizer`` read."""
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos_token,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        return config


def _list(meta: Mapping[str, Any], key: str, kind: type, length: int | None = None) -> list:
    value = meta.get(key)
    if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
        raise ModelLoadError(f"metadata {key!r}: must be an array of {kind.__name__}, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise ModelLoadError(f"metadata {key!r}: has {len(value)} entries, expected {length} (one per token)")
    return value


def _token_id(meta: Mapping[str, Any], key: str, vocab: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
        raise ModelLoadError(f"metadata {key!r} = {value!r}: must be a token id in 0..{vocab - 1}")
    return value


def build_gguf_tokenizer(meta: Mapping[str, Any]) -> GGUFTokenizerFiles:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"metadata 'tokenizer.ggml.model' = {kind!r} is not supported (supported: 'gpt2', byte-level BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"metadata 'tokenizer.ggml.pre' = {pre!r} is not supported (supported: {sorted(PRE_TOKENIZERS)})"
        )
    tokens = _list(meta, "tokenizer.ggml.tokens", str)
    types = _list(meta, "tokenizer.ggml.token_type", int, len(tokens)) if "tokenizer.ggml.token_type" in meta \
        else [NORMAL] * len(tokens)
    merges = _list(meta, "tokenizer.ggml.merges", str)
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    # Byte-level vocabularies spell every token in the byte alphabet; a token written otherwise
    # (raw text) is respelled so BPE can reach it.
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        key = token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(key, i)
    pairs: list[tuple[str, str]] = []
    for i, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ModelLoadError(f"metadata 'tokenizer.ggml.merges'[{i}] = {merge!r}: must be two tokens separated by a space")
        pairs.append((parts[0], parts[1]))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()

    # Only tokens spelled in the byte alphabet can be matched whole: BPE's vocabulary holds them
    # under that spelling, so the added token keeps its id. Others (llama.cpp mislabels) are left
    # out, as transformers does; adding them would hand out ids past the model's vocabulary.
    control = [i for i, t in enumerate(types) if t == CONTROL and set(tokens[i]) <= spelled]
    user = [i for i, t in enumerate(types) if t == USER_DEFINED and set(tokens[i]) <= spelled]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ModelLoadError(f"metadata 'tokenizer.ggml.tokens': {len(tokens)} tokens make a tokenizer of "
                             f"{tok.get_vocab_size(with_added_tokens=True)} ids (duplicate tokens?)")

    vocab_size = len(tokens)
    bos = _token_id(meta, "tokenizer.ggml.bos_token_id", vocab_size)
    eos = _token_id(meta, "tokenizer.ggml.eos_token_id", vocab_size)
    add_bos = meta.get("tokenizer.ggml.add_bos_token", False)
    if not isinstance(add_bos, bool):
        raise ModelLoadError(f"metadata 'tokenizer.ggml.add_bos_token' = {add_bos!r}: must be true/false")
    if add_bos and bos is None:
        raise ModelLoadError("metadata 'tokenizer.ggml.add_bos_token' = True but 'tokenizer.ggml.bos_token_id' is missing")
    if add_bos:
        bos_token = tokens[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B:1", special_tokens=[(bos_token, bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"metadata 'tokenizer.chat_template': must be a string, got {type(template).__name__}")
    return GGUFTokenizerFiles(
        tokenizer=tok,
        bos_token=tokens[bos] if bos is not None else None,
        eos_token=tokens[eos] if eos is not None else None,
        add_bos_token=add_bos,
        chat_template=template,
        special_ids=control,
    )
