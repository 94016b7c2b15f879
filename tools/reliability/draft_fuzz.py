"""`specstream fuzz --draft-side`: a hostile draft service against a real target and gateway. A draft's
reply is untrusted input to the target (target_service/drafting.py, ``malformed``); this probe
proves that with real processes and the real draft's guesses.

``HostileDraft`` is the draft service's own servicer around the real proposer (the pair's draft,
built as the draft service builds it) that corrupts a seeded fraction of its replies, one way each, and counts
what it did per cause: a reply naming another sequence (``seq_id``), more tokens than asked
(``tokens``), an id outside the vocabulary (``token_id``), a held length past what it was sent and
guessed (``length``), a tree that is not one or was not asked for (a parent out of range or not
before its child, a path deeper than γ, parents missing, branches where none were allowed, a
sampled tree's sibling drawn twice: ``tree``; the target runs ``--gamma-policy fixed
--tree-branches 2``, so rows ask for trees and the real draft sends them), and for sampled rows a q table that is not a distribution per token
(a row's sum off 1, a negative or NaN probability, an id outside the vocabulary, no probability on
the drawn token, entries missing: ``q``). The start-up timing's sequence (id 0) is answered honestly: the
target does not verify its guesses.

The oracle, per request: the target runs coupled speculative sampling, so every answer, greedy or
sampled, must be the answer with ``speculation=off`` token for token, whatever the draft did; and
afterwards the target's ``specstream:draft_replies_malformed_total{cause}`` must equal what the
draft injected per cause (every corrupted reply refused for its row, and nothing else), and the
stack must still serve. Requests run several at a time, so corrupted rows share batches with
clean ones.

What it does not know: the public API's validation (``fuzz.py`` fuzzes that).
"""

from __future__ import annotations

import asyncio
import math
import random
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import grpc

from draft_service.server import DraftServicer
from specstream.data.propose import Proposer
from specstream.serving.metrics import MALFORMED_CAUSES, PREFIX, DraftMetrics
from tools.bench.passes import metric_samples
from tools.progress import Progress
from specstream_pb import draft_pb2, draft_pb2_grpc

__all__ = ["DraftFuzzReport", "HostileDraft", "fuzz_draft_side"]

TIMING_SEQ = 0  # the target's start-up timing of the draft (target_service/drafting.py): never corrupted
OUTSIDE = 1 << 24  # token ids from here on are outside any vocabulary this serves


