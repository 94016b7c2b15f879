"""Every rule a generation request (``SequenceRequest``) must keep, written once.

The gateway applies them to the request it builds from the public one, before any work, under its
limits (its own and the ones the targets report); the target engine applies them again to every
request it is sent, under its own (defence in depth: another gateway, an old one, a test). Both
call ``check_request``, so a request is refused with the same error, naming the field as the public
request spells it, wherever it is refused. One function per rule family; the families whose
values are dataclasses check themselves when built (``SamplingParams``, ``BeamOptions``).

What only the public encoding can get wrong (unknown fields, stop strings, a traceparent, chat
messages, ``top_logprobs`` without ``logprobs``) is the gateway's own (gateway/validation.py);
what only a target knows (a request id already running on its connection) is the engine's.
Plain data: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from specstream.data.beam import check_combination
from specstream.data.engine import SPECULATION_MODES, SequenceRequest, Speculation
from specstream.data.errors import InvalidArgumentError
from specstream.data.prefix import MAX_SALT_CHARS
from specstream.data.sampling import SamplingParams

__all__ = ["RequestLimits", "check_beam", "check_budget", "check_logprobs", "check_min_tokens", "check_prompt",
           "check_cache_salt", "check_constraint", "check_penalties", "check_request", "check_speculation", "check_stop_ids"]


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit, as the side that checks it knows it."""

    vocab_size: int  # every token id is below it
    max_context_length: int  # prompt + max_new_tokens, at most
    max_new_tokens: int  # the budget's own limit (the gateway's; the engine's is its context)
    max_gamma: int  # proposals per step, at most
    max_top_logprobs: int  # alternatives per token, at most
    max_beams: int = 0  # num_beams, at most (the target's slots and rows per step); 0: not known here


def check_request(req: SequenceRequest, limits: RequestLimits, prompt_field: str = "prompt_token_ids",
                  stop_strings: int = 0, asked: SamplingParams | None = None) -> None:
    """Raises InvalidArgumentError naming the first field that breaks a rule. The gateway says
    more of the public request than the engine's request keeps: ``prompt_field``, how the prompt
    came (``prompt``, ``messages`` or ``prompt_token_ids``); ``stop_strings``, how many stop
    strings; ``asked``, the sampling settings as written (cuts a greedy request ignores included)."""
    check_prompt(req.prompt_token_ids, limits, prompt_field)
    check_budget(req.max_new_tokens, len(req.prompt_token_ids), limits)
    check_min_tokens(req.min_tokens, req.max_new_tokens)
    check_stop_ids(sorted(req.stop_token_ids), limits)
    check_speculation(req.speculation, limits)
    check_logprobs(req.logprobs, limits)
    if req.beam is not None:
        check_beam(req, limits, stop_strings, asked)
    if req.constraint is not None:
        check_constraint(req)
    if req.penalties is not None:
        check_penalties(req, limits)
    check_cache_salt(req.cache_salt)


def check_cache_salt(salt: str) -> None:
    """A salt is a name, not a payload: at most MAX_SALT_CHARS characters."""
    if len(salt) > MAX_SALT_CHARS:
        raise InvalidArgumentError("cache_salt", f"<{len(salt)} characters>", f"longer than {MAX_SALT_CHARS} characters")


def check_prompt(ids: list[int], limits: RequestLimits, field: str = "prompt_token_ids") -> None:
    """At least one token, every id in the vocabulary, and room left for one new token."""
    if not ids:
        raise InvalidArgumentError(field, [], "must not be empty")
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidArgumentError(field, bad, f"token id must be < vocab size {limits.vocab_size}")
    if len(ids) >= limits.max_context_length:
        raise InvalidArgumentError(field, f"<{len(ids)} tokens>",
                                   f"prompt is longer than the context length {limits.max_context_length} "
                                   "(leave room for at least one new token)")


def check_budget(max_new_tokens: int, prompt_len: int, limits: RequestLimits) -> None:
    """1..the limit, and the prompt plus the budget within the context."""
    if max_new_tokens <= 0:
        raise InvalidArgumentError("max_new_tokens", max_new_tokens, "must be >= 1")
    if max_new_tokens > limits.max_new_tokens:
        raise InvalidArgumentError("max_new_tokens", max_new_tokens, f"must be <= {limits.max_new_tokens}")
    if prompt_len + max_new_tokens > limits.max_context_length:
        raise InvalidArgumentError("max_new_tokens", max_new_tokens,
                                   f"prompt ({prompt_len} tokens) + max_new_tokens exceeds the context length "
                                   f"{limits.max_context_length}")


