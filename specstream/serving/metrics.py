"""Prometheus metrics of the three services, named after vLLM's `vllm:` metrics (docs/observability.md).

Each service builds one `GatewayMetrics`, `TargetMetrics` or `DraftMetrics`. Each owns a
`CollectorRegistry` of its own, never prometheus_client's global one, so several services in one
process (tests) never collide, and `start_metrics_server` serves that registry on `/metrics` from
prometheus_client's own HTTP server thread. The services call one small hook per event (a decode
step, an accepted run, a token chunk, a finished request, a propose batch); gauges of queue lengths
are read when scraped, from the HTTP thread (a `len()` or an int read, atomic under the GIL).

Knows nothing about models, scheduling or gRPC; reads only the protobuf fields it is handed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.context_managers import Timer

from specstream_pb import common_pb2, generation_pb2

PREFIX = "specstream:"

# Bucket bounds in seconds: vLLM's, extended downwards because a small model on a CPU decodes a
# token in milliseconds.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                   30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
PROPOSE_BUCKETS = (0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Finish reasons exported from the start (at 0), so a rate() over them has a series from the first scrape.
FINISH_REASONS = ("length", "stop", "eos", "tool_calls")
# The parts of a decode pass (TargetMetrics.pass_seconds): the target's compute call, waiting for
# the draft, and the engine's host work around them.
PASS_PARTS = ("target", "draft", "host")
# Why a draft's reply is refused for its row (target_service/drafting.py's `malformed`), kept here
# rather than there: the gateway imports this module without the target's code.
MALFORMED_CAUSES = ("seq_id", "tokens", "token_id", "length", "q", "tree")


def finish_reason_label(value: int) -> str:
    """common.FinishReason -> its lower-case name without the prefix: FINISH_REASON_EOS -> "eos"."""
    return common_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def occupancy_buckets(max_batch: int) -> tuple[int, ...]:
    """Rows per decode step: every count up to 16 (exact for the usual batch sizes), then powers of
    two, and max_batch itself."""
    bounds = set(range(1, min(max_batch, 16) + 1)) | {2**i for i in range(5, 31) if 2**i <= max_batch}
    return tuple(sorted(bounds | {max_batch}))


class GatewayMetrics:
    """Per-request latencies and token counts, as the gateway (and so the caller) sees them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds",
                              "Gateway receipt to the first token chunk, per finished request.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds",
                             "Time between successive token chunks of a request divided by the chunk's tokens, "
                             "observed once per token after the first chunk.", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds",
                             "Gateway receipt to the final chunk, per finished request.",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram(f"{PREFIX}request_queue_time_seconds",
                               "Wait before prefill (gateway queue + target queue), per finished request.",
                               buckets=REQUEST_BUCKETS, registry=r)
        self.running = Gauge(f"{PREFIX}num_requests_running",
                             "Requests in flight that have left the gateway's queue (sent to a target replica).",
                             registry=r)
        self.waiting = Gauge(f"{PREFIX}num_requests_waiting",
                             "Requests in the gateway's queue, waiting for a replica with room.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens",
                                         "Tokens returned to callers (after stop strings cut them).", registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.success = Counter(f"{PREFIX}request_success", "Finished requests by finish reason.",
                               ["finish_reason"], registry=r)
        self.resumed = Counter(f"{PREFIX}requests_resumed",
                               "Requests moved to another target replica after they had started there (the replica's "
                               "stream broke or it stopped stepping); each move counts.", registry=r)
        # Per replica: what its prefix cache served of the prompts this gateway sent it.
        self.replica_prompt_tokens = Counter(f"{PREFIX}replica_prompt_tokens", "Prompt tokens of finished requests, "
                                             "by the target replica that served them.", ["replica"], registry=r)
        self.replica_cached_tokens = Counter(f"{PREFIX}replica_cached_tokens", "Of those, the tokens the replica's "
                                             "prefix cache served (its hit rate: this over replica_prompt_tokens).",
                                             ["replica"], registry=r)
        for reason in FINISH_REASONS:
            self.success.labels(finish_reason=reason)

    def watch_requests(self, in_flight: Callable[[], int], queued: Callable[[], int]) -> None:
        """The gauges read these when scraped: requests admitted and not yet finished (queued ones
        included), and requests in the gateway's queue. Running is their difference, so running +
        waiting is everything in flight, as in vLLM, where the two are disjoint."""
        self.running.set_function(lambda: max(in_flight() - queued(), 0))
        self.waiting.set_function(queued)

    def request(self) -> RequestObserver:
        return RequestObserver(self)


class RequestObserver:
    """One gateway request: `tokens` for every chunk, `finished` once with the final chunk."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics
        self._last: float | None = None  # when the previous chunk with tokens arrived

    def tokens(self, count: int, now: float) -> None:
        """A chunk of `count` tokens reached the gateway at `now` (time.monotonic())."""
        if count == 0:
            return
        m = self._metrics
        m.generation_tokens.inc(count)
        if self._last is not None:
            # Per token, so the histogram's sum is the decode time and its count the tokens.
            gap = (now - self._last) / count
            for _ in range(count):
                m.itl.observe(gap)
        self._last = now

    def resumed(self) -> None:
        """The request continues on another replica after its own was lost."""
        self._metrics.resumed.inc()

    def finished(self, chunk: generation_pb2.GenerateStreamResponse, replica: str = "") -> None:
        """The final chunk (with finish_reason, usage and timings) is about to go to the caller;
        ``replica``: the one that served it (its label on the per-replica counters)."""
        m, timings = self._metrics, chunk.timings
        m.success.labels(finish_reason=finish_reason_label(chunk.finish_reason)).inc()
        m.prompt_tokens.inc(chunk.usage.prompt_tokens)
        if replica:
            m.replica_prompt_tokens.labels(replica=replica).inc(chunk.usage.prompt_tokens)
            m.replica_cached_tokens.labels(replica=replica).inc(chunk.usage.cached_tokens)
        m.ttft.observe(timings.time_to_first_token_seconds)
        m.e2e.observe(timings.total_seconds)
        m.queue.observe(timings.queue_seconds)


class TargetMetrics:
    """The engine's steps, batch occupancy and speculation counters."""

    def __init__(self, max_gamma: int, max_batch: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge(f"{PREFIX}num_requests_running", "Sequences holding a KV-cache slot.", registry=r)
        self.waiting = Gauge(f"{PREFIX}num_requests_waiting", "Sequences waiting for a slot.", registry=r)
        self.steps = Counter(f"{PREFIX}engine_steps", "Decode steps (one verify forward each).", registry=r)
        self.occupancy = Histogram(f"{PREFIX}batch_occupancy", "Rows expanded per decode step.",
                                   buckets=occupancy_buckets(max_batch), registry=r)
        self.drafts = Counter(f"{PREFIX}spec_decode_num_drafts", "Decode passes that verified at least one proposal.",
                              registry=r)
        self.draft_tokens = Counter(f"{PREFIX}spec_decode_num_draft_tokens", "Proposals verified.", registry=r)
        self.observe_ahead = WorkAheadCounter(r).observe  # a draft in this process working ahead
        self.accepted_tokens = Counter(f"{PREFIX}spec_decode_num_accepted_tokens",
                                       "Accepted proposals that were emitted.", registry=r)
        self.accepted_per_pos = Counter(f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted proposals by their position in the run (1: first proposal).",
                                        ["position"], registry=r)
        self._per_pos = [self.accepted_per_pos.labels(position=str(i)) for i in range(1, max_gamma + 1)]
        # The γ controller (target_service/gamma.py): what it chose, what it believes, how well it predicts.
        self.gamma = Histogram(f"{PREFIX}spec_decode_gamma", "γ given to each row of each decode step (0: none).",
                               buckets=gamma_buckets(max_gamma), registry=r)
        self.branches = Histogram(f"{PREFIX}spec_decode_branches",
                                  "Branches beside the chain of each drafting row of each decode step (0: a chain).",
                                  buckets=gamma_buckets(max_gamma), registry=r)
        self.branch_tokens = Counter(f"{PREFIX}spec_decode_num_branch_tokens",
                                     "Accepted proposals that were branches beside the draft's chain.", registry=r)
        self.alpha = Gauge(f"{PREFIX}gamma_controller_alpha",
                           "Pooled acceptance estimate per proposer and kind of request (greedy or sampled).",
                           ["proposer", "kind"], registry=r)
        self.cost = Gauge(f"{PREFIX}gamma_controller_cost_seconds",
                          "The controller's cost model: verify = v0 + v1·tokens, draft = d0 + d1·depth + d2·proposals, "
                          "other = the rest of a step.", ["term"], registry=r)
        self.predicted_step = Gauge(f"{PREFIX}gamma_controller_predicted_step_seconds",
                                    "Predicted time of the last decode step the controller planned.", registry=r)
        self.measured_step = Gauge(f"{PREFIX}gamma_controller_measured_step_seconds",
                                   "Measured time of that step.", registry=r)
        # Where a decode pass's time goes, by the engine's own clock (target_service/engine.py,
        # EngineTimings): passes that prefilled nothing, whose parts add up to the pass.
        self.pass_seconds = Counter(f"{PREFIX}decode_pass_seconds",
                                    "Time of decode passes that prefilled nothing, by part: target (the compute "
                                    "call: the layers, the output layer, verification), draft (waiting for the "
                                    "proposals: building the items, the draft's round trip or in-process work), "
                                    "host (the rest: scheduling, committing, emitting, hops between threads).",
                                    ["part"], registry=r)
        self._pass_parts = {part: self.pass_seconds.labels(part=part) for part in PASS_PARTS}
        self.passes = Counter(f"{PREFIX}decode_passes", "Decode passes that prefilled nothing (the passes "
                              "decode_pass_seconds times).", registry=r)
        # Draft replies refused as malformed (target_service/drafting.py, ``malformed``): the row decodes plainly.
        self.malformed_replies = Counter(f"{PREFIX}draft_replies_malformed",
                                         "Draft replies refused for their row as malformed, by cause: seq_id "
                                         "(names another sequence), tokens (more than asked), token_id (outside "
                                         "the vocabulary), length (holds more than it was sent and guessed), q "
                                         "(not a distribution per token, or none on the token drawn).",
                                         ["cause"], registry=r)
        for cause in MALFORMED_CAUSES:  # exported at 0 from the start
            self.malformed_replies.labels(cause=cause)
        # Constrained requests (target_service/grammar_rows.py).
        self.constrained = Counter(f"{PREFIX}constrained_requests", "Requests admitted with a constraint, by kind "
                                   "(json_schema, json_object, regex, grammar, choice).", ["kind"], registry=r)
        self.grammar_mask = Histogram(f"{PREFIX}grammar_mask_seconds", "Time to fill the grammar masks of a decode "
                                      "pass's constrained rows (all their positions, on a thread beside the "
                                      "forward).", buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3),
                                      registry=r)
        self.grammar_cut = Counter(f"{PREFIX}grammar_cut_draft_tokens", "Proposals cut before verification because "
                                   "the request's grammar refuses them (or a token before them).", registry=r)
        self.forced_tokens = Counter(f"{PREFIX}grammar_forced_tokens", "Tokens proposed because the request's "
                                     "grammar allows nothing else there, or allows one text there and these are "
                                     "its likely tokens (no model guessed them).", registry=r)
        # The prefix cache (specstream/models/prefix_cache.py), by vLLM's names: tokens, not requests.
        self.prefix_queries = Counter(f"{PREFIX}prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "(the full blocks before each admitted prompt's last token).", registry=r)
        self.prefix_hits = Counter(f"{PREFIX}prefix_cache_hits", "Prompt tokens served from the prefix cache "
                                   "(not prefilled).", registry=r)
        # A feature draft's prefix cache (target_service/drafting.py ``_cached_prefix``).
        self.draft_prefix_queries = Counter(f"{PREFIX}draft_prefix_cache_queries", "Prompt tokens the target's "
                                            "prefix cache served that a feature draft was expected to hold too "
                                            "(their features not sent).", registry=r)
        self.draft_prefix_hits = Counter(f"{PREFIX}draft_prefix_cache_hits", "Of draft_prefix_cache_queries, the "
                                         "tokens the draft held (the rest were sent on its next call).", registry=r)
        self.draft_prefix_bytes = Counter(f"{PREFIX}draft_prefix_feature_bytes_saved", "Feature bytes not sent to "
                                          "the draft because it held the prefix.", registry=r)
        self.prefix_slots = Gauge(f"{PREFIX}prefix_cache_slots", "KV-cache slots holding finished sequences' "
                                  "prefixes for reuse.", registry=r)
        self.forward_threads = Gauge(f"{PREFIX}forward_threads", "CPU threads the target's forwards run on now "
                                     "(fewer while the process gets less CPU time than they need: "
                                     "specstream/serving/thread_governor.py).", registry=r)
        # Beam search (target_service/beam.py).
        self.beam_width = Histogram(f"{PREFIX}beam_width", "Running hypotheses of a beam request at each step it is "
                                    "expanded (variable width prunes below num_beams).",
                                    buckets=occupancy_buckets(max_batch), registry=r)
        self.beam_expansions = Counter(f"{PREFIX}beam_expansions", "Beam hypothesis rows expanded (candidate "
                                       "expansions): per step, their rate over engine_steps'.", registry=r)
        self.beam_requests = Counter(f"{PREFIX}beam_requests", "Beam requests admitted, by whether others were "
                                     "running (refill: streaming top-up) or the batch was empty (start).",
                                     ["admission"], registry=r)
        self.beam_finished_expansions = Histogram(f"{PREFIX}beam_request_expansions", "Hypothesis rows a beam "
                                                  "request expanded in all, at its end.",
                                                  buckets=(1, 4, 16, 64, 256, 1024, 4096), registry=r)

    def observe_gammas(self, gammas: list[int], branches: list[int] = ()) -> None:
        """Each row's chain of γ and (rows that drafted) the branches beside it."""
        for g in gammas:
            self.gamma.observe(g)
        for g, b in zip(gammas, branches):
            if g:
                self.branches.observe(b)

    def observe_prefix(self, queried: int, hit: int) -> None:
        """An admitted prompt: its reusable tokens and those the prefix cache served."""
        self.prefix_queries.inc(queried)
        if hit:
            self.prefix_hits.inc(hit)

    def observe_draft_prefix(self, claimed: int, restored: int, saved_bytes: int) -> None:
        self.draft_prefix_queries.inc(claimed)
        self.draft_prefix_hits.inc(restored)
        self.draft_prefix_bytes.inc(saved_bytes)

    def observe_grammar(self, mask_seconds: float, cut: int, forced: int) -> None:
        """A decode pass with constrained rows: the time of their masks, proposals the grammar cut,
        forced tokens proposed."""
        self.grammar_mask.observe(mask_seconds)
        if cut:
            self.grammar_cut.inc(cut)
        if forced:
            self.forced_tokens.inc(forced)

    def observe_branch_tokens(self, kept: int) -> None:
        if kept:
            self.branch_tokens.inc(kept)

    def observe_controller(self, alphas: dict[tuple[str, bool], float], costs: dict[str, float],
                           predicted_s: float, measured_s: float) -> None:
        """The controller's state after a step: pooled α per (proposer, greedy), cost terms, and the
        step time it predicted (0: it made no prediction) beside the measured one."""
        for (proposer, greedy), value in alphas.items():
            self.alpha.labels(proposer=proposer, kind="greedy" if greedy else "sampled").set(value)
        for term, value in costs.items():
            self.cost.labels(term=term).set(value)
        if predicted_s > 0.0:
            self.predicted_step.set(predicted_s)
            self.measured_step.set(measured_s)

    def watch_sequences(self, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        self.running.set_function(running)
        self.waiting.set_function(waiting)

    def observe_pass(self, seconds: dict[str, float]) -> None:
        """A decode pass that prefilled nothing took ``seconds`` per part (PASS_PARTS)."""
        self.passes.inc()
        for part, value in seconds.items():
            self._pass_parts[part].inc(value)

    def observe_malformed(self, cause: str) -> None:
        self.malformed_replies.labels(cause=cause).inc()

    def observe_step(self, rows: int) -> None:
        """A decode step expanded `rows` rows."""
        self.steps.inc()
        self.occupancy.observe(rows)

    def observe_beam_admission(self, refill: bool) -> None:
        self.beam_requests.labels(admission="refill" if refill else "start").inc()

    def observe_beam_step(self, width: int) -> None:
        """A beam request expanded `width` hypotheses in a step."""
        self.beam_width.observe(width)
        self.beam_expansions.inc(width)

    def observe_beam_end(self, expansions: int) -> None:
        self.beam_finished_expansions.observe(expansions)

    def observe_accept(self, proposed: int, accepted: int) -> None:
        """One row's pass verified `proposed` proposals and emitted the first `accepted` of them."""
        if proposed == 0:
            return
        self.drafts.inc()
        self.draft_tokens.inc(proposed)
        self.accepted_tokens.inc(accepted)
        for i in range(accepted):
            child = self._per_pos[i] if i < len(self._per_pos) else self.accepted_per_pos.labels(position=str(i + 1))
            child.inc()


def gamma_buckets(max_gamma: int) -> list[float]:
    """Upper bounds 0, 1, 2, 3, 4, 6, 8, 12, 16, ... up to max_gamma."""
    bounds = [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    return [float(b) for b in bounds if b < max_gamma] + [float(max_gamma)]


class WorkAheadCounter:
    """``specstream:draft_work_ahead_total{outcome}``: a draft working ahead (--work-ahead), in the
    draft service or, colocated, in the target. Rounds prepared, and the items that had one, by
    outcome (hit: answered from it; miss: drafted afresh; hit_runner_up: hits on another outcome's
    round)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counter = Counter(f"{PREFIX}draft_work_ahead", "Working ahead (--work-ahead): rounds prepared, and the "
                               "items that had one, by outcome (hit: answered from it; miss: drafted afresh).",
                               ["outcome"], registry=registry)
        self._seen: dict[str, int] = {}

    def observe(self, counts: dict[str, int]) -> None:
        """Brings the counter up to the proposer's running ``counts`` (prepared, hit, miss, ...)."""
        for outcome, total in list(counts.items()):
            self.counter.labels(outcome).inc(total - self._seen.get(outcome, 0))
            self._seen[outcome] = total


class DraftMetrics:
    """How long proposing takes and how many sequences the draft holds."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.propose = Histogram(f"{PREFIX}draft_propose_seconds", "Time to answer one ProposeBatch.",
                                 buckets=PROPOSE_BUCKETS, registry=r)
        self.sequences = Gauge(f"{PREFIX}draft_sequences", "Sequences whose KV state the draft holds (all streams).",
                               registry=r)
        self.observe_ahead = WorkAheadCounter(r).observe

    def watch_sequences(self, held: Callable[[], int]) -> None:
        self.sequences.set_function(held)

    def time_propose(self) -> Timer:
        """`with metrics.time_propose():` observes the time spent inside."""
        return self.propose.time()


@dataclass
class MetricsServer:
    """A running `/metrics` endpoint (prometheus_client's threaded WSGI server)."""

    httpd: WSGIServer
    thread: Thread

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def close(self) -> None:
        """Stops serving; blocks for up to the server's poll interval (0.5 s)."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serves `registry` over HTTP on host:port (0: a free port; see `.port`) from a daemon thread.
    Every path answers with the metrics; Prometheus scrapes `/metrics`."""
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(httpd, thread)
