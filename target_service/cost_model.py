"""What a decode step costs, in seconds, learnt from the engine's own measurements: the verify
forward as a function of the step's positions, the draft's call as a function of its depth and
proposals, and the rest of the step. The γ controller (target_service/gamma.py) prices its choices
with it; the engine feeds it (through the controller) what each step took.

Knows nothing about models, tokens or gRPC: step shapes in, seconds out.
"""

from __future__ import annotations

from target_service.linear_fit import LinearFit

__all__ = ["CostModel"]


class CostModel:
    """Seconds a decode step takes, learnt from the engine's own measurements.

    verify(positions, sampled_rows) = v0 + v1·positions + v2·sampled_rows + r[positions] (one target
    forward + verification); positions = rows × (depth + 1): the forward is one rectangle, so a row
    with fewer proposals than the deepest is padded and costs as much as if it had proposed;
    sampled_rows = the sampling rows that proposed, each of which settles by Leviathan's rule (its
    p at every position, its q's support, the residual) where a greedy row takes an argmax: on a
    small CPU as much as a couple more positions (docs/benchmarks.md, "Figures behind design
    choices"). r is a per-size correction (an EMA of what the line missed at that size, once
    measured): kernels work in blocks, so the true cost is a staircase — the CPU int4 kernel takes
    rows 4 at a time, so on SmolLM2 a verify over 5 positions costs much more than one over 4 (same
    section) — which a line alone smooths away, making the first position of a new block look cheap
    for ever. Sizes never measured get the line;
    draft(depth, proposals, fed, sampled) = d0 + d1·depth + d2·proposals + d3·fed + d4·sampled
    (depth = the largest γ: the draft's sequential forwards; proposals = Σγ; fed = the tokens the
    draft had to take in first; sampled = the proposals of sampling rows, each of which also builds
    and sends its q, so it costs more than a greedy guess), 0 when nothing is proposed;
    other = the rest of a step (an EMA). Slopes are clamped at 0 when predicting. The engine seeds
    the verify terms before its first request (target_service/calibration.py: one forward per step
    shape, and one sampling row's verification) and the draft terms once the draft is connected
    (``Drafting.time_draft``: a few propose calls for a throwaway sequence, through the same RPC or
    in-process call every step makes); until the draft has proposed, a draft forward
    is assumed to cost ``DRAFT_PRIOR`` of a one-position verify. ``ready`` is False
    until a verify has been measured (then the policy's answer is the configured γ).

    The fed term keeps catch-up out of the price of a guess: a row's first proposal feeds the draft
    its whole prompt, and a row that sat at γ = 0 feeds everything since. Without the term one such
    step (8 prompts of 150 tokens) read as a draft forward dearer than the target's whole step
    (docs/benchmarks.md, "Figures behind design choices"), γ = 0 then looked best for every row,
    and no later step corrected it. A choice is priced with one token fed per
    drafting row, what a row that drafts every step feeds."""

    # Prior variances over a noise of ~1 ms. Verify: the intercept takes the first sample whole and
    # the per-position slope starts at 0 (optimistic: more positions look cheap until steps of
    # different sizes show otherwise). The sampled rows' term starts at the engine's start-up
    # timing of a sampling row's verification (``seed_sampled``; else 0), worth one sample: its
    # prior is uncorrelated with the line's terms, so steps without such rows leave it alone.
    # Draft: its cost is split between depth and proposals from the first sample on (weighted by
    # their sizes, so at first a batch's proposals look dear):
    # rows with a poor α then draft less than the others, which is what separates the two terms.
    # A catch-up step is hundreds of tokens fed against a few proposals, so the fed term takes
    # nearly all of it. The sampled term is learnt slowly (a prior worth ~10 samples): a new
    # sampling row's first call also catches up, and a free term took that whole (tens of times
    # dearer per sampled guess than once learnt slowly: docs/benchmarks.md, "Figures behind design
    # choices").
    RESIDUAL_WEIGHT = 0.3  # of the newest sample in a size's correction
    # Per decode step a size goes unmeasured, its correction fades by this factor (~100 steps to
    # 1/e): one unlucky sample (a pause during the forward) must not rule a size out for good.
    RESIDUAL_FADE = 0.99
    OUTLIER = 1.25  # a verify sample at a measured size counts for at most this × its prediction
    # A draft forward's cost before the draft has proposed, as a share of a one-position verify:
    # Leviathan et al.'s c for a draft ~10× smaller than its target.
    DRAFT_PRIOR = 0.1

    def __init__(self) -> None:
        self.verify = LinearFit([0.0, 0.0, 0.0], [1e6, 1.0, 1.0])  # [v0, v1, v2]
        # positions -> (seconds the line misses there, self.verify.samples when last measured)
        self.residual: dict[int, tuple[float, int]] = {}
        self.draft = LinearFit([0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1e6, 1e6, 1e6, 0.1])  # [d0, d1, d2, d3, d4]
        self.other_s = 0.0
        self._steps = 0

    @property
    def ready(self) -> bool:
        return self.verify.samples > 0

    def observe(self, positions: int, depth: int, proposals: int, verify_s: float, draft_s: float,
                other_s: float, fed: int = 0, sampled: int = 0, sampled_rows: int = 0) -> None:
        self.observe_verify(positions, verify_s, sampled_rows)
        self.observe_draft(depth, proposals, fed, draft_s, sampled)
        self._steps += 1
        self.other_s = other_s if self._steps == 1 else 0.9 * self.other_s + 0.1 * other_s

    def observe_draft(self, depth: int, proposals: int, fed: int, draft_s: float, sampled: int = 0) -> None:
        """A propose call for `proposals` guesses (`sampled` of them for sampling rows), `depth` deep,
        after feeding `fed` tokens, took `draft_s` seconds (nothing is learnt from a call that
        guessed nothing)."""
        if depth > 0:
            self.draft.observe([1.0, depth, proposals, fed, sampled], draft_s)

    def observe_verify(self, positions: int, verify_s: float, sampled_rows: int = 0) -> None:
        """A verify forward over `positions`, `sampled_rows` of its rows sampling rows that proposed,
        took `verify_s` seconds. At a size measured before (without sampling rows that proposed:
        there the prediction is grounded), a sample counts as at most ``OUTLIER`` × its prediction:
        a pause (the scheduler, a collection) only ever makes a step slower, and one such sample
        at one position taught the plain step a cost of twice its own, which made every guess look
        cheap until the correction faded (~100 steps of drafting at α ≈ 0.2). A new size, whose
        prediction is the line's extrapolation, counts whole."""
        if positions in self.residual and not sampled_rows:
            verify_s = min(verify_s, self.OUTLIER * self.verify_s(positions))
        self.verify.observe([1.0, positions, sampled_rows], verify_s)
        missed = verify_s - self._line(positions, sampled_rows)
        old = self._residual(positions)
        w = self.RESIDUAL_WEIGHT
        self.residual[positions] = (missed if positions not in self.residual else (1.0 - w) * old + w * missed,
                                    self.verify.samples)

    def seed_sampled(self, seconds: float) -> None:
        """v2's prior: a sampling row's verification timed apart (the engine does at start-up)."""
        self.verify.seed(2, seconds)

    def _line(self, positions: int, sampled_rows: int = 0) -> float:
        v0, v1, v2 = self.verify.values
        return v0 + max(v1, 0.0) * positions + max(v2, 0.0) * sampled_rows

    def _residual(self, positions: int) -> float:
        missed, at = self.residual.get(positions, (0.0, 0))
        return missed * self.RESIDUAL_FADE ** (self.verify.samples - at)

    def verify_s(self, positions: int, sampled_rows: int = 0) -> float:
        return max(self._line(positions, sampled_rows) + self._residual(positions), 1e-6)

    def draft_s(self, depth: int, proposals: int, drafting: int = 1, sampled: int = 0) -> float:
        """A propose call's seconds; `drafting` rows ask, each feeding the draft one token; `sampled`
        of the proposals are sampling rows'."""
        if depth <= 0:
            return 0.0
        if not self.draft.samples:
            return self.DRAFT_PRIOR * self.verify_s(1) * depth
        d0, d1, d2, d3, d4 = self.draft.values
        return (max(d0, 0.0) + max(d1, 0.0) * depth + max(d2, 0.0) * proposals + max(d3, 0.0) * drafting
                + max(d4, 0.0) * sampled)

    def sampled_s(self) -> float:
        """What a sampling row's proposal adds to the draft's time beyond a greedy one's."""
        return max(self.draft.values[4], 0.0) if self.draft.samples else 0.0

    def step_s(self, rows: int, depth: int, proposals: int, drafting: int = 1, sampled: int = 0,
               sampled_rows: int = 0) -> float:
        """A step's seconds: `rows` padded to `depth` + 1 positions, `proposals` guesses from
        `drafting` rows, `sampled` of them from the `sampled_rows` sampling rows that draft."""
        return (self.verify_s(rows * (depth + 1), sampled_rows) + self.draft_s(depth, proposals, drafting, sampled)
                + self.other_s)

    def terms(self) -> dict[str, float]:
        """The fitted terms by name (for metrics)."""
        v0, v1, v2 = self.verify.theta
        d0, d1, d2, d3, d4 = self.draft.theta
        return {"verify_v0": v0, "verify_v1": v1, "verify_sampled": v2, "draft_d0": d0, "draft_d1": d1,
                "draft_d2": d2, "draft_fed": d3, "draft_sampled": d4, "other": self.other_s}

    def draft_ratio(self) -> float:
        """Leviathan's c at batch 1: a draft proposal's time over a one-token step's."""
        return self.draft_s(1, 1) / (self.verify_s(1) + self.other_s)