class HostileDraft(DraftServicer):
    """The real draft service around the real proposer, ``rate`` of its replies corrupted (seeded);
    ``injected`` counts each cause."""

    def __init__(self, proposer: Proposer, compute: ThreadPoolExecutor, vocab_size: int, rate: float,
                 seed: int) -> None:
        super().__init__(proposer, compute, DraftMetrics())
        self.vocab_size, self.rate = vocab_size, rate
        self._rng = random.Random(seed)
        self.injected: Counter = Counter()
        self.replies = 0  # replies to the target's sequences (the timing's aside), corrupted or not

    def reply(self, item: draft_pb2.ProposeItem, proposal) -> draft_pb2.Proposal:
        pb = super().reply(item, proposal)
        if item.seq_id != TIMING_SEQ:
            self.replies += 1
            if pb.token_ids and self._rng.random() < self.rate:
                self.injected[self._corrupt(pb, item)] += 1
        return pb

    def _corrupt(self, pb: draft_pb2.Proposal, item: draft_pb2.ProposeItem) -> str:
        """Corrupts ``pb`` one way, drawn at random among those that apply; returns the cause."""
        rng, vocab = self._rng, self.vocab_size
        sampled = item.sampling.temperature > 0 and pb.q_width > 0
        cause = rng.choice(["seq_id", "tokens", "token_id", "length", "tree", *(["q"] * 2 if sampled else [])])
        if cause == "seq_id":
            pb.seq_id = item.seq_id + rng.randrange(1, 1 << 20)
        elif cause == "tokens":  # past the chain and every branch allowed
            extra = item.gamma + item.branches + 1 - len(pb.token_ids)
            pb.token_ids.extend(rng.randrange(vocab) for _ in range(extra))
            if pb.parents:
                pb.parents.extend([0] * extra)
        elif cause == "tree":
            self._corrupt_tree(pb, item)
        elif cause == "token_id":
            pb.token_ids[rng.randrange(len(pb.token_ids))] = OUTSIDE + rng.randrange(1 << 16)
        elif cause == "length":
            pb.length = item.rollback_to + len(item.append_token_ids) + len(pb.token_ids) + rng.randrange(1, 64)
        else:
            self._corrupt_q(pb)
        return cause

    def _corrupt_tree(self, pb: draft_pb2.Proposal, item: draft_pb2.ProposeItem) -> None:
        rng, n = self._rng, len(pb.token_ids)
        parents = list(pb.parents) or list(range(n))  # a chain's parents, where the draft sent none
        branched = [i for i in range(n) if pb.parents and pb.parents[i] != i]  # the branches sent
        if not item.branches:  # a tree where none was asked for (no room past the chain)
            how = "unasked"
        else:
            how = rng.choice(["range", "order", "missing", *(["deep"] if n <= item.gamma else []),
                              *(["twice"] if pb.q_width and branched else [])])
        if how in ("unasked", "range"):
            parents[rng.randrange(n)] = n + 1 + rng.randrange(8) if how == "range" else 0
            if how == "unasked" and n == 1:
                parents = [1]  # a single token's only wrong parent: itself
        elif how == "order":  # a parent at or after its child
            i = rng.randrange(n)
            parents[i] = i + 1 + rng.randrange(n - i)
        elif how == "twice":  # a sampled branch drawn again: the same token as its first sibling
            i = rng.choice(branched)
            pb.token_ids[i] = pb.token_ids[next(j for j in range(n) if parents[j] == parents[i])]
        elif how == "missing":
            parents = parents[:-1] if n > 1 else [0, 0]
        else:  # deeper than gamma: a chain one past it
            pb.token_ids.extend(rng.randrange(self.vocab_size) for _ in range(item.gamma + 1 - n))
            parents = list(range(item.gamma + 1))
        pb.parents[:] = parents

    def _corrupt_q(self, pb: draft_pb2.Proposal) -> None:
        rng, width = self._rng, pb.q_width
        row = rng.randrange(len(pb.token_ids))
        at = row * width
        how = rng.choice(["sum", "negative", "nan", "id", "support", "missing"])
        if how == "sum":
            for j in range(at, at + width):
                pb.q_probs[j] *= 0.5
        elif how == "negative":
            pb.q_probs[at + rng.randrange(width)] = -0.25
        elif how == "nan":
            pb.q_probs[at + rng.randrange(width)] = math.nan
        elif how == "id":
            pb.q_ids[at + rng.randrange(width)] = OUTSIDE + rng.randrange(1 << 16)
        elif how == "support":  # the drawn token's entries get no probability, the rest still sum to 1
            drawn = pb.token_ids[row]
            for j in range(at, at + width):
                if pb.q_ids[j] == drawn:
                    pb.q_ids[j] = (drawn + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size
        else:
            del pb.q_probs[-1]


@dataclass
class DraftFuzzReport:
    seed: int
    requests: int = 0
    sampled: int = 0
    mismatches: int = 0  # answers that differ from speculation=off
    failures: int = 0  # requests that failed
    replies: int = 0  # draft replies to the target's sequences
    injected: dict[str, int] = field(default_factory=dict)  # corrupted replies by cause
    refused: dict[str, int] = field(default_factory=dict)  # the target's count by cause
    accepted_tokens: int = 0  # guesses the target accepted (the clean replies still worked)
    seconds: float = 0.0
    serving_after: bool = False
    examples: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (not self.mismatches and not self.failures and self.serving_after and self.refused == self.injected
                and self.accepted_tokens > 0)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def fuzz_draft_side(models, requests: int = 200, seed: int = 0, rate: float = 0.25, concurrency: int = 4,
                    max_new_tokens: int = 24, quiet: bool = False) -> DraftFuzzReport:
    """``requests`` random requests (greedy and sampled, fixed γ and auto), each also with
    speculation off, through a target and gateway whose draft is a ``HostileDraft`` around the
    pair's draft (``models``: tools.bench.models.BenchModels)."""
    from draft_service.build import build_proposer
    from specstream.data.config import DraftConfig, ModelSpec
    from specstream.serving.compute import compute_executor
    from tools.launcher import Stack, StackSpec, free_port

    draft = models.require_draft()
    compute = compute_executor("hostile-draft", 1)
    proposer = compute.submit(build_proposer, DraftConfig(
        ModelSpec(str(draft), models.dtype), max_slots=2 * concurrency + 2, max_seq_len=2048,
        **models.proposing)).result()
    hostile = HostileDraft(proposer, compute, proposer.vocab_size, rate, seed)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="hostile-draft", daemon=True)
    thread.start()
    port = free_port()
    server = asyncio.run_coroutine_threadsafe(_serve(hostile, port), loop).result()
    report = DraftFuzzReport(seed=seed)
    try:
        with tempfile.TemporaryDirectory() as logs, Stack(StackSpec(
                str(models.target), None, dtype=models.dtype, weights=models.weights, max_slots=concurrency,
                log_dir=logs, metrics=True, gamma_policy="fixed", extra_target_args=[
                    "--draft-url", f"127.0.0.1:{port}", "--speculative-sampling", "coupled",
                    "--tree-branches", "2"])) as stack:
            asyncio.run(_run(stack, report, requests, seed, concurrency, max_new_tokens, quiet))
            report.refused = {cause: int(n) for cause, n in _refused(stack.metrics_addresses["target"]).items() if n}
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        compute.shutdown()
    report.replies, report.injected = hostile.replies, dict(sorted(hostile.injected.items()))
    report.refused = dict(sorted(report.refused.items()))
    return report


