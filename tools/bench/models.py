"""What a benchmark serves: the target and draft, their serving dtype, and the prompts to send.

``BenchModels.from_refs(target, draft, dtype, label)`` resolves model references (names, GGUF
files, directories: ``specstream.models.registry``) once. ``prompts(n)`` gives chat prompts for a
model with a chat template (the held-out split of a shipped draft's prompt set, rendered with the
model's template: subjects the drafts never saw; ``prompt_set`` "draft": the token draft's
questions about documentation, "everyday": the feature draft's everyday chat, one domain after
another) and the openings of held-out standard-library files otherwise; ``prompt_set``
"nonsense" gives made-up words to any model. ``hf_draft()`` is a copy of the draft that transformers can load
as an assistant model (a draft that shares the target's embedding and predicts over a vocabulary
subset gets the embedding written in and a full-vocabulary tied head), so Hugging Face assisted
generation runs with the same draft layers as ours; transformers cannot run a feature draft (it
reads the target's hidden states), so for one it is the pair's token draft (``token_draft``), or none.

What it does not know: how the benchmarks measure.
"""

from __future__ import annotations

import atexit
import gzip
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from specstream.data.config import DraftConfig
from specstream.models.feature_draft import is_feature_draft
from specstream.models.registry import DRAFTS, MODELS, resolve_dtype, resolve_model
from specstream.serving.compute import on_torch_thread
from specstream.text.tokenizer import TextTokenizer

__all__ = ["BenchModels", "chat_prompts"]

CHAT_PROMPTS = DRAFTS / "smollm2-135m-draft" / "prompts.jsonl.gz"
PROMPT_SETS = {"draft": CHAT_PROMPTS, "everyday": DRAFTS / "smollm2-135m-feature" / "prompts.jsonl.gz"}


def chat_prompts(tok: TextTokenizer, n: int, prompt_set: str = "draft") -> list[list[int]]:
    """The first ``n`` held-out prompts of a prompt set (PROMPT_SETS), as chat prompt ids; a set
    whose prompts name their domain gives them one domain after another (the first of each, then
    the second of each, ...)."""
    path = PROMPT_SETS[prompt_set]
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        held = [p for p in map(json.loads, fh) if p["split"] == "held_out"]
    if len(held) < n:
        raise ValueError(f"only {len(held)} held-out chat prompts in {path}, asked for {n}")
    if all("domain" in p for p in held):
        by_domain: dict[str, list[dict]] = {}
        for p in held:
            by_domain.setdefault(p["domain"], []).append(p)
        held = [p for rank in zip(*by_domain.values()) for p in rank]
    return [tok.encode_chat(p["messages"]) for p in held[:n]]


