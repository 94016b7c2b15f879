"""The committed generated stubs must be exactly what `make protos` produces."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "tools" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_fresh():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_protos.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_check_detects_a_stale_stub(tmp_path, monkeypatch):
    gen = _gen_module()
    copy = tmp_path / "specstream_pb"
    shutil.copytree(gen.OUT_DIR, copy)
    monkeypatch.setattr(gen, "OUT_DIR", copy)
    files = gen.generate()
    assert gen.stale_files(files) == []
    (copy / "draft_pb2.py").write_text((copy / "draft_pb2.py").read_text() + "\n# edited\n")
    (copy / "extra_pb2.py").write_text("")
    assert gen.stale_files(files) == ["draft_pb2.py", "extra_pb2.py"]


def test_every_request_carries_traceparent():
    from specstream_pb import draft_pb2, generation_pb2, target_pb2

    for message in (generation_pb2.GenerateRequest, target_pb2.SequenceRequest, draft_pb2.ProposeRequest):
        assert "traceparent" in message.DESCRIPTOR.fields_by_name, message.DESCRIPTOR.full_name
