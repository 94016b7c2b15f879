"""Beam search through the three real processes: the SDK (sync, async, stream) and the CLI get
the engine's n-best hypotheses with their text; beams share the target with ordinary requests
without changing them; bad options come back as INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from specstream.data.config import ModelSpec, TargetConfig
from specstream.data.engine import BeamOptions, SequenceRequest, Speculation
from specstream.models.loader import load_model
from specstream.text.tokenizer import TextTokenizer
from specstream_client import AsyncClient, Client, InvalidArgument
from target_service.engine import Engine
from target_service.inprocess import run_requests

PROMPTS = ["def main():", "The weather", "import os"]


@pytest.fixture(scope="module")
def stack(stack_factory, model_zoo):
    return stack_factory(model_zoo["target"], model_zoo["partial"], max_slots=8)


@pytest.fixture(scope="module")
def in_process(model_zoo):
    """The engine's own beams for PROMPTS (k = 4, the 3 best, 12 tokens, EOS ignored)."""
    tokenizer = TextTokenizer.from_dir(model_zoo["target"])
    engine = Engine(load_model(model_zoo["target"]), TargetConfig(model=ModelSpec("t"), max_slots=8, max_seq_len=512,
                                                                 max_gamma=8), None)
    requests = [SequenceRequest(str(i), tokenizer.encode(p), 12, speculation=Speculation("off"),
                                beam=BeamOptions(4, 3)) for i, p in enumerate(PROMPTS)]
    return tokenizer, [r.final.sequences for r in run_requests(engine, requests, timeout_s=120)]


def test_sdk_returns_the_engines_n_best_with_text(stack, in_process):
    tokenizer, want = in_process
    with Client(stack.gateway_address, timeout=120) as client:
        for prompt, beams in zip(PROMPTS, want):
            result = client.generate(prompt, max_new_tokens=12, ignore_eos=True, num_beams=4, num_return_sequences=3)
            assert [s.token_ids for s in result.sequences] == [h.token_ids for h in beams]
            assert [s.score for s in result.sequences] == pytest.approx([h.score for h in beams], rel=1e-6)
            assert result.token_ids == beams[0].token_ids and result.text == result.sequences[0].text
            assert [s.text for s in result.sequences] == [tokenizer.decode(h.token_ids) for h in beams]
            assert result.stats.beam_expansions > 0 and result.usage.completion_tokens == len(result.token_ids)
            chunks = list(client.generate_stream(prompt, max_new_tokens=12, ignore_eos=True, num_beams=4,
                                                 num_return_sequences=3))
            assert len(chunks) == 1, "a beam is sent as one chunk when its search ends"
            assert chunks[0].sequences == result.sequences and chunks[0].text == result.text


def test_beams_beside_ordinary_requests_change_nothing(stack):
    async def main():
        async with AsyncClient(stack.gateway_address, timeout=120) as client:
            alone = await asyncio.gather(*[client.generate(p, max_new_tokens=16, speculation=4, ignore_eos=True)
                                           for p in PROMPTS])
            beam_alone = await client.generate(PROMPTS[0], max_new_tokens=10, ignore_eos=True, num_beams=3,
                                               num_return_sequences=3, beam_threshold=3.0)
            mixed = await asyncio.gather(
                client.generate(PROMPTS[0], max_new_tokens=10, ignore_eos=True, num_beams=3, num_return_sequences=3,
                                beam_threshold=3.0),
                *[client.generate(p, max_new_tokens=16, speculation=4, ignore_eos=True) for p in PROMPTS])
            return alone, beam_alone, mixed

    alone, beam_alone, mixed = asyncio.run(main())
    assert [r.token_ids for r in mixed[1:]] == [r.token_ids for r in alone]
    assert [s.token_ids for s in mixed[0].sequences] == [s.token_ids for s in beam_alone.sequences]
    assert sum(r.stats.accepted_tokens for r in mixed[1:]) > 0  # the ordinary ones did speculate


@pytest.mark.parametrize(("field", "kwargs"), [
    ("beam.num_beams", dict(num_beams=9)),  # more than the target's 8 slots: the engine says so
    ("beam.num_return_sequences", dict(num_beams=2, num_return_sequences=3)),
    ("temperature", dict(num_beams=2, temperature=0.7)),
    ("stop", dict(num_beams=2, stop=["\n"])),
])
def test_bad_beam_requests_name_the_field(stack, field, kwargs):
    with Client(stack.gateway_address, timeout=60) as client:
        with pytest.raises(InvalidArgument, match=rf"^INVALID_ARGUMENT: {field}="):
            client.generate("x = 1", max_new_tokens=4, **kwargs)
        assert client.generate("x = 1", max_new_tokens=4, num_beams=2).sequences  # the service carries on


def test_cli_prints_the_n_best(stack, in_process):
    tokenizer, want = in_process
    out = subprocess.run([sys.executable, "-m", "tools.cli", "generate", "--url", stack.gateway_address,
                          "--max-new-tokens", "12", "--ignore-eos", "--num-beams", "4", "--num-return", "3",
                          PROMPTS[0]], capture_output=True, text=True, timeout=120, check=True)
    ranks = [line for line in out.stdout.splitlines() if line.startswith("#")]
    assert len(ranks) == 3
    for rank, (line, h) in enumerate(zip(ranks, want[0]), 1):
        assert line.startswith(f"#{rank}  score {h.score:.4f}") and line.endswith("length")
    assert "beam expansions" in out.stderr
