"""Configuration of the three services: dataclasses validated in one place.

Every limit is a field with a comment; `__post_init__` rejects bad values with a ValueError that
quotes them. The CLI builds these from flags and environment variables (`tools.cli`); nothing
here reads the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

GAMMA_POLICIES = ("goodput", "fixed", "hf", "leviathan")  # target_service/gamma.py
# How sampled proposals are verified (target_service/settle.py): Leviathan's accept/reject with the
# residual (the most tokens per pass), or coupled: accept a proposal iff it is the target's own
# sample, so sampled output is exactly plain sampling's whatever γ, the draft or a resubmission.
SPECULATIVE_SAMPLING = ("leviathan", "coupled")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: bfloat16 where native (model_registry.resolve_dtype)
# How weight matrices are served (specstream/models/loader.py): dense in the dtype; "int4": the
# checkpoint's own 4-bit blocks (a converted Q4_0/Q4_1 GGUF file); "int4-rtn": a dense checkpoint
# rounded to 4 bits at load (drafts only: it changes the model, which a draft may, since only α
# depends on it); "int4-a8": int4 with each layer's projection inputs rounded to 8 bits per block of
# 32 and multiplied in integers, as llama.cpp multiplies Q4_1 by Q8_1: faster on a CPU without
# AVX-512 BF16, with llama.cpp's logits and answers rather than the file's (docs/benchmarks.md), so
# asked for, never auto's; "int4-a16": the same with 16 bits per block (float32 on AVX2: a step's
# arithmetic in integers, each input kept to 15 bits of its block's largest magnitude). auto: on a CPU
# in bfloat16 (the kernel's fast path), int4 where the checkpoint has 4-bit blocks, and for a draft
# int4-rtn otherwise; dense everywhere else.
WEIGHT_FORMATS = ("auto", "dense", "int4", "int4-a8", "int4-a16", "int4-rtn")
# The int4 formats whose projection inputs are rounded, and to how many bits per block of 32.
ROUNDED_ACTIVATIONS = {"int4-a8": 8, "int4-a16": 16}


# Messages between our own services batch many requests' token ids (a Submit of 256 prompts of 8k
# tokens is ~10 MB); public limits are set per server.
INTERNAL_MESSAGE_BYTES = 64 * 1024 * 1024


def _check(ok: bool, name: str, value: object, want: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}: must be {want}")


def _check_file(name: str, path: str | None) -> None:
    """None, or a file this process can read (caught here, before a model loads for minutes)."""
    _check(path is None or (bool(path) and os.path.isfile(path) and os.access(path, os.R_OK)), name, path,
           "None or a readable file")


@dataclass
class ServerSecurity:
    """Who may call a server (docs/architecture.md §9.1). All off by default. The files are read at start and
    again on SIGHUP (specstream/serving/tls.py, specstream/serving/auth.py); grpc.health.v1 stays open to every
    caller that completes the TLS handshake, so that probes work."""

    cert_file: str | None = None  # PEM certificate chain the server presents; with key_file, TLS is on
    key_file: str | None = None  # PEM private key of cert_file
    # PEM CA bundle: every caller must present a certificate it signed (mTLS). Needs TLS.
    client_ca_file: str | None = None
    # With mTLS: a caller's certificate must also carry one of these names, as a subject
    # alternative name (DNS, URI, IP or e-mail) or as its common name. Empty: any certificate
    # client_ca_file signed.
    allowed_peers: tuple[str, ...] = ()
    # Bearer tokens a caller must send (`authorization: Bearer <token>`), one per line; lines
    # starting with # and blank lines are ignored. None: no token asked for.
    token_file: str | None = None

    def __post_init__(self) -> None:
        self.allowed_peers = tuple(self.allowed_peers)
        _check((self.cert_file is None) == (self.key_file is None), "key_file" if self.cert_file else "cert_file",
               self.key_file if self.cert_file else self.cert_file, "given together with the other (both or neither)")
        _check(self.client_ca_file is None or self.tls, "client_ca_file", self.client_ca_file,
               "given with cert_file and key_file: client certificates are checked in the TLS handshake")
        _check(not self.allowed_peers or self.mtls, "allowed_peers", self.allowed_peers,
               "given with client_ca_file: the names come from verified client certificates")
        for peer in self.allowed_peers:
            _check(bool(peer) and not any(c.isspace() or c == "," for c in peer), "allowed_peers", self.allowed_peers,
                   "names without spaces or commas")
        for name in ("cert_file", "key_file", "client_ca_file", "token_file"):
            _check_file(name, getattr(self, name))

    @property
    def tls(self) -> bool:
        return self.cert_file is not None

    @property
    def mtls(self) -> bool:
        return self.client_ca_file is not None

    @property
    def enabled(self) -> bool:
        """Anything to check or to reload on SIGHUP."""
        return self.tls or self.token_file is not None


@dataclass
class ChannelSecurity:
    """How a service calls another of ours (gateway -> target, target -> draft): TLS, its own
    certificate for mTLS, a shared internal token. All off by default. Read once, when the
    channel opens (specstream/serving/channels.py)."""

    # For messages: the config field that holds this ("target_security", "draft_security").
    label: str = "channel"
    # PEM CA bundle the server's certificate must chain to. Set: TLS on.
    ca_file: str | None = None
    cert_file: str | None = None  # PEM certificate this side presents (mTLS); needs key_file and ca_file
    key_file: str | None = None  # PEM private key of cert_file
    # The name the server's certificate must carry, instead of the host in its address: needed
    # where that is an address no certificate names (a Kubernetes pod IP from a headless Service).
    server_name: str | None = None
    # Sends this file's first token (ServerSecurity.token_file's format) as `authorization: Bearer`.
    token_file: str | None = None

    def __post_init__(self) -> None:
        label = self.label
        _check((self.cert_file is None) == (self.key_file is None),
               f"{label}.key_file" if self.cert_file else f"{label}.cert_file",
               self.key_file if self.cert_file else self.cert_file, "given together with the other (both or neither)")
        _check(self.cert_file is None or self.tls, f"{label}.cert_file", self.cert_file,
               "given with ca_file: a client certificate is presented over TLS only")
        _check(self.server_name is None or (self.tls and bool(self.server_name.strip())), f"{label}.server_name",
               self.server_name, "a non-empty name, given with ca_file")
        for name in ("ca_file", "cert_file", "key_file", "token_file"):
            _check_file(f"{label}.{name}", getattr(self, name))

    @property
    def tls(self) -> bool:
        return self.ca_file is not None


@dataclass
class ServerConfig:
    """gRPC server settings shared by all three services."""

    host: str = "127.0.0.1"  # address to bind; 0.0.0.0 in containers
    port: int = 0  # 0 picks a free port
    max_message_bytes: int = INTERNAL_MESSAGE_BYTES  # send and receive limit (the gateway's CLI: 4 MiB)
    keepalive_time_s: float = 30.0  # ping an idle connection after this long
    keepalive_timeout_s: float = 10.0  # drop the connection if a ping is unanswered this long
    # Peers may ping this often (gRPC's default allows one ping per 5 min without data and answers
    # more with GOAWAY too_many_pings): the gateway's target channels ping every second.
    min_ping_interval_s: float = 0.5
    grace_s: float = 5.0  # on shutdown, in-flight RPCs get this long to finish
    # Prometheus /metrics over HTTP on `host` at this port (specstream/serving/metrics.py). None: no
    # endpoint; 0: a free port (logged).
    metrics_port: int | None = None
    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS, mTLS, tokens (all off)
    # Serve grpc.reflection (lists and describes the services, for grpcurl and the like). The CLI
    # turns it on for the gateway, whose API is public anyway; target and draft keep it off.
    reflection: bool = False

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", self.port, "in 0..65535")
        _check(self.metrics_port is None or 0 <= self.metrics_port <= 65535, "metrics_port", self.metrics_port,
               "None or in 0..65535")
        _check(self.metrics_port in (None, 0) or self.metrics_port != self.port, "metrics_port", self.metrics_port,
               f"different from port ({self.port})")
        _check(self.max_message_bytes >= 1024, "max_message_bytes", self.max_message_bytes, ">= 1024")
        _check(self.keepalive_time_s > 0, "keepalive_time_s", self.keepalive_time_s, "> 0")
        _check(self.keepalive_timeout_s > 0, "keepalive_timeout_s", self.keepalive_timeout_s, "> 0")
        _check(self.min_ping_interval_s > 0, "min_ping_interval_s", self.min_ping_interval_s, "> 0")
        _check(self.grace_s >= 0, "grace_s", self.grace_s, ">= 0")

    def message_options(self, max_message_bytes: int | None = None) -> list[tuple[str, int]]:
        """The size limits; `max_message_bytes` overrides them (a public server's channels to the
        internal services carry batches of requests, not one)."""
        size = max_message_bytes or self.max_message_bytes
        return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]

    def grpc_options(self) -> list[tuple[str, int]]:
        # SO_REUSEPORT off: a server owns its port. With it (gRPC's default) a second server binding
        # the same port succeeds and the kernel splits new connections between the two, so a
        # client can reach another process's services ("Method not found").
        return [
            ("grpc.so_reuseport", 0),
            *self.message_options(),
            *keepalive_options(self.keepalive_time_s, self.keepalive_timeout_s),
            ("grpc.http2.min_ping_interval_without_data_ms", int(self.min_ping_interval_s * 1000)),
        ]


def keepalive_options(time_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """gRPC channel arguments for keepalive pings every `time_s` that drop the connection when one
    is unanswered for `timeout_s`. gRPC core (1.85) drops a connection whose ping goes unanswered
    only after `grpc.http2.ping_timeout_ms` (default 1 min), whatever `keepalive_timeout_ms` says,
    so both are set."""
    return [
        ("grpc.keepalive_time_ms", int(time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
        ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


@dataclass
class ModelSpec:
    """Which checkpoint to load and how."""

    path: str  # model reference: a name (smollm2), a .gguf file or a Hugging Face checkpoint directory
    dtype: str = "float32"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"  # torch device, e.g. cuda:0
    weights: str = "auto"  # one of WEIGHT_FORMATS

    def __post_init__(self) -> None:
        _check(bool(self.path), "model path", self.path, "a directory")
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        _check(self.weights in WEIGHT_FORMATS, "weights", self.weights, f"one of {WEIGHT_FORMATS}")


@dataclass
class MemoryConfig:
    """Keeping a model service's native memory flat while it serves (specstream/serving/native_memory.py)."""

    # Entries kept by oneDNN's and ideep's shape-keyed kernel caches (default 1,024 each, which
    # grew a target's memory for minutes: decode shapes change every step; docs/benchmarks.md,
    # "Figures behind design choices").
    kernel_cache_capacity: int = 16
    heap_trim_interval_s: float = 10.0  # glibc malloc_trim on the torch thread this often; 0: never

    def __post_init__(self) -> None:
        _check(self.kernel_cache_capacity >= 0, "kernel_cache_capacity", self.kernel_cache_capacity, ">= 0")
        _check(self.heap_trim_interval_s >= 0, "heap_trim_interval_s", self.heap_trim_interval_s, ">= 0")


