"""Config validation names the field and quotes the bad value."""

from __future__ import annotations

import pytest

from specstream.data.config import DraftConfig, GatewayConfig, ModelSpec, RestartPolicy, ServerConfig, TargetConfig


@pytest.mark.parametrize("make,match", [
    (lambda: ServerConfig(port=70000), "port=70000"),
    (lambda: ModelSpec("m", dtype="int8"), "dtype='int8'"),
    (lambda: TargetConfig(ModelSpec("m"), max_slots=0), "max_slots=0"),
    (lambda: TargetConfig(ModelSpec("m"), default_gamma=20, max_gamma=16), "default_gamma=20"),
    (lambda: TargetConfig(ModelSpec("m"), draft_timeout_s=0), "draft_timeout_s=0"),
    (lambda: TargetConfig(ModelSpec("m"), draft_deadline_floor_s=0), "draft_deadline_floor_s=0"),
    (lambda: TargetConfig(ModelSpec("m"), draft_timeout_s=1, draft_deadline_floor_s=2), "draft_deadline_floor_s=2"),
    (lambda: TargetConfig(ModelSpec("m"), draft_deadline_factor=0.5), "draft_deadline_factor=0.5"),
    (lambda: TargetConfig(ModelSpec("m"), speculative_sampling="maximal"), "speculative_sampling='maximal'"),
    (lambda: RestartPolicy(initial_delay_s=-1), "initial_delay_s=-1"),
    (lambda: RestartPolicy(max_delay_s=0.1), "max_delay_s=0.1"),
    (lambda: RestartPolicy(stable_s=0), "stable_s=0"),
    (lambda: DraftConfig(ModelSpec("m"), max_seq_len=2), "max_seq_len=2"),
    (lambda: DraftConfig(ModelSpec("m"), work_ahead_outcomes=0), "work_ahead_outcomes=0"),
    (lambda: DraftConfig(ModelSpec("m"), work_ahead="idle", work_ahead_outcomes=17), "work_ahead_outcomes=17"),
    (lambda: DraftConfig(ModelSpec("m"), work_ahead_outcomes=3), "work_ahead_outcomes=3: must be 1 unless the draft"),
    (lambda: GatewayConfig("t:1", "m", max_in_flight=0), "max_in_flight=0"),
    (lambda: GatewayConfig("t:1", "m", max_top_logprobs=-1), "max_top_logprobs=-1"),
])
def test_bad_values_are_rejected_with_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_defaults_are_valid():
    TargetConfig(ModelSpec("m"))
    RestartPolicy()
    DraftConfig(ModelSpec("m"))
    GatewayConfig("t:1", "m")


def test_security_settings_are_checked_naming_the_field(tmp_path):
    from specstream.data.config import ChannelSecurity, ServerSecurity

    pem = tmp_path / "x.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    f = str(pem)
    cases = [
        (lambda: ServerSecurity(cert_file=f), r"key_file=None: must be given together"),
        (lambda: ServerSecurity(key_file=f), r"cert_file=None: must be given together"),
        (lambda: ServerSecurity(client_ca_file=f), r"client_ca_file=.*x.pem': must be given with cert_file"),
        (lambda: ServerSecurity(cert_file=f, key_file=f, allowed_peers=("a",)), r"allowed_peers=\('a',\)"),
        (lambda: ServerSecurity(cert_file=f, key_file=f, client_ca_file=f, allowed_peers=("a b",)),
         r"allowed_peers=\('a b',\): must be names without spaces"),
        (lambda: ServerSecurity(token_file=str(tmp_path / "nope")), r"token_file=.*nope': must be None or a readable"),
        (lambda: ChannelSecurity("draft_security", cert_file=f, key_file=f),
         r"draft_security.cert_file=.*: must be given with ca_file"),
        (lambda: ChannelSecurity("target_security", ca_file=f, key_file=f), r"target_security.cert_file=None"),
        (lambda: ChannelSecurity("target_security", server_name="t"), r"target_security.server_name='t'"),
        (lambda: ChannelSecurity("draft_security", ca_file=str(tmp_path)), r"draft_security.ca_file=.*must be None"),
        (lambda: GatewayConfig("t:1", "m", http_port=8080, server=ServerConfig(security=ServerSecurity(
            cert_file=f, key_file=f, client_ca_file=f, allowed_peers=("p",)))), r"allowed_peers=\('p',\): must be "
         "empty with http_port"),
    ]
    for make, match in cases:
        with pytest.raises(ValueError, match=match):
            make()
    # All off by default; complete settings pass.
    assert not ServerSecurity().enabled and not ChannelSecurity().tls
    assert ServerSecurity(cert_file=f, key_file=f, client_ca_file=f, allowed_peers=("p",), token_file=f).mtls
    assert ChannelSecurity(ca_file=f, cert_file=f, key_file=f, server_name="n", token_file=f).tls
