"""The γ controller (docs/architecture.md §4.1): how many tokens each row asks the draft for, every step.

Policies for ``speculation=auto`` rows (``--gamma-policy``):
- ``goodput`` (the default): per sequence, an acceptance estimate α̂ (discounted Beta posterior,
  separate per proposer and for greedy vs sampled rows, starting from the pooled estimate of its
  kind, and each pool from the acceptance the draft's card states for that kind, else 0.6); the engine's own measured costs (``CostModel``: verify time as a function of the step's
  total tokens, draft time as a function of its depth and total proposals, the rest of a step).
  It picks the γ vector that maximises expected committed tokens per second for the WHOLE batch:
  Σ_i E_i(γ_i) / T(γ), E(γ) = (1 − α^(γ+1)) / (1 − α) (Leviathan et al., Thm 3.8, per row) and T
  the predicted step time. γ = 0 for some or all rows is a normal answer; all-zero is always a
  candidate, so the predicted goodput is never below plain decoding's, and it is chosen unless
  speculating is predicted to gain at least ``min_gain`` (5%): a marginal prediction is noise.
- ``fixed``: the configured default γ.
- ``hf``: Hugging Face's heuristic per sequence: start at 5, +2 after a step whose proposals were
  all accepted, −1 otherwise (never below 1).
- ``leviathan``: per row, the batch-1 optimum argmax_γ (1 − α^(γ+1)) / ((1 − α)(γc + 1)) from the
  row's α̂ and the measured c = draft time per proposal / time of a one-token step.
Constrained rows (a grammar masks their output) are pooled apart from free text: their
proposer's name gains ``+grammar`` (``pooled_source``), since a draft guessing from a masked
distribution on a schema's values accepts at another rate than on prose, and the forced tokens
before its guesses are not counted (the drafting scores the draft's own guesses). A constrained
pool starts from ``prior_alpha``: no draft card states a constrained α. A row's forced tokens
(``RowView.forced``) are priced too: the pass verifies them with or without guesses, so guesses
must pay for the draft's call and their positions against a pass that already commits 1 + forced
tokens; in a batch the verify is padded to the deepest row's forced tokens and guesses.
Rows with ``speculation=fixed`` get their γ; ``off`` rows get 0. Every choice is capped by the
row's caps (budget, draft context: target_service/drafting.py) and its request's ``max_gamma``.

Trees (``branches``): a row that drafts may add the draft's runner-up guesses as branches beside
its chain (a sampled row's: the next draws of the same race, verified by recursive rejection).
Under ``goodput`` each extra position of the pass is bought only when what it is expected to add
pays for it: the branch at depth j stands when the chain's first j guesses stood,
its (j+1)-th failed and the runner-up is the target's token, α^j (1 − α) β (β: how often a
runner-up beside a failed guess was right, pooled over greedy rows and over sampled rows apart,
from a prior of 0.3), each token
worth the pass's seconds per token; the price is the measured verify curve's slope. On a small
CPU a position is dear, and few branches pay (docs/benchmarks.md, "Figures behind design
choices"). ``fixed`` gives every row that drafts all the branches allowed
(``TargetConfig.tree_branches``); ``hf`` and ``leviathan`` chains.
Under goodput a request's fixed γ is a chain of γ: only speculation=auto rows branch.

Knows nothing about models, tokens or gRPC: rows are ids with a few facts, costs are seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from specstream.data.config import GAMMA_POLICIES as POLICIES
from target_service.cost_model import CostModel

__all__ = ["AUTO_GAMMA", "POLICIES", "GammaController", "RowView", "expected_tokens", "leviathan_gamma",
           "pooled_source"]

AUTO_GAMMA = -1  # a row's requested γ under speculation=auto
# Proposers whose chains end where their own confidence does (draft_service/suffix.py): for a row
# they answer, γ is a cap, not a length. Where the controller gives such a row any γ, it gets its
# limit, within the depth the step verifies anyway when other rows share it (a longer chain would
# pad every row's verify): at batch 1 the proposer decides how far to go (docs/benchmarks.md,
# "Agent traffic"). Prompt lookup copies γ tokens whatever follows: the controller prices it.
SELF_LIMITING = frozenset({"suffix"})
BRANCH_PRIOR = 0.3  # β before any branch was verified: a runner-up beside a refused guess is right
MAX_BACKOFF = 3  # a row's probes wait at most probe_every × 2^MAX_BACKOFF idle steps
PROBE_GAP = 0.2  # how far below paying a row's α must stay after a refused probe to slow its probes
# Probes spend at most this share of the plain steps' predicted time (``GammaController.probe_share``).
PROBE_SHARE = 0.02


@dataclass(frozen=True)
class RowView:
    seq_id: int
    gamma: int  # requested: AUTO_GAMMA, 0 (off) or a fixed γ >= 1
    max_gamma: int  # auto rows: the most they may get
    greedy: bool
    # Tokens the draft would take in before guessing for this row (what it has not seen: all of a
    # row it never drafted for, else the tokens committed since it last did; a feature draft reads
    # the target's features of each): a row idle for long, or new, costs its first guess more.
    unfed: int = 1
    constrained: bool = False  # a grammar masks its output: its acceptance is pooled apart
    # The grammar's forced tokens it proposes this pass, before any guess: certain tokens that widen
    # the verify and that the draft's guesses follow (priced at batch 1: ``_goodput_one``).
    forced: int = 0


def pooled_source(source: str, constrained: bool) -> str:
    """The name a proposer's acceptance is learnt under: apart for constrained rows."""
    return f"{source}+grammar" if constrained else source


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a pass commits on average with γ proposals at per-token acceptance α: 1 + α + … + α^γ."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def leviathan_gamma(alpha: float, c: float, cap: int) -> int:
    """argmax over γ in 0..cap of the improvement factor (1 − α^(γ+1)) / ((1 − α)(γc + 1))."""
    return max(range(cap + 1), key=lambda g: (expected_tokens(alpha, g) / (g * c + 1.0), -g))