@dataclass
class TargetConfig:
    model: ModelSpec
    server: ServerConfig = field(default_factory=ServerConfig)
    max_slots: int = 8  # sequences decoded at once (KV-cache slots)
    max_seq_len: int = 2048  # per slot: prompt + generated + gamma + 1; capped by the model
    default_gamma: int = 4  # speculation=auto's γ under gamma_policy "fixed" (and before any step is measured)
    max_gamma: int = 16  # largest gamma a request may ask for, and the controller may pick
    gamma_policy: str = "goodput"  # speculation=auto: "goodput", "fixed", "hf" or "leviathan" (target_service/gamma.py)
    speculative_sampling: str = "leviathan"  # one of SPECULATIVE_SAMPLING: how sampled proposals are verified
    # Trees: a row may add up to this many of the draft's runner-up guesses as branches beside its
    # chain, verified in the same forward (a sampled row's by recursive rejection, with q): speculation=auto rows as many as the measured verify
    # cost says pay under gamma_policy goodput (a fixed γ stays a chain), every drafting row all of
    # them under fixed, none under hf and leviathan (target_service/gamma.py).
    # Only where the target's forward is the native CPU one (bit-exact trees); 0: chains only. A
    # row's chain and branches together stay within max_gamma (the slot's headroom past its budget).
    tree_branches: int = 4
    # A constrained request that speculates proposes its grammar's forced tokens (the text the
    # grammar allows alone: a schema's braces, keys, quotes), and that text's likely tokens where it
    # may be tokenized more ways than one, before any draft guess, at no model cost.
    forced_tokens: bool = True
    # Time verify forwards of each step shape at start-up for the γ controller's cost model
    # (target_service/calibration.py; a few seconds at most).
    calibrate: bool = True
    draft_url: str | None = None  # host:port of the draft service; None decodes plainly (or colocated_draft)
    # The draft in this process instead (no gRPC hop; it runs on the engine's torch thread between
    # forwards). Exclusive with draft_url. Its server settings are unused.
    colocated_draft: DraftConfig | None = None
    # Every propose round trip has a deadline derived from the measured round trips of its shape
    # (target_service/draft_deadline.py): clamp(factor × predicted × spread, floor, draft_timeout_s).
    # Past it the step decodes with γ = 0 and the stream is dropped; this is the longest it can be.
    # Half the gateway's hang floor (StallConfig.floor_s, 5 s): while the target waits on its draft
    # it sends the gateway nothing, so a hung draft must never make its target look hung.
    draft_timeout_s: float = 2.5
    draft_deadline_floor_s: float = 0.25  # the shortest deadline (scheduling noise on a busy host)
    draft_deadline_factor: float = 2.0  # the deadline over the round trip predicted for the shape
    draft_retry_s: float = 1.0  # wait this long before reconnecting to a failed draft
    # Ask the draft service for the next pass as soon as a pass is verified, before the engine's
    # host work (emitting tokens, retiring, admitting), when the next pass will decode the same rows
    # (target_service/drafting.py ``propose_early``): the draft computes while the host works. Off
    # by default: on 2 shared cores it measured within the noise, at batch 1 only (docs/benchmarks.md,
    # "Working ahead").
    draft_early: bool = False
    # TLS, client certificate and internal token towards the draft service (draft_url).
    draft_security: ChannelSecurity = field(default_factory=lambda: ChannelSecurity("draft_security"))
    torch_threads: int = 0  # CPU threads for the model (0: torch's default, one per core)
    # Fewer threads while the process gets less CPU time than its threads need, more again when it
    # gets it back (specstream/serving/thread_governor.py); False: torch_threads always.
    adapt_threads: bool = True
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    # Batching (docs/architecture.md §4; target_service/scheduler.py).
    policy: str = "topup"  # "static": fill, run until all finish; "topup": refill as rows finish
    refill_threshold: float = 1.0  # topup's ε: refill once running <= ε * max_batch (1: every step)
    max_batch: int = 0  # rows expanded per step; 0: max_slots
    row_selection: str = "all"  # "all", "min_length" (VAR-STREAM) or "fifo" (VAR-STR-FIFO)
    min_length_slack: int = 0  # min_length: also expand rows at most this many tokens longer
    max_wait_steps: int = 8  # starvation bound: a row left out this many steps in a row goes next
    # Prompt tokens prefilled per step, so a long prompt stalls no one long. 0: 128 on a CPU (a
    # 512-token chunk held running streams ~0.85 s on 2 cores, a 128-token one ~0.22 s, the long
    # prompt no slower for it: `bench constraint-cost`, docs/reliability.md), 512 on a GPU.
    prefill_chunk: int = 0
    # The prefix cache (specstream/models/prefix_cache.py): KV-cache slots, beyond max_slots, that keep
    # finished sequences' K/V for prompts that start the same way (a conversation's next turn, an
    # agent's system prompt and tools). -1: as many as max_slots, fewer where a quarter of the
    # memory available at start-up would not hold them; 0: no prefix cache.
    prefix_cache_slots: int = -1

    def __post_init__(self) -> None:
        _check(self.max_slots >= 1, "max_slots", self.max_slots, ">= 1")
        _check(self.prefix_cache_slots >= -1, "prefix_cache_slots", self.prefix_cache_slots,
               ">= -1 (-1: by memory, 0: off)")
        _check(self.max_seq_len >= 8, "max_seq_len", self.max_seq_len, ">= 8")
        _check(self.model.weights != "int4-rtn", "weights", self.model.weights,
               "the checkpoint's own ('auto', 'dense' or 'int4') for a target: rounding would change its output")
        _check(self.policy in ("static", "topup"), "policy", self.policy, "'static' or 'topup'")
        _check(0.0 <= self.refill_threshold <= 1.0, "refill_threshold", self.refill_threshold, "in [0, 1]")
        _check(0 <= self.max_batch <= self.max_slots, "max_batch", self.max_batch, f"in 0..max_slots ({self.max_slots})")
        _check(self.row_selection in ("all", "min_length", "fifo"), "row_selection", self.row_selection,
               "'all', 'min_length' or 'fifo'")
        _check(self.min_length_slack >= 0, "min_length_slack", self.min_length_slack, ">= 0")
        _check(self.max_wait_steps >= 1, "max_wait_steps", self.max_wait_steps, ">= 1")
        _check(self.prefill_chunk >= 0, "prefill_chunk", self.prefill_chunk, ">= 0 (0: by device)")
        _check(self.max_gamma >= 0, "max_gamma", self.max_gamma, ">= 0")
        _check(0 <= self.default_gamma <= self.max_gamma, "default_gamma", self.default_gamma,
               f"in 0..max_gamma ({self.max_gamma})")
        _check(self.max_gamma + 2 < self.max_seq_len, "max_gamma", self.max_gamma, "well below max_seq_len")
        _check(self.gamma_policy in GAMMA_POLICIES, "gamma_policy", self.gamma_policy,
               f"one of {', '.join(GAMMA_POLICIES)}")
        _check(self.speculative_sampling in SPECULATIVE_SAMPLING, "speculative_sampling", self.speculative_sampling,
               f"one of {', '.join(SPECULATIVE_SAMPLING)}")
        _check(0 <= self.tree_branches <= 64, "tree_branches", self.tree_branches, "in 0..64")
        _check(not (self.draft_url and self.colocated_draft), "colocated_draft", "set",
               f"unset when draft_url is set ({self.draft_url!r}): the draft runs in one place")
        _check(self.draft_timeout_s > 0, "draft_timeout_s", self.draft_timeout_s, "> 0")
        _check(0 < self.draft_deadline_floor_s <= self.draft_timeout_s, "draft_deadline_floor_s",
               self.draft_deadline_floor_s, f"in (0, draft_timeout_s={self.draft_timeout_s}]")
        _check(self.draft_deadline_factor >= 1.0, "draft_deadline_factor", self.draft_deadline_factor, ">= 1")
        _check(self.draft_retry_s >= 0, "draft_retry_s", self.draft_retry_s, ">= 0")
        _check(self.torch_threads >= 0, "torch_threads", self.torch_threads, ">= 0")

    @property
    def batch_rows(self) -> int:
        return self.max_batch or self.max_slots


