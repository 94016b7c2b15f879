"""The layers contract ([tool.importlinter] in pyproject.toml): it holds on the tree, it fails on a
copy of the tree with a wrong-way import (inside a function, where cycles used to hide), a cycle or
torch in the plain data, and docs/architecture.md §2 lists the layers the contract lists."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tools", "specstream", "kernels", "gateway", "target_service", "draft_service", "client/specstream_client",
            "client/specstream_pb")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'client'}"}
    lint = Path(sys.executable).parent / "lint-imports"
    return subprocess.run([str(lint), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _contract() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def test_the_tree_keeps_every_contract() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    kept = re.findall(r"\bKEPT\b", result.stdout)
    assert len(kept) == len(_contract()["contracts"]) >= 3, result.stdout


@pytest.fixture()
def tree_copy(tmp_path: Path) -> Path:
    """The packages' Python files and pyproject.toml, copied: a tree to break on purpose."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc",
                                                                                          "*.safetensors", "*.json",
                                                                                          "*.gz"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _add(path: Path, code: str) -> None:
    path.write_text(path.read_text() + "\n\n" + code + "\n")


# (module file, code appended to it, what the broken contract's report must name)
BREAKS = {
    # A core module reaching up to a tool, inside a function: function-level imports count.
    "upwards, in a function": ("specstream/data/config.py",
                               "def _parser():\n    from tools.cli import build_parser\n\n"
                               "    return build_parser()",
                               r"specstream\.data\.config -> tools\.cli"),
    # One service importing another.
    "sideways, between services": ("gateway/router.py", "import target_service.engine  # noqa: E402",
                                   r"gateway\.router -> target_service\.engine"),
    # Two sibling ops importing each other (the cycle kernels/nbest.py <-> sample.py once was).
    "a cycle between siblings": ("kernels/nbest.py", "def _cuts():\n    import kernels.cuts\n\n    return kernels.cuts",
                                 r"\.nbest -> \.cuts|\.cuts -> \.nbest"),
    # Torch in the plain data.
    "torch in the plain data": ("specstream/data/beam.py", "import torch  # noqa: E402",
                                r"specstream\.data\.beam -> torch"),
}


@pytest.mark.parametrize("case", list(BREAKS))
def test_a_wrong_import_breaks_the_contract(tree_copy: Path, case: str) -> None:
    module, code, report = BREAKS[case]
    assert _lint(tree_copy).returncode == 0  # the copy itself keeps the contract
    _add(tree_copy / module, code)
    result = _lint(tree_copy)
    assert result.returncode != 0, result.stdout
    assert "BROKEN" in result.stdout and re.search(report, result.stdout), result.stdout


def test_architecture_section_2_lists_the_contracts_layers_in_order() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc[doc.index("## 2. "):doc.index("## 3. ")]
    layers = next(c for c in _contract()["contracts"] if c["type"] == "layers")["layers"]
    positions = []
    for layer in layers:
        modules = [m.strip() for m in layer.split("|")]
        row = next((line for line in section.splitlines()  # cells split at pipes not escaped as \|
                    if line.startswith("|") and all(f"`{m}`" in re.split(r"(?<!\\)\|", line)[1] for m in modules)),
                   None)
        assert row is not None, f"§2 has no table row whose first column names {modules}"
        positions.append(section.index(row))
    assert positions == sorted(positions), "§2's rows are not in the contract's order, top to bottom"
