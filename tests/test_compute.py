"""One torch thread per process (specstream/serving/compute.py): in-process engines, LocalDraft and model
loading all run their torch work on it."""

from __future__ import annotations

import asyncio
import threading

from specstream.data.propose import Proposal, ProposeItem, Proposer
from specstream.serving.compute import on_torch_thread, torch_thread
from target_service.local_draft import LocalDraft


def test_on_torch_thread_always_runs_on_the_one_shared_thread_and_nests() -> None:
    first = on_torch_thread(threading.get_ident)
    assert first != threading.get_ident()
    assert on_torch_thread(threading.get_ident) == first
    assert torch_thread().submit(threading.get_ident).result() == first
    # Called from the torch thread itself it runs inline (waiting on its own queue would deadlock).
    assert on_torch_thread(lambda: on_torch_thread(threading.get_ident)) == first


class _RecordingProposer(Proposer):
    """A proposer that notes which thread each call ran on."""

    name, max_len, vocab_size, held = "recording", 64, 10, 0

    def __init__(self) -> None:
        self.threads: list[int] = []

    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        self.threads.append(threading.get_ident())
        return [Proposal([1] * item.gamma, item.rollback_to + len(item.append)) for item in items]

    def release(self, keys) -> None:
        self.threads.append(threading.get_ident())


def test_local_draft_proposes_on_the_torch_thread_not_the_event_loop() -> None:
    proposer = _RecordingProposer()
    draft = LocalDraft(proposer)

    async def main() -> list[Proposal]:
        out = await draft.propose(1, [ProposeItem(("s", 1), 0, [5, 6], 2)])
        await draft.release([("s", 1)])
        return out

    assert asyncio.run(main())[0].tokens == [1, 1]
    assert proposer.threads == [on_torch_thread(threading.get_ident)] * 2


def _cgroups(tmp_path, proc: str, files: dict[str, str]):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "self_cgroup").write_text(proc)
    return tmp_path, tmp_path / "self_cgroup"


def test_cpu_share_is_the_affinity_capped_by_the_tightest_cgroup_quota(tmp_path) -> None:
    import os

    from specstream.serving.compute import cpu_share

    cores = len(os.sched_getaffinity(0))
    # cgroup v2, a Kubernetes-style limit of 1.5 CPUs on the pod and 4 on the container: floor(1.5).
    root, proc = _cgroups(tmp_path / "v2", "0::/kubepods/pod1/ctr\n",
                          {"kubepods/pod1/cpu.max": "150000 100000\n", "kubepods/pod1/ctr/cpu.max": "400000 100000\n",
                           "cpu.max": "max 100000\n"})
    assert cpu_share(root, proc) == min(cores, 1)
    # A quota under one CPU still gets one thread; no quota ("max") leaves the affinity.
    (root / "kubepods/pod1/cpu.max").write_text("20000 100000\n")
    assert cpu_share(root, proc) == 1
    (root / "kubepods/pod1/cpu.max").write_text("max 100000\n")
    assert cpu_share(root, proc) == min(cores, 4)
    # cgroup v1: cpu.cfs_quota_us / cpu.cfs_period_us, -1 meaning none.
    root, proc = _cgroups(tmp_path / "v1", "3:cpu,cpuacct:/\n",
                          {"cpu,cpuacct/cpu.cfs_quota_us": "100000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cpu_share(root, proc) == 1
    (root / "cpu,cpuacct/cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_share(root, proc) == cores
    # Nothing readable: the affinity.
    assert cpu_share(tmp_path / "none", tmp_path / "none" / "cgroup") == cores


def test_the_inline_executor_runs_each_call_on_the_awaiting_loops_thread_and_delivers_its_failure() -> None:
    import pytest

    from specstream.serving.compute import InlineExecutor

    async def main() -> tuple[int, int]:
        executor, loop = InlineExecutor(1), asyncio.get_running_loop()
        ran_on = await loop.run_in_executor(executor, threading.get_ident)
        with pytest.raises(ValueError, match="the call failed"):
            await loop.run_in_executor(executor, _fails)
        return ran_on, threading.get_ident()

    ran_on, loop_thread = asyncio.run(main())
    assert ran_on == loop_thread


def _fails() -> None:
    raise ValueError("the call failed")
