"""Integration fixtures: the real three processes on loopback ports."""

from __future__ import annotations

import pytest

from tools.launcher import Stack, StackSpec


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="module")
def stack_factory(tmp_path_factory):
    stacks: list[Stack] = []

    def start(target, draft, **kwargs) -> Stack:
        spec = StackSpec(str(target), str(draft) if draft else None, max_seq_len=512, max_gamma=8,
                         log_dir=str(tmp_path_factory.mktemp("logs")), **kwargs)
        stack = Stack(spec).start(timeout_s=120)
        stacks.append(stack)
        return stack

    yield start
    codes = [stack.stop() for stack in stacks]  # every stack, before any verdict: none is left running
    for code in codes:
        assert all(c == 0 for c in code.values()), f"unclean exit: {code}"
