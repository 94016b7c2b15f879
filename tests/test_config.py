"""Config validation names the field and quotes the bad value."""

from __future__ import annotations

import pytest

from specstream.config import DraftConfig, GatewayConfig, ModelSpec, RestartPolicy, ServerConfig, TargetConfig


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
