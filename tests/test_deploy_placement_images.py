"""deploy/: where the draft runs in each layout, the GPU overlay, OpenTelemetry export, the
container images (Dockerfiles: the pinned torch, the demo models, no registry needed) and the
network policies, checked on every kustomize layout rendered offline (tests/support/manifests.py)."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.support.manifests import (  # noqa: F401 (objects, rendered: fixtures)
    DEPLOY,
    DRAFT_PLACEMENT,
    LAYOUTS,
    ROOT,
    by_kind,
    container_env,
    find_container,
    namespace_of,
    parsed_args,
    pod_spec,
    running_containers,
    service_containers,
    objects,
    rendered,
)



# ---- where the draft runs ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_draft_placement(layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    namespace = namespace_of(docs)
    target_pod = pod_spec(docs, "target")
    target = parsed_args(find_container(docs, "target"), docs, namespace)
    placement = DRAFT_PLACEMENT[layout]
    components = {d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                  for d in by_kind(docs, "Deployment").values()}
    names = sorted(c["name"] for c in running_containers(target_pod))
    if placement is None:
        assert target.draft_url is None and names == ["target"] and "draft" not in components
    elif placement == "sidecar":
        assert names == ["draft", "target"], "the colocated target pod runs two containers"
        [draft] = [c for c in target_pod["initContainers"] if c["name"] == "draft"]
        assert draft["restartPolicy"] == "Always"  # a native sidecar: up before the target, down after it
        draft_port = parsed_args(draft, docs, namespace).port
        assert target.draft_url == f"127.0.0.1:{draft_port}"
        assert "draft" not in components
    else:
        assert names == ["target"] and "draft" in components
        service = by_kind(docs, "Service")["specstream-draft"]
        draft_port = parsed_args(find_container(docs, "draft"), docs, namespace).port
        [port] = service["spec"]["ports"]
        assert target.draft_url == f"{service['metadata']['name']}:{port['port']}"
        assert port["port"] == draft_port


@pytest.mark.parametrize("layout", LAYOUTS)
def test_only_the_gpu_overlay_puts_the_target_on_a_gpu(layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    namespace = namespace_of(docs)
    gpu = layout == "overlays/gpu"
    target_pod = pod_spec(docs, "target")
    target = find_container(docs, "target")
    gpus = [target["resources"][kind].get("nvidia.com/gpu") for kind in ("requests", "limits")]
    assert gpus == ([1, 1] if gpu else [None, None])
    assert parsed_args(target, docs, namespace).device == ("cuda" if gpu else "cpu")
    assert target["image"].startswith("specstream-cuda:" if gpu else "specstream:")
    tolerations = [t["key"] for t in target_pod.get("tolerations", [])]
    assert ("nvidia.com/gpu" in tolerations) == gpu
    # Nothing else asks for a GPU or needs the larger CUDA image.
    for _, container in service_containers(docs):
        if container is not target:
            assert "nvidia.com/gpu" not in container["resources"]["limits"], container["name"]
            assert getattr(parsed_args(container, docs, namespace), "device", "cpu") == "cpu"
            assert container["image"].startswith("specstream:"), container["name"]


# ---- OpenTelemetry ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_services_send_otlp_to_the_collector(layout: str, objects: dict[str, list[dict]]) -> None:
    docs = objects[layout]
    namespace = namespace_of(docs)
    collector_pod = pod_spec(docs, "otel-collector")
    [collector] = collector_pod["containers"]
    [volume] = [v for v in collector_pod["volumes"] if "configMap" in v]
    configmap = by_kind(docs, "ConfigMap")[volume["configMap"]["name"]]
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    assert {"grpc", "http"} <= set(config["receivers"]["otlp"]["protocols"])
    assert "debug" in config["exporters"]
    for signal in ("traces", "metrics", "logs"):
        pipeline = config["service"]["pipelines"][signal]
        assert "otlp" in pipeline["receivers"] and "debug" in pipeline["exporters"], signal
    mount = next(m for m in collector["volumeMounts"] if m["name"] == volume["name"])
    assert f"--config={mount['mountPath']}/config.yaml" in collector["args"]
    service = by_kind(docs, "Service")["specstream-otel-collector"]
    assert {p["port"] for p in service["spec"]["ports"]} == {4317, 4318}
    for _, container in service_containers(docs):
        env = container_env(container, docs, namespace)
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

    config = by_kind(objects["base"], "ConfigMap")
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
        for name, c in by_kind(docs, "ConfigMap").items():
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
    found = [d["spec"]["template"]["metadata"]["labels"] for d in by_kind(docs, "Deployment").values()
             if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    return found[0] if found else None


def _ports_of(pod: dict) -> dict[int, str]:
    """Container port number -> its name, over the pod's running containers."""
    return {p["containerPort"]: p.get("name", "") for c in running_containers(pod) for p in c.get("ports", [])}


def _admits(docs: list[dict], namespace: str, source: tuple[str, dict[str, str]], component: str, port: int) -> bool:
    """Whether the rendered NetworkPolicies let a pod (`source`: its namespace and labels) open a
    connection to `port` of the `component` pods: NetworkPolicy semantics, for the selector forms
    these manifests use (matchLabels pod selectors, an empty namespace selector, named ports)."""
    labels = _pod_labels(docs, component)
    port_name = _ports_of(pod_spec(docs, component))[port]
    selecting = [p for p in by_kind(docs, "NetworkPolicy").values()
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
    namespace = namespace_of(docs)
    policies = by_kind(docs, "NetworkPolicy")
    deny = policies["specstream-default-deny-ingress"]["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and not deny.get("ingress")
    pods = {c: (namespace, _pod_labels(docs, c)) for c in ("gateway", "target", "draft", "otel-collector")
            if _pod_labels(docs, c) is not None}
    outsider = ("elsewhere", {"app": "curious"})
    same_namespace_stranger = (namespace, {"app": "curious"})
    gateway_port = parsed_args(find_container(docs, "gateway"), docs, namespace).port
    target_port = parsed_args(find_container(docs, "target"), docs, namespace).port
    for source in (outsider, same_namespace_stranger, pods["target"]):
        assert _admits(docs, namespace, source, "gateway", gateway_port), source  # the public API
    assert _admits(docs, namespace, pods["gateway"], "target", target_port)
    for source in (outsider, same_namespace_stranger, *(pods[c] for c in pods if c not in ("gateway",))):
        assert not _admits(docs, namespace, source, "target", target_port), source
    placement = DRAFT_PLACEMENT[layout]
    if placement == "deployment":
        draft_port = parsed_args(find_container(docs, "draft"), docs, namespace).port
        assert _admits(docs, namespace, pods["target"], "draft", draft_port)
        for source in (outsider, same_namespace_stranger, pods["gateway"]):
            assert not _admits(docs, namespace, source, "draft", draft_port), source
    elif placement == "sidecar":  # reached over the pod's loopback only: its port is open to no one
        [draft] = [c for c in pod_spec(docs, "target")["initContainers"] if c["name"] == "draft"]
        draft_port = parsed_args(draft, docs, namespace).port
        for source in (outsider, same_namespace_stranger, pods["gateway"], pods["target"]):
            assert not _admits(docs, namespace, source, "target", draft_port), source
    collector = _ports_of(pod_spec(docs, "otel-collector"))
    for port in collector:
        allowed = _admits(docs, namespace, pods["target"], "otel-collector", port)
        assert allowed == (collector[port] in ("otlp-grpc", "otlp-http")), (port, collector[port])
        assert not _admits(docs, namespace, outsider, "otel-collector", port)
