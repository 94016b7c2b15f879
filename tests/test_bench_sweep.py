"""The benchmarks' batch-1 sweep (tools.bench.latency.sweep) over a fake client: rounds
run the γ list again in reverse every other round and pool each γ's generations and metrics;
routed settings go to another stack and read its metrics; and the nonsense prompt set
(tools.bench.prompts)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

import pytest

from tools.bench import latency
from tools.bench.models import BenchModels
from tools.bench.prompts import SYLLABLES, nonsense_texts


class _FakeClient:
    """Answers every generate with `max_new_tokens` tokens in 0.1 s (the warm-up's 16 in 0.1 s too),
    two proposals of which one accepted when speculating; records (speculation, seed) per call."""

    calls: ClassVar[list[tuple[object, int | None]]] = []
    addresses: ClassVar[list[str]] = []  # per call, the address of the client that made it

    def __init__(self, address, timeout=None):
        self.address = address

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def generate(self, prompt, max_new_tokens, speculation="auto", ignore_eos=False, temperature=0.0, seed=None):
        self.calls.append((speculation, seed))
        self.addresses.append(self.address)
        drafting = speculation != "off"
        stats = SimpleNamespace(draft_tokens=2 * drafting, accepted_tokens=drafting, rejections=drafting,
                                target_passes=max_new_tokens - drafting, branch_histogram=(), branch_tokens=0,
                                gamma_histogram=(0, 0, 1) if drafting else ())
        return SimpleNamespace(usage=SimpleNamespace(completion_tokens=max_new_tokens),
                               timings=SimpleNamespace(total_seconds=0.1, time_to_first_token_seconds=0.01),
                               stats=stats, token_ids=[len(prompt)] * max_new_tokens)


def test_rounds_reverse_the_order_and_pool_every_gammas_generations(monkeypatch):
    import specstream_client

    monkeypatch.setattr(specstream_client, "Client", _FakeClient)
    readings = iter(range(100))  # every /metrics reading: one more pass, 2 ms more of each part than the last

    def read(address):
        n = next(readings)
        return {"passes": float(n), "target": 0.002 * n, "draft": 0.002 * n, "host": 0.002 * n}

    monkeypatch.setattr(latency, "read_counters", read)
    _FakeClient.calls = []
    got = latency.sweep("fake:0", [[1, 2], [3]], [0, 2, "auto"], 8, temperature=1.0, metrics="fake-metrics:0",
                        rounds=3)
    order = [speculation for speculation, _ in _FakeClient.calls[1:]]  # after the warm-up
    assert order == ["off"] * 2 + [2] * 2 + ["auto"] * 2 + ["auto"] * 2 + [2] * 2 + ["off"] * 2 + \
        ["off"] * 2 + [2] * 2 + ["auto"] * 2
    assert [seed for _, seed in _FakeClient.calls[1:3]] == [0, 1]  # seed = the prompt's index, every round
    for gamma, r in got.items():
        assert r["tokens"] == 3 * 2 * 8 and r["seconds"] == pytest.approx(0.6), gamma  # 3 rounds x 2 prompts
        assert len(r["token_ids"]) == 6, gamma
        # one reading before and one after each (round, γ): each grew by 1 pass and 2 ms a part
        assert r["pass_ms"] == pytest.approx({"passes": 3.0, "target": 2.0, "draft": 2.0, "host": 2.0}), gamma
    assert got[0]["proposed"] == 0 and got[2]["proposed"] == 12 and got["auto"]["drafting_passes"] == 6


def test_routed_settings_take_their_turns_on_their_own_stack_and_read_its_metrics(monkeypatch):
    """bench sampling's auto in a stack of its own: "auto" and that stack's plain decoding go to the
    other gateway with the speculation each route names, and are timed by the other target's /metrics."""
    import specstream_client

    monkeypatch.setattr(specstream_client, "Client", _FakeClient)
    readings = {"main-metrics:0": iter(range(100)), "own-metrics:0": iter(range(0, 1000, 10))}

    def read(address):
        n = next(readings[address])  # the main target counts one pass a reading, the own one ten
        return {"passes": float(n), "target": 0.002 * n, "draft": 0.0, "host": 0.0}

    monkeypatch.setattr(latency, "read_counters", read)
    _FakeClient.calls, _FakeClient.addresses = [], []
    routes = {"auto": ("own:0", "own-metrics:0", "auto"), "auto plain": ("own:0", "own-metrics:0", "off")}
    got = latency.sweep("main:0", [[1, 2]], [0, 2, "auto", "auto plain"], 8, metrics="main-metrics:0", routes=routes)
    sent = list(zip(_FakeClient.addresses, (speculation for speculation, _ in _FakeClient.calls)))
    assert sorted(sent[:2]) == [("main:0", "auto"), ("own:0", "auto")]  # one warm-up a stack
    assert sent[2:] == [("main:0", "off"), ("main:0", 2), ("own:0", "auto"), ("own:0", "off")]
    assert got[0]["pass_ms"]["passes"] == got[2]["pass_ms"]["passes"] == 1.0
    assert got["auto"]["pass_ms"]["passes"] == got["auto plain"]["pass_ms"]["passes"] == 10.0
    assert got["auto plain"]["proposed"] == 0 and got["auto"]["proposed"] == 2


def test_nonsense_prompts_are_made_up_words_the_same_for_a_seed():
    texts = nonsense_texts(6)
    assert texts == nonsense_texts(6) and texts != nonsense_texts(6, seed=8) and len(set(texts)) == 6
    for text in texts:
        words = text.split(" ")
        assert 8 <= len(words) <= 20, text
        for word in words:  # each word 1-3 syllables of SYLLABLES
            rest, parts = word, 0
            while rest:
                rest = next(rest[len(s):] for s in SYLLABLES if rest.startswith(s))
                parts += 1
            assert 1 <= parts <= 3, word


def test_a_model_without_a_chat_template_gets_nonsense_as_plain_text(model_zoo):
    models = BenchModels.from_refs(str(model_zoo["target"]), None, "float32", "zoo", prompt_set="nonsense")
    tok = models.tokenizer()
    assert tok.chat_template is None
    assert [tok.decode(ids) for ids in models.prompts(3)] == nonsense_texts(3)
