"""Greedy verification of draft proposals against one target forward pass (design §5).

Row b proposed `num_draft[b]` tokens (padded to G with any id). The target scored γ+1 positions:
position j predicts the token after draft token j (position 0 follows the row's last committed
token). A proposal is accepted while it equals the target's argmax; the token emitted after the
accepted run is the target's own argmax there (the correction, or the bonus token when every
proposal was accepted). Since accepted proposals equal the target's argmax, a row emits exactly
`target_tokens[b, : num_accepted[b] + 1]`.
"""

from __future__ import annotations

import torch

from kernels.output import argmax


def greedy_verify(
    draft_tokens: torch.Tensor, num_draft: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [B, G], num_draft [B], target_logits [B, G+1, V] ->
    (num_accepted [B], target_tokens [B, G+1]), both int64 and on the logits' device."""
    return greedy_verify_reference(draft_tokens, num_draft, target_logits)


def greedy_verify_reference(
    draft_tokens: torch.Tensor, num_draft: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, gamma = draft_tokens.shape
    assert target_logits.shape[:2] == (batch, gamma + 1), (draft_tokens.shape, target_logits.shape)
    target_tokens = argmax(target_logits)  # [B, G+1]
    in_range = torch.arange(gamma, device=draft_tokens.device) < num_draft[:, None]  # [B, G]
    match = (draft_tokens == target_tokens[:, :gamma]) & in_range  # [B, G]
    # Leviathan §2.3 (greedy case): the accepted run is the longest all-match prefix.
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    return num_accepted, target_tokens
