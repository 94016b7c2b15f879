"""Continuing a request on another target replica after the one running it was lost.

A request that had started on a replica that then broke its stream or stalled is sent again as
its *continuation*: the admitted request with the tokens already received appended to the prompt
and the budget reduced by as many; every other option (stop ids, EOS ids, sampling and seed,
speculation, logprobs, beam, traceparent) unchanged. The engine treats it as any request, so:

- greedy decoding continues exactly as an uninterrupted run would (the next token is the argmax
  after the same prefix);
- seeded sampling keys its randomness by (seed, absolute position in prompt + generated)
  (kernels/random.py), and the continuation's prompt holds the tokens generated so far, so
  the first new token has the same absolute position (original prompt length + tokens so far) as
  it would have had: no extra field is needed on the wire. Without speculation the rest is then
  the uninterrupted run's, token for token (tests/test_resume_contract.py). With speculation it
  is an exact sample from the same distribution but in general other tokens: what a speculative
  step commits depends on where step boundaries fall, not only on (seed, position);
- a beam request reports its tokens only when its search ends, so when it is lost nothing has
  been received and its continuation is the original request: the search starts over.

The speculation stats a replica reports are cumulative for the sequence it ran; `merge_stats`
adds those of the lost attempts to the current one's, so the caller's stats count all the work.

Plain data (specstream/data/engine.py). Knows nothing about routing, streams, protobuf or the
caller's text (the gateway's detokenizer and stop string state live in the request pipeline and
simply carry on).
"""

from __future__ import annotations

import dataclasses

from specstream.data.engine import SequenceRequest, SequenceStats


def continuation(original: SequenceRequest, generated: list[int]) -> SequenceRequest:
    """`original` continued after `generated` (the token ids already received for it)."""
    assert len(generated) < original.max_new_tokens, (len(generated), original.max_new_tokens)
    return dataclasses.replace(original, prompt_token_ids=[*original.prompt_token_ids, *generated],
                               max_new_tokens=original.max_new_tokens - len(generated))


def merge_stats(before: SequenceStats, now: SequenceStats) -> SequenceStats:
    """The stats of a request that ran as `before` (lost attempts, cumulative) and then `now`:
    counters and histograms add; tokens per decode pass is re-weighted by decode passes (the
    histogram's total); the γ controller's α estimate is the latest attempt's."""
    passes_before, passes_now = sum(before.gamma_histogram), sum(now.gamma_histogram)
    passes = passes_before + passes_now
    emitted = before.mean_accepted_length * passes_before + now.mean_accepted_length * passes_now
    return SequenceStats(
        draft_tokens=before.draft_tokens + now.draft_tokens,
        accepted_tokens=before.accepted_tokens + now.accepted_tokens,
        target_passes=before.target_passes + now.target_passes,
        mean_accepted_length=emitted / passes if passes else 0.0,
        rejections=before.rejections + now.rejections,
        gamma_histogram=_add(before.gamma_histogram, now.gamma_histogram),
        alpha_estimate=now.alpha_estimate if passes_now else before.alpha_estimate,
        beam_expansions=before.beam_expansions + now.beam_expansions,
        accepted_per_position=_add(before.accepted_per_position, now.accepted_per_position),
        branch_histogram=_add(before.branch_histogram, now.branch_histogram),
        branch_tokens=before.branch_tokens + now.branch_tokens)


def _add(a: list[int], b: list[int]) -> list[int]:
    longer, shorter = (list(a), b) if len(a) >= len(b) else (list(b), a)
    for i, value in enumerate(shorter):
        longer[i] += value
    return longer
