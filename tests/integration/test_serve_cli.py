"""`specstream serve` as a user runs it: three processes, health, reflection (the gateway's only),
Ctrl-C stops all."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specstream_client import Client


def _services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(stub.ServerReflectionInfo(iter([request]), timeout=10))
        return {s.name for s in reply.list_services_response.service}


def test_serve_with_default_models_then_sigint(tmp_path):
    """No model flags: SmolLM2 with its shipped draft (converted into a fresh model cache); health,
    reflection on the gateway and off on target and draft, lossless output, clean Ctrl-C."""
    env = {**os.environ, "SPECSTREAM_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "serve", "--port", "0", "--max-seq-len", "512",
                             "--log-dir", str(tmp_path / "logs")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "listening on" in line:
                break
        output = "".join(lines)
        assert "RANDOM-INIT" not in output
        match = re.search(r"listening on (\S+)", output)
        assert match, output
        address = match.group(1)
        addresses = dict(re.findall(r"(target|draft) (\d+\.\d+\.\d+\.\d+:\d+)", proc.stdout.readline()))
        assert "specstream.v1.Generation" in _services(address)
        assert "grpc.health.v1.Health" in _services(address)
        for name in ("target", "draft"):  # internal services: reflection only with --reflection
            with pytest.raises(grpc.RpcError) as off:
                _services(addresses[name])
            assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with Client(address, timeout=60) as client:
            info = client.model_info()
            # The pair's default proposer: prompt lookup in front of its draft.
            assert (info.target_model, info.draft_model) == ("SmolLM2-135M-Instruct.Q4_1", "ngram+smollm2-135m-feature")
            assert info.has_chat_template
            off = client.generate("def main():", max_new_tokens=16, speculation="off", ignore_eos=True)
            spec = client.generate("def main():", max_new_tokens=16, speculation=4, ignore_eos=True)
        assert spec.token_ids == off.token_ids
        assert spec.stats.accepted_tokens > 0
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0, rest
        assert re.search(r"stopped: \{'draft': 0, 'target': 0, 'gateway': 0\}", rest), rest
    finally:
        if proc.poll() is None:  # a failed assertion: stop the stack gracefully (a kill orphans its services)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
