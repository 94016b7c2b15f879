"""Greedy verification of draft proposals against one target forward pass (docs/architecture.md §7).

Row b proposed `num_draft[b]` tokens (padded to G with any id). The target scored γ+1 positions:
position j predicts the token after draft token j (position 0 follows the row's last committed
token). A proposal is accepted while it equals the target's argmax; the token emitted after the
accepted run is the target's own argmax there (the correction, or the bonus token when every
proposal was accepted). Since accepted proposals equal the target's argmax, a row emits exactly
`target_tokens[b, : num_accepted[b] + 1]`.

On CPU float32 logits the native library does it in one call (kernels/csrc/greedy_verify.cpp,
``greedy_verify``: the argmax by torch.argmax's rule, first largest, NaN above all), not the five
torch ops of the reference. On the Triton backend each row's 1-best comes from the fused row pass
(kernels/row_pass.py: the vocabulary split across programs), reading logits or the hidden states
with the LM head (kernels/lm_head.py), and the prefix match is the reference's, in torch.
"""

from __future__ import annotations

import torch

from kernels import native
from kernels.argmax import argmax
from kernels.dispatch import backend
from kernels.lm_head import Hidden, Scores, rows_and_vocab, scores_reference
from kernels.row_pass import row_partials


def greedy_verify(draft_tokens: torch.Tensor, num_draft: torch.Tensor, target: Scores
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [B, G], num_draft [B], target logits [B, G+1, V] (or Hidden over the B*(G+1)
    rows, sequence-major) -> (num_accepted [B], target_tokens [B, G+1]), int64 on the target's device."""
    states = target.states if isinstance(target, Hidden) else target
    if backend(states) == "torch":
        library = native.library()
        if (library is not None and not isinstance(target, Hidden) and target.dtype == torch.float32
                and target.device.type == "cpu"):  # a CPU op: on a CUDA tensor it would read device memory as host
            accepted, tokens = library.greedy_verify(target, draft_tokens, num_draft)  # one call, the same answer
            return accepted, tokens
        return greedy_verify_reference(draft_tokens, num_draft, target)
    batch, gamma = draft_tokens.shape
    scores = target if isinstance(target, Hidden) else target.reshape(batch * (gamma + 1), -1)
    assert rows_and_vocab(scores)[0] == batch * (gamma + 1), (draft_tokens.shape, rows_and_vocab(scores))
    tokens = row_partials(scores)[0].view(batch, gamma + 1)  # [B, G+1]: each position's 1-best
    return _accepted(draft_tokens.to(tokens.device), num_draft.to(tokens.device), tokens), tokens


def _accepted(draft_tokens: torch.Tensor, num_draft: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """[B]: the length of each row's run of proposals equal to the target's 1-best (Leviathan §2.3,
    the greedy case: the longest all-match prefix)."""
    gamma = draft_tokens.shape[1]
    in_range = torch.arange(gamma, device=draft_tokens.device) < num_draft[:, None]  # [B, G]
    match = (draft_tokens == target_tokens[:, :gamma]) & in_range  # [B, G]
    return match.to(torch.int64).cumprod(dim=1).sum(dim=1)


def greedy_verify_reference(draft_tokens: torch.Tensor, num_draft: torch.Tensor, target: Scores
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    batch, gamma = draft_tokens.shape
    logits = scores_reference(target).view(batch, gamma + 1, -1) if isinstance(target, Hidden) else target
    assert logits.shape[:2] == (batch, gamma + 1), (draft_tokens.shape, logits.shape)
    target_tokens = argmax(logits)  # [B, G+1]
    return _accepted(draft_tokens, num_draft, target_tokens), target_tokens
