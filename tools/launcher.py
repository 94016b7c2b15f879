"""Starts draft, target(s) and gateway as OS processes on loopback ports and stops them.

Used by `specstream serve`, the demo and the integration tests. With `target_replicas = N` there
are N target processes, named `target`, `target-1`, ..., `target-{N-1}`, all behind the one
gateway and all sharing the one draft process (the draft keys its state per stream, so targets
cannot see each other's sequences; its `max_slots` bounds the sequences of all of them together).
There is a draft process when there is something to propose with: a draft model, the synthetic
oracle, or a model-free `proposer` ("ngram": prompt lookup; "suffix") — unless `colocate_draft`, where each
target runs the draft in its own process (`specstream target --draft-model`) and none starts.
Waits until each process answers `grpc.health.v1` with SERVING; stopping sends SIGTERM (graceful)
and escalates to SIGKILL only after a grace period. With `metrics`, each process also serves
Prometheus `/metrics` on a free port of its own (`Stack.metrics_addresses`). With `security`
(StackSecurity) every hop runs TLS: mTLS plus the internal token between the services, each
accepting only the certificate of the service that calls it, and TLS plus the API token on the
public API; the launcher's own health polling and `Stack.channel` present the certificate of each
process's usual caller. With `supervise` (what `specstream serve` runs with) a draft or target that
exits is started again on its old address after a growing delay (tools/supervisor.py) and only
the gateway's exit ends the stack; without it (the default, for tests that kill processes on
purpose) a process that exits stays down until `restart`. Knows nothing about what the services do.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specstream.data.config import GAMMA_POLICIES, ChannelSecurity, DraftConfig, RestartPolicy, TargetConfig
from specstream.models.registry import resolve_model
from specstream.serving.channels import open_blocking_channel
from specstream.serving.grpc_server import process_health_name
from tools.certs import ROLES, peer_name
from tools.supervisor import Supervisor

log = logging.getLogger(__name__)

# The services' security variables (the CLI's flag defaults). `serve` passes security to its
# children as flags only, so the launcher drops these from their environment: a variable left in
# the caller's shell must not half-secure a stack (_child_env).
SERVICE_SECURITY_ENV = ("SPECSTREAM_TLS_CERT", "SPECSTREAM_TLS_KEY", "SPECSTREAM_TLS_CLIENT_CA",
                        "SPECSTREAM_ALLOWED_PEERS", "SPECSTREAM_TOKEN_FILE",
                        *(f"SPECSTREAM_{upstream}_{name}" for upstream in ("TARGET", "DRAFT")
                          for name in ("TLS_CA", "TLS_CERT", "TLS_KEY", "SERVER_NAME", "TOKEN_FILE")))


PORT_ATTEMPTS = 3  # Stack.start: starts on new ports after a process could not bind its own
# What a service's log says when its gRPC server, or its /metrics server, could not bind its port.
PORT_TAKEN = (b"Failed to bind to address", b"Address already in use")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_healthy(address: str, timeout_s: float, proc: subprocess.Popen | None = None,
                 should_stop: Callable[[], bool] = lambda: False, security: ChannelSecurity | None = None) -> None:
    """Polls grpc.health.v1 until SERVING (over TLS as `security` says); raises if the process
    dies, `should_stop()` turns true (InterruptedError) or time runs out. With ``proc``, the health
    asked for is that process's own: a program that took the port before it could bind (free_port's
    port is free only when chosen) answers NOT_FOUND, until ``proc`` exits for the lost port."""
    deadline = time.monotonic() + timeout_s
    service = process_health_name(proc.pid) if proc is not None else ""
    with open_blocking_channel(address, security=security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process for {address} exited with code {proc.returncode}")
            if should_stop():
                raise InterruptedError(f"stopped while waiting for {address}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not healthy after {timeout_s:.0f}s")
            time.sleep(0.1)


# Who calls each service: the role whose certificate (and token) a call to it presents.
CALLER = {"gateway": "client", "target": "gateway", "draft": "target"}


def role_of(name: str) -> str:
    """A process name's role: `target-1` is a target."""
    return "target" if name.startswith("target") else name