def check_min_tokens(min_tokens: int, max_new_tokens: int) -> None:
    """0..max_new_tokens: EOS and the stop ids cannot end generation before this many tokens."""
    if not 0 <= min_tokens <= max_new_tokens:
        raise InvalidArgumentError("min_tokens", min_tokens, f"must be in 0..max_new_tokens ({max_new_tokens})")


def check_stop_ids(ids: Iterable[int], limits: RequestLimits) -> None:
    """Every id in the vocabulary; the index in the message counts ``ids`` as given."""
    for i, token in enumerate(ids):
        if not 0 <= token < limits.vocab_size:
            raise InvalidArgumentError(f"stop_token_ids[{i}]", token, f"token id must be < vocab size {limits.vocab_size}")


def check_speculation(spec: Speculation, limits: RequestLimits) -> None:
    """A known mode; γ (fixed mode only) 1..max_gamma; the controller's cap (auto mode only)
    0..max_gamma, 0 meaning the server's limit."""
    if spec.mode not in SPECULATION_MODES:
        raise InvalidArgumentError("speculation.mode", spec.mode, f"unknown mode; use one of {list(SPECULATION_MODES)}")
    if spec.mode == "fixed":
        if not 1 <= spec.gamma <= limits.max_gamma:
            raise InvalidArgumentError("speculation.gamma", spec.gamma, f"must be in 1..{limits.max_gamma}")
    elif spec.gamma != 0:
        raise InvalidArgumentError("speculation.gamma", spec.gamma,
                                   f"only applies with mode fixed (mode is {spec.mode})")
    if spec.mode == "auto":
        if not 0 <= spec.max_gamma <= limits.max_gamma:
            raise InvalidArgumentError("speculation.max_gamma", spec.max_gamma,
                                       f"must be in 0..{limits.max_gamma} (0: the server's limit)")
    elif spec.max_gamma != 0:
        raise InvalidArgumentError("speculation.max_gamma", spec.max_gamma,
                                   f"only applies with mode auto (mode is {spec.mode})")


def check_logprobs(top: int | None, limits: RequestLimits) -> None:
    """None: not asked; else 0..max_top_logprobs alternatives per token."""
    if top is not None and not 0 <= top <= limits.max_top_logprobs:
        raise InvalidArgumentError("top_logprobs", top, f"must be in 0..{limits.max_top_logprobs}")


def check_beam(req: SequenceRequest, limits: RequestLimits, stop_strings: int = 0,
               asked: SamplingParams | None = None) -> None:
    """Beam search: greedy (``asked``, else the request's sampling settings), without logprobs,
    stop strings or min_tokens, and no wider than the target can hold (where that is known). The
    options checked themselves (``BeamOptions``)."""
    assert req.beam is not None
    if limits.max_beams and req.beam.num_beams > limits.max_beams:
        raise InvalidArgumentError("beam.num_beams", req.beam.num_beams,
                                   f"must be <= {limits.max_beams} (this target's slots and rows per step)")
    sampling = asked or req.sampling
    check_combination(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                      fixed_speculation=req.speculation.mode == "fixed", logprobs=req.logprobs is not None,
                      stop_strings=stop_strings, min_tokens=req.min_tokens)


def check_penalties(req: SequenceRequest, limits: RequestLimits) -> None:
    """Penalties (their ranges checked as built) name tokens of the vocabulary, and apply to one
    sequence: no beam."""
    assert req.penalties is not None
    req.penalties.check_ids(limits.vocab_size)
    if req.beam is not None:
        raise InvalidArgumentError("beam", req.beam.num_beams, "cannot be combined with penalties or logit_bias")


def check_constraint(req: SequenceRequest) -> None:
    """A constrained request (its ``Constraint`` checked itself; the grammar compiles where the
    tokenizer is) is one sequence whose end the grammar decides: no beam, no min_tokens."""
    assert req.constraint is not None
    if req.beam is not None:
        raise InvalidArgumentError("beam", req.beam.num_beams, f"cannot be combined with {req.constraint.field}")
    if req.min_tokens:
        raise InvalidArgumentError("min_tokens", req.min_tokens,
                                   f"cannot be combined with {req.constraint.field} (the grammar decides where "
                                   "the output may end)")
