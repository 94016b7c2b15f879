"""Target addresses: config validation of the entries, and a name becoming one replica per address
(with a scripted resolver: no network)."""

from __future__ import annotations

import socket

import pytest

from gateway.discovery import resolve_targets, split_host_port
from specstream.data.config import GatewayConfig
from tools.cli import build_parser
from tools.cli.services import _gateway_config


def fake_dns(table: dict[str, list[tuple[int, str]]]):
    """A getaddrinfo over a fixed table: name -> [(family, ip)], each listed as getaddrinfo would."""

    def getaddrinfo(host, port, type=0):  # noqa: A002 - socket.getaddrinfo's keyword
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(family, type, 6, "", (ip, port) if family == socket.AF_INET else (ip, port, 0, 0))
                for family, ip in table[host]]

    return getaddrinfo


V4, V6 = socket.AF_INET, socket.AF_INET6
DNS = fake_dns({
    "target-headless": [(V4, "10.0.0.7"), (V4, "10.0.0.8"), (V4, "10.0.0.7"), (V4, "10.0.0.9")],
    "localhost": [(V6, "::1"), (V4, "127.0.0.1")],
    "dual-pod": [(V4, "10.1.0.1"), (V6, "fd00::1"), (V4, "10.1.0.2"), (V6, "fd00::2")],
    "v6-only": [(V6, "fd00::5"), (V6, "fd00::6")],
})


@pytest.mark.parametrize("entries,want", [
    (["127.0.0.1:50052"], ["127.0.0.1:50052"]),
    (["10.0.0.1:1", "10.0.0.2:1"], ["10.0.0.1:1", "10.0.0.2:1"]),
    (["dns:///target-headless:50052"], ["10.0.0.7:50052", "10.0.0.8:50052", "10.0.0.9:50052"]),
    (["target-headless:50052"], ["10.0.0.7:50052", "10.0.0.8:50052", "10.0.0.9:50052"]),
    (["localhost:7"], ["127.0.0.1:7"]),  # one server, listed once per family: IPv4 only
    (["dual-pod:7"], ["10.1.0.1:7", "10.1.0.2:7"]),
    (["v6-only:7"], ["[fd00::5]:7", "[fd00::6]:7"]),
    (["[::1]:7"], ["[::1]:7"]),
    (["10.0.0.7:50052", "target-headless:50052"], ["10.0.0.7:50052", "10.0.0.8:50052", "10.0.0.9:50052"]),
])
def test_each_address_is_one_replica(entries, want):
    assert resolve_targets(entries, getaddrinfo=DNS) == want


def test_unresolvable_and_malformed_entries_name_themselves():
    with pytest.raises(ValueError, match="cannot resolve 'nowhere'"):
        resolve_targets(["nowhere:1"], getaddrinfo=DNS)
    for bad in ["nohost", ":50052", "host:", "host:port", "host:70000", "dns:///host"]:
        with pytest.raises(ValueError, match="target_url"):
            split_host_port(bad)


@pytest.mark.parametrize("make,match", [
    (lambda: GatewayConfig("", "m"), "target_url=''"),
    (lambda: GatewayConfig("host", "m"), "target_url='host'"),
    (lambda: GatewayConfig("a:1", "m", target_urls=["b:x"]), "target_url='b:x'"),
    (lambda: GatewayConfig("a:1", "m", target_urls=["a:1"]), "without duplicates"),
    (lambda: GatewayConfig("a:1", "m", max_queue=-1), "max_queue=-1"),
    (lambda: GatewayConfig("a:1", "m", replica_backlog=-1), "replica_backlog=-1"),
    (lambda: GatewayConfig("a:1", "m", target_resolve_interval_s=-1), "target_resolve_interval_s=-1"),
    (lambda: GatewayConfig("a:1", "m", target_keepalive_time_s=0), "target_keepalive_time_s=0"),
])
def test_bad_gateway_settings_are_rejected_with_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_target_url_alone_or_with_target_urls():
    assert GatewayConfig("a:1", "m").target_addresses == ["a:1"]
    assert GatewayConfig("a:1", "m", target_urls=["dns:///b:2"]).target_addresses == ["a:1", "dns:///b:2"]
    assert GatewayConfig("", "m", target_urls=["b:2", "c:3"]).target_addresses == ["b:2", "c:3"]


def test_gateway_flags_take_several_targets_repeated_or_comma_separated():
    args = build_parser().parse_args(["gateway", "--tokenizer", "m", "--target-url", "a:1,b:2", "--target-url", "c:3",
                                      "--max-queue", "4"])
    config = _gateway_config(args)
    assert config.target_addresses == ["a:1", "b:2", "c:3"]
    assert config.max_queue == 4 and config.replica_backlog is None
    assert (config.target_resolve_interval_s, config.stall.floor_s, config.stall.ceiling_s) == (10.0, 5.0, 30.0)
    assert (config.target_keepalive_time_s, config.target_keepalive_timeout_s) == (1.0, 1.0)
    args = build_parser().parse_args(["gateway", "--tokenizer", "m", "--target-url", "dns:///t:1",
                                      "--target-resolve-interval", "0", "--target-stall-timeout", "5",
                                      "--target-stall-floor", "0.5", "--target-keepalive-time", "2",
                                      "--target-keepalive-timeout", "3", "--min-ping-interval", "0.25"])
    config = _gateway_config(args)
    assert (config.target_resolve_interval_s, config.stall.floor_s, config.stall.ceiling_s) == (0.0, 0.5, 5.0)
    assert config.server.min_ping_interval_s == 0.25
    options = dict(config.target_channel_options())
    # gRPC enforces a ping's timeout through ping_timeout_ms, so it is set with keepalive_timeout_ms.
    assert options["grpc.keepalive_time_ms"] == 2000 and options["grpc.keepalive_timeout_ms"] == 3000
    assert options["grpc.http2.ping_timeout_ms"] == 3000
    assert dict(config.server.grpc_options())["grpc.http2.min_ping_interval_without_data_ms"] == 250
    args = build_parser().parse_args(["serve", "--replicas", "3"])
    assert args.replicas == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--replicas", "0"])