@dataclass
class StackSecurity:
    """TLS and tokens on every hop of a stack, from the files of one directory (tools/certs.py
    `write_stack_files` writes them): `ca.crt` signed every certificate; `<role>.crt`/`.key` for
    gateway, target, draft and client (each naming `specstream-<role>`); `api-tokens` (the public
    API's tokens, the first one is the client's) and `internal-token`."""

    FILES: ClassVar[tuple[str, ...]] = ("ca.crt", *(f"{role}.{ext}" for role in ROLES for ext in ("crt", "key")),
                                        "api-tokens", "internal-token")

    directory: str
    # The public API (gRPC and HTTPS) also requires a client certificate signed by ca.crt.
    client_certs: bool = False

    def __post_init__(self) -> None:
        missing = [name for name in self.FILES if not (Path(self.directory) / name).is_file()]
        if missing:
            raise ValueError(f"tls_dir={self.directory!r}: must hold {', '.join(missing)} (specstream serve --tls-dir "
                             "writes them into an empty directory)")
        self.directory = os.path.abspath(self.directory)

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def server_args(self, role: str) -> list[str]:
        """The flags that secure the server of a process of `role`, and its calls to its upstream."""
        internal = role != "gateway"
        args = ["--tls-cert", self.path(f"{role}.crt"), "--tls-key", self.path(f"{role}.key"),
                "--token-file", self.path("internal-token" if internal else "api-tokens")]
        if internal or self.client_certs:
            args += ["--tls-client-ca", self.path("ca.crt")]
        if internal:
            args += ["--allowed-peers", peer_name(CALLER[role])]
        upstream = {"gateway": "target", "target": "draft"}.get(role)
        if upstream:
            args += [f"--{upstream}-tls-ca", self.path("ca.crt"), f"--{upstream}-tls-cert", self.path(f"{role}.crt"),
                     f"--{upstream}-tls-key", self.path(f"{role}.key"), f"--{upstream}-server-name",
                     peer_name(upstream), f"--{upstream}-token-file", self.path("internal-token")]
        return args

    def calling(self, role: str) -> ChannelSecurity:
        """How to call a process of `role` as its usual caller does: that caller's certificate and
        token, the role's name expected in the server's certificate."""
        caller = CALLER[role]
        return ChannelSecurity(label=f"{role} channel", ca_file=self.path("ca.crt"),
                               cert_file=self.path(f"{caller}.crt"), key_file=self.path(f"{caller}.key"),
                               server_name=peer_name(role),
                               token_file=self.path("api-tokens" if role == "gateway" else "internal-token"))


