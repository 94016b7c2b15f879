"""The gateway's core, shared by its two fronts (gRPC `Generation` and the OpenAI-compatible HTTP
API): admission (a bound on requests in flight), validation and tokenization, the request pipeline
through the `Router`, and what the served model is.

Both fronts hand it a public `GenerateRequest` and get back `GenerateStreamResponse` chunks (or
one `GenerateResponse`), so they share one path and differ only in encoding. Knows nothing about
either front's wire format or status codes: errors are `specstream.data.errors` exceptions.

Validation and tokenization run on `tokenize_threads` worker threads, not on the event loop: a
prompt of the largest size allowed takes a few hundred milliseconds to tokenize, and on the loop
that would stall every other request's stream as long (the tokenizer releases the GIL). The
workers run at a lower CPU priority (`TOKENIZE_NICE`): where the gateway shares cores with a
target, a huge prompt is tokenized on spare cycles instead of slowing the engine's steps.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from gateway import request as pipeline
from gateway import samples
from gateway.router import Router
from gateway.validation import Limits, ValidRequest, validate
from specstream.data.prefix import caller_salt
from specstream.data.config import GatewayConfig
from specstream.data.engine import TargetInfo
from specstream.data.errors import OverloadedError
from specstream.serving.metrics import GatewayMetrics
from specstream.text.grammar import GrammarCompiler
from specstream.text.tokenizer import TextTokenizer
from specstream_pb import generation_pb2

log = logging.getLogger(__name__)
TOKENIZE_NICE = 10  # the tokenize workers' niceness above the process's (Linux: per thread)


def _lower_priority() -> None:
    """Thread initializer: this worker yields the CPU to the event loop and to any colocated
    engine. Where threads cannot be reniced, it keeps the process's priority."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + TOKENIZE_NICE)
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed
        log.debug("tokenize worker keeps its priority: %s", exc)


class Gateway:
    def __init__(self, config: GatewayConfig, router: Router, info: TargetInfo,
                 tokenizer: TextTokenizer, metrics: GatewayMetrics) -> None:
        self.config = config
        self.router = router
        self.metrics = metrics
        self.info = info  # what every replica serves (gateway.server.common_info)
        self.tokenizer = tokenizer
        self.grammars = GrammarCompiler(tokenizer)  # refuses a bad constraint before any target sees it
        self.limits = Limits.build(config, info)
        self.eos_ids = tuple(sorted(set(info.eos_token_ids) | set(tokenizer.eos_token_ids)))  # as validate adds them
        # Admitted requests, by id(): each holds one of `max_in_flight` places from `admit` until
        # `release` (the reference keeps its id unique while it is held).
        self._held: dict[int, ValidRequest] = {}
        self._validating = 0  # requests past the in-flight check, being validated (they hold a place too)
        self._workers = ThreadPoolExecutor(config.tokenize_threads, thread_name_prefix="tokenize",
                                           initializer=_lower_priority)

    @property
    def in_flight(self) -> int:
        return len(self._held) + self._validating

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def serving(self) -> bool:
        """At least one replica can take requests."""
        return self.router.serving

    async def admit(self, request: generation_pb2.GenerateRequest, fill_max_new_tokens: bool = False,
                    authorization: str | None = None) -> ValidRequest:
        """Refuses the request when `max_in_flight` are being served (OverloadedError), else
        validates and tokenizes it on a worker thread (InvalidArgumentError naming the field). It
        holds a place from the check on, so requests arriving together cannot all pass the bound
        before any counts. `stream`/`generate` release the place when they end; a caller that
        admits and never calls them must `release` it. `fill_max_new_tokens`: max_new_tokens 0
        means as many as fit (OpenAI's unset max_tokens). ``authorization``: the caller's bearer
        token, when callers need one: its prompts are cached apart from other callers'
        (specstream/data/prefix.py ``caller_salt``)."""
        if self.in_flight >= self.config.max_in_flight:
            raise OverloadedError(f"{self.in_flight} requests in flight (max_in_flight={self.config.max_in_flight}); "
                                  "retry later")
        self._validating += 1
        try:
            valid = await asyncio.get_running_loop().run_in_executor(self._workers, functools.partial(
                validate, request, self.limits, self.tokenizer, fill_max_new_tokens=fill_max_new_tokens,
                grammars=self.grammars))
        finally:
            self._validating -= 1
        valid.model = self.model_name
        if authorization:
            valid.sequence.cache_salt = caller_salt(authorization, valid.sequence.cache_salt)
        self._held[id(valid)] = valid  # no await since the check above: the place passes on to it
        return valid

    async def admit_samples(self, request: generation_pb2.GenerateRequest, fill_max_new_tokens: bool = False,
                            authorization: str | None = None) -> list[ValidRequest]:
        """``admit`` for each of the request's ``n`` samples (gateway/samples.py: InvalidArgumentError
        naming ``n`` where it breaks the rule); each holds a place. One refused: none is held."""
        admitted: list[ValidRequest] = []
        try:
            for sample in samples.split(request):
                admitted.append(await self.admit(sample, fill_max_new_tokens, authorization))
        except BaseException:
            for valid in admitted:
                self.release(valid)
            raise
        return admitted

    def release(self, valid: ValidRequest) -> None:
        """Gives back the place `admit` held for `valid`; idempotent."""
        if self._held.get(id(valid)) is valid:
            del self._held[id(valid)]

    async def stream(self, valid: ValidRequest) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        """The request's chunks (deltas; the last has finish_reason, usage, stats and timings).
        Counts as in flight until the iteration ends; leaving early cancels it on the target."""
        try:
            async for chunk in pipeline.stream_chunks(valid, self.router, self.tokenizer, self.metrics):
                yield chunk
        finally:
            self.release(valid)

    async def generate(self, valid: ValidRequest) -> generation_pb2.GenerateResponse:
        try:
            return await pipeline.generate(valid, self.router, self.tokenizer, self.metrics)
        finally:
            self.release(valid)

    async def generate_samples(self, valids: list[ValidRequest]) -> generation_pb2.GenerateResponse:
        """One response for a request's samples (``admit_samples``): the first's, with every one in
        ``samples`` (none for a single one); one failed: the others are cancelled."""
        try:
            responses = await samples.gather([self.generate(valid) for valid in valids])
        finally:  # also for a sample cancelled before its task began (its own release never ran)
            for valid in valids:
                self.release(valid)
        return responses[0] if len(responses) == 1 else samples.response(responses)

    async def stream_samples(self, valids: list[ValidRequest]) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        """The chunks of a request's samples as they come, each with its sample's ``index``."""
        if len(valids) == 1:
            async for chunk in self.stream(valids[0]):
                yield chunk
            return
        async for i, chunk in samples.interleaved([self.stream(valid) for valid in valids]):
            chunk.index = i
            yield chunk