@dataclass
class DraftConfig:
    # What proposes: the draft model; prompt-lookup n-grams (no model); suffix drafting, from the
    # sequence and earlier outputs of its salt (no model); or either of those where it matches and
    # the model elsewhere (draft_service/build.py PROPOSERS builds each).
    PROPOSERS: ClassVar[tuple[str, ...]] = ("model", "ngram", "ngram+model", "suffix", "suffix+model")
    MODEL_FREE: ClassVar[tuple[str, ...]] = ("ngram", "suffix")  # the proposers that need no model
    # work_ahead: not at all, at SCHED_IDLE, at the compute thread's own priority
    WORK_AHEAD: ClassVar[tuple[str, ...]] = ("off", "idle", "normal")

    model: ModelSpec | None  # None with a MODEL_FREE proposer or with synthetic_oracle
    server: ServerConfig = field(default_factory=ServerConfig)
    proposer: str = "model"  # one of PROPOSERS
    # Prompt lookup copies what followed the latest earlier occurrence of the sequence's last n
    # tokens, trying n = ngram_max down to ngram_min (draft_service/ngram.py). A larger ngram_min
    # makes "ngram+model" trust fewer, longer matches and ask the model more often.
    ngram_max: int = 4
    ngram_min: int = 1
    # Suffix drafting (draft_service/suffix.py) matches the same n-grams, and keeps this many tokens
    # of earlier outputs (over all salts; the oldest output goes first) to draft from. 0: none.
    suffix_capacity: int = 65536
    # The draft's prefix cache (draft_service/prefix_state.py): released sequences' slots kept for
    # their prefixes, at most. -1: every idle one of max_slots (evicted when a sequence needs it, so
    # it costs no memory); 0: none (then the target sends every position's features).
    prefix_cache_slots: int = -1
    max_slots: int = 64  # sequences whose KV state the draft holds at once
    max_seq_len: int = 2048  # per slot; capped by the model
    torch_threads: int = 0  # CPU threads for the model (0: torch's default, one per core)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    # Sampling: q is cut to this many most likely tokens (and renormalised) before it is sampled
    # and sent, so a proposal's size on the wire never grows with the vocabulary. Wider keeps more
    # of q, hence more acceptance (demo pair, T=1: alpha 0.64 at 64, 0.73 at 256, 0.80 uncut).
    # A constrained sequence's guesses drawn from the draft's distribution masked by its grammar
    # (draft_service/grammar_state.py); False: guessed unmasked, the target cutting what the
    # grammar refuses (how vLLM drafts under a grammar; a baseline for benchmarks).
    grammar_draft: bool = True
    q_support: int = 256
    # Benchmarks only: replay the target's greedy continuations from this file, each token
    # corrupted with probability 1 - synthetic_alpha (draft_service/synthetic.py).
    synthetic_oracle: str | None = None
    synthetic_alpha: float = 0.7
    synthetic_seed: int = 0
    # After each reply, draft the next round of its chains until the next request arrives
    # (draft_service/work_ahead.py): "off", "idle" (at SCHED_IDLE: on cycles nothing else wants) or
    # "normal" (at the thread's priority). Off by default: on 2 shared cores it measured no faster
    # (docs/benchmarks.md, "Working ahead").
    work_ahead: str = "off"
    # How many outcomes of a chain's verification a draft working ahead prepares the next round for:
    # 1, the whole chain kept; n, also the first n - 1 shorter kept parts, each with the draft's
    # runner-up where it stops (draft_service/work_ahead.py). Each outcome costs its own drafting.
    work_ahead_outcomes: int = 1
    MAX_WORK_AHEAD_OUTCOMES: ClassVar[int] = 16
    # Compute proposals on the event loop's own thread (the one torch thread: no hop to a worker and
    # back; docs/benchmarks.md, "Figures behind design choices"). A draft that works ahead always
    # uses a worker thread (its loop must read the next request while it works); False: a worker
    # thread regardless.
    compute_on_loop: bool = True

    def __post_init__(self) -> None:
        _check(self.proposer in self.PROPOSERS, "proposer", self.proposer, f"one of {', '.join(self.PROPOSERS)}")
        _check(self.work_ahead in self.WORK_AHEAD, "work_ahead", self.work_ahead, f"one of {', '.join(self.WORK_AHEAD)}")
        _check(isinstance(self.work_ahead_outcomes, int) and 1 <= self.work_ahead_outcomes <= self.MAX_WORK_AHEAD_OUTCOMES,
               "work_ahead_outcomes", self.work_ahead_outcomes, f"an int in [1, {self.MAX_WORK_AHEAD_OUTCOMES}]")
        _check(self.work_ahead_outcomes == 1 or self.work_ahead != "off", "work_ahead_outcomes",
               self.work_ahead_outcomes, "1 unless the draft works ahead (work_ahead 'idle' or 'normal')")
        _check(self.synthetic_oracle is None or self.proposer == "model", "proposer", self.proposer,
               "'model' (the default) with synthetic_oracle, which replaces the model")
        needs_model = self.proposer not in self.MODEL_FREE and self.synthetic_oracle is None
        _check((self.model is not None) == needs_model, "model", self.model,
               "given unless synthetic_oracle is or proposer is 'ngram' or 'suffix' (and not with them)")
        _check(self.suffix_capacity >= 0, "suffix_capacity", self.suffix_capacity, ">= 0")
        _check(self.prefix_cache_slots >= -1, "prefix_cache_slots", self.prefix_cache_slots, ">= -1 (-1: max_slots, 0: off)")
        _check(1 <= self.ngram_min <= self.ngram_max <= 32, "ngram_min", (self.ngram_min, self.ngram_max),
               "with ngram_max: 1 <= ngram_min <= ngram_max <= 32")
        _check(0.0 <= self.synthetic_alpha <= 1.0, "synthetic_alpha", self.synthetic_alpha, "in [0, 1]")
        _check(self.max_slots >= 1, "max_slots", self.max_slots, ">= 1")
        _check(self.max_seq_len >= 8, "max_seq_len", self.max_seq_len, ">= 8")
        _check(self.torch_threads >= 0, "torch_threads", self.torch_threads, ">= 0")
        _check(self.q_support >= 1, "q_support", self.q_support, ">= 1")


