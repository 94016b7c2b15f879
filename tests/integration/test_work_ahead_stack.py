"""A draft service started with --work-ahead normal (and three outcomes a chain) serves the three real
processes: greedy answers equal plain decoding's, and its /metrics count the rounds it prepared and
the items they answered.
(At ``idle`` the tiny models' passes leave the work no spare cycles to count on; the priority itself
is tested in tests/test_work_ahead.py.)"""

from __future__ import annotations

import asyncio
import urllib.request

from specstream_client import AsyncClient

PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):", "for i in range("]


async def _generate_all(address: str, speculation) -> list[list[int]]:
    async with AsyncClient(address, timeout=120) as client:
        results = await asyncio.gather(*[client.generate(p, max_new_tokens=40, speculation=speculation,
                                                         ignore_eos=True) for p in PROMPTS])
    return [list(r.token_ids) for r in results]


def test_a_draft_service_working_ahead_is_exact_and_counted(stack_factory, model_zoo):
    # Three outcomes a chain: the whole chain kept, and the runner-up after its first or second guess.
    stack = stack_factory(model_zoo["target"], model_zoo["same"], max_slots=4, work_ahead="normal",
                          work_ahead_outcomes=3, metrics=True)
    plain = asyncio.run(_generate_all(stack.gateway_address, "off"))
    for gamma in (2, 4):
        assert asyncio.run(_generate_all(stack.gateway_address, gamma)) == plain, f"gamma={gamma}"
    with urllib.request.urlopen(f"http://{stack.metrics_addresses['draft']}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    counts = {outcome: _value(text, f'specstream:draft_work_ahead_total{{outcome="{outcome}"}}')
              for outcome in ("prepared", "hit")}
    # The `same` draft is the target: every chain is kept and its bonus guessed, so rounds hit.
    assert counts["prepared"] > 0 and counts["hit"] > 0, counts


def _value(text: str, sample: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(sample + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0