@dataclass
class StackSpec:
    target_model: str  # model reference: name, .gguf file or checkpoint directory
    # Draft model reference. None: no draft service (plain decoding), unless `proposer` is model-free
    # or `synthetic` is set, which need no model.
    draft_model: str | None
    gateway_port: int = 0  # 0 picks a free port
    http_port: int | None = None  # the gateway's OpenAI-compatible HTTP API (0: a free port; None: off)
    host: str = "127.0.0.1"
    gamma: int = 4  # the targets' default γ: policy "fixed"'s, and every policy's before a step is measured
    max_gamma: int = 16  # the targets' limit on γ, per request and for the controller
    gamma_policy: str = TargetConfig.gamma_policy  # the targets' γ controller for speculation=auto
    calibrate: bool = TargetConfig.calibrate  # the targets time their verify forwards at start-up
    proposer: str = DraftConfig.proposer  # the draft's (DraftConfig.PROPOSERS; "ngram" and "suffix" take no draft_model)
    ngram_max: int = DraftConfig.ngram_max  # prompt lookup tries n = ngram_max down to ngram_min
    ngram_min: int = DraftConfig.ngram_min
    suffix_capacity: int = DraftConfig.suffix_capacity  # tokens of earlier outputs suffix drafting keeps
    max_slots: int = 8  # per target replica
    target_replicas: int = 1  # target processes behind the gateway
    max_seq_len: int = 2048
    dtype: str = "float32"  # or "auto" (bfloat16 where native)
    device: str = "cpu"  # the target's and a draft model's torch device ("cuda", "cuda:1", ...)
    weights: str = "auto"  # the targets' weight format (specstream/data/config.py); a draft always uses "auto"
    draft_threads: int = 1  # CPU threads of the draft's model (0: one per core); a small draft runs best on one
    work_ahead: str = DraftConfig.work_ahead  # the draft's (off, idle, normal): its service's, or in each target colocated
    work_ahead_outcomes: int = DraftConfig.work_ahead_outcomes  # outcomes it prepares (1: the whole chain)
    target_threads: int = 0  # CPU threads of the target's model (0: one per core)
    extra_target_args: list[str] = field(default_factory=list)
    extra_draft_args: list[str] = field(default_factory=list)
    extra_gateway_args: list[str] = field(default_factory=list)
    log_dir: str | None = None  # each process logs to <log_dir>/<name>.log; None inherits stderr
    synthetic: tuple[str, float] | None = None  # benchmarks: (oracle file, alpha) replaces the draft model
    trace_file: str | None = None  # all processes append their spans to this file (JSON lines)
    metrics: bool = False  # each process serves Prometheus /metrics on a free port (Stack.metrics_addresses)
    # Each target runs the draft (draft_model / proposer) in its own process: no draft service.
    colocate_draft: bool = False
    grammar_draft: bool = DraftConfig.grammar_draft  # the draft masks constrained guesses by their grammar
    security: StackSecurity | None = None  # TLS and tokens on every hop; None: plaintext, no tokens
    # Restart a draft or target process that exits, by this policy (`serve` sets it); None: a process
    # that exits stays down (what tests that kill processes on purpose expect).
    supervise: RestartPolicy | None = None

    def __post_init__(self) -> None:
        # The services check their own values again; these are the ones that decide which
        # processes start and with which flags, caught before any of them does.
        if self.gamma_policy not in GAMMA_POLICIES:
            raise ValueError(f"gamma_policy={self.gamma_policy!r}: must be one of {', '.join(GAMMA_POLICIES)}")
        if self.proposer not in DraftConfig.PROPOSERS:
            raise ValueError(f"proposer={self.proposer!r}: must be one of {', '.join(DraftConfig.PROPOSERS)}")
        if self.synthetic and self.proposer != "model":
            raise ValueError(f"proposer={self.proposer!r}: synthetic replaces the draft model and needs 'model'")
        if self.work_ahead not in DraftConfig.WORK_AHEAD:
            raise ValueError(f"work_ahead={self.work_ahead!r}: must be one of {', '.join(DraftConfig.WORK_AHEAD)}")
        if not 1 <= self.work_ahead_outcomes <= DraftConfig.MAX_WORK_AHEAD_OUTCOMES:
            raise ValueError(f"work_ahead_outcomes={self.work_ahead_outcomes!r}: must be in "
                             f"[1, {DraftConfig.MAX_WORK_AHEAD_OUTCOMES}]")
        if self.proposer in DraftConfig.MODEL_FREE and self.draft_model:
            raise ValueError(f"draft_model={self.draft_model!r}: proposer {self.proposer!r} uses no draft model")
        if self.proposer.endswith("+model") and not self.draft_model:
            raise ValueError(f"draft_model=None: proposer {self.proposer!r} needs a draft model")
        if self.colocate_draft and self.synthetic:
            raise ValueError("colocate_draft: the synthetic benchmark proposer runs as a draft service only")

    @property
    def has_draft(self) -> bool:
        """Whether a draft process runs (see the module docstring)."""
        return self.drafts and not self.colocate_draft

    @property
    def drafts(self) -> bool:
        """Whether anything proposes: a draft model, n-grams or the synthetic proposer."""
        return bool(self.draft_model or self.synthetic or self.proposer in DraftConfig.MODEL_FREE)


def target_names(replicas: int) -> list[str]:
    """`target`, then `target-1`, `target-2`, ... for further replicas."""
    return ["target", *(f"target-{i}" for i in range(1, replicas))]


