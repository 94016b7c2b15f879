"""The output layer as an input to the output ops: either logits, or hidden states and the head.

A model's forward can stop at its final (normed) hidden states; ``Hidden(states, head)`` then
stands for the logits ``head.logits(states)`` without computing them. The Triton ops read either
form through ``_score_tile``: with hidden states they compute each [rows, vocab-tile] block of
logits from the head's GEMM as they go (the fused LM head, as Liger's fused linear cross-entropy
and FlashSampling do), so [rows, vocab] logits are never written; with logits they load the tile.
The torch references always build the logits (``scores_reference``).

``_lm_head_kernel`` writes the tiles out: it exists to test ``_score_tile`` against the torch
head; no op calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.linear import linear
from kernels.triton_shim import tl, triton

# Hidden units per step of the fused head's GEMM. A step's tiles go through shared memory (the
# head's [BLOCK_H, 512] converted to float32, pipelined 3 deep on CUDA): 64 needed 264-288 KiB, more
# than an H100 has (227 KiB: OutOfResources at the first launch), 32 needs 132-144 KiB (more than an
# L4's or A10's 99 KiB), 16 needs 66-72 KiB, which every GPU since Volta has
# (tools/kernel_resources.py compiles the kernels for sm_90 without a GPU and checks it).
BLOCK_H = 16


@dataclass(frozen=True)
class OutputHead:
    """logits = hidden @ weight.T (+ bias); column c scores token ``output_ids[c]`` (a draft over a
    vocabulary subset) or token c (``output_ids`` None)."""

    weight: torch.Tensor  # [V, H] (or a 4-bit Q4Weight or 8-bit Q8Weight, which only the torch path computes)
    bias: torch.Tensor | None = None  # [V]
    output_ids: torch.Tensor | None = None  # [V] token id of each column
    # The inputs rounded per block of 32 first (``linear``): a 4-bit weight's to 8 or 16 bits, an 8-bit one's to 16.
    bits: int = 0

    @property
    def fusable(self) -> bool:
        """A dense weight the Triton GEMM can read (a 4-bit head computes its logits in torch)."""
        return isinstance(self.weight, torch.Tensor)

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] float32, rounded as the model's dtype rounds them."""
        return linear(hidden, self.weight, self.bias, self.bits).float()


@dataclass(frozen=True)
class Hidden:
    """Final hidden states [N, H] waiting for the output layer."""

    states: torch.Tensor  # [N, H]
    head: OutputHead

    def logits(self) -> torch.Tensor:
        return self.head.logits(self.states)  # [N, V]


Scores = torch.Tensor | Hidden  # what every output op reads: logits [N, V], or hidden states + head


def scores_reference(scores: Scores) -> torch.Tensor:
    """The logits [N, V] float32 either form stands for."""
    return scores.logits() if isinstance(scores, Hidden) else scores.float()


def rows_and_vocab(scores: Scores) -> tuple[int, int]:
    if isinstance(scores, Hidden):
        return scores.states.shape[0], scores.head.vocab
    return scores.shape[0], scores.shape[1]


def kernel_args(scores: Scores) -> dict:
    """The pointer, stride and flag arguments ``_score_tile`` takes, for a launch."""
    if isinstance(scores, Hidden) and not scores.head.fusable:
        scores = scores.logits()  # a 4-bit head: the logits are built in torch
    if isinstance(scores, Hidden):
        states, head = scores.states.contiguous(), scores.head
        weight = head.weight.contiguous()
        return dict(logits=states, logits_stride=0, hidden=states, hidden_stride=states.stride(0),
                    weight=weight, weight_stride=weight.stride(0),
                    bias=head.bias if head.bias is not None else weight, H=states.shape[1],
                    FROM_HIDDEN=True, HAS_BIAS=head.bias is not None,
                    ROUND=_ROUNDING.get(weight.dtype, 0), BLOCK_H=BLOCK_H)
    logits = scores if scores.stride(-1) == 1 else scores.contiguous()
    return dict(logits=logits, logits_stride=logits.stride(0), hidden=logits, hidden_stride=0,
                weight=logits, weight_stride=0, bias=logits, H=0,
                FROM_HIDDEN=False, HAS_BIAS=False, ROUND=0, BLOCK_H=BLOCK_H)


def scores_at(scores: Scores, ids: torch.Tensor) -> torch.Tensor:
    """Raw scores [N, K] at ids [N, K]: gathered from logits, or dot products with the head's rows
    (float32, + bias, rounded once to the head's dtype, as the fused head computes them)."""
    if not isinstance(scores, Hidden):
        return scores.float().gather(1, ids)
    head = scores.head
    if not head.fusable:
        return scores.logits().gather(1, ids)
    out = torch.einsum("rh,rkh->rk", scores.states.float(), head.weight[ids].float())  # [N, K]
    if head.bias is not None:
        out = out + head.bias[ids].float()
    return out.to(head.weight.dtype).float()


# The torch head returns logits in the model's dtype before `.float()`; the fused head rounds its
# float32 sums the same way, so both paths score with numbers of the same precision.
_ROUNDING = {torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _score_tile(logits, logits_stride, hidden, hidden_stride, weight, weight_stride, bias, H,
                rows, row_ok, cols, col_ok,
                FROM_HIDDEN: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    """[BLOCK_R, BLOCK_V] float32 scores of `rows` x `cols` (int64 offsets); -inf outside the masks."""
    ok = row_ok[:, None] & col_ok[None, :]
    if FROM_HIDDEN:
        acc = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            h_ok = hs < H
            x = tl.load(hidden + rows[:, None] * hidden_stride + hs[None, :],
                        mask=row_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)  # [R, BH]
            w = tl.load(weight + cols[None, :] * weight_stride + hs[:, None],
                        mask=col_ok[None, :] & h_ok[:, None], other=0.0).to(tl.float32)  # [BH, V]
            acc += tl.dot(x, w, input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if ROUND == 1:  # one rounding of (x @ W.T + b), as torch's linear in the head's dtype
            acc = acc.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:
            acc = acc.to(tl.float16).to(tl.float32)
    else:
        acc = tl.load(logits + rows[:, None] * logits_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    return tl.where(ok, acc, float("-inf"))


@triton.jit
def _lm_head_kernel(out, out_stride, N, V, logits, logits_stride, hidden, hidden_stride, weight, weight_stride,
                    bias, H, FROM_HIDDEN: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    tile = _score_tile(logits, logits_stride, hidden, hidden_stride, weight, weight_stride, bias, H,
                       rows, rows < N, cols, cols < V, FROM_HIDDEN, HAS_BIAS, ROUND, BLOCK_R, BLOCK_V, BLOCK_H)
    tl.store(out + rows[:, None] * out_stride + cols[None, :], tile, mask=(rows < N)[:, None] & (cols < V)[None, :])


def lm_head(scores: Scores, block_v: int = 128) -> torch.Tensor:
    """The logits [N, V] float32 of ``scores``, tile by tile through ``_score_tile`` (tests only)."""
    n, vocab = rows_and_vocab(scores)
    args = kernel_args(scores)
    out = torch.empty(n, vocab, dtype=torch.float32, device=args["logits"].device)
    grid = (triton.cdiv(n, 16), triton.cdiv(vocab, block_v))
    _lm_head_kernel[grid](out, out.stride(0), n, vocab, **args, BLOCK_R=16, BLOCK_V=block_v)
    return out