async def _serve(servicer: HostileDraft, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    draft_pb2_grpc.add_DraftServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def _run(stack, report: DraftFuzzReport, requests: int, seed: int, concurrency: int,
               max_new_tokens: int, quiet: bool) -> None:
    from specstream_client import AsyncClient

    rng = random.Random(seed + 1)
    started = time.monotonic()
    async with AsyncClient(stack.gateway_address, timeout=300) as client:
        info = await client.model_info()
        deadline = time.monotonic() + 120
        while not info.draft_model and time.monotonic() < deadline:  # the target found the draft
            await asyncio.sleep(0.2)
            info = await client.model_info()
        if not info.draft_model:
            raise RuntimeError("the target never connected to the hostile draft")
        cases = [_case(rng, info.vocab_size, max_new_tokens) for _ in range(requests)]
        gate = asyncio.Semaphore(concurrency)
        with Progress(len(cases), "requests", "fuzz --draft-side", quiet=quiet) as progress:

            async def one(case: dict) -> None:
                async with gate:
                    try:
                        spec = await client.generate(case["prompt"], **case["options"])
                        plain = await client.generate(case["prompt"], **{**case["options"], "speculation": "off"})
                    except Exception as exc:  # noqa: BLE001 - a failed request is a finding, not a crash of the probe
                        report.failures += 1
                        _example(report, case, f"{type(exc).__name__}: {exc}")
                        return
                    finally:
                        progress.update()
                report.requests += 1
                report.sampled += case["options"]["temperature"] > 0
                report.accepted_tokens += spec.stats.accepted_tokens
                if spec.token_ids != plain.token_ids:
                    report.mismatches += 1
                    _example(report, case, f"speculative {spec.token_ids} != plain {plain.token_ids}")

            await asyncio.gather(*(one(case) for case in cases))
        report.serving_after = bool((await client.generate([1, 2, 3], max_new_tokens=2)).token_ids)
    report.seconds = time.monotonic() - started


def _case(rng: random.Random, vocab: int, max_new_tokens: int) -> dict:
    sampled = rng.random() < 0.5
    options = {"max_new_tokens": rng.randint(4, max_new_tokens), "ignore_eos": True,
               "speculation": rng.choice(["auto", 1, 2, 3, 4, 6]),
               "temperature": rng.choice([0.6, 1.0, 1.4]) if sampled else 0.0}
    if sampled:
        options["seed"] = rng.randrange(1 << 30)
        if rng.random() < 0.3:
            options["top_k"] = rng.randint(2, 50)
    # Repetitive prompts now and then, so prompt lookup (when the pair proposes with it) fires too.
    base = [rng.randrange(vocab) for _ in range(rng.randint(2, 24))]
    prompt = base * rng.randint(1, 3) if rng.random() < 0.3 else base
    return {"prompt": prompt, "options": options}


def _example(report: DraftFuzzReport, case: dict, what: str) -> None:
    if len(report.examples) < 10:
        report.examples.append({"prompt": case["prompt"][:40], "options": case["options"], "got": what[:400]})


def _refused(address: str) -> dict[str, float]:
    """The target's count of malformed draft replies, by cause."""
    counts = dict.fromkeys(MALFORMED_CAUSES, 0.0)
    for labels, value in metric_samples(address, f"{PREFIX}draft_replies_malformed_total"):
        counts[labels["cause"]] = value
    return counts
