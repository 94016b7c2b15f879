"""The CPU image as three containers, draft, target and gateway, on a user-defined Docker bridge
network: each service reaches the next by its network alias (`--draft-url draft:50053`,
`--target-url target:50052`), the gateway's gRPC and HTTP ports are published on this host's
loopback, and the containers run as the manifests run the pods (non-root, read-only root
filesystem with a tmpfs at /tmp, no capabilities, no privilege escalation) on the model pair the
manifests serve by default (SmolLM2-135M-Instruct, converted at build time, and its draft).

Checked from the host: every service's health, and greedy generation with speculation through the
gRPC SDK and through the `openai` client equal to plain decoding token for token, with the draft's
proposals reaching the target over the network.

Needs a Docker daemon and the image (`SPECSTREAM_IMAGE`, default specstream:0.1.0): `make
container-test` builds the image when it is missing and runs this folder. The default suite never
collects it (tests/conftest.py); without a daemon or the image these tests fail, they do not skip.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specstream_client import Client

pytestmark = pytest.mark.container

DOCKER = os.environ.get("DOCKER", "docker")
IMAGE = os.environ.get("SPECSTREAM_IMAGE", "specstream:0.1.0")
STARTUP_S = 300  # model loading and the target's verify timing, on a small shared CPU
PROMPTS = ["The three laws of motion are", "def fibonacci(n):\n"]
CHAT = [{"role": "user", "content": "Name three primary colors."}]
GAMMA = 4
# As the manifests run each pod (deploy/base): what the image must work under.
HARDENED = ["--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
# name: (gRPC port, arguments); started in this order, each after the one before is healthy.
SERVICES = {
    "draft": (50053, ["draft", "--host", "0.0.0.0", "--port", "50053",
                      "--model", "/opt/specstream/drafts/smollm2-135m-draft", "--threads", "1"]),
    "target": (50052, ["target", "--host", "0.0.0.0", "--port", "50052", "--model", "smollm2",
                       "--draft-url", "draft:50053", "--threads", "1", "--gamma", str(GAMMA)]),
    "gateway": (50051, ["gateway", "--host", "0.0.0.0", "--port", "50051", "--target-url", "target:50052",
                        "--tokenizer", "smollm2", "--http-port", "8080"]),
}


def docker(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{DOCKER} {' '.join(args)}: exit {result.returncode}: {result.stderr.strip()}")
    return result


@dataclass
class Deployment:
    network: str
    containers: dict[str, str]  # service -> container name
    grpc_address: str  # the gateway's gRPC port, published on this host
    http_address: str  # the gateway's HTTP port, published on this host



def exec_health(container: str, service: str) -> subprocess.CompletedProcess[str]:
    """`specstream health` inside the service's own container, as an exec probe runs it."""
    return docker("exec", container, "specstream", "health", "--url", f"127.0.0.1:{SERVICES[service][0]}",
                  check=False)


def logs(container: str) -> str:
    result = docker("logs", "--tail", "40", container, check=False)
    return result.stdout + result.stderr


def _published(container: str, port: int) -> str:
    # One line per address family: "127.0.0.1:32768".
    return docker("port", container, f"{port}/tcp").stdout.split()[0]


def _wait_healthy(container: str, service: str) -> None:
    deadline = time.monotonic() + STARTUP_S
    while True:
        state = docker("inspect", "-f", "{{.State.Status}}", container).stdout.strip()
        if state != "running":
            raise RuntimeError(f"{service} container is {state}:\n{logs(container)}")
        if exec_health(container, service).returncode == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{service} not SERVING after {STARTUP_S} s:\n{logs(container)}")
        time.sleep(1.0)


@pytest.fixture(scope="module")
def deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    if docker("image", "inspect", IMAGE, check=False).returncode != 0:
        pytest.fail(f"no image {IMAGE!r} (is the Docker daemon running? `make image` builds the image)")
    suffix = uuid.uuid4().hex[:8]
    network = f"specstream-test-{suffix}"
    containers = {service: f"specstream-test-{service}-{suffix}" for service in SERVICES}
    docker("network", "create", "--driver", "bridge", network)
    failed_before = request.session.testsfailed
    try:
        for service, (port, args) in SERVICES.items():
            publish = ["-p", f"127.0.0.1::{port}", "-p", "127.0.0.1::8080"] if service == "gateway" else []
            docker("run", "--detach", "--name", containers[service], "--network", network, "--network-alias", service,
                   *HARDENED, *publish, IMAGE, *args)
            _wait_healthy(containers[service], service)
        gateway = containers["gateway"]
        yield Deployment(network, containers, _published(gateway, 50051), _published(gateway, 8080))
    finally:
        if request.session.testsfailed > failed_before:
            report = request.config.pluginmanager.get_plugin("terminalreporter")
            for service in SERVICES:
                report.write_line(f"---- {service} container log (last 40 lines) ----\n{logs(containers[service])}")
        docker("rm", "--force", *containers.values(), check=False)
        docker("network", "rm", network, check=False)


def test_every_service_is_healthy_and_runs_as_the_image_user(deployment: Deployment) -> None:
    for service in ("draft", "target", "gateway"):
        result = exec_health(deployment.containers[service], service)
        assert result.returncode == 0 and result.stdout.strip().endswith(": SERVING"), (service, result)
        uid = docker("exec", deployment.containers[service], "id", "-u").stdout.strip()
        assert uid == "10001", (service, uid)
    # The gateway's published ports, from this host: gRPC health and the HTTP readiness endpoint.
    with grpc.insecure_channel(deployment.grpc_address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with urllib.request.urlopen(f"http://{deployment.http_address}/health", timeout=10) as response:
        assert response.status == 200


def test_greedy_through_grpc_equals_plain_decoding(deployment: Deployment) -> None:
    accepted = 0
    with Client(deployment.grpc_address, timeout=300) as client:
        for prompt in PROMPTS:
            speculative = client.generate(prompt, max_new_tokens=32, speculation=GAMMA, ignore_eos=True)
            plain = client.generate(prompt, max_new_tokens=32, speculation="off", ignore_eos=True)
            assert speculative.token_ids == plain.token_ids and len(plain.token_ids) == 32, prompt
            assert speculative.text == plain.text
            # The draft container's proposals reached the target over the network.
            assert speculative.stats.draft_tokens > 0, (prompt, speculative.stats)
            assert plain.stats.draft_tokens == 0
            accepted += speculative.stats.accepted_tokens
    assert accepted > 0


def test_greedy_through_the_openai_client_equals_plain_decoding(deployment: Deployment) -> None:
    with openai.OpenAI(base_url=f"http://{deployment.http_address}/v1", api_key="none", max_retries=0,
                       timeout=300) as http, Client(deployment.grpc_address, timeout=300) as grpc_client:
        [model] = [m.id for m in http.models.list().data]
        for prompt in PROMPTS:
            completion = http.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0,
                                                 extra_body={"speculation": GAMMA, "return_token_ids": True})
            plain = grpc_client.generate(prompt, max_new_tokens=32, speculation="off")
            assert completion.choices[0].model_extra["token_ids"] == plain.token_ids, prompt
            assert completion.choices[0].text == plain.text
            assert completion.model_extra["metrics"]["speculative_decoding"]["num_draft_tokens"] > 0
        chat = http.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=32, temperature=0,
                                            extra_body={"speculation": GAMMA, "return_token_ids": True})
        plain = grpc_client.chat(CHAT, max_new_tokens=32, speculation="off")
        assert chat.choices[0].model_extra["token_ids"] == plain.token_ids
        assert chat.choices[0].message.content == plain.text
