"""Flags that must reach another process: `specstream serve`'s γ controller and proposer flags on
the target and draft command lines the launcher builds, and the client commands' --max-gamma in
the request they send; `--quiet` of the long-running commands on the tool each one runs.

The launcher's command lines are parsed back by the real CLI into the services' configs, so a flag
that `serve` accepts but does not pass on, or passes in a form the service reads differently,
fails here. Nothing is started but a fake gateway on a loopback port.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from tests.support.fake_gateway import serve_generation

from specstream.data.config import GAMMA_POLICIES, DraftConfig, ModelSpec, TargetConfig
from tools.cli import build_parser, main
from tools.cli.serve import _stack_spec
from tools.cli.services import _draft_config, _gateway_config, _target_config
from tools.launcher import StackSpec, command_lines
from specstream_pb import common_pb2, generation_pb2, generation_pb2_grpc

ADDRESSES = {"draft": "127.0.0.1:7001", "target": "127.0.0.1:7002", "target-1": "127.0.0.1:7003",
             "gateway": "127.0.0.1:7000"}


def _lines(spec: StackSpec) -> dict[str, list[str]]:
    return command_lines(spec, "/models/target", ADDRESSES, {})


def _serve(*flags: str) -> dict[str, list[str]]:
    """The command lines `specstream serve <flags>` would start its processes with."""
    return _lines(_stack_spec(build_parser().parse_args(["serve", *flags])))


def _target_configs(lines: dict[str, list[str]]) -> list[TargetConfig]:
    return [_target_config(build_parser().parse_args(args))
            for name, args in lines.items() if name.startswith("target")]


def _draft(lines: dict[str, list[str]]) -> DraftConfig:
    return _draft_config(build_parser().parse_args(lines["draft"]))


# --- the HTTP front: serve -> gateway ---------------------------------------------------------------------

def test_serve_http_port_reaches_the_gateways_config() -> None:
    spec = _stack_spec(build_parser().parse_args(["serve", "--http-port", "8000"]))
    assert spec.http_port == 8000
    lines = command_lines(spec, "/models/target", {**ADDRESSES, "http": "127.0.0.1:8000"}, {})
    assert _gateway_config(build_parser().parse_args(lines["gateway"])).http_port == 8000
    plain = _serve()  # off unless asked for
    assert "--http-port" not in plain["gateway"]
    assert _gateway_config(build_parser().parse_args(plain["gateway"])).http_port is None


def test_the_gateway_refuses_an_http_port_it_cannot_use() -> None:
    with pytest.raises(ValueError, match="http_port=70000"):
        _gateway_config(build_parser().parse_args(["gateway", "--target-url", "h:1", "--tokenizer", "t",
                                                   "--http-port", "70000"]))
    with pytest.raises(ValueError, match=r"http_port=9000: must be different from port \(9000\)"):
        _gateway_config(build_parser().parse_args(["gateway", "--target-url", "h:1", "--tokenizer", "t",
                                                   "--port", "9000", "--http-port", "9000"]))


# --- γ controller: serve -> target ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", GAMMA_POLICIES)
def test_serve_passes_the_gamma_policy_to_every_target(policy: str) -> None:
    lines = _serve("--target", "t", "--draft", "d", "--replicas", "2", "--gamma-policy", policy, "--gamma", "3",
                   "--max-gamma", "9")
    configs = _target_configs(lines)
    assert len(configs) == 2
    for config in configs:
        assert (config.gamma_policy, config.default_gamma, config.max_gamma) == (policy, 3, 9)
        assert config.draft_url == ADDRESSES["draft"]


def test_gamma_policy_defaults_to_the_configs_and_rejects_unknown_names() -> None:
    (config,) = _target_configs(_serve("--target", "t", "--draft", "d"))
    assert (config.gamma_policy, config.default_gamma, config.max_gamma) == ("goodput", 4, 16)
    config = _target_config(build_parser().parse_args(["target", "--model", "m", "--gamma-policy", "hf",
                                                       "--gamma", "2"]))
    assert (config.gamma_policy, config.default_gamma) == ("hf", 2)
    for command in (["serve"], ["target", "--model", "m"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--gamma-policy", "greedy"])
    with pytest.raises(ValueError, match="gamma_policy='greedy'"):
        StackSpec("t", "d", gamma_policy="greedy")


@pytest.mark.parametrize("mode", ["leviathan", "coupled"])
def test_serve_passes_the_verification_of_sampled_proposals_to_every_target(mode: str) -> None:
    lines = _serve("--target", "t", "--draft", "d", "--replicas", "2", "--speculative-sampling", mode)
    assert [c.speculative_sampling for c in _target_configs(lines)] == [mode, mode]
    (default,) = _target_configs(_serve("--target", "t", "--draft", "d"))
    assert default.speculative_sampling == "leviathan"


def test_the_targets_draft_deadline_flags_reach_its_config() -> None:
    config = _target_config(build_parser().parse_args(
        ["target", "--model", "m", "--draft-url", "h:1", "--draft-timeout", "4", "--draft-deadline-floor", "0.1",
         "--draft-deadline-factor", "3", "--draft-retry", "0.5"]))
    assert (config.draft_timeout_s, config.draft_deadline_floor_s, config.draft_deadline_factor,
            config.draft_retry_s) == (4.0, 0.1, 3.0, 0.5)
    default = _target_config(build_parser().parse_args(["target", "--model", "m"]))
    assert (default.draft_deadline_floor_s, default.draft_deadline_factor) == (
        TargetConfig.draft_deadline_floor_s, TargetConfig.draft_deadline_factor)


def test_serve_supervises_unless_told_not_to() -> None:
    spec = _stack_spec(build_parser().parse_args(["serve", "--restart-max-delay", "4"]))
    assert spec.supervise is not None and spec.supervise.max_delay_s == 4.0
    assert _stack_spec(build_parser().parse_args(["serve", "--no-supervise"])).supervise is None
    assert StackSpec("t", "d").supervise is None  # Stack itself: off (tests kill processes on purpose)


# --- proposer: serve -> draft -----------------------------------------------------------------------------


def test_serve_ngram_starts_a_draft_without_a_model() -> None:
    # The default pair (smollm2) has a draft model; prompt lookup leaves it out.
    for flags in ([], ["--target", "t"], ["--models", "smollm2"]):
        lines = _serve(*flags, "--proposer", "ngram", "--ngram-max", "6", "--ngram-min", "2")
        assert "--model" not in lines["draft"]
        draft = _draft(lines)
        assert (draft.proposer, draft.model, draft.ngram_max, draft.ngram_min) == ("ngram", None, 6, 2)
        (target,) = _target_configs(lines)
        assert target.draft_url == ADDRESSES["draft"]


def test_serve_passes_the_proposer_with_its_draft_model() -> None:
    draft = _draft(_serve("--target", "t", "--draft", "d", "--proposer", "ngram+model", "--ngram-min", "3"))
    assert (draft.proposer, draft.model.path, draft.ngram_max, draft.ngram_min) == ("ngram+model", "d", 4, 3)
    from specstream.models.registry import pair_refs

    pair_draft = pair_refs("smollm2")[1]
    draft = _draft(_serve("--proposer", "model"))
    assert (draft.proposer, draft.model.path) == ("model", pair_draft)


def test_serve_takes_the_pairs_proposer_unless_told_otherwise() -> None:
    from specstream.models.registry import PAIRS

    pair = PAIRS["smollm2"]
    assert pair.proposing == {"proposer": "ngram+model", "ngram_min": 2}
    draft = _draft(_serve())  # no flags: the default pair as it is meant to be served
    assert (draft.proposer, draft.model.path, draft.ngram_min) == ("ngram+model", pair.draft, 2)
    draft = _draft(_serve("--ngram-min", "3"))
    assert (draft.proposer, draft.ngram_min) == ("ngram+model", 3)
    # Another proposer by name gets DraftConfig's n-gram range, not the pair's (tuned for its own).
    draft = _draft(_serve("--proposer", "ngram"))
    assert (draft.proposer, draft.ngram_min) == ("ngram", DraftConfig.ngram_min)
    # A pair without one, and models given by path, propose with the draft model alone.
    assert _draft(_serve("--models", "demo-small")).proposer == "model"
    assert _draft(_serve("--target", "t", "--draft", "d")).proposer == "model"
    # --no-draft turns the pair's default proposer off with its draft, but not one asked for.
    assert "draft" not in _serve("--no-draft")
    (config,) = _target_configs(_serve("--colocate-draft"))
    assert (config.colocated_draft.proposer, config.colocated_draft.ngram_min) == ("ngram+model", 2)


def test_serve_without_a_draft_starts_no_draft_process() -> None:
    for flags in (["--no-draft"], ["--target", "t"]):  # a --target without --draft: no draft model
        lines = _serve(*flags)
        assert "draft" not in lines
        assert [config.draft_url for config in _target_configs(lines)] == [None]


def test_serve_colocate_draft_runs_the_draft_inside_every_target() -> None:
    lines = _serve("--target", "t", "--draft", "d", "--replicas", "2", "--colocate-draft", "--proposer",
                   "ngram+model", "--ngram-min", "2")
    assert "draft" not in lines  # no draft process
    configs = _target_configs(lines)
    assert len(configs) == 2
    for config in configs:
        draft = config.colocated_draft
        assert config.draft_url is None and draft is not None
        assert (draft.proposer, draft.model.path, draft.ngram_min, draft.max_slots) == ("ngram+model", "d", 2, 8)
        assert draft.model.weights == "auto"  # a draft: auto may round it to 4 bits
    lines = _serve("--target", "t", "--draft", "d", "--weights", "dense")
    assert [config.model.weights for config in _target_configs(lines)] == ["dense"]
    assert "--weights" not in lines["draft"] and _draft(lines).model.weights == "auto"  # a draft may round itself
    (config,) = _target_configs(_serve("--colocate-draft", "--proposer", "ngram"))
    assert (config.colocated_draft.proposer, config.colocated_draft.model) == ("ngram", None)
    (config,) = _target_configs(_serve("--colocate-draft", "--no-draft"))
    assert config.colocated_draft is None and config.draft_url is None


def test_serve_work_ahead_reaches_the_draft_service_or_the_colocated_draft() -> None:
    lines = _serve("--target", "t", "--draft", "d", "--work-ahead", "idle", "--work-ahead-outcomes", "3")
    assert (_draft(lines).work_ahead, _draft(lines).work_ahead_outcomes) == ("idle", 3)
    assert "--work-ahead" not in lines["target"]
    lines = _serve("--target", "t", "--draft", "d", "--colocate-draft", "--work-ahead", "normal",
                   "--work-ahead-outcomes", "2")
    (config,) = _target_configs(lines)
    assert (config.colocated_draft.work_ahead, config.colocated_draft.work_ahead_outcomes) == ("normal", 2)
    (config,) = _target_configs(_serve("--target", "t", "--draft", "d", "--colocate-draft"))
    assert (config.colocated_draft.work_ahead, config.colocated_draft.work_ahead_outcomes) == ("off", 1)


def test_target_refuses_work_ahead_without_a_draft_in_its_process(capsys) -> None:
    assert main(["target", "--model", "m", "--draft-url", "h:1", "--work-ahead", "idle"]) == 2
    assert "--work-ahead idle: works ahead with a draft in this process (--draft-model)" in capsys.readouterr().err


def test_target_refuses_a_draft_both_remote_and_in_process(capsys) -> None:
    assert main(["target", "--model", "m", "--draft-url", "h:1", "--draft-model", "d"]) == 2
    assert "--draft-url h:1: the draft runs at --draft-url or in this process" in capsys.readouterr().err
    with pytest.raises(ValueError, match="colocated_draft='set': must be unset when draft_url is set"):
        TargetConfig(model=ModelSpec("m"), draft_url="h:1", colocated_draft=DraftConfig(None, proposer="ngram"))


@pytest.mark.parametrize(("flags", "message"), [
    (["--no-draft", "--proposer", "ngram"], "--no-draft runs no draft service; --proposer ngram needs one"),
    (["--proposer", "ngram", "--draft", "d"], "--draft d: --proposer ngram uses no draft model"),
    (["--target", "t", "--proposer", "ngram+model"], "--proposer ngram\\+model needs a draft model"),
    (["--proposer", "ngram", "--ngram-min", "3", "--ngram-max", "2"], "ngram_min=\\(3, 2\\)"),
    (["--proposer", "ngram", "--ngram-max", "33"], "ngram_min=\\(1, 33\\)"),
])
def test_serve_refuses_clashing_proposer_flags_before_starting_anything(
        flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=message):
        _stack_spec(build_parser().parse_args(["serve", *flags]))
    assert main(["serve", "--port", "0", *flags]) == 2  # returns before any process or port is taken
    err = capsys.readouterr().err
    assert err.startswith("specstream serve: error: ") and re.search(message, err)


def test_stack_spec_checks_the_proposer_against_the_draft_model() -> None:
    assert StackSpec("t", None, proposer="ngram").has_draft
    assert not StackSpec("t", None).has_draft
    for kwargs, message in [(dict(draft_model="d", proposer="ngram"), "draft_model='d'"),
                            (dict(draft_model=None, proposer="ngram+model"), "draft_model=None"),
                            (dict(draft_model=None, proposer="lookup"), "proposer='lookup'"),
                            (dict(draft_model=None, proposer="ngram", synthetic=("o.json", 0.5)),
                             "proposer='ngram'")]:
        with pytest.raises(ValueError, match=message):
            StackSpec("t", **kwargs)


def test_synthetic_draft_keeps_its_own_flags() -> None:
    lines = _lines(StackSpec("t", None, synthetic=("oracle.json", 0.5)))
    assert "--proposer" not in lines["draft"]
    draft = _draft(lines)
    assert (draft.synthetic_oracle, draft.synthetic_alpha, draft.model, draft.proposer) == \
        ("oracle.json", 0.5, None, "model")


# --- security: serve -> every process; env -> the services' configs ---------------------------------------


def test_serve_without_tls_secures_nothing_and_reflects_the_gateway_only() -> None:
    lines = _serve("--target", "t", "--draft", "d")
    assert not any(flag.startswith(("--tls", "--token-file", "--allowed", "--target-tls", "--draft-tls"))
                   for args in lines.values() for flag in args)
    (target,) = _target_configs(lines)
    gateway = _gateway_config(build_parser().parse_args(lines["gateway"]))
    draft = _draft(lines)
    for server in (target.server, gateway.server, draft.server):
        assert not server.security.enabled and not server.security.mtls
    assert (gateway.server.reflection, target.server.reflection, draft.server.reflection) == (True, False, False)
    assert not target.draft_security.tls and target.draft_security.token_file is None
    assert not gateway.target_security.tls
    reflecting = _target_config(build_parser().parse_args(["target", "--model", "m", "--reflection"]))
    assert reflecting.server.reflection
    quiet = _gateway_config(build_parser().parse_args(["gateway", "--target-url", "h:1", "--tokenizer", "t",
                                                       "--no-reflection"]))
    assert not quiet.server.reflection


def test_serve_tls_dir_secures_every_hop(pki) -> None:
    lines = _serve("--target", "t", "--draft", "d", "--replicas", "2", "--tls-dir", str(pki.dir))
    path = pki.path
    draft = _draft(lines).server.security
    assert (draft.cert_file, draft.key_file, draft.client_ca_file, draft.allowed_peers, draft.token_file) == \
        (path("draft.crt"), path("draft.key"), path("ca.crt"), ("specstream-target",), path("internal-token"))
    for target in _target_configs(lines):
        server = target.server.security
        assert (server.cert_file, server.client_ca_file, server.allowed_peers, server.token_file) == \
            (path("target.crt"), path("ca.crt"), ("specstream-gateway",), path("internal-token"))
        upstream = target.draft_security
        assert (upstream.ca_file, upstream.cert_file, upstream.key_file, upstream.server_name, upstream.token_file) \
            == (path("ca.crt"), path("target.crt"), path("target.key"), "specstream-draft", path("internal-token"))
    gateway = _gateway_config(build_parser().parse_args(lines["gateway"]))
    server = gateway.server.security
    assert (server.cert_file, server.client_ca_file, server.allowed_peers, server.token_file) == \
        (path("gateway.crt"), None, (), path("api-tokens"))  # the public API: TLS and tokens
    upstream = gateway.target_security
    assert (upstream.ca_file, upstream.cert_file, upstream.server_name, upstream.token_file) == \
        (path("ca.crt"), path("gateway.crt"), "specstream-target", path("internal-token"))
    lines = _serve("--target", "t", "--no-draft", "--tls-dir", str(pki.dir), "--client-certs")
    assert _gateway_config(build_parser().parse_args(lines["gateway"])).server.security.client_ca_file == path("ca.crt")


def test_serve_tls_dir_is_made_when_empty_and_refused_when_incomplete(tmp_path, capsys) -> None:
    with pytest.raises(ValueError, match="--client-certs needs --tls-dir"):
        _stack_spec(build_parser().parse_args(["serve", "--client-certs"]))
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    assert main(["serve", "--port", "0", "--tls-dir", str(partial)]) == 2  # before any process starts
    err = capsys.readouterr().err
    assert "tls_dir=" in err and "must hold gateway.crt" in err and "internal-token" in err
    assert not (partial / "gateway.crt").exists()  # a directory with files of its own is never written to
    from tools.cli.serve import _ensure_tls_dir
    from tools.launcher import StackSecurity

    made = tmp_path / "new"
    assert _ensure_tls_dir(str(made)) and not _ensure_tls_dir(str(made))
    security = StackSecurity(str(made))
    assert all((made / name).is_file() for name in StackSecurity.FILES)
    assert (made / "client.key").stat().st_mode & 0o077 == 0  # keys and tokens are private
    assert (made / "api-tokens").stat().st_mode & 0o077 == 0
    assert security.calling("draft").server_name == "specstream-draft"


def test_services_read_their_security_settings_from_the_environment(pki, monkeypatch) -> None:
    env = {"SPECSTREAM_TLS_CERT": pki.path("target.crt"), "SPECSTREAM_TLS_KEY": pki.path("target.key"),
           "SPECSTREAM_TLS_CLIENT_CA": pki.path("ca.crt"), "SPECSTREAM_ALLOWED_PEERS": "specstream-gateway, admin",
           "SPECSTREAM_TOKEN_FILE": pki.path("internal-token"), "SPECSTREAM_DRAFT_TLS_CA": pki.path("ca.crt"),
           "SPECSTREAM_DRAFT_TLS_CERT": pki.path("target.crt"), "SPECSTREAM_DRAFT_TLS_KEY": pki.path("target.key"),
           "SPECSTREAM_DRAFT_SERVER_NAME": "specstream-draft",
           "SPECSTREAM_DRAFT_TOKEN_FILE": pki.path("internal-token")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = _target_config(build_parser().parse_args(["target", "--model", "m", "--draft-url", "d:1"]))
    security = config.server.security
    assert (security.cert_file, security.key_file, security.client_ca_file, security.allowed_peers,
            security.token_file) == (pki.path("target.crt"), pki.path("target.key"), pki.path("ca.crt"),
                                     ("specstream-gateway", "admin"), pki.path("internal-token"))
    assert config.draft_security.server_name == "specstream-draft" and config.draft_security.tls
    # A flag wins over the environment.
    config = _target_config(build_parser().parse_args(["target", "--model", "m", "--allowed-peers", "x"]))
    assert config.server.security.allowed_peers == ("x",)
    monkeypatch.setenv("SPECSTREAM_TLS_KEY", "")  # empty is unset: the certificate alone is refused
    with pytest.raises(ValueError, match="key_file=None"):
        _target_config(build_parser().parse_args(["target", "--model", "m"]))


def test_serve_children_take_security_from_their_flags_only(monkeypatch) -> None:
    # Every variable the services' security flags read is one the launcher keeps from its children.
    from tools.launcher import SERVICE_SECURITY_ENV, _child_env

    subcommands = build_parser()._subparsers._group_actions[0].choices
    read = set()
    for command in ("gateway", "target", "draft"):
        for group in subcommands[command]._action_groups:
            if group.title.startswith("security"):
                read |= {m for action in group._group_actions for m in re.findall(r"env (SPECSTREAM_\w+)",
                                                                                    action.help or "")}
    assert read == set(SERVICE_SECURITY_ENV)
    for name in SERVICE_SECURITY_ENV:
        monkeypatch.setenv(name, "/from/the/shell")
    monkeypatch.setenv("SPECSTREAM_LOG_LEVEL", "DEBUG")
    env = _child_env()
    assert not set(SERVICE_SECURITY_ENV) & set(env) and env["SPECSTREAM_LOG_LEVEL"] == "DEBUG"


def test_a_service_refuses_incomplete_security_settings_before_loading_anything(pki, capsys) -> None:
    assert main(["draft", "--proposer", "ngram", "--tls-cert", pki.path("draft.crt")]) == 2
    assert "key_file=None: must be given together" in capsys.readouterr().err
    assert main(["gateway", "--target-url", "h:1", "--tokenizer", "t", "--target-tls-cert",
                 pki.path("gateway.crt"), "--target-tls-key", pki.path("gateway.key")]) == 2
    assert "target_security.cert_file=" in capsys.readouterr().err
    assert main(["target", "--model", "m", "--token-file", "/no/such/tokens"]) == 2
    assert "token_file='/no/such/tokens': must be None or a readable file" in capsys.readouterr().err


# --- generate / chat --max-gamma -> the request -----------------------------------------------------------


class RecordingGateway(generation_pb2_grpc.GenerationServicer):
    """Records each request and answers with a minimal finished generation."""

    def __init__(self) -> None:
        self.requests: list[generation_pb2.GenerateRequest] = []

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.requests.append(request)
        return generation_pb2.GenerateResponse(request_id="r", text="ok", token_ids=[1],
                                               finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                               usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=1))

    def GenerateStream(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self.requests.append(request)
        yield generation_pb2.GenerateStreamResponse(request_id="r", text="ok", token_ids=[1],
                                                    finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                                    usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=1),
                                                    stats=common_pb2.SpeculationStats(),
                                                    timings=common_pb2.Timings())


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[RecordingGateway, str]]:
    servicer = RecordingGateway()
    with serve_generation(servicer, workers=2) as address:
        yield servicer, address


@pytest.mark.parametrize("command", [["generate"], ["chat"], ["generate", "--stream"], ["chat", "--stream"]])
def test_client_max_gamma_reaches_the_request(command: list[str], gateway: tuple[RecordingGateway, str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    fake, url = gateway
    assert main([*command, "--url", url, "--max-gamma", "5", "--json", "hi"]) == 0
    speculation = fake.requests[-1].speculation
    assert (speculation.mode, speculation.max_gamma) == (common_pb2.SPECULATION_MODE_AUTO, 5)
    json.loads(capsys.readouterr().out.splitlines()[-1] if "--stream" in command else capsys.readouterr().out)

    assert main([*command, "--url", url, "--gamma", "auto", "--max-gamma", "1", "hi"]) == 0
    assert fake.requests[-1].speculation.max_gamma == 1
    assert main([*command, "--url", url, "hi"]) == 0  # unset: 0 on the wire, the server's limit
    speculation = fake.requests[-1].speculation
    assert (speculation.mode, speculation.max_gamma) == (common_pb2.SPECULATION_MODE_AUTO, 0)


def test_client_max_gamma_needs_automatic_speculation(gateway: tuple[RecordingGateway, str],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    fake, url = gateway
    sent = len(fake.requests)
    for gamma in ("2", "off"):
        assert main(["generate", "--url", url, "--gamma", gamma, "--max-gamma", "5", "hi"]) == 2
        assert "--max-gamma 5 caps automatic speculation and needs --gamma auto" in capsys.readouterr().err
    assert len(fake.requests) == sent  # refused before any request
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit):
            main(["chat", "--url", url, "--max-gamma", bad, "hi"])
        assert "--max-gamma" in capsys.readouterr().err


# --- --quiet -> the long-running tools --------------------------------------------------------------------


class _Reached(Exception):
    """Raised by a stand-in for a tool's entry point once it has recorded its keywords."""