def command_lines(spec: StackSpec, target_model: str, addresses: dict[str, str],
                  metrics_ports: dict[str, int]) -> dict[str, list[str]]:
    """Each process's `specstream` arguments, in start order (draft if `spec.has_draft`, targets,
    gateway). `addresses`: host:port per process name; `target_model`: the resolved checkpoint
    directory; `metrics_ports`: the /metrics port of each process that serves one. Starts nothing."""
    names = target_names(spec.target_replicas)
    port = {name: address.rpartition(":")[2] for name, address in addresses.items()}

    def metrics_flag(name: str) -> list[str]:
        return ["--metrics-port", str(metrics_ports[name])] if name in metrics_ports else []

    tracing = ["--trace-file", spec.trace_file] if spec.trace_file else []
    common = ["--host", spec.host, "--dtype", spec.dtype, "--device", spec.device, "--max-seq-len",
              str(spec.max_seq_len), *tracing]
    lines: dict[str, list[str]] = {}
    proposer = ["--proposer", spec.proposer, "--ngram-max", str(spec.ngram_max), "--ngram-min", str(spec.ngram_min),
                "--suffix-capacity", str(spec.suffix_capacity),
                *([] if spec.grammar_draft else ["--no-grammar-draft"])]

    def draft_model(flag: str) -> list[str]:
        return [flag, spec.draft_model] if spec.draft_model else []

    def security(role: str) -> list[str]:
        return spec.security.server_args(role) if spec.security else []

    # Working ahead: the draft service's, or the draft's in each target when colocated.
    ahead = [*(["--work-ahead", spec.work_ahead] if spec.work_ahead != "off" else []),
             *(["--work-ahead-outcomes", str(spec.work_ahead_outcomes)] if spec.work_ahead_outcomes != 1 else [])]
    if spec.has_draft:
        if spec.synthetic:
            source = ["--synthetic-oracle", spec.synthetic[0], "--synthetic-alpha", str(spec.synthetic[1])]
        else:
            source = [*proposer, *draft_model("--model")]
        lines["draft"] = ["draft", *source, "--port", port["draft"], *common, "--threads", str(spec.draft_threads),
                          *metrics_flag("draft"), *security("draft"),
                          *ahead, *spec.extra_draft_args]
    for name in names:
        lines[name] = ["target", "--model", target_model, "--port", port[name], *common, "--weights", spec.weights,
                       "--gamma", str(spec.gamma), "--max-gamma", str(spec.max_gamma), "--gamma-policy",
                       spec.gamma_policy, *([] if spec.calibrate else ["--no-calibrate"]),
                       "--max-slots", str(spec.max_slots), "--threads", str(spec.target_threads),
                       *metrics_flag(name), *security("target"), *spec.extra_target_args,
                       *(["--draft-url", addresses["draft"]] if spec.has_draft else []),
                       *([*proposer, *draft_model("--draft-model"), *ahead] if spec.colocate_draft and spec.drafts
                         else [])]
    http = ["--http-port", port["http"]] if spec.http_port is not None else []
    lines["gateway"] = ["gateway", "--target-url", ",".join(addresses[name] for name in names), "--tokenizer",
                        target_model, "--host", spec.host, "--port", port["gateway"], *http, *metrics_flag("gateway"),
                        *tracing, *security("gateway"), *spec.extra_gateway_args]
    return lines


def _child_env() -> dict[str, str]:
    """The services' environment. On CPU the three processes share the cores and take turns
    (draft, then target): OpenMP threads that keep spinning after a forward steal the core the
    other process needs next. A short spin (libgomp's GOMP_SPINCOUNT) measured faster speculative
    steps with no loss for plain decoding (docs/benchmarks.md, "Figures behind design choices"); a
    value set by the user wins. The services' security variables are dropped: a stack is secured by
    `StackSpec.security` alone."""
    env = {name: value for name, value in os.environ.items() if name not in SERVICE_SECURITY_ENV}
    env.setdefault("GOMP_SPINCOUNT", "10000")
    return env