@dataclass
class BenchModels:
    label: str  # how tables name the pair ("smollm2", "demo-small", or the target's name)
    target: Path  # checkpoint directory
    draft: Path | None
    dtype: str  # resolved: "bfloat16" or "float32"
    gguf: Path | None = None  # the target's original GGUF file, when it came as one (llama.cpp runs it)
    weights: str = "auto"  # our weight format (specstream/data/config.py WEIGHT_FORMATS); peers always run dense
    # What our speculative runs propose with (DraftConfig.PROPOSERS), as the pair serves it.
    proposer: str = DraftConfig.proposer
    ngram_max: int = DraftConfig.ngram_max
    ngram_min: int = DraftConfig.ngram_min
    suffix_capacity: int = DraftConfig.suffix_capacity
    device: str = "cpu"  # where the target (and a draft model) run: "cpu", "cuda", ...
    # Benchmarks of system overhead: (oracle file, alpha) of the synthetic proposer, in place of a draft.
    synthetic: tuple[str, float] | None = None
    prompt_set: str = "draft"  # which held-out chat prompts (PROMPT_SETS), or "nonsense" (made-up words)
    token_draft: Path | None = None  # the pair's token draft, where ``draft`` is a feature draft (ModelPair)
    _hf_draft: Path | None = field(default=None, repr=False)

    @classmethod
    def from_refs(cls, target: str, draft: str | None, dtype: str, label: str, weights: str = "auto",
                  proposer: str = DraftConfig.proposer, ngram_max: int = DraftConfig.ngram_max,
                  ngram_min: int = DraftConfig.ngram_min, prompt_set: str = "draft",
                  token_draft: str | None = None, suffix_capacity: int = DraftConfig.suffix_capacity) -> BenchModels:
        gguf = MODELS[target].path() if target in MODELS else Path(target) if target.endswith(".gguf") else None
        return cls(label, resolve_model(target), resolve_model(draft) if draft else None, resolve_dtype(dtype), gguf,
                   weights, proposer, ngram_max, ngram_min, suffix_capacity, prompt_set=prompt_set,
                   token_draft=resolve_model(token_draft) if token_draft else None)

    @property
    def proposing(self) -> dict:
        """StackSpec's proposer fields for our speculative runs."""
        return {"proposer": self.proposer, "ngram_max": self.ngram_max, "ngram_min": self.ngram_min,
                "suffix_capacity": self.suffix_capacity}

    def stack_fields(self, speculative: bool = True) -> dict:
        """StackSpec's fields for a stack serving these models: plain decoding, or with
        `speculative` what proposes (the synthetic oracle, or the draft as the pair serves it)."""
        fields = {"target_model": str(self.target), "draft_model": None, "dtype": self.dtype, "weights": self.weights,
                  "device": self.device}
        if speculative and self.synthetic:
            return fields | {"synthetic": self.synthetic}
        if speculative:
            draft = None if self.proposer in DraftConfig.MODEL_FREE else str(self.require_draft())
            return fields | {"draft_model": draft, **self.proposing}
        return fields

    @property
    def proposer_label(self) -> str:
        """How tables name what proposes: "our draft", or with the n-gram range it tries first."""
        if self.proposer == "model":
            return "our draft"
        kind = "prompt lookup" if self.proposer.startswith("ngram") else "suffix drafting"
        lookup = f"{kind} (n={self.ngram_max}..{self.ngram_min})"
        return lookup if self.proposer in DraftConfig.MODEL_FREE else f"{lookup}, else our draft"

    def require_draft(self) -> Path:
        """The draft directory; a benchmark of speculation without one is a usage error."""
        if self.draft is None:
            raise ValueError(f"{self.label}: this benchmark needs a draft model (--draft DIR, or a --models pair)")
        return self.draft

    def tokenizer(self) -> TextTokenizer:
        return TextTokenizer.from_dir(self.target)

    @property
    def chat(self) -> bool:
        return self.tokenizer().chat_template is not None

    def prompts(self, n: int, length: int = 48) -> list[list[int]]:
        """``n`` prompts as token ids: the prompt set's (``prompt_set`` "nonsense": made-up words,
        as a chat message for a chat model and as plain text otherwise), or for a model without a
        chat template the openings of held-out standard-library files (``length`` tokens)."""
        from tools.bench.prompts import held_out_prompts, nonsense_texts

        tok = self.tokenizer()
        if self.prompt_set == "nonsense":
            texts = nonsense_texts(n)
            if tok.chat_template is None:
                return [tok.encode(text) for text in texts]
            return [tok.encode_chat([{"role": "user", "content": text}]) for text in texts]
        if tok.chat_template is not None:
            return chat_prompts(tok, n, self.prompt_set)
        return held_out_prompts(tok, n, length)

    @property
    def feature_draft(self) -> bool:
        """Whether the draft is a feature draft (specstream/models/feature_draft.py)."""
        return self.draft is not None and is_feature_draft(self.draft)

    def load(self, which: str):
        """The target (a CausalLM) or the draft: a CausalLM, or a FeatureDraft for a feature draft."""
        from specstream.models.feature_draft import load_feature_draft
        from specstream.models.loader import load_model

        path = self.target if which == "target" else self.require_draft()
        # On the process's torch thread, where in-process engines run it (specstream.serving.compute).
        if which == "draft" and self.feature_draft:
            return on_torch_thread(load_feature_draft, path, resolve_model, self.dtype, self.weights)
        return on_torch_thread(load_model, path, dtype=self.dtype, resolve=resolve_model, weights=self.weights,
                               draft=which == "draft")

    @property
    def assistant(self) -> Path | None:
        """The draft transformers runs as the assistant model: ours, or for a feature draft the
        pair's token draft (None without one)."""
        return self.token_draft if self.feature_draft else self.draft

    def hf_draft(self) -> Path | None:
        """The assistant as a plain transformers checkpoint (see the module docstring); cached per run."""
        if self.assistant is None:
            return None
        config = json.loads((self.assistant / "config.json").read_text())
        if "specstream" not in config:
            return self.assistant
        if self._hf_draft is None:
            self._hf_draft = _export_for_transformers(self.assistant, config)
        return self._hf_draft


def _export_for_transformers(draft: Path, config: dict) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    ext = config.pop("specstream")
    weights = {k: v.float() for k, v in load_file(str(draft / "model.safetensors")).items()
               if not k.startswith("specstream.")}
    shared = ext.get("shared_embedding")
    if shared is not None:
        source = resolve_model(shared["model"])
        weights["model.embed_tokens.weight"] = load_file(str(source / "model.safetensors"))["model.embed_tokens.weight"]
    config["tie_word_embeddings"] = True  # a full-vocabulary head: transformers has no vocabulary subset
    config["torch_dtype"] = "float32"
    out = Path(tempfile.mkdtemp(prefix="hf-draft-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    save_file({k: v.to(torch.float32).contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