@dataclass
class StallConfig:
    """When the gateway declares a target replica hung (gateway/watchdog.py): it has requests of
    this gateway outstanding and has sent nothing for longer than

        deadline = min(ceiling_s, max(floor_s, step_multiple * p99 of its measured silences))

    A target reports its Load on every engine step, so while it has work its silences are its
    step times (plus the network)."""

    floor_s: float = 5.0  # never declared hung after less silence than this
    ceiling_s: float = 30.0  # always declared hung after this much (also the deadline before any step is measured)
    step_multiple: float = 20.0  # the deadline in multiples of the replica's p99 step interval

    def __post_init__(self) -> None:
        _check(self.floor_s > 0, "stall floor_s", self.floor_s, "> 0")
        _check(self.ceiling_s >= self.floor_s, "stall ceiling_s", self.ceiling_s, f">= floor_s ({self.floor_s})")
        _check(self.step_multiple >= 1, "stall step_multiple", self.step_multiple, ">= 1")


@dataclass
class RestartPolicy:
    """How `specstream serve` restarts a draft or target process that exited (tools/supervisor.py)."""

    initial_delay_s: float = 0.5  # wait this long before the first restart after a crash
    max_delay_s: float = 10.0  # each further crash doubles the wait, up to this
    stable_s: float = 30.0  # a process that stays up this long is forgiven: the next crash waits initial_delay_s

    def __post_init__(self) -> None:
        _check(self.initial_delay_s >= 0, "initial_delay_s", self.initial_delay_s, ">= 0")
        _check(self.max_delay_s >= self.initial_delay_s, "max_delay_s", self.max_delay_s,
               f">= initial_delay_s ({self.initial_delay_s})")
        _check(self.stable_s > 0, "stable_s", self.stable_s, "> 0")


