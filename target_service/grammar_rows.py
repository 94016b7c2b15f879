"""Constrained rows of a verify pass: their proposals cut where the grammar refuses them, and the
masks of every position they verify, filled while the target's forward runs (docs/architecture.md §7).

A constrained sequence holds one ``Matcher`` (specstream/text/grammar.py) at its committed tokens.
Before the forward, ``cut`` keeps each row's proposals up to the first one its grammar refuses:

- a greedy row, or a row whose proposals came without q (point masses), drops the refused token
  and all after it: greedy output is the argmax of the masked logits whatever was proposed, and a
  point mass on a token the masked p gives 0 is rejected with certainty and leaves p as its
  residual, so the sample is p's either way;
- a sampled row with the draft's q keeps the refused token as its last proposal: Leviathan's rule
  rejects it with certainty (p is 0 there) and samples from norm(max(0, p − q)), which is what
  makes the emitted token's distribution p. Dropping it would sample from p after a draw of q
  that was conditioned away, and bias the output.

Constrained rows verify chains (the masks follow one path): the drafting asks them for no
branches, and a reply with a tree nobody asked for is refused as malformed. ``GrammarMasks.start``
fills, for the whole batch, the packed mask of each row's position after its last committed token
and after each valid proposal (the node after a kept refused token allows everything: it is never
reached), beside the forward where a core is free for it, else before it. ``settle`` puts the
target's logits at −inf where a mask refuses (target_service/settle.py), greedy and sampled alike,
and does not run the output layer where a mask allows one token only.
After the verdict, ``Sequence.append`` commits the tokens to the matcher.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from specstream.text.grammar import fill_masks, mask_words
from target_service.sequence import Sequence
from target_service.settle import VerifyRow

__all__ = ["GrammarMasks", "cut"]


def cut(seq: Sequence, row: VerifyRow) -> int:
    """Cuts ``row``'s proposals to what ``seq``'s grammar allows (module docstring), in place; how
    many of those left the grammar accepts (all, or all but a kept refused last one)."""
    assert seq.matcher is not None and not row.parents, "constrained rows verify chains"
    valid = seq.matcher.valid_prefix(row.proposals)
    keep = valid + 1 if valid < len(row.proposals) and row.q_width and not row.params.greedy else valid
    _truncate(row, keep)
    return valid


def _truncate(row: VerifyRow, n: int) -> None:
    if n < len(row.proposals):
        row.proposals = row.proposals[:n]
        if row.q_width:
            row.q_ids, row.q_probs = row.q_ids[: n * row.q_width], row.q_probs[: n * row.q_width]
            if not n:
                row.q_width = 0


class GrammarMasks:
    """Fills constrained rows' masks. ``beside``: on a thread of its own, beside the forward on the
    compute thread (llguidance's work runs without the GIL), where a core is free for it: the model
    on an accelerator, or fewer model threads than the process's cores. Else before the forward, on
    the calling thread, where a forced position costs no mask computation (``fill_masks``): on a
    CPU whose every core runs the forward, a fill beside it competed with the forward's threads and
    waited for the GIL (docs/benchmarks.md, structured outputs). ``seconds``: the last fill's time;
    ``dropped``: proposals cut by the grammar in the last ``start`` (the metrics')."""

    def __init__(self, beside: bool = False) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks") if beside else None
        self.seconds = 0.0
        self.dropped = 0

    def start(self, rows: list[Sequence], checks: list[VerifyRow]) -> Future | None:
        """Cuts every constrained row's proposals (``cut``) and starts filling their masks: a
        future of ``{row index: int32 [len(proposals) + 1, W]}``, None when no row is constrained."""
        chosen = [i for i, seq in enumerate(rows) if seq.matcher is not None]
        if not chosen:
            return None
        jobs, self.dropped = [], 0
        for i in chosen:
            before = len(checks[i].proposals)
            valid = cut(rows[i], checks[i])
            self.dropped += before - len(checks[i].proposals)
            rows[i].draft_tokens -= before - len(checks[i].proposals)  # counted as the draft answered
            jobs.append((rows[i].matcher, checks[i].proposals[:valid]))
        lengths = [len(checks[i].proposals) for i in chosen]
        if self._pool is not None:
            return self._pool.submit(self._fill, chosen, jobs, lengths)
        done: Future = Future()
        done.set_result(self._fill(chosen, jobs, lengths))
        return done

    def _fill(self, chosen: list[int], jobs: list, lengths: list[int]) -> dict[int, np.ndarray]:
        began = time.perf_counter()
        masks = fill_masks(jobs, threads=self._pool is not None)
        out = {}
        for i, (matcher, valid), mask, n in zip(chosen, jobs, masks, lengths):
            if n > len(valid):  # a kept refused token: the node after it is never reached
                mask = np.concatenate([mask, np.full((1, mask_words(matcher.vocab_size)), -1, dtype=np.int32)])
            out[i] = mask
        self.seconds = time.perf_counter() - began
        return out

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
