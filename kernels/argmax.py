"""Output layer: 1-best token from logits.

Argmax needs no softmax (Marian, "Faster NMT": the 1-best is the max logit), so none is computed.
Ties break toward the lowest id, as `torch.argmax` and Hugging Face greedy decoding do.
"""

from __future__ import annotations

import torch


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., vocab] -> token ids [...] (int64)."""
    return argmax_reference(logits)


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)