@dataclass
class _Acceptance:
    """Discounted Beta counts of accepted (hits) and rejected (misses) proposals, with a change
    detector: a fast-forgetting copy runs beside them, and when it disagrees with the slow counts by
    more than `_CHANGE_Z` standard deviations the text has changed (code after prose, a quote
    ending), so the slow counts restart from the fast ones instead of unlearning pass by pass."""

    hits: float = 0.0
    misses: float = 0.0
    fast_hits: float = 0.0
    fast_misses: float = 0.0

    def add(self, proposed: int, accepted: int, decay: float) -> None:
        miss = 1.0 if accepted < proposed else 0.0
        self.hits = self.hits * decay + accepted
        self.misses = self.misses * decay + miss
        self.fast_hits = self.fast_hits * _FAST_DECAY + accepted
        self.fast_misses = self.fast_misses * _FAST_DECAY + miss
        slow_n, fast_n = self.hits + self.misses, self.fast_hits + self.fast_misses
        if fast_n < 4.0 or slow_n <= fast_n:
            return
        slow, fast = self.hits / slow_n, self.fast_hits / fast_n
        spread = math.sqrt(max(slow * (1.0 - slow), 0.01) / fast_n)
        if abs(fast - slow) > _CHANGE_Z * spread:
            self.hits, self.misses = self.fast_hits, self.fast_misses

    def decay(self, decay: float) -> None:
        self.hits *= decay
        self.misses *= decay
        self.fast_hits *= decay
        self.fast_misses *= decay


_FAST_DECAY = 0.7  # the change detector's memory: ~3 passes
_CHANGE_Z = 3.0


@dataclass
class _RowState:
    source: str = "model"  # the proposer that answered last
    counts: dict[str, _Acceptance] = field(default_factory=dict)  # per proposer
    hf_gamma: int = 5  # the HF heuristic's current γ
    idle: int = 0  # consecutive steps it was given γ = 0 though it could draft
    # While its probe is out: the α at which that probe's step would have paid, and the step's rows.
    probing: tuple[float, int] | None = None
    backoff: int = 0  # its probes wait probe_every × 2^backoff idle steps


