"""Configuration of the three services: dataclasses validated in one place.

Every limit is a field with a comment; `__post_init__` rejects bad values with a ValueError that
quotes them. The CLI builds these from flags and environment variables (`specstream.cli`); nothing
here reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16", "float16")


def _check(ok: bool, name: str, value: object, want: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}: must be {want}")


@dataclass
class ServerConfig:
    """gRPC server settings shared by all three services."""

    host: str = "127.0.0.1"  # address to bind; 0.0.0.0 in containers
    port: int = 0  # 0 picks a free port
    max_message_bytes: int = 64 * 1024 * 1024  # send and receive limit
    keepalive_time_s: float = 30.0  # ping an idle connection after this long
    keepalive_timeout_s: float = 10.0  # drop the connection if a ping is unanswered this long
    grace_s: float = 5.0  # on shutdown, in-flight RPCs get this long to finish

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", self.port, "in 0..65535")
        _check(self.max_message_bytes >= 1024, "max_message_bytes", self.max_message_bytes, ">= 1024")
        _check(self.keepalive_time_s > 0, "keepalive_time_s", self.keepalive_time_s, "> 0")
        _check(self.keepalive_timeout_s > 0, "keepalive_timeout_s", self.keepalive_timeout_s, "> 0")
        _check(self.grace_s >= 0, "grace_s", self.grace_s, ">= 0")

    def grpc_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]


@dataclass
class ModelSpec:
    """Which checkpoint to load and how."""

    path: str  # Hugging Face model directory: config.json, *.safetensors, tokenizer.json
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"  # torch device, e.g. cuda:0

    def __post_init__(self) -> None:
        _check(bool(self.path), "model path", self.path, "a directory")
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")


@dataclass
class TargetConfig:
    model: ModelSpec
    server: ServerConfig = field(default_factory=ServerConfig)
    max_slots: int = 8  # sequences decoded at once (KV-cache slots)
    max_seq_len: int = 2048  # per slot: prompt + generated + gamma + 1; capped by the model
    default_gamma: int = 4  # proposals per step for speculation=auto
    max_gamma: int = 16  # largest gamma a request may ask for
    draft_url: str | None = None  # host:port of the draft service; None decodes plainly
    draft_timeout_s: float = 10.0  # a propose round trip longer than this counts as draft failure
    draft_retry_s: float = 1.0  # wait this long before reconnecting to a failed draft
    torch_threads: int = 0  # CPU threads for the model (0: torch's default, one per core)

    def __post_init__(self) -> None:
        _check(self.max_slots >= 1, "max_slots", self.max_slots, ">= 1")
        _check(self.max_seq_len >= 8, "max_seq_len", self.max_seq_len, ">= 8")
        _check(self.max_gamma >= 0, "max_gamma", self.max_gamma, ">= 0")
        _check(0 <= self.default_gamma <= self.max_gamma, "default_gamma", self.default_gamma,
               f"in 0..max_gamma ({self.max_gamma})")
        _check(self.max_gamma + 2 < self.max_seq_len, "max_gamma", self.max_gamma, "well below max_seq_len")
        _check(self.draft_timeout_s > 0, "draft_timeout_s", self.draft_timeout_s, "> 0")
        _check(self.draft_retry_s >= 0, "draft_retry_s", self.draft_retry_s, ">= 0")
        _check(self.torch_threads >= 0, "torch_threads", self.torch_threads, ">= 0")


@dataclass
class DraftConfig:
    model: ModelSpec | None  # None only with synthetic_oracle
    server: ServerConfig = field(default_factory=ServerConfig)
    max_slots: int = 64  # sequences whose KV state the draft holds at once
    max_seq_len: int = 2048  # per slot; capped by the model
    torch_threads: int = 0  # CPU threads for the model (0: torch's default, one per core)
    # Sampling: q is cut to this many most likely tokens (and renormalised) before it is sampled
    # and sent, so a proposal's size on the wire never grows with the vocabulary. Wider keeps more
    # of q, hence more acceptance (demo pair, T=1: alpha 0.64 at 64, 0.73 at 256, 0.80 uncut).
    q_support: int = 256
    # Benchmarks only: replay the target's greedy continuations from this file, each token
    # corrupted with probability 1 - synthetic_alpha (draft_service/synthetic.py).
    synthetic_oracle: str | None = None
    synthetic_alpha: float = 0.7
    synthetic_seed: int = 0

    def __post_init__(self) -> None:
        _check((self.model is None) != (self.synthetic_oracle is None), "model", self.model,
               "given unless synthetic_oracle is (and not both)")
        _check(0.0 <= self.synthetic_alpha <= 1.0, "synthetic_alpha", self.synthetic_alpha, "in [0, 1]")
        _check(self.max_slots >= 1, "max_slots", self.max_slots, ">= 1")
        _check(self.max_seq_len >= 8, "max_seq_len", self.max_seq_len, ">= 8")
        _check(self.torch_threads >= 0, "torch_threads", self.torch_threads, ">= 0")
        _check(self.q_support >= 1, "q_support", self.q_support, ">= 1")


@dataclass
class GatewayConfig:
    target_url: str  # host:port of the target service
    tokenizer_path: str  # directory with tokenizer.json (the target's model directory)
    server: ServerConfig = field(default_factory=ServerConfig)
    max_new_tokens_limit: int = 1024  # largest max_new_tokens a request may ask for
    max_in_flight: int = 256  # requests served at once; more get RESOURCE_EXHAUSTED
    max_stop_strings: int = 16  # per request
    max_stop_string_chars: int = 128  # per stop string
    max_request_id_chars: int = 128
    max_top_logprobs: int = 20  # largest top_logprobs (alternatives per token) a request may ask for
    connect_timeout_s: float = 60.0  # how long to wait for the target at startup

    def __post_init__(self) -> None:
        _check(bool(self.target_url), "target_url", self.target_url, "host:port")
        _check(self.max_new_tokens_limit >= 1, "max_new_tokens_limit", self.max_new_tokens_limit, ">= 1")
        _check(self.max_in_flight >= 1, "max_in_flight", self.max_in_flight, ">= 1")
        _check(self.max_stop_strings >= 0, "max_stop_strings", self.max_stop_strings, ">= 0")
        _check(self.max_stop_string_chars >= 1, "max_stop_string_chars", self.max_stop_string_chars, ">= 1")
        _check(self.max_top_logprobs >= 0, "max_top_logprobs", self.max_top_logprobs, ">= 0")
        _check(self.connect_timeout_s > 0, "connect_timeout_s", self.connect_timeout_s, "> 0")