def _stand_in(seen: dict[str, Any]):
    def run(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise _Reached

    return run


@contextlib.contextmanager
def _no_stack(*args: Any, **kwargs: Any) -> Iterator[SimpleNamespace]:
    yield SimpleNamespace(grpc="127.0.0.1:1", http=None, stack=None)


# (argv, the module and attribute of the entry point the command calls)
QUIET_ENTRY_POINTS = [
    *[(["bench", kind], f"tools.bench.{kind}", "run")
      for kind in ("latency", "sampling", "synthetic", "throughput", "profile", "gamma", "kernels", "beam")],
    (["experiment"], "tools.experiment", "run"),
    (["train-draft"], "tools.distill.pipeline", "main"),
    (["fuzz"], "tools.reliability.fuzz", "fuzz"),
    (["soak"], "tools.reliability.soak", "soak"),
]


@pytest.mark.parametrize("quiet", [False, True])
@pytest.mark.parametrize(("argv", "module", "entry"), QUIET_ENTRY_POINTS, ids=lambda v: " ".join(v) if
                         isinstance(v, list) else None)
def test_quiet_reaches_the_long_running_tools(argv: list[str], module: str, entry: str, quiet: bool, tmp_path,
                                              monkeypatch) -> None:
    import tools.cli.bench as bench_cli
    import tools.cli.reliability as reliability_cli
    import tools.cli.train as train_cli
    from tools.reliability import runner

    # No models loaded, no stack started: the entry point stops the command once it is called.
    for namespace in (bench_cli, reliability_cli):
        monkeypatch.setattr(namespace, "bench_models", lambda args: SimpleNamespace(label="stand-in"))
    monkeypatch.setattr(train_cli, "resolve_model", lambda ref: tmp_path / "target")
    monkeypatch.setattr(runner, "gateway_of", _no_stack)
    seen: dict[str, Any] = {}
    monkeypatch.setattr(importlib.import_module(module), entry, _stand_in(seen))
    flags = ["--work-dir" if argv == ["train-draft"] else "--out", str(tmp_path)] + (["--quiet"] if quiet else [])
    with pytest.raises(_Reached):
        main([*argv, *flags])
    assert seen["quiet"] is quiet


@pytest.mark.parametrize("quiet", [False, True])
def test_quiet_reaches_every_fault_scenario(quiet: bool, tmp_path, monkeypatch) -> None:
    import tools.cli.reliability as reliability_cli
    from tools.reliability import FAULT_SCENARIOS
    from tools.reliability.faults import RUNNERS

    monkeypatch.setattr(reliability_cli, "bench_models", lambda args: SimpleNamespace(label="stand-in"))
    seen: list[tuple[str, bool]] = []
    for name in FAULT_SCENARIOS:
        monkeypatch.setitem(RUNNERS, name, lambda models, name=name, **kw: seen.append((name, kw["quiet"])) or
                            {"scenario": name})
    assert main(["faults", "--out", str(tmp_path)] + (["--quiet"] if quiet else [])) == 0
    assert seen == [(name, quiet) for name in FAULT_SCENARIOS]
    assert json.loads((tmp_path / "faults.json").read_text())["scenarios"] == [{"scenario": n} for n in FAULT_SCENARIOS]