class GammaController:
    """Chooses γ per row (``choose``) and learns from what happened (``observe``, ``observe_step``)."""

    def __init__(self, policy: str = "goodput", default_gamma: int = 4, max_gamma: int = 16,
                 prior_alpha: float = 0.6, prior_strength: float = 4.0, row_decay: float = 0.97,
                 pool_decay: float = 0.995, idle_decay: float = 0.98, explore: float = 0.5,
                 probe_every: int = 16, min_gain: float = 0.05, probe_share: float = PROBE_SHARE) -> None:
        if policy not in POLICIES:
            raise ValueError(f"gamma policy {policy!r}: must be one of {', '.join(POLICIES)}")
        self.policy = policy
        self.default_gamma = default_gamma
        self.max_gamma = max_gamma
        self.prior_alpha = prior_alpha  # before anything is measured, where the draft states no prior
        # (proposer, greedy) -> the acceptance its draft's card states (``set_priors``): where a pool starts
        self.priors: dict[tuple[str, bool], float] = {}
        self.prior_strength = prior_strength  # pseudo-observations the pooled estimate is worth to a row
        self.row_decay = row_decay  # per observation: a row's memory is ~1 / (1 − decay) passes
        self.pool_decay = pool_decay
        self.idle_decay = idle_decay  # per step a row is not drafting: its estimate drifts back to the pool
        self.explore = explore  # standard deviations of optimism in the estimate a choice uses
        # Once every probe_every × (rows in the step) steps, the row idle longest (γ = 0 though it
        # could draft) gets one proposal: without it a pool that turned pessimistic (a few hard
        # prompts) would keep every later sequence at γ = 0 and never see that they are easier. At
        # batch 1 that is one extra position every 16 steps; at batch n the interval grows with n,
        # since a probe pads every row of its step. A refused probe of a row whose estimate stays
        # clearly (PROBE_GAP) below the α at which the probe would have paid doubles the idle steps
        # its next probe waits (up to 2^MAX_BACKOFF times); a kept one halves them. At α ≈ 0.3 on
        # sampled chat a probe costs more than it wins (~3% of a batch-1 run on SmolLM2 at 16 steps),
        # while a row near paying, or one that starts from a pessimistic pool, is probed as often.
        self.probe_every = probe_every
        # And probes of rows far from paying (their optimistic α more than PROBE_GAP below the α at
        # which the probe would pay) spend at most `probe_share` of decoding's time: each step with
        # an idle row adds that share of a plain step's predicted seconds to a credit, and such a
        # probe waits until the credit covers what it is predicted to add to its step (the draft's
        # call, catching up on the tokens the row's draft has not seen, and the wider verify), then
        # spends it. A request's first probe costs more than later ones (the draft reads the prompt's
        # features), and either is of the order of a plain pass (docs/benchmarks.md, "Figures behind
        # design choices"). The credit is kept across requests (a probe of the next
        # request may spend what this one saved), up to what MAX_BACKOFF's longest wait earns; a
        # probe dearer than that goes when the credit is full and leaves a debt. A row near paying
        # is probed every due step as before: budgeting those too ran below the unbudgeted
        # controller on bench gamma's chat workload (docs/benchmarks.md, "Figures behind design choices").
        self.probe_share = probe_share
        self._probe_credit = 0.0
        # Speculate only for a predicted gain of at least this share over the plain step: the
        # predictions are estimates (an α from a few passes, step times that drift on a shared
        # machine, optimism while exploring), and a marginal predicted gain is as likely a
        # loss: steps with proposals ran longer than predicted, and without this margin automatic γ
        # ran slower than plain (docs/benchmarks.md, "Figures behind design choices").
        self.min_gain = min_gain
        # The sources whose γ is a cap (SELF_LIMITING), unless a model stands behind them: a draft
        # asks its model where the lookup has nothing, at the γ it was sent (Drafting sets this).
        self.self_limiting: frozenset[str] = SELF_LIMITING
        self._since_probe = 0
        self.costs = CostModel()
        self._rows: dict[int, _RowState] = {}
        self._pool: dict[tuple[str, bool], _Acceptance] = {}  # (proposer, greedy) -> pooled counts
        # runner-ups beside a failed guess, greedy rows and sampled rows apart: kept (hits) or not (misses)
        self._branch = {True: _Acceptance(), False: _Acceptance()}
        self.predicted_s = 0.0  # the chosen vector's predicted step time (0 when not predicted)

    # ----- estimates --------------------------------------------------------------------------
    def set_priors(self, priors: dict[tuple[str, bool], float]) -> None:
        """Where each (proposer, greedy) pool starts: the acceptance the draft's card states was
        measured for that kind (DraftInfo.acceptance), in place of ``prior_alpha``; an entry without
        a proposer or with α not strictly between 0 and 1 is no prior (left out). Pools already
        learnt keep their counts; the prior is what they are shrunk toward."""
        self.priors = {(source, greedy): alpha for (source, greedy), alpha in priors.items()
                       if source and 0.0 < alpha < 1.0}

    def prior(self, source: str, greedy: bool) -> float:
        return self.priors.get((source, greedy), self.prior_alpha)

    def pooled_alpha(self, source: str, greedy: bool) -> float:
        prior = self.prior(source, greedy)
        pool = self._pool.get((source, greedy))
        if pool is None:
            return prior
        s = self.prior_strength
        return (pool.hits + s * prior) / (pool.hits + pool.misses + s)

    def alpha(self, seq_id: int, greedy: bool) -> float:
        """The row's acceptance estimate: its own discounted counts over a prior worth
        `prior_strength` observations at the pooled estimate of its proposer and kind."""
        return self._posterior(seq_id, greedy)[0]

    def _posterior(self, seq_id: int, greedy: bool, source: str | None = None) -> tuple[float, float]:
        """(mean, standard deviation) of the row's Beta posterior over α: of ``source``'s guesses,
        by default the proposer that answered it last."""
        row = self._rows.get(seq_id)
        source = source or (row.source if row else "model")
        prior = self.pooled_alpha(source, greedy)
        counts = row.counts.get(source) if row else None
        hits = counts.hits if counts else 0.0
        misses = counts.misses if counts else 0.0
        a = hits + self.prior_strength * prior
        b = misses + self.prior_strength * (1.0 - prior)
        return a / (a + b), math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1.0)))

    def lookup_gamma(self, rows: list[RowView], gammas: list[int], i: int, source: str, cap: int) -> int:
        """γ for asking row ``i``'s model-free lookup alone (``ProposeItem.lookup_only``) in a step
        whose γ vector ``gammas`` gave it none: a row that a draft model answered last is priced
        by that model's α, and one priced out is never asked again, so the lookup in front of the
        model (prompt lookup, suffix drafting; ``source`` names it) would go unheard however well
        it matches. The depth up to ``cap`` whose expected tokens at the lookup's α for this row
        (its own counts over the lookup's pool; a constrained row's apart, ``pooled_source``, with
        its forced tokens in the verify before the guesses) best pay for the verify positions it
        adds to the step (the other rows counted at one token each: a lower bound); 0 unless that
        beats the step without it by ``min_gain``, and before the step costs are measured."""
        row = rows[i]
        cap = min(cap, row.max_gamma or self.max_gamma, self.max_gamma)  # as `choose` limits a row
        if cap <= 0 or not self.costs.ready or self.policy not in ("goodput", "leviathan"):
            return 0
        alpha = self._posterior(row.seq_id, row.greedy, pooled_source(source, row.constrained))[0]
        costs, n, sampled = self.costs, len(rows), int(not row.greedy)
        depth = max((r.forced + g for r, g in zip(rows, gammas)), default=0)  # the rows' forced tokens verify too
        base_verify = costs.verify_s(n * (depth + 1), sampled)
        step_s = self.predicted_s or base_verify + costs.other_s
        committed = float(n + sum(r.forced for r in rows))  # without the lookup: 1 + forced tokens a row
        best, best_rate = 0, committed / step_s
        tokens, term = committed, 1.0
        for g in range(1, cap + 1):
            term *= alpha
            tokens += term
            added = max(0.0, costs.verify_s(n * (max(depth, row.forced + g) + 1), sampled) - base_verify)
            if tokens / (step_s + added) > best_rate * (1.0 + 1e-9):
                best, best_rate = g, tokens / (step_s + added)
        if best_rate < committed / step_s * (1.0 + self.min_gain):
            return 0
        return cap if source in SELF_LIMITING and n == 1 else best  # γ a cap, as in ``choose`` (never the model's here)

    def _optimistic_alpha(self, seq_id: int, greedy: bool, rows: int) -> float:
        """The estimate the choice uses: the mean plus `explore` / `rows` standard deviations. A
        row whose few first guesses failed is not written off: while its evidence is thin (and again
        as it fades while the row is not drafting) it gets another try; with evidence the bonus
        shrinks. A try pads every row of the step to its depth, so it costs the whole batch while
        informing one row: the bonus shrinks with the batch."""
        mean, std = self._posterior(seq_id, greedy)
        return min(mean + self.explore * std / rows, 1.0)

    # ----- learning ----------------------------------------------------------------------------
    def observe(self, seq_id: int, source: str, greedy: bool, proposed: int, accepted: int) -> None:
        """A verified pass: `accepted` of `proposed` proposals (by `source`) stood."""
        if proposed <= 0:
            return
        row = self._rows.setdefault(seq_id, _RowState())
        row.source = source
        row.counts.setdefault(source, _Acceptance()).add(proposed, accepted, self.row_decay)
        self._pool.setdefault((source, greedy), _Acceptance()).add(proposed, accepted, self.pool_decay)
        row.hf_gamma = row.hf_gamma + 2 if accepted == proposed else max(1, row.hf_gamma - 1)
        if row.probing is not None:
            needed, batch = row.probing
            row.probing = None
            if accepted == proposed:
                row.backoff = max(row.backoff - 1, 0)
            elif self._optimistic_alpha(seq_id, greedy, batch) < needed - PROBE_GAP:
                row.backoff = min(row.backoff + 1, MAX_BACKOFF)

    def observe_step(self, rows: int, depth: int, proposals: int, verify_s: float, draft_s: float,
                     other_s: float, fed: int = 0, sampled: int = 0, sampled_rows: int = 0,
                     forced: tuple[int, int] = (0, 0)) -> None:
        """A decode step's measured times (seconds) and its size: `rows` rows, the deepest with
        `depth` proposals, `proposals` in all (`sampled` of them from the `sampled_rows` sampling
        rows that proposed), `fed` tokens the draft took in before guessing. ``forced``: (the
        grammar's forced tokens among the proposals, the draft's deepest chain of guesses after
        them): they widen the verify, but the draft did not guess them, so its cost is learnt from
        its own guesses alone (a pass of forced tokens only teaches it nothing)."""
        forced_tokens, draft_depth = forced
        self.costs.observe(rows * (depth + 1), draft_depth if forced_tokens else depth, proposals - forced_tokens,
                           verify_s, draft_s, other_s, fed, sampled, sampled_rows)

    def observe_verify_timing(self, positions: int, seconds: float) -> None:
        """A verify forward over ``positions`` timed apart (the engine's start-up calibration)."""
        self.costs.observe_verify(positions, seconds)

    def observe_sampled_timing(self, seconds: float) -> None:
        """What a sampling row's verification adds, timed apart at start-up (the prior of its term)."""
        self.costs.seed_sampled(seconds)

    def observe_draft_timing(self, depth: int, proposals: int, fed: int, seconds: float) -> None:
        """A propose call timed apart (``Drafting.time_draft`` at start-up)."""
        self.costs.observe_draft(depth, proposals, fed, seconds)

    def draft_ratio(self) -> float:
        """Leviathan's c at batch 1 as the cost model stands: a guess's time over a one-token step's."""
        return self.costs.draft_ratio()

    def cost_terms(self) -> dict[str, float]:
        """The cost model's fitted terms by name (for metrics)."""
        return self.costs.terms()

    def observe_branch(self, kept: bool, greedy: bool = True) -> None:
        """A tree's branch stood beside the guess the target refused: it was `kept` or not."""
        self._branch[greedy].add(1, int(kept), self.pool_decay)

    def branch_rate(self, greedy: bool = True) -> float:
        """β: how often the runner-up beside a refused guess was the target's token."""
        s, seen = self.prior_strength, self._branch[greedy]
        return (seen.hits + s * BRANCH_PRIOR) / (seen.hits + seen.misses + s)

    def branches(self, rows: list[RowView], gammas: list[int], cap: int) -> list[int]:
        """Branches per row beside its chain of ``gammas[i]`` (at most ``cap``; rows that draft
        only). Under goodput, for speculation=auto rows, the positions whose expected tokens
        pay their verify seconds (module docstring; none before a step is measured), and a fixed γ
        stays a chain; under fixed, ``cap`` for every such row; the chain heuristics (hf,
        leviathan) none."""
        out = [0] * len(rows)
        live = [i for i, g in enumerate(gammas) if g > 0]
        if cap <= 0 or not live or self.policy not in ("goodput", "fixed"):
            return out
        # A row's nodes stay within max_gamma: the headroom every slot keeps past its budget.
        cap_of = {i: max(0, min(cap, self.max_gamma - gammas[i])) for i in live}
        if self.policy == "fixed":
            return [cap_of.get(i, 0) for i in range(len(rows))]
        auto = [i for i in live if rows[i].gamma == AUTO_GAMMA]
        if not auto or not self.costs.ready:
            return out
        batch = len(rows)
        beta = {greedy: self.branch_rate(greedy) for greedy in (True, False)}
        alphas = {i: self.alpha(rows[i].seq_id, rows[i].greedy) for i in auto}
        expected = sum(expected_tokens(self.alpha(r.seq_id, r.greedy), g) for r, g in zip(rows, gammas))
        width = 1 + max(g + b for g, b in zip(gammas, out))
        drafting = sum(1 for g in gammas if g > 0)
        sampled = sum(g for r, g in zip(rows, gammas) if not r.greedy)
        sampled_rows = sum(1 for r, g in zip(rows, gammas) if g > 0 and not r.greedy)
        per_token = self.costs.step_s(batch, width - 1, sum(gammas), drafting, sampled,
                                      sampled_rows) / max(expected, 1.0)
        for extra in range(cap):  # one more position for every auto row: the branch at depth `extra`
            gain = sum(alphas[i] ** extra * (1.0 - alphas[i]) * beta[rows[i].greedy] for i in auto if extra < gammas[i])
            price = self.costs.verify_s(batch * (width + extra + 1)) - self.costs.verify_s(batch * (width + extra))
            if gain * per_token <= price:
                break
            for i in auto:
                out[i] += extra < gammas[i] and out[i] < cap_of[i]
        return out

    def pooled(self) -> dict[tuple[str, bool], float]:
        """The pooled acceptance estimate per (proposer, greedy) seen so far."""
        return {key: self.pooled_alpha(*key) for key in self._pool}

    def forget(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)

    # ----- choosing ----------------------------------------------------------------------------
    def choose(self, rows: list[RowView], caps: list[int]) -> list[int]:
        """γ per row, each within its cap (caps[i] >= 0)."""
        gammas = [0] * len(rows)
        auto: list[int] = []
        for i, (row, cap) in enumerate(zip(rows, caps)):
            if row.gamma == AUTO_GAMMA:
                auto.append(i)
            else:
                gammas[i] = min(row.gamma, cap)
        self.predicted_s = 0.0
        if not auto:
            return gammas
        limits = {i: max(0, min(caps[i], rows[i].max_gamma or self.max_gamma, self.max_gamma)) for i in auto}
        for i in auto:  # a probe whose pass was never verified (the draft was away) is forgotten
            self._rows.setdefault(rows[i].seq_id, _RowState(pooled_source("model", rows[i].constrained))).probing = None
        alphas = {i: self._optimistic_alpha(rows[i].seq_id, rows[i].greedy, len(rows)) for i in auto}
        if self.policy == "fixed" or not self.costs.ready and self.policy != "hf":
            # Before the first measured step: the configured γ (it also gives the cost model a sample).
            for i in auto:
                gammas[i] = min(self.default_gamma, limits[i])
        elif self.policy == "hf":
            for i in auto:
                gammas[i] = min(self._rows[rows[i].seq_id].hf_gamma, limits[i])
        elif self.policy == "leviathan":
            c = self.costs.draft_ratio()
            for i in auto:
                gammas[i] = leviathan_gamma(alphas[i], c, limits[i])
        elif len(rows) == 1:
            self._goodput_one(gammas, rows[0], limits[0], alphas[0])
        else:
            self._goodput(gammas, auto, limits, alphas, rows)
        if self.policy in ("goodput", "leviathan") and self.costs.ready:
            self._let_self_limiting_go_on(gammas, auto, limits, rows)
        idle = []
        for i in auto:
            state = self._rows[rows[i].seq_id]
            if gammas[i] > 0 or limits[i] == 0:
                state.idle = 0
                continue
            # Not drafting: what it learnt fades toward the pool (a later retry is cheap).
            for counts in state.counts.values():
                counts.decay(self.idle_decay)
            state.idle += 1
            idle.append(i)
        self._since_probe += 1
        due = self.probe_every * len(rows)
        probing = self.policy in ("goodput", "leviathan") and self.costs.ready
        cap = 0.0
        if idle and probing:
            earned = self.probe_share * self.costs.step_s(len(rows), 0, 0, 0)
            cap = earned * (due << MAX_BACKOFF)
            self._probe_credit = min(self._probe_credit + earned, cap)
        ready = [i for i in idle if self._rows[rows[i].seq_id].idle >= due << self._rows[rows[i].seq_id].backoff]
        if ready and probing and self._since_probe >= due:
            i = max(ready, key=lambda j: self._rows[rows[j].seq_id].idle)
            plain, probe = self._probe_step_s(rows, i)
            needed = len(rows) * ((1.0 + self.min_gain) * probe / plain - 1.0)
            # A row near paying is probed as before; one far from it only on the budget. A probe
            # dearer than the most the credit holds goes once the credit is full, and its debt is
            # paid back by the steps after it.
            near = alphas[i] >= needed - PROBE_GAP
            if near or self._probe_credit >= min(probe - plain, cap):
                self._probe_credit -= 0.0 if near else probe - plain
                state = self._rows[rows[i].seq_id]
                gammas[i], state.idle, state.probing, self._since_probe = 1, 0, (needed, len(rows)), 0
        return gammas

    def _probe_step_s(self, rows: list[RowView], i: int) -> tuple[float, float]:
        """(a plain step's predicted seconds, a probe's of row i: one guess after the draft takes in
        the row's unseen tokens, the other rows padded, guessing nothing). The probe pays for
        itself (``min_gain`` over the plain step) at α = n × ((1 + min_gain) × probe / plain − 1):
        n rows commit n + α tokens instead of n."""
        sampling = int(not rows[i].greedy)
        return (self.costs.step_s(len(rows), 0, 0, 0),
                self.costs.step_s(len(rows), 1, 1, max(rows[i].unfed, 1), sampling, sampling))

    def _nothing_pays(self, rows: list[RowView], auto: list[int], limits: dict[int, int], alphas: dict[int, float],
                      fixed_expected: float, plain: tuple[int, int, int, int, int, int], plain_rate: float) -> bool:
        """True when no γ vector can gain ``min_gain`` over the plain step (``plain``: its verify
        depth, draft depth, the fixed rows' proposals and drafting rows), by a bound that costs a
        few predictions instead of ``_goodput``'s search: every auto row's most tokens (its limit)
        over the cheapest step in which any auto row guesses (draft and verify costs never fall
        with size, bar the verify's per-size corrections: every depth is tried). Most steps of a
        row that does not pay end here."""
        tokens = fixed_expected + sum(rows[i].forced + expected_tokens(alphas[i], limits[i]) for i in auto)
        verify_depth, draft_depth, proposals, drafting, sampled, sampled_rows = plain
        least = int(all(not rows[i].greedy for i in auto))  # a guessing auto row is a sampling one
        deepest = max(limits[i] for i in auto)
        if deepest == 0:
            return True
        lead = min(rows[i].forced for i in auto)  # a guess lands after its row's forced tokens
        verify = min(self.costs.verify_s(len(rows) * (max(verify_depth, lead + d) + 1), sampled_rows + least)
                     for d in range(1, deepest + 1))
        draft = self.costs.draft_s(max(draft_depth, lead + 1), proposals + 1, drafting + 1, sampled + least)
        cheapest = verify + draft + self.costs.other_s
        return tokens / cheapest < plain_rate * (1.0 + self.min_gain)

    def _step_s(self, rows: int, verify_depth: int, draft_depth: int, proposals: int, drafting: int,
                sampled: int, sampled_rows: int) -> float:
        """``CostModel.step_s`` with the verify padded to ``verify_depth`` (forced tokens included)
        and the draft run ``draft_depth`` deep (0: not asked)."""
        costs = self.costs
        return (costs.verify_s(rows * (verify_depth + 1), sampled_rows)
                + costs.draft_s(draft_depth, proposals, drafting, sampled) + costs.other_s)

    def _let_self_limiting_go_on(self, gammas: list[int], auto: list[int], limits: dict[int, int],
                                 rows: list[RowView]) -> None:
        """In place: each auto row given γ > 0 whose last answer came from a ``SELF_LIMITING``
        proposer gets its limit, alone in its step, else the deepest γ of the step's rows."""
        deepest = max(gammas, default=0)
        for i in auto:
            if gammas[i] > 0 and self._rows[rows[i].seq_id].source in self.self_limiting:
                gammas[i] = limits[i] if len(rows) == 1 else max(gammas[i], min(deepest, limits[i]))

    def _goodput_one(self, gammas: list[int], row: RowView, limit: int, alpha: float) -> None:
        """``_goodput`` for a step of one row (batch 1, the latency case), in place: every depth up to
        its limit, in as many predictions. The search's vector arithmetic is a noticeable share of a
        SmolLM2 step, paid on every step of an auto row even when it decodes plainly; this is several
        times cheaper (docs/benchmarks.md, "Figures behind design choices") and chooses as the search
        would (tests/test_gamma.py)."""
        costs = self.costs
        sampled = int(not row.greedy)
        forced = row.forced  # certain tokens ahead of the guesses: the plain pass verifies them too
        plain_s = costs.verify_s(1 + forced) + costs.other_s
        best, best_s = 0, plain_s
        plain_rate = best_rate = (1.0 + forced) / plain_s
        tokens, term = 1.0 + forced, 1.0  # forced + E(γ), E(γ) = Σ_{k=0..γ} α^k
        for depth in range(1, limit + 1):
            term *= alpha
            tokens += term
            step_s = (costs.verify_s(1 + forced + depth, sampled)
                      + costs.draft_s(forced + depth, depth, 1, sampled * depth) + costs.other_s)
            if tokens / step_s > best_rate * (1.0 + 1e-9):
                best, best_s, best_rate = depth, step_s, tokens / step_s
        if best and best_rate < plain_rate * (1.0 + self.min_gain):  # a marginal gain: none
            best, best_s = 0, plain_s
        gammas[0] = best
        self.predicted_s = best_s

    def _goodput(self, gammas: list[int], auto: list[int], limits: dict[int, int], alphas: dict[int, float],
                 rows: list[RowView]) -> None:
        """Maximises Σ E_i(γ_i) / T(γ) over the auto rows' γ (fixed rows as given), in place.

        For a depth G (the largest γ) the verify cost is fixed (every row is padded to G + 1
        positions) and so is the draft's depth cost; what one more proposal adds is τ_i, the draft's
        marginal seconds per proposal (a sampling row's: plus what building its q adds). For a
        price λ per second each row then independently takes the γ maximising E_i(γ) − λ·τ_i·γ
        within min(G, limit): since E_i's increments α^k shrink, that is the number of k with
        α^k > λτ_i. A sampling row that proposes also costs its verification a fixed amount (its
        residual, whatever its γ): not a per-proposal price, so each depth is also tried with the
        sampling rows at γ = 0.
        Dinkelbach's iteration (λ ← the best goodput found) over every G converges in a few rounds;
        G = 0 (nothing proposed) is always a candidate. A row's forced tokens (``RowView.forced``)
        come first: certain tokens that every candidate verifies, its guesses landing after them,
        so the verify is padded to the deepest row's forced + γ and the draft runs that deep."""
        costs = self.costs
        others = [i for i in range(len(rows)) if i not in limits]
        fixed_expected = sum(rows[i].forced + expected_tokens(self.alpha(rows[i].seq_id, rows[i].greedy), gammas[i])
                             for i in others)
        # Verify depth: every row's forced tokens and guesses; draft depth: the drafting rows' only.
        fixed_depth = max((rows[i].forced + gammas[i] for i in range(len(rows))), default=0)
        fixed_draft_depth = max((rows[i].forced + gammas[i] for i in others if gammas[i] > 0), default=0)
        fixed_proposals = sum(gammas[i] for i in others)
        fixed_drafting = sum(1 for i in others if gammas[i] > 0)
        fixed_sampled = sum(gammas[i] for i in others if not rows[i].greedy)
        fixed_sampled_rows = sum(1 for i in others if gammas[i] > 0 and not rows[i].greedy)
        plain = (fixed_depth, fixed_draft_depth, fixed_proposals, fixed_drafting, fixed_sampled, fixed_sampled_rows)
        forced = np.array([rows[i].forced for i in auto], dtype=np.int64)  # [A]
        plain_s = self._step_s(len(rows), *plain)
        plain_rate = (fixed_expected + len(auto) + int(forced.sum())) / plain_s
        if self._nothing_pays(rows, auto, limits, alphas, fixed_expected, plain, plain_rate):
            self.predicted_s = plain_s
            return
        alpha = np.array([alphas[i] for i in auto], dtype=np.float64)  # [A]
        sampling = np.array([not rows[i].greedy for i in auto])  # [A]
        limit = np.array([limits[i] for i in auto], dtype=np.int64)  # [A]
        log_alpha = np.log(np.clip(alpha, 1e-300, 1.0))  # [A], 0 where α = 1
        # E_i(γ) = Σ_{k=0..γ} α_i^k for every γ up to the largest limit, once: [A, L + 1]
        steps = np.arange(int(limit.max(initial=0)) + 1)  # [L + 1]
        table = np.where(alpha[:, None] < 1.0,
                         (1.0 - alpha[:, None] ** (steps + 1)) / np.maximum(1.0 - alpha[:, None], 1e-12),
                         steps + 1.0)  # [A, L + 1]
        row_index = np.arange(len(auto))[:, None]  # [A, 1]
        # (verify depth, draft depth, proposals, drafting, sampled proposals, sampled rows) -> a step's seconds
        seconds_at: dict[tuple[int, int, int, int, int, int], float] = {}

        def seconds(*key: int) -> float:
            if key not in seconds_at:
                seconds_at[key] = self._step_s(len(rows), *key)
            return seconds_at[key]

        best = np.zeros(len(auto), dtype=np.int64)
        best_s = seconds(*plain)
        best_rate = plain_rate
        # What one more guess adds, per row: a sampling row's also builds and sends its q.
        tau = max(costs.draft_s(1, 2) - costs.draft_s(1, 1), 0.0) + costs.sampled_s() * sampling  # [A]
        for _ in range(3):
            price = best_rate * tau  # [A]
            # α^k > price  <=>  k < log(price) / log(α): the count of such k >= 1
            with np.errstate(divide="ignore"):
                bound = np.where(log_alpha < 0.0, np.log(np.clip(price, 1e-300, 1.0)) / np.minimum(log_alpha, -1e-300),
                                 np.inf)
            wanted = np.where(np.isinf(bound), limit, np.maximum(np.ceil(bound) - 1, 0)).astype(np.int64)
            wanted = np.where(price <= 0.0, limit, np.where(price >= 1.0, 0, wanted))
            wanted = np.minimum(wanted, limit)  # [A]
            found = False
            options = [wanted]
            if (wanted * sampling).any() and (wanted * ~sampling).any():
                options.append(wanted * ~sampling)  # the greedy rows draft, the sampling rows do not
            for option in options:
                deepest = int((forced + option).max(initial=0))
                # The candidates: every row's wanted γ capped where its forced tokens and guesses
                # reach a depth d = 1..deepest (deeper: the same vector)
                room = np.arange(1, deepest + 1) - forced[:, None]  # [A, D]: guesses that fit under depth d
                grid = np.clip(np.minimum(option[:, None], room), 0, None)  # [A, D]
                expected = fixed_expected + int(forced.sum()) + table[row_index, grid].sum(axis=0)  # [D]
                reach = forced[:, None] + grid  # [A, D]: each row's forced tokens and guesses
                verify_depth = np.maximum(reach.max(axis=0), fixed_depth)  # [D]
                draft_depth = np.maximum(np.where(grid > 0, reach, 0).max(axis=0), fixed_draft_depth)  # [D]
                proposals = grid.sum(axis=0)  # [D]
                sampled = fixed_sampled + (grid * sampling[:, None]).sum(axis=0)  # [D]
                drafting = fixed_drafting + int(np.count_nonzero(option))
                sampled_rows = fixed_sampled_rows + int(np.count_nonzero(option * sampling))
                for d in range(deepest):
                    step_s = seconds(int(verify_depth[d]), int(draft_depth[d]), fixed_proposals + int(proposals[d]),
                                     drafting, int(sampled[d]), sampled_rows)
                    rate = float(expected[d]) / step_s
                    if rate > best_rate * (1.0 + 1e-9):
                        best, best_rate, best_s, found = grid[:, d], rate, step_s, True
            if not found:
                break
        if best.any() and best_rate < plain_rate * (1.0 + self.min_gain):  # a marginal gain: none
            best, best_s = np.zeros_like(best), seconds(*plain)
        for i, g in zip(auto, best.tolist()):
            gammas[i] = g
        self.predicted_s = best_s