class Stack:
    def __init__(self, spec: StackSpec, report: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.procs: dict[str, subprocess.Popen] = {}
        self._log_offsets: dict[str, int] = {}  # where each process's log began at its latest start
        self.args: dict[str, list[str]] = {}
        self.addresses: dict[str, str] = {}
        self.metrics_addresses: dict[str, str] = {}  # name -> host:port of its /metrics, with spec.metrics
        self.report = report  # the supervisor's exits and restarts go here (None: the logger)
        self.supervisor: Supervisor | None = None

    @property
    def gateway_address(self) -> str:
        return self.addresses["gateway"]

    @property
    def target_names(self) -> list[str]:
        return target_names(self.spec.target_replicas)

    @property
    def http_address(self) -> str | None:
        """host:port of the gateway's OpenAI-compatible HTTP API (None without `http_port`)."""
        return self.addresses.get("http")

    @property
    def http_base_url(self) -> str | None:
        """The HTTP API's base URL for OpenAI clients (https with `security`)."""
        address = self.http_address
        return f"{'https' if self.spec.security else 'http'}://{address}/v1" if address else None

    def calling(self, name: str) -> ChannelSecurity | None:
        """How to call process `name` as its usual caller does (None without `security`)."""
        return self.spec.security.calling(role_of(name)) if self.spec.security else None

    def channel(self, name: str) -> grpc.Channel:
        """A blocking channel to process `name`, presenting its usual caller's credentials."""
        return open_blocking_channel(self.addresses[name], security=self.calling(name))

    def reload(self) -> None:
        """SIGHUP to every running process: they read their certificate and token files again."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGHUP)

    def start(self, timeout_s: float = 120.0, should_stop: Callable[[], bool] = lambda: False) -> Stack:
        """Starts every process and waits until each is healthy. Ports are chosen free here and bound
        by the children, so another program can take one in between: a stack whose process could
        not bind its port (its log, with `log_dir`, says so) starts again on new ports, at most
        twice. The ports the spec names are never changed."""
        for attempt in range(PORT_ATTEMPTS):
            try:
                return self._start(timeout_s, should_stop)
            except RuntimeError:
                if attempt + 1 == PORT_ATTEMPTS or not self._lost_a_port():
                    raise
                log.warning("a process of the stack could not bind its port; starting the stack on new ports")
        raise AssertionError("unreachable")

    def _lost_a_port(self) -> bool:
        """Whether a process of the latest start could not bind a port it was given (from its log)."""
        if not self.spec.log_dir or self.spec.gateway_port or self.spec.http_port:
            return False
        for name, offset in self._log_offsets.items():
            path = Path(self.spec.log_dir) / f"{name}.log"
            with open(path, "rb") as log_file:
                log_file.seek(offset)
                text = log_file.read()
            if any(message in text for message in PORT_TAKEN):
                return True
        return False

    def _start(self, timeout_s: float, should_stop: Callable[[], bool]) -> Stack:
        spec = self.spec
        if spec.target_replicas < 1:
            raise ValueError(f"target_replicas={spec.target_replicas!r}: must be >= 1")
        ports = {"draft": free_port(spec.host), **{name: free_port(spec.host) for name in self.target_names},
                 "gateway": spec.gateway_port or free_port(spec.host)}
        if spec.http_port is not None:
            ports["http"] = spec.http_port or free_port(spec.host)
        self.addresses = {name: f"{spec.host}:{port}" for name, port in ports.items()}
        # A named or GGUF target is converted here, once, before three processes would race for it.
        target_model = str(resolve_model(spec.target_model))
        names = [*(["draft"] if spec.has_draft else []), *self.target_names, "gateway"]
        metrics_ports = {name: free_port(spec.host) for name in names} if spec.metrics else {}
        self.metrics_addresses = {name: f"{spec.host}:{port}" for name, port in metrics_ports.items()}
        try:
            for name, args in command_lines(spec, target_model, self.addresses, metrics_ports).items():
                self._spawn(name, args)
            for name, proc in self.procs.items():
                wait_healthy(self.addresses[name], timeout_s, proc, should_stop, self.calling(name))
        except BaseException:
            self.stop()
            raise
        if spec.supervise is not None:
            self.supervisor = Supervisor(self.procs, lambda name: self._spawn(name, self.args[name]), spec.supervise,
                                         **({"report": self.report} if self.report else {}))
            self.supervisor.start()
        return self

    def _spawn(self, name: str, args: list[str]) -> None:
        out = None
        if self.spec.log_dir:
            Path(self.spec.log_dir).mkdir(parents=True, exist_ok=True)
            out = open(Path(self.spec.log_dir) / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
            self._log_offsets[name] = out.tell()
        self.args[name] = args
        # A process group of its own: Ctrl-C in a terminal reaches only us, and we stop the children in
        # order. Not a session of its own: Linux schedules each session as one group (autogroup), and
        # CPU weights (nice) only rank processes inside a group, so a session of their own gave the
        # services an equal share with a nice-19 busy loop started beside them.
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "tools.cli", *args], stdout=out,
                                            stderr=subprocess.STDOUT if out else None, env=_child_env(),
                                            process_group=0)

    def restart(self, name: str, timeout_s: float = 120.0) -> None:
        """Starts a stopped service (`draft`, `target`, `target-1`, ..., `gateway`) again on its old
        address, with its old arguments (for failure tests)."""
        if name not in self.args:
            raise KeyError(f"no service named {name!r}; have {sorted(self.args)}")
        if self.supervisor is not None:
            with self.supervisor.lock:
                self._spawn(name, self.args[name])
        else:
            self._spawn(name, self.args[name])
        wait_healthy(self.addresses[name], timeout_s, self.procs[name], security=self.calling(name))

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def serving(self) -> bool:
        """Whether the stack still serves: with supervision, while the gateway runs (the others
        are restarted); without, while every process runs."""
        if self.supervisor is not None:
            return self.supervisor.final_exit is None and self.supervisor.running
        return self.alive()

    def stop(self, grace_s: float = 15.0) -> dict[str, int | None]:
        """SIGTERM in reverse start order, each after the one before has exited (the gateway
        finishes its requests before the target goes); SIGKILL after `grace_s`. Returns exit codes.
        Supervision ends first, so nothing is restarted while the stack stops."""
        if self.supervisor is not None:
            self.supervisor.stop()
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return {name: proc.returncode for name, proc in self.procs.items()}

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