@dataclass
class GatewayConfig:
    # host:port, or dns:///host:port, of a target. A name that resolves to several addresses is
    # one replica per address (gateway/discovery.py). "" when target_urls name them all.
    target_url: str
    tokenizer_path: str  # the target's model reference (name, .gguf file or directory with tokenizer.json)
    server: ServerConfig = field(default_factory=ServerConfig)
    target_urls: list[str] = field(default_factory=list)  # further target replicas, same forms
    max_new_tokens_limit: int = 1024  # largest max_new_tokens a request may ask for
    max_in_flight: int = 256  # requests served at once (queued here or on a replica); more get RESOURCE_EXHAUSTED
    # Requests waiting here for a replica with room (FIFO); a request that finds it full gets
    # RESOURCE_EXHAUSTED at once. 0: refuse whatever no replica can take right away.
    max_queue: int = 256
    # Requests a replica may hold waiting for a slot beyond its max_slots running ones, so its
    # engine can refill a freed slot the very next step without a round trip to the gateway.
    # None: as many as its max_slots (gateway/router.py).
    replica_backlog: int | None = None
    # Cache-aware routing (gateway/prefix_routing.py): a request goes to the replica believed to
    # hold the longest prefix of its prompt, unless that one holds more than this many requests
    # above the least loaded replica. -1: by load alone.
    prefix_routing_imbalance: int = 4
    max_stop_strings: int = 16  # per request
    max_stop_string_chars: int = 128  # per stop string
    max_request_id_chars: int = 128
    max_top_logprobs: int = 20  # largest top_logprobs (alternatives per token) a request may ask for
    max_messages: int = 256  # chat turns per request
    # Characters a text prompt (or a chat's contents together) may have, checked before tokenizing.
    # 0: the target's context length × the most characters one token can stand for, so no prompt
    # refused here could have fit (a longer one cannot encode to few enough tokens).
    max_prompt_chars: int = 0
    # GetModelInfo (public) lists each replica's ip:port; False: "replica-<n>" (its position).
    expose_replica_addresses: bool = False
    # Threads that validate and tokenize requests, off the event loop: a long prompt delays only
    # requests waiting for these threads, never other requests' streams.
    tokenize_threads: int = 2
    connect_timeout_s: float = 60.0  # how long to wait for the targets at startup
    retry_s: float = 1.0  # wait this long before reconnecting to a lost target replica
    # Keepalive on the gateway's channels to the targets: a ping every target_keepalive_time_s; a
    # connection whose ping goes unanswered for target_keepalive_timeout_s is dropped (and its
    # replica's requests move). The targets must allow pings this often (ServerConfig.min_ping_interval_s).
    target_keepalive_time_s: float = 1.0
    target_keepalive_timeout_s: float = 1.0
    stall: StallConfig = field(default_factory=StallConfig)  # the step-progress watchdog on each replica
    # Re-resolve dns:/// and host-name target entries this often, adding replicas for new addresses
    # and draining those whose address is gone (gateway/membership.py). 0: resolve once, at startup.
    target_resolve_interval_s: float = 10.0
    # The OpenAI-compatible HTTP API (gateway/http/) on `server.host` at this port; also /health,
    # and /metrics when metrics are on. None: off; 0: a free port (logged).
    http_port: int | None = None
    # TLS, client certificate and internal token towards the targets. The HTTP front serves HTTPS
    # with server.security's certificate and asks for its tokens (on all but /health and /metrics).
    target_security: ChannelSecurity = field(default_factory=lambda: ChannelSecurity("target_security"))

    def __post_init__(self) -> None:
        urls = self.target_addresses
        _check(bool(urls), "target_url", self.target_url, "host:port (or target_urls non-empty)")
        for url in urls:
            host, _, port = url.removeprefix("dns:///").rpartition(":")
            _check(bool(host.strip("[]")) and port.isdigit() and 0 < int(port) <= 65535, "target_url", url,
                   "host:port or dns:///host:port")
        _check(len(set(urls)) == len(urls), "target_urls", urls, "without duplicates")
        _check(self.max_new_tokens_limit >= 1, "max_new_tokens_limit", self.max_new_tokens_limit, ">= 1")
        _check(self.max_in_flight >= 1, "max_in_flight", self.max_in_flight, ">= 1")
        _check(self.max_queue >= 0, "max_queue", self.max_queue, ">= 0")
        _check(self.replica_backlog is None or self.replica_backlog >= 0, "replica_backlog", self.replica_backlog,
               "None or >= 0")
        _check(self.prefix_routing_imbalance >= -1, "prefix_routing_imbalance", self.prefix_routing_imbalance,
               ">= -1 (-1: by load alone)")
        _check(self.max_stop_strings >= 0, "max_stop_strings", self.max_stop_strings, ">= 0")
        _check(self.max_stop_string_chars >= 1, "max_stop_string_chars", self.max_stop_string_chars, ">= 1")
        _check(self.max_top_logprobs >= 0, "max_top_logprobs", self.max_top_logprobs, ">= 0")
        _check(self.max_messages >= 1, "max_messages", self.max_messages, ">= 1")
        _check(self.max_prompt_chars >= 0, "max_prompt_chars", self.max_prompt_chars, ">= 0 (0: from the model)")
        _check(self.tokenize_threads >= 1, "tokenize_threads", self.tokenize_threads, ">= 1")
        _check(self.connect_timeout_s > 0, "connect_timeout_s", self.connect_timeout_s, "> 0")
        _check(self.retry_s >= 0, "retry_s", self.retry_s, ">= 0")
        _check(self.target_keepalive_time_s > 0, "target_keepalive_time_s", self.target_keepalive_time_s, "> 0")
        _check(self.target_keepalive_timeout_s > 0, "target_keepalive_timeout_s", self.target_keepalive_timeout_s,
               "> 0")
        _check(self.target_resolve_interval_s >= 0, "target_resolve_interval_s", self.target_resolve_interval_s,
               ">= 0 (0: resolve once)")
        _check(self.http_port is None or 0 <= self.http_port <= 65535, "http_port", self.http_port,
               "None or in 0..65535")
        _check(self.http_port in (None, 0) or self.http_port not in (self.server.port, self.server.metrics_port),
               "http_port", self.http_port, f"different from port ({self.server.port}) and metrics_port "
               f"({self.server.metrics_port})")
        _check(self.http_port is None or not self.server.security.allowed_peers, "allowed_peers",
               self.server.security.allowed_peers, "empty with http_port: the HTTP front cannot see a client "
               "certificate's names (it still requires one signed by client_ca_file)")

    def target_channel_options(self) -> list[tuple[str, int]]:
        """The gateway's channels to its targets: the internal message limits, its own keepalive,
        and reconnection attempts at least every 2 * retry_s (gRPC's default backoff grows to 2 min,
        which would keep a target that was stopped for a while out of use long after it is back)."""
        backoff_ms = int(max(self.retry_s, 0.1) * 1000)
        return [*self.server.message_options(INTERNAL_MESSAGE_BYTES),
                *keepalive_options(self.target_keepalive_time_s, self.target_keepalive_timeout_s),
                ("grpc.initial_reconnect_backoff_ms", backoff_ms), ("grpc.min_reconnect_backoff_ms", backoff_ms),
                ("grpc.max_reconnect_backoff_ms", 2 * backoff_ms)]

    @property
    def target_addresses(self) -> list[str]:
        """Every configured target entry, target_url first (before DNS names are expanded)."""
        return [url for url in [self.target_url, *self.target_urls] if url]
