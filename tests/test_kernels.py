"""The output-layer and verification ops against hand-worked cases."""

from __future__ import annotations

import pytest
import torch

import kernels


def _logits_for(tokens: list[list[int]], vocab: int = 10) -> torch.Tensor:
    """Logits whose argmax at row b, position j is tokens[b][j]."""
    logits = torch.randn(len(tokens), len(tokens[0]), vocab) * 0.1  # [B, G+1, V]
    for b, row in enumerate(tokens):
        for j, tok in enumerate(row):
            logits[b, j, tok] += 5.0
    return logits


def test_argmax_breaks_ties_toward_lowest_id():
    assert kernels.argmax(torch.tensor([[1.0, 3.0, 3.0, 0.0]])).tolist() == [1]


def test_greedy_verify_accepts_the_longest_matching_prefix():
    target = [[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7], [1, 2, 3, 9]]
    draft = torch.tensor([[4, 5, 6], [4, 9, 6], [8, 5, 6], [1, 2, -1]])  # row 3 proposed only 2
    num_draft = torch.tensor([3, 3, 3, 2])
    accepted, tokens = kernels.greedy_verify(draft, num_draft, _logits_for(target))
    assert accepted.tolist() == [3, 1, 0, 2]  # all (bonus next), stop at a mismatch, none, all of a shorter row
    assert tokens.tolist() == target


def test_greedy_verify_ignores_padding_past_num_draft():
    target = [[3, 3, 3]]
    accepted, _ = kernels.greedy_verify(torch.tensor([[3, 3]]), torch.tensor([1]), _logits_for(target))
    assert accepted.tolist() == [1]


def test_greedy_verify_with_no_proposals():
    accepted, tokens = kernels.greedy_verify(torch.zeros(2, 0, dtype=torch.int64), torch.tensor([0, 0]),
                                             _logits_for([[5], [6]]))
    assert accepted.tolist() == [0, 0] and tokens.tolist() == [[5], [6]]


def test_the_ops_serve_without_triton_installed():
    """The CPU runtime has no Triton: the ops import and run their torch references, and forcing a
    Triton kernel says what is missing."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch, kernels\n"
        "from kernels.dispatch import triton_available\n"
        "assert not triton_available()\n"
        "print(kernels.argmax(torch.tensor([[0.0, 2.0, 1.0]])).tolist())\n"
        "from kernels.row_pass import _chunk_kernel\n"
        "try:\n"
        "    _chunk_kernel[(1,)]()\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
        "with kernels.use('triton'):\n"
        "    try:\n"
        "        kernels.argmax(torch.zeros(1, 3))\n"
        "    except RuntimeError as e:\n"
        "        print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "[1]"
    assert "Triton is not installed" in lines[1] and "_chunk_kernel" in lines[1]
    assert "Triton is not installed" in lines[2]


def test_the_dispatcher_picks_and_checks_its_backend(monkeypatch):
    from kernels.dispatch import backend, use

    cpu = torch.zeros(1)
    assert backend(cpu) == "torch"  # auto: torch (on CUDA too, until the kernels beat it there)
    if torch.cuda.is_available():
        assert backend(torch.zeros(1, device="cuda")) == "torch"
    with use("torch"):
        assert backend(cpu) == "torch"
    monkeypatch.setenv("SPECSTREAM_KERNELS", "fast")
    with pytest.raises(ValueError, match="SPECSTREAM_KERNELS='fast'"):
        backend(cpu)
    monkeypatch.setenv("SPECSTREAM_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend(cpu)
    with pytest.raises(ValueError, match="kernel backend 'gpu'"):
        with use("gpu"):
            pass
