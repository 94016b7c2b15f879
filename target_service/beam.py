"""Beam search over one request's hypotheses: which candidates continue, which finish, when it ends.

Fixed width is transformers' beam search (`generate(num_beams=k, do_sample=False,
length_penalty, early_stopping)`, its `_beam_search`), step for step: per step the best
max(2, 1 + stop ids)·k candidates of all running hypotheses by accumulated log-probability; the
best k that do not end continue; those that end among the first k enter the k-best finished list,
scored sum / generated_length ** length_penalty; the search stops when the finished list is full
and (early_stopping) cannot improve, or at the length limit. Scores are float32 sums, as there.

Variable width (Freitag & Al-Onaizan 2017, as the VAR-STREAM paper uses it) prunes the continuing
hypotheses: at most M extend one parent (the next best candidate takes the place of one over
the cap), and none more than δ below the best score of this step's continuing candidates and of
the hypotheses finished so far (the paper's Appendix A: the best may be a finished one). δ is in
nats of log-probability; a finished hypothesis counts with the log-probability its ranking score
stands for at the candidates' length (length_penalty 0: its plain sum, the paper's rule), so a
short finished hypothesis does not prune longer ones the ranking could still put first. δ = ∞
and M = k prune nothing: the same code is the fixed-width search. The search also ends when
pruning leaves nothing running.

Knows nothing about models, caches or slots: a step takes each running hypothesis' best
candidates (token ids and accumulated scores, from kernels.topk_logprobs) and says which parent
each new hypothesis extends; target_service/engine.py moves the KV rows accordingly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specstream.data.engine import BeamHypothesis, BeamOptions

__all__ = ["BeamSearch", "Continuation"]

_PENALTY = -1.0e9  # transformers' "never choose this" offset, in float32 like its scores


@dataclass(frozen=True)
class Continuation:
    parent: int  # index of the hypothesis it extends, among the step's running ones
    token: int


class BeamSearch:
    """One beam request's search state: running hypotheses (generated tokens and float32 score)
    and the k-best finished list."""

    def __init__(self, options: BeamOptions, max_new_tokens: int, stop_ids: frozenset[int],
                 eos_ids: frozenset[int]) -> None:
        self.options = options
        self.k = options.num_beams
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids
        self.eos_ids = eos_ids
        self.limit = options.max_candidates_per_parent or self.k  # M
        # Candidates kept per step: enough that k survive even if every parent's best ones end. One
        # beam is greedy decoding (as in transformers, whatever length_penalty and early_stopping say):
        # the best token only, and the search ends with it.
        self.candidates = max(2, 1 + len(stop_ids)) * self.k if self.k > 1 else 1
        self.running: list[list[int]] = [[]]  # the prompt alone: one hypothesis with nothing generated
        self.scores = torch.zeros(1, dtype=torch.float32)  # [width] accumulated log-probabilities
        self.generated = 0  # tokens per running hypothesis (all have the same length)
        # The finished list: k entries, best first; empty entries score _PENALTY.
        self.finished: list[list[int] | None] = [None] * self.k
        self.finished_scores = torch.full((self.k,), _PENALTY, dtype=torch.float32)  # length-penalised
        self.finished_logprobs = torch.full((self.k,), _PENALTY, dtype=torch.float32)  # plain sums
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False
        self.expansions = 0  # hypothesis rows expanded, all steps

    @property
    def width(self) -> int:
        return len(self.running)

    def step(self, values: torch.Tensor, ids: torch.Tensor) -> list[Continuation]:
        """values [width, c] float32: each running hypothesis' c best accumulated scores (its
        score + log-softmax), best first; ids [width, c]: their tokens (c >= self.candidates,
        or the vocabulary when smaller). Returns the new running hypotheses' parents and tokens,
        best first (empty once the search is done)."""
        assert not self.done and values.shape[0] == self.width
        self.expansions += self.width
        flat = values.reshape(-1)  # [width * c]
        keep = min(self.candidates, flat.numel())
        top, where = torch.topk(flat, keep)  # [keep], best first
        parents = (where // values.shape[1]).tolist()
        tokens = ids.reshape(-1)[where].tolist()
        length = self.generated + 1
        ends = torch.tensor([t in self.stop_ids or length >= self.max_new_tokens for t in tokens])  # [keep]

        self._finish(top, ends, tokens, parents, length)
        chosen = self._continue(top, ends, parents)
        self.running = [self.running[parents[i]] + [tokens[i]] for i in chosen]
        self.scores = top[chosen] if chosen else torch.zeros(0, dtype=torch.float32)
        self.generated = length
        self._check_end(bool(ends.all()))
        return [] if self.done else [Continuation(parents[i], tokens[i]) for i in chosen]

    def _finish(self, top: torch.Tensor, ends: torch.Tensor, tokens: list[int], parents: list[int], length: int) -> None:
        """Candidates that end among the first k enter the finished list if they beat its worst."""
        ranked = torch.zeros_like(ends)
        ranked[: self.k] = True
        just_finished = ends & ranked  # [keep]
        scored = top / (length ** self.options.length_penalty)
        if bool(torch.all(self._full())) and self.options.early_stopping == "first_k":
            scored = scored + _PENALTY
        if not self.improvable:
            scored = scored + _PENALTY
        scored = scored + (~just_finished).to(torch.float32) * _PENALTY
        merged = torch.cat((self.finished_scores, scored))  # [k + keep]
        best = torch.topk(merged, self.k).indices.tolist()
        entries = self.finished + [self.running[p] + [t] for p, t in zip(parents, tokens)]
        logprobs = torch.cat((self.finished_logprobs, top))
        done = torch.cat((self._full(), just_finished))
        self.finished = [entries[i] if bool(done[i]) else None for i in best]
        self.finished_scores = merged[best]
        self.finished_logprobs = logprobs[best]

    def _full(self) -> torch.Tensor:
        return torch.tensor([h is not None for h in self.finished])  # [k]

    def _continue(self, top: torch.Tensor, ends: torch.Tensor, parents: list[int]) -> list[int]:
        """Indices of the candidates that run on: the best that do not end, at most M per parent,
        at most k, none more than δ below the best candidate or finished hypothesis. (With fewer
        than k that do not end, transformers runs ended ones on at a -1e9 score; that happens only
        at the length limit, where the search ends either way.)"""
        per_parent: dict[int, int] = {}
        chosen = []
        for i in range(top.numel()):  # best first
            if len(chosen) == self.k:
                break
            if bool(ends[i]) or per_parent.get(parents[i], 0) >= self.limit:
                continue
            per_parent[parents[i]] = per_parent.get(parents[i], 0) + 1
            chosen.append(i)
        threshold = self.options.beam_threshold
        if threshold != float("inf") and chosen:
            # δ is in nats of log-probability, as in the paper, and the best is taken on the
            # ranking's scale: a finished hypothesis counts with the score it would have at this
            # length (its sum / its length ** length_penalty × this length ** length_penalty), so a
            # shorter one does not prune longer ones the ranking may still put first. With
            # length_penalty 0 this is the paper's rule exactly.
            scale = (self.generated + 1) ** self.options.length_penalty
            finished = [float(v) * scale for v, h in zip(self.finished_scores, self.finished) if h is not None]
            best = max([float(top[chosen[0]]), *finished])
            chosen = [i for i in chosen if float(top[i]) >= best - threshold]
        return chosen

    def _check_end(self, all_end: bool) -> None:
        """transformers' stopping rule after a step, plus: nothing left running."""
        opts = self.options
        full = bool(torch.all(self._full()))
        if self.width:
            length = (self.max_new_tokens if opts.early_stopping == "never" and opts.length_penalty > 0.0
                      else self.generated)
            best_possible = self.scores[:1] / (length ** opts.length_penalty)  # the running best, scored
            worst = torch.where(self._full(), self.finished_scores.min(), torch.tensor(_PENALTY))  # [k]
            self.improvable = self.improvable and bool(torch.any(best_possible > worst))
        self.done = (not self.improvable or (full and opts.early_stopping == "first_k") or all_end
                     or not self.width)

    def results(self) -> list[BeamHypothesis]:
        """The best `num_return_sequences` finished hypotheses, best first."""
        out = []
        for tokens, score, logprob in zip(self.finished, self.finished_scores.tolist(), self.finished_logprobs.tolist()):
            if tokens is None or len(out) == self.options.num_return_sequences:
                continue
            last = tokens[-1]
            reason = "eos" if last in self.eos_ids else "stop" if last in self.stop_ids else "length"
            out.append(BeamHypothesis(list(tokens), score, logprob, reason))
        return out
