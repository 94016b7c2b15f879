"""Working ahead: what a draft model prepares for a sequence's next round while the target verifies
this one (``DraftConfig.work_ahead``; docs/architecture.md §3.3, "Working ahead").

After answering a greedy row with a chain c_1..c_γ, the draft assumes the target keeps the whole
chain and emits the draft's own next guess b' as its bonus token, and drafts on from there: the
next round's guesses e_1..e_d are prepared before the target has verified this round. The next
item of that sequence is then either exactly what was assumed (it rolls back to the length this
reply reported and appends the chain's unheld tokens and b' — a hit: the prepared guesses go out
at once, with no forward) or anything else (a miss: the prepared guesses are dropped unread and the
item is drafted as it would have been without working ahead; nothing the work wrote is counted,
and what the other outcomes' work wrote over is fed again).

A prepared proposal is keyed by the sequence (whose key names its stream, so a new stream — a new
epoch on the target — never matches one) and matched on the item's whole content, never on a
guess: a stale, late or wrong-prefix proposal cannot be answered. The work runs on the draft's one
compute thread after a reply has been sent and stops at its next forward when a request arrives,
at the lowest CPU priority the OS offers (``SCHED_IDLE``: it runs on cycles nothing else wants, so
a target that shares the cores is not slowed by it) unless the config says ``normal``.

The other outcomes (``DraftConfig.work_ahead_outcomes`` > 1): after the whole chain, the rounds
that follow the target keeping c_1..c_k and correcting c_{k+1} to the draft's own runner-up r_{k+1}
there, for k = 0, 1, ..., as many as the setting asks, each matched the same way, whole, on the
item the target then sends: it rolls back to what the draft still holds of the chain and appends
the rest of c_1..c_k and r_{k+1} (the feature draft holds none of its chain: it rolls back to the
reported length and appends c_1..c_k r_{k+1}; the token draft holds all but c_γ: it rolls back to
the chain's start + k and appends r_{k+1}). The token draft's rounds write over the chain it holds:
a hit on a round a later one wrote over, and a miss that rolls back inside the chain, have the
chain's kept tokens fed again first (``DraftProposer``).

A sampling row works ahead on the whole chain only: the target keeps c_1..c_γ and its own draw
at the next position equals the draft's draw there (both keyed by the request's seed and the
position, so they often agree where p and q are alike). The prepared guesses are the draws a fresh
round would make at those positions (the same keys), sent with the q each was drawn from, so the
target's rule stays exact; they are answered only to an item with the very sampling settings the
work assumed. A sampling row's other outcomes are not prepared (its correction is a draw from the
residual, which no runner-up predicts), nor is a tree's branches (a hit answers a chain).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field

from specstream.data.propose import ProposeItem
from specstream.data.sampling import GREEDY, SamplingParams


@dataclass
class Prepared:
    """A sequence's next round, drafted ahead: answered only to an item that rolls back to
    ``rollback_to`` and appends exactly ``append`` (the chain's unheld tokens, then the draft's
    guess of the bonus token; or a part of the chain, then the draft's runner-up where it stops),
    with ``tail``'s guesses (as many as were drafted before a request stopped the work).
    ``whole``: it assumed the whole chain kept. ``cached``: the draft's cache still holds what this
    round's work wrote (a later outcome's work may have written over it); ``intact``: where the
    chain started, below which no outcome's work writes. ``seconds``: the draft's runner-up per
    guess of the tail (for the outcomes of the round after it). ``sampling``: the settings the
    tail was drawn with; a sampling round's ``q`` is (width, ids, probs), the q table of each guess
    of the tail, ``width`` entries a guess, row-major (as ``Proposal.q_ids``/``q_probs``)."""

    rollback_to: int
    append: list[int]
    tail: list[int]
    whole: bool = True
    cached: bool = True
    intact: int = 0
    seconds: list[int] = field(default_factory=list)
    sampling: SamplingParams = GREEDY
    q: tuple[int, list[int], list[float]] | None = None

    def answers(self, item: ProposeItem) -> bool:
        if item.masked_ids or item.forced:  # drafted without masks, or from the item's own tokens: afresh
            return False
        same = (item.sampling.greedy and self.sampling.greedy) or item.sampling == self.sampling
        return same and item.rollback_to == self.rollback_to and item.append == self.append

    def cut(self, gamma: int) -> Prepared:
        """This round with its first ``gamma`` guesses (and their q rows) only."""
        q = None if self.q is None else (self.q[0], self.q[1][: gamma * self.q[0]], self.q[2][: gamma * self.q[0]])
        return dataclasses.replace(self, tail=self.tail[:gamma], seconds=self.seconds[:gamma], q=q)


@dataclass
class Ahead:
    """A proposer's prepared rounds, by sequence key (one per outcome prepared), and its counts:
    rounds prepared, and how the items that had any were answered (hit, miss; hit_runner_up: a
    hit on an outcome other than the whole chain). ``outcomes``: how many outcomes to prepare per
    chain (``DraftConfig.work_ahead_outcomes``; 1: the whole chain only)."""

    prepared: dict[Hashable, list[Prepared]] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)
    outcomes: int = 1

    def keep(self, key: Hashable, ready: Prepared) -> None:
        """Adds a prepared round for ``key``; the ones before it no longer have their work cached."""
        for before in self.prepared.setdefault(key, []):
            before.cached = False
        self.prepared[key].append(ready)
        self.counts["prepared"] += 1

    def answer(self, item: ProposeItem, max_len: int) -> Prepared | None:
        """The prepared round that answers ``item``, its tail cut to the item's γ (within
        ``max_len`` tokens), or None: nothing was prepared for its sequence, or no round is the
        item assumed (a miss). Either way the sequence's prepared rounds are used up."""
        rounds = self.prepared.pop(item.key, None)
        if not rounds:
            return None
        ready = next((r for r in rounds if r.answers(item)), None)
        gamma = min(item.gamma, len(ready.tail), max_len - item.rollback_to - len(item.append)) if ready else 0
        if gamma <= 0:
            self.counts["miss"] += 1
            return None
        self.counts["hit"] += 1
        if not ready.whole:
            self.counts["hit_runner_up"] += 1
        return ready.cut(gamma)

    def forget(self, key: Hashable) -> None:
        self.prepared.pop(key, None)
