"""Text <-> token ids for the gateway: loading a checkpoint's tokenizer, streaming detokenization,
and a tiny trainable byte-level tokenizer for random-init demo models and test fixtures.

Contract:

* ``TextTokenizer.from_dir`` loads ``tokenizer.json`` (the Hugging Face ``tokenizers`` format) and
  collects EOS/BOS ids from ``config.json``, ``generation_config.json`` and ``tokenizer_config.json``.
  ``encode`` applies the tokenizer's own post-processor (so a BOS is added exactly when the
  tokenizer says so); ``decode`` skips special tokens.
* ``IncrementalDetokenizer`` turns generated ids into text deltas whose concatenation equals
  decoding all generated ids at once in the context of the prompt. Each ``push`` decodes only a
  short window of recent tokens, so its cost is O(new tokens), not O(sequence length).
* ``build_byte_level_tokenizer`` trains a byte-level BPE (any Unicode text round-trips exactly;
  multi-byte characters can split across tokens) in well under a second.

Chat: ``from_dir`` also takes ``chat_template`` from ``tokenizer_config.json`` (rendered by
``specstream.text.chat``) and the id of the token that ends an assistant turn (``end_of_turn_id``).

What this module does not know: how a chat template is rendered, the model's embedding size (which may exceed the
tokenizer's vocabulary), stop strings (see ``stop_strings``), and anything about the HTTP/gRPC
layers. Windowed decoding assumes the decoder is prefix-stable at character boundaries (true for
ByteLevel, Metaspace, ByteFallback/Fuse/Strip and WordPiece decoders); a decoder that rewrites
already-final text when later tokens arrive would make deltas differ from a one-shot decode.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from specstream.text.chat import ChatError, ChatTemplate

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "IncrementalDetokenizer",
    "TextTokenizer",
    "build_byte_level_tokenizer",
    "save_tokenizer_files",
]

BOS_TOKEN = "<s>"  # id 0 in tokenizers built by build_byte_level_tokenizer
EOS_TOKEN = "</s>"  # id 1

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context before the first generated token (vLLM uses the same number):
# enough for SentencePiece's leading-space rule and for a prompt that ends mid-character.
_INITIAL_CONTEXT_TOKENS = 5
# Tokens held back (text ending inside a character) before looking for an earlier clean boundary
# to move the window to; keeps a long run of split characters from growing the window.
_REANCHOR_AFTER_TOKENS = 8


def _trailing_replacements(text: str) -> int:
    n = len(text)
    i = n
    while i > 0 and text[i - 1] == _REPLACEMENT:
        i -= 1
    return n - i


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas whose concatenation equals decoding all generated
    ids at once (in the context of the prompt, so SentencePiece-style leading spaces come out right).
    A token that ends inside a multi-byte UTF-8 character yields no text for that character until it
    completes (decode gives U+FFFD at the end: that run is held back).

    Window technique (as vLLM/TGI): only ``ids[start:]`` is decoded. ``ids[start:read]`` is context
    whose text was already accounted for; text past it is new. Both offsets sit on clean boundaries
    (where the decoded text does not end in U+FFFD), so the context's text is a prefix of the
    window's text. Unlike plain vLLM, the valid text before a trailing U+FFFD run is emitted at once
    (``_emitted`` counts it), so a run of split CJK characters is not held back as a whole.

    Not thread-safe; one instance per sequence.
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        prompt_ids: Sequence[int],
        *,
        context_tokens: int = _INITIAL_CONTEXT_TOKENS,
    ) -> None:
        if context_tokens < 1:
            raise ValueError(f"context_tokens must be >= 1, got {context_tokens}")
        self._decode = decode
        start = max(len(prompt_ids) - context_tokens, 0)
        self._ids: list[int] = [int(t) for t in prompt_ids[start:]]
        self._read = len(self._ids)
        ctx = decode(self._ids) if self._ids else ""
        # A prompt that ends inside a character (token-id prompts can) leaves U+FFFD at the end of
        # the context; the generated tokens that complete it then emit the whole character.
        self._ctx_len = len(ctx) - _trailing_replacements(ctx)
        self._emitted = 0  # chars of the window's text past _ctx_len already emitted
        self._scanned = self._read  # boundaries at or below this are known not to be clean
        self._pieces: list[str] = []
        self._joined = ""
        self._joined_count = 0
        self._flushed = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the new text they make final (possibly "")."""
        if self._flushed:
            raise RuntimeError("IncrementalDetokenizer.push after flush")
        if not token_ids:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        body = self._decode(self._ids)[self._ctx_len :]
        stable = len(body) - _trailing_replacements(body)
        delta = body[self._emitted : stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        if stable == len(body):
            self._move_window(len(self._ids))
            self._emitted = 0
        elif len(self._ids) - self._read > _REANCHOR_AFTER_TOKENS:
            self._reanchor_on_earlier_boundary()
        if delta:
            self._pieces.append(delta)
        return delta

    def flush(self) -> str:
        """At the end: release whatever was held back (a real U+FFFD stays). Later pushes fail."""
        if self._flushed:
            return ""
        self._flushed = True
        if len(self._ids) == self._read:
            return ""
        body = self._decode(self._ids)[self._ctx_len :]
        delta = body[self._emitted :]
        if delta:
            self._pieces.append(delta)
        return delta

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if self._joined_count != len(self._pieces):
            self._joined = "".join(self._pieces)
            self._joined_count = len(self._pieces)
        return self._joined

    def _move_window(self, boundary: int) -> None:
        # The old read offset becomes the new start: its tokens are the context that keeps
        # leading-space rules right for the tokens after it.
        shift = self._read
        if shift:
            del self._ids[:shift]
        self._read = boundary - shift
        ctx = self._decode(self._ids[: self._read]) if self._read else ""
        self._ctx_len = len(ctx) - _trailing_replacements(ctx)
        self._scanned = self._read

    def _reanchor_on_earlier_boundary(self) -> None:
        # Each boundary is tried once (``_scanned``), newest first, so the scanning work is
        # amortised over the pushes that created those boundaries.
        end = len(self._ids)
        for j in range(end - 1, max(self._scanned, self._read), -1):
            prefix = self._decode(self._ids[:j])
            if not prefix.endswith(_REPLACEMENT):
                self._move_window(j)
                body = self._decode(self._ids)[self._ctx_len :]
                # Everything before the trailing U+FFFD run was emitted already (same global
                # position as in the old window).
                self._emitted = len(body) - _trailing_replacements(body)
                return
        self._scanned = end


class TextTokenizer:
    """A loaded ``tokenizers.Tokenizer`` plus the EOS/BOS ids of its checkpoint."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        # tokenizer.json files from the Hub often carry truncation/padding settings meant for
        # training; applied here they would silently cut or pad prompts.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tok = tokenizer
        self._max_token_chars: int | None = None
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.bos_token_id: int | None = bos_token_id
        self.chat_template = chat_template
        # The token closing an assistant turn (ChatML's <|im_end|>): chat generation stops there.
        self.end_of_turn_id: int | None = None
        if chat_template is not None and chat_template.end_of_turn is not None:
            self.end_of_turn_id = tokenizer.token_to_id(chat_template.end_of_turn)

    @classmethod
    def from_dir(cls, path: str | Path) -> TextTokenizer:
        """Load ``tokenizer.json`` from a model directory; EOS ids are the union (in this order) of
        ``config.json`` and ``generation_config.json`` ``eos_token_id`` (int or list) and
        ``tokenizer_config.json`` ``eos_token``; BOS is the first found in that same order.
        A ``tokenizer_config.json`` token string that is not in the vocabulary is ignored."""
        root = Path(path)
        tj = root / "tokenizer.json"
        if not tj.is_file():
            raise ValueError(f"{tj}: tokenizer.json not found in model directory {root}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as exc:  # tokenizers raises plain Exception subclasses from Rust
            raise ValueError(f"{tj}: cannot read tokenizer.json: {exc}") from exc

        eos: list[int] = []
        bos: int | None = None
        for name in ("config.json", "generation_config.json"):
            cfg = _read_json(root / name)
            if cfg is None:
                continue
            eos.extend(_token_ids(cfg.get("eos_token_id"), root / name, "eos_token_id"))
            if bos is None:
                found = _token_ids(cfg.get("bos_token_id"), root / name, "bos_token_id")
                bos = found[0] if found else None
        tcfg = _read_json(root / "tokenizer_config.json")
        template = None
        if tcfg is not None:
            eos_id = _token_string_id(tok, tcfg.get("eos_token"))
            if eos_id is not None:
                eos.append(eos_id)
            if bos is None:
                bos = _token_string_id(tok, tcfg.get("bos_token"))
            template = _chat_template(tcfg, root / "tokenizer_config.json")
        jinja = root / "chat_template.jinja"  # where transformers >= 4.43 saves it
        if template is None and jinja.is_file():
            template = _chat_template({**(tcfg or {}), "chat_template": jinja.read_text(encoding="utf-8")}, jinja)
        return cls(tok, eos_token_ids=eos, bos_token_id=bos, chat_template=template)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], tools: list[dict] | None = None) -> list[int]:
        """The prompt ids of a conversation, ready for the assistant's reply: the template's text,
        encoded without the post-processor (the template writes any BOS it wants). ChatError when the
        model has no chat template or the template rejects the messages. ``tools``: for a template
        that renders them (``ChatTemplate.renders_tools``)."""
        if self.chat_template is None:
            raise ChatError("this model has no chat template")
        text = self.chat_template.render(messages, add_generation_prompt=True, tools=tools)
        return self._encode(text, add_special_tokens=False)

    @property
    def tokenizer(self) -> tokenizers.Tokenizer:
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # The batch call without offsets releases the GIL while it works; `Tokenizer.encode` holds
        # it throughout (seconds for a long prompt), which would stall every thread, the event
        # loop's included, even when it runs on a worker thread.
        (encoding,) = self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (log-probability listings)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    @property
    def max_token_chars(self) -> int:
        """At least the most characters of text one token can stand for: its longest piece's length
        (a byte-level piece has one character per byte of text, and a character is at least one
        byte; other pieces spell their text), so a text of more than n × this characters cannot
        encode to n tokens."""
        if self._max_token_chars is None:
            pieces = self._tok.get_vocab(with_added_tokens=True)
            self._max_token_chars = max((len(p) for p in pieces), default=1)
        return self._max_token_chars

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes: part of a UTF-8 character where the token holds one (which
        `token_text` shows as U+FFFD). Byte-level BPE pieces map back through GPT-2's byte
        alphabet, SentencePiece byte pieces (`<0x0A>`) are their byte; other tokens are their text."""
        piece = self._tok.id_to_token(token_id)
        if piece is not None and isinstance(self._tok.decoder, decoders.ByteLevel):
            if all(ch in _BYTE_OF_CHAR for ch in piece):
                return bytes(_BYTE_OF_CHAR[ch] for ch in piece)
        elif piece is not None and (byte := _SENTENCEPIECE_BYTE.fullmatch(piece)):
            return bytes([int(byte.group(1), 16)])
        return self.token_text(token_id).encode("utf-8")

    def space_free_ids(self) -> list[int]:
        """Per token id, the id of the same piece without its leading space where the vocabulary
        has one (byte-level BPE's ``Ġword`` -> ``word``, SentencePiece's ``▁word`` -> ``word``), else
        the id itself: a word inside a sentence and the same word after a quote are one word."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        ids = list(range(self.vocab_size))
        for piece, token_id in vocab.items():
            if piece[:1] in ("Ġ", "▁") and (bare := vocab.get(piece[1:])) is not None and token_id < len(ids):
                ids[token_id] = bare
        return ids

    def detokenizer(self, prompt_ids: Sequence[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.decode, prompt_ids)


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, inverted: char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _gpt2_byte_alphabet()
_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _read_json(file: Path) -> dict[str, Any] | None:
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _chat_template(config: dict[str, Any], file: Path) -> ChatTemplate | None:
    """``chat_template`` is a string, or a list of {name, template} where "default" is the chat one."""
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{file}: chat_template must be a string or a list of named templates")
    try:
        return ChatTemplate(value, bos_token=_token_string(config.get("bos_token")),
                            eos_token=_token_string(config.get("eos_token")))
    except ChatError as exc:
        raise ValueError(f"{file}: {exc}") from exc


def _token_string(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _token_ids(value: Any, file: Path, key: str) -> list[int]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    out: list[int] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ValueError(f"{file}: {key} must be a non-negative int or a list of them, got {value!r}")
        out.append(item)
    return out


def _token_string_id(tok: tokenizers.Tokenizer, value: Any) -> int | None:
    # Older tokenizer_config.json files serialise AddedToken as {"content": "</s>", ...}.
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str) or not value:
        return None
    return tok.token_to_id(value)


# A few KB of English prose and Python so that the default 320-token vocabulary gets real merges.
_BUILTIN_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. The dog did not seem to mind at all.",
    "Speculative decoding lets a small draft model propose several tokens that the large target "
    "model then verifies in a single forward pass, accepting the longest agreeing prefix.",
    "In the beginning there was a question, and the question was how to make the answer arrive "
    "sooner without changing what the answer would have been.",
    "It is a truth universally acknowledged, that a single server in possession of a good GPU "
    "must be in want of a larger batch.",
    "Once upon a time, in a land far away, there lived a king who loved to count the stars. "
    "Every night he would climb the tallest tower of his castle and count them one by one.",
    "The weather today is sunny with a chance of rain in the afternoon. Temperatures will rise "
    "to twenty degrees before falling again in the evening.",
    "She said that they would meet at the station at seven o'clock, but the train was late and "
    "nobody knew when it would arrive.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "class Request:\n    def __init__(self, prompt: str, max_tokens: int = 64) -> None:\n"
    "        self.prompt = prompt\n        self.max_tokens = max_tokens\n",
    "import os\nimport sys\n\ndef main() -> int:\n    path = os.path.join(sys.argv[1], 'data')\n"
    "    with open(path) as f:\n        return len(f.read())\n",
    "if __name__ == '__main__':\n    raise SystemExit(main())\n",
    "x = [a + b for a, b in zip(left, right) if a is not None]\n",
    "return {'status': 'ok', 'tokens': tokens, 'time': elapsed}\n",
    "The results were clear: the model answered every question correctly, and it did so in "
    "half the time that the previous system needed.",
)


def build_byte_level_tokenizer(
    corpus: Iterable[str] | None = None, vocab_size: int = 320
) -> tokenizers.Tokenizer:
    """Train a byte-level BPE tokenizer.

    Layout: ``<s>`` = 0 (BOS, prepended by the post-processor on every ``encode``), ``</s>`` = 1
    (EOS), then the 256 ByteLevel byte symbols (ids 2..257, in the sort order of their ByteLevel
    characters, not byte order), then merges. No ``<unk>``: every byte has a symbol. The vocabulary
    has at most ``vocab_size`` entries -- fewer when the corpus offers fewer merges, so callers must
    read ``get_vocab_size()`` rather than assume. Deterministic for a given corpus.
    """
    if vocab_size < 258:
        raise ValueError(f"vocab_size must be >= 258 (2 special tokens + 256 bytes), got {vocab_size}")
    tok = tokenizers.Tokenizer(models.BPE())
    # No prefix space: encode/decode must round-trip the exact text, including its first char.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = list(_BUILTIN_CORPUS if corpus is None else corpus)
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def save_tokenizer_files(tok: tokenizers.Tokenizer, path: Path, *, bos: str, eos: str) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (bos_token, eos_token) into ``path``
    (created if missing). ``bos``/``eos`` must be tokens of ``tok``."""
    for name, value in (("bos", bos), ("eos", eos)):
        if tok.token_to_id(value) is None:
            raise ValueError(f"{name}={value!r} is not a token of the tokenizer")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        # transformers would otherwise rewrite " ." etc. on decode and disagree with us.
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
