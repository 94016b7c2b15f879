"""Greedy verification of draft proposals against one target forward pass (design §5).

Row b proposed `num_draft[b]` tokens (padded to G with any id). The target scored γ+1 positions:
position j predicts the token after draft token j (position 0 follows the row's last committed
token). A proposal is accepted while it equals the target's argmax; the token emitted after the
accepted run is the target's own argmax there (the correction, or the bonus token when every
proposal was accepted). Since accepted proposals equal the target's argmax, a row emits exactly
`target_tokens[b, : num_accepted[b] + 1]`.

On CPU float32 logits the native library does it in one call (kernels/csrc/cpu_ops.cpp,
``greedy_verify``: the argmax by torch.argmax's rule, first largest, NaN above all), not the five
torch ops of the reference. The Triton kernel takes one sequence's γ+1 rows per program: the fused 1-best of each row
(kernels/argmax.py's pass) and the prefix match, in one launch; the scores are logits or the
hidden states with the LM head (kernels/lm_head.py).
"""

from __future__ import annotations

import torch

from kernels import native
from kernels.argmax import argmax
from kernels.dispatch import backend
from kernels.lm_head import Hidden, Scores, kernel_args, rows_and_vocab, scores_reference
from kernels.row_pass import _row_pass, launch_rows, tile
from kernels.triton_shim import tl, triton


@triton.jit
def _greedy_verify_kernel(accepted_out, tokens_out, draft, num_draft, G, V, logits, logits_stride, hidden,
                          hidden_stride, weight, weight_stride, bias, H, FROM_HIDDEN: tl.constexpr,
                          HAS_BIAS: tl.constexpr, ROUND: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_R)
    ok = j < G + 1
    rows = b * (G + 1) + j
    ones = tl.full([BLOCK_R], 1.0, dtype=tl.float32)
    none = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    keys = tl.zeros([BLOCK_R], dtype=tl.int64)
    best, _, _, _, _ = _row_pass(logits, logits_stride, hidden, hidden_stride, weight, weight_stride, bias,
                                 H, V, rows, ok, ones, none, keys, draft, 0,
                                 False, False, 0, FROM_HIDDEN, HAS_BIAS, ROUND, BLOCK_R, BLOCK_V, BLOCK_H)
    tl.store(tokens_out + rows, best, mask=ok)
    n = tl.load(num_draft + b)
    guess = tl.load(draft + b * G + j, mask=j < G, other=-1)
    match = (guess == best) & (j < n)
    tl.store(accepted_out + b, tl.min(tl.where(match, BLOCK_R, j), axis=0).to(tl.int64))  # first miss


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
    rows, vocab = rows_and_vocab(scores)
    assert rows == batch * (gamma + 1), (rows, draft_tokens.shape)
    device = states.device
    accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    tokens = torch.zeros(batch, gamma + 1, dtype=torch.int64, device=device)
    if batch:
        _greedy_verify_kernel[(batch,)](accepted, tokens, draft_tokens.to(device).contiguous(),
                                        num_draft.to(device).contiguous(), gamma, vocab, **kernel_args(scores),
                                        BLOCK_R=launch_rows(gamma + 1), BLOCK_V=tile(vocab))
    return accepted, tokens


def greedy_verify_reference(draft_tokens: torch.Tensor, num_draft: torch.Tensor, target: Scores
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    batch, gamma = draft_tokens.shape
    logits = scores_reference(target).view(batch, gamma + 1, -1) if isinstance(target, Hidden) else target
    assert logits.shape[:2] == (batch, gamma + 1), (draft_tokens.shape, logits.shape)
    target_tokens = argmax(logits)  # [B, G+1]
    in_range = torch.arange(gamma, device=draft_tokens.device) < num_draft[:, None]  # [B, G]
    match = (draft_tokens == target_tokens[:, :gamma]) & in_range  # [B, G]
    # Leviathan §2.3 (greedy case): the accepted run is the longest all-match prefix.
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    return num_accepted, target_tokens
