"""Where converted models and training work files live: ``models_home()``, and the converted copy
of a GGUF file keyed by its content hash. Shared by the registry (resolving a reference), the GGUF
converter (writing the copy) and the default models (building a random pair). No torch.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["GGUF_CONVERTER_VERSION", "file_sha256", "gguf_cache_dir", "models_home"]

# Bump when the converted layout changes: old cache entries are then ignored, not misread.
GGUF_CONVERTER_VERSION = 2


def models_home() -> Path:
    """The model cache (converted GGUF files, training work files): $SPECSTREAM_HOME or ~/.cache/specstream."""
    return Path(os.environ.get("SPECSTREAM_HOME", Path.home() / ".cache" / "specstream"))


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def gguf_cache_dir(sha256: str, cache_root: Path) -> Path:
    """Where the converted copy of the GGUF file with this content hash lives."""
    return cache_root / "gguf" / f"{sha256[:16]}-v{GGUF_CONVERTER_VERSION}"
