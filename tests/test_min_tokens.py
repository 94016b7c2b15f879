"""`min_tokens`: EOS and the stop ids are masked until that many tokens exist, exactly under
speculation.

One rule (specstream/data/request_rules.py) refuses the same requests with the same message at the
gateway and in the engine; each hop carries the field (the public request, the SDK, the HTTP
front, the target's request, the draft's item as masked ids); the target's verify masks each
position by the length it would have (greedy output equals plain decoding's under the same
request, token for token; sampled output has its distribution: exact equality under coupled
verification, chi-square tests under Leviathan's rule); the draft masks its own guesses there, so
it is not refused for guessing what the target cannot emit; stop strings are looked for only in
the text after the first min_tokens tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import pytest
import torch

from draft_service.ngram import NgramProposer
from draft_service.proposer import DraftProposer
from gateway.validation import Limits, validate
from specstream.data.config import GatewayConfig, ModelSpec, TargetConfig
from specstream.data.engine import SequenceRequest, TargetInfo
from specstream.data.engine_wire import request_from_pb, request_to_pb
from specstream.data.errors import InvalidArgumentError
from specstream.data.propose import ProposeItem, without_masked
from specstream.data.propose_wire import item_from_pb, item_to_pb
from specstream.data.request_rules import check_min_tokens
from specstream.data.sampling import SamplingParams
from specstream.models.loader import load_model
from specstream.text.tokenizer import TextTokenizer, build_byte_level_tokenizer
from specstream_client.options import GenerateOptions
from specstream_pb import common_pb2, generation_pb2
from tests.support.chi_square import two_sample_p_value
from tests.support.engine_harness import run_engine

TT = TextTokenizer(build_byte_level_tokenizer(), eos_token_ids=[1], bos_token_id=0)
INFO = TargetInfo(vocab_size=TT.vocab_size, max_context_length=256, max_gamma=8, eos_token_ids=[1])
LIMITS = Limits.build(GatewayConfig("t:1", "m"), INFO)
THRESHOLD = 1e-3  # per chi-square comparison: the chance a correct engine fails one


# ----- the rule, once ------------------------------------------------------------------------------
@pytest.mark.parametrize(("min_tokens", "max_new_tokens"), [(-1, 4), (5, 4)])
def test_min_tokens_outside_0_to_max_new_tokens_is_refused_naming_it(min_tokens, max_new_tokens):
    with pytest.raises(InvalidArgumentError) as info:
        check_min_tokens(min_tokens, max_new_tokens)
    assert info.value.field == "min_tokens" and str(info.value).startswith(f"min_tokens={min_tokens}:")


def test_the_gateway_and_the_engine_refuse_with_the_same_message(model_zoo):
    """The same rule, called from both: the gateway's early error and the engine's defence in depth
    (a request another gateway sent) read alike."""
    from target_service.connection import Connection
    from target_service.engine import Engine

    with pytest.raises(InvalidArgumentError) as gateway:
        validate(generation_pb2.GenerateRequest(prompt_token_ids=dict(ids=[5, 6]), max_new_tokens=4, min_tokens=9),
                 LIMITS, TT)
    engine = Engine(load_model(model_zoo["target"]), TargetConfig(model=ModelSpec("t"), max_slots=2, max_seq_len=64),
                    None)
    conn = Connection()
    engine.submit(conn, [SequenceRequest("r", [5, 6], 4, min_tokens=9)])
    [event] = conn.outbox.get_nowait().events
    assert event.finish_reason == "error" and str(event.error) == str(gateway.value)
    assert str(event.error) == "min_tokens=9: must be in 0..max_new_tokens (4)"


def test_beam_search_refuses_min_tokens():
    with pytest.raises(InvalidArgumentError) as info:
        validate(generation_pb2.GenerateRequest(prompt="x", max_new_tokens=4, min_tokens=2,
                                                beam=common_pb2.BeamSearch(num_beams=2)), LIMITS, TT)
    assert info.value.field == "min_tokens"


# ----- one conversion per hop ------------------------------------------------------------------------
def test_every_hop_carries_it():
    # the SDK -> the public request -> the engine's request -> the target's wire form and back
    public = GenerateOptions(max_new_tokens=6, min_tokens=4).to_pb()
    public.prompt = "hello"
    sequence = validate(public, LIMITS, TT).sequence
    assert sequence.min_tokens == 4
    assert request_from_pb(request_to_pb(sequence)) == sequence
    # the target -> the draft: the ids masked and until where, only while they apply
    item = ProposeItem(3, 2, [7, 8], 4, masked_ids=frozenset({1, 9}), masked_until=6)
    back = item_from_pb(3, item_to_pb(item))
    assert back == item and back.masked_at(5) == {1, 9} and back.masked_at(6) == frozenset()
    with pytest.raises(ValueError, match="min_tokens"):
        GenerateOptions(min_tokens=-1)


def test_the_http_front_reads_vllms_min_tokens():
    from gateway.http.schema import CompletionRequest
    from gateway.http.translate import to_generate_request

    req = to_generate_request(CompletionRequest(model="m", prompt="x", max_tokens=5, min_tokens=3))
    assert req.min_tokens == 3
    with pytest.raises(InvalidArgumentError, match="^min_tokens=-2"):
        to_generate_request(CompletionRequest(model="m", prompt="x", max_tokens=5, min_tokens=-2))


# ----- the engine: greedy, exact -----------------------------------------------------------------------
MIN_TOKENS, MAX_NEW = 8, 16


@pytest.fixture(scope="module")
def greedy_setup(model_zoo):
    """Prompts, and stop ids the target's greedy continuations reach early: without min_tokens most
    of these requests would end before MIN_TOKENS tokens."""
    from tests.test_engine_lossless import _prompts

    tok = TextTokenizer.from_dir(model_zoo["target"])
    prompts = _prompts(tok, tok.vocab_size)
    free, _ = run_engine(model_zoo["target"], None, prompts, gamma=0, max_new_tokens=MAX_NEW)
    early = Counter(t for seq in free for t in seq[: MIN_TOKENS // 2])
    stops = [t for t, _ in early.most_common(3)]
    return prompts, stops


@torch.inference_mode()
def _masked_greedy(target, prompt: list[int], stops: list[int]) -> list[int]:
    """Plain greedy decoding by full recomputation, stop ids masked while fewer than MIN_TOKENS
    tokens exist, ending at the first stop id: independent of the engine."""
    model = load_model(target)
    tokens = list(prompt)
    while len(tokens) - len(prompt) < MAX_NEW:
        cache = model.new_cache(1, len(tokens) + 1)
        logits = model(torch.tensor([tokens]), cache, torch.tensor([0]), torch.tensor([0]))[0, -1]
        if len(tokens) - len(prompt) < MIN_TOKENS:
            logits[stops] = float("-inf")
        tokens.append(int(logits.argmax()))
        if tokens[-1] in stops:
            break
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def greedy_plain(model_zoo, greedy_setup):
    prompts, stops = greedy_setup
    tokens, _ = run_engine(model_zoo["target"], None, prompts, gamma=0, max_new_tokens=MAX_NEW, stop_ids=stops,
                           eos_ids=stops, min_tokens=MIN_TOKENS)
    return tokens


def test_plain_decoding_masks_the_stop_ids_until_min_tokens(model_zoo, greedy_setup, greedy_plain):
    prompts, stops = greedy_setup
    unmasked, _ = run_engine(model_zoo["target"], None, prompts, gamma=0, max_new_tokens=MAX_NEW, stop_ids=stops,
                             eos_ids=stops)
    assert sum(len(t) < MIN_TOKENS for t in unmasked) >= 5  # the mask has something to do
    assert all(len(t) >= MIN_TOKENS for t in greedy_plain)
    assert all(not set(t[:MIN_TOKENS]) & set(stops) for t in greedy_plain)
    assert sum(t[-1] in stops for t in greedy_plain) >= 3  # and lets them end the sequence after
    for prompt, got in list(zip(prompts, greedy_plain))[::3]:
        assert got == _masked_greedy(model_zoo["target"], prompt, stops)


@pytest.mark.parametrize("draft_kind", ["same", "unrelated", "partial"])
@pytest.mark.parametrize("gamma", [1, 3, None])
def test_speculative_greedy_equals_plain_under_min_tokens(model_zoo, greedy_setup, greedy_plain, draft_kind, gamma):
    prompts, stops = greedy_setup
    tokens, finals = run_engine(model_zoo["target"], model_zoo[draft_kind], prompts, gamma=gamma,
                                max_new_tokens=MAX_NEW, stop_ids=stops, eos_ids=stops, min_tokens=MIN_TOKENS,
                                config={"calibrate": False, "gamma_policy": "fixed", "default_gamma": 2})
    for i, (got, want) in enumerate(zip(tokens, greedy_plain)):
        assert got == want, f"prompt {i}: speculative {got} != plain {want}"
    proposed = sum(f.stats.draft_tokens for f in finals)
    assert proposed > 0
    if draft_kind == "same":
        # The draft masks what the target masks, so it is refused only where a stop id it guessed
        # past min_tokens ended the sequence inside the run (at most once a sequence).
        assert sum(f.stats.rejections for f in finals) <= sum(t[-1] in stops for t in tokens)


def test_prompt_lookup_drops_the_guesses_the_target_would_refuse(model_zoo, greedy_setup, greedy_plain):
    prompts, stops = greedy_setup
    tokens, _ = run_engine(model_zoo["target"], None, prompts, gamma=3, max_new_tokens=MAX_NEW, stop_ids=stops,
                           eos_ids=stops, min_tokens=MIN_TOKENS, proposer=NgramProposer(32, 512))
    assert tokens == greedy_plain
    item = ProposeItem("k", 0, [5, 6, 7], 4, masked_ids=frozenset({9}), masked_until=5)
    # guesses land at positions 3, 4, 5, 6: the 9 at 4 goes, with the tree's node under it
    assert without_masked(item, [8, 9, 9, 4], []) == ([8], [])
    assert without_masked(item, [8, 9, 4, 7], [0, 1, 0, 3]) == ([8, 4, 7], [0, 0, 2])
    assert without_masked(item, [8, 9, 4, 9], [0, 1, 0, 3]) == ([8, 4], [0, 0])


def test_the_draft_masks_its_own_guesses_there(model_zoo, sampling_pair):
    """A draft model's guesses avoid the masked ids before masked_until, greedy and sampled, and a
    head over a subset of the vocabulary maps them to its columns; past masked_until it is free."""
    for path in (model_zoo["same"], sampling_pair["draft"], sampling_pair["draft_subset"]):
        model = load_model(path)
        proposer = DraftProposer(model, max_slots=4, max_seq_len=64)
        prompt = [5, 6, 7, 5, 6]
        [free] = proposer.propose([ProposeItem("free", 0, prompt, 6)])
        banned = frozenset(free.tokens[:3])
        for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=4)):
            item = ProposeItem(params.greedy, 0, prompt, 6, params, masked_ids=banned,
                               masked_until=len(prompt) + 3)
            [guess] = proposer.propose([item])
            assert len(guess.tokens) == 6 and not set(guess.tokens[:3]) & banned, (path, params, guess.tokens)
            if guess.q_width:  # q itself gives them nothing where masked
                for j in range(3):
                    row = slice(j * guess.q_width, (j + 1) * guess.q_width)
                    assert all(p == 0.0 or t not in banned for t, p in zip(guess.q_ids[row], guess.q_probs[row]))
            proposer.release([item.key])


# ----- the engine: sampled -------------------------------------------------------------------------------
SAMPLES, SAMPLED_MIN, SAMPLED_NEW = 1500, 3, 4


@pytest.fixture(scope="module")
def sampled_setup(sampling_pair):
    """A prompt, and the two stop ids most likely at its first positions (so the mask moves mass)."""
    prompt = [5, 9, 17, 3, 22]
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(400)]
    free, _ = run_engine(sampling_pair["target"], None, [prompt] * 400, 0, SAMPLED_MIN, sampling=params,
                         max_slots=64)
    seen = Counter(t for seq in free for t in seq)
    stops = [t for t, _ in seen.most_common(2)]
    assert sum(seen[t] for t in stops) / sum(seen.values()) > 0.15  # the masked ids carry real mass
    return prompt, stops


def _sampled(sampling_pair, setup, draft, gamma, seeds, coupled=False):
    prompt, stops = setup
    params = [SamplingParams(temperature=1.0, seed=s) for s in seeds]
    config = {"calibrate": False, **({"speculative_sampling": "coupled"} if coupled else {})}
    tokens, _ = run_engine(sampling_pair["target"], sampling_pair[draft] if draft else None, [prompt] * len(seeds),
                           gamma, SAMPLED_NEW, stop_ids=stops, eos_ids=stops, sampling=params, max_slots=64,
                           min_tokens=SAMPLED_MIN, config=config)
    return tokens


@pytest.fixture(scope="module")
def sampled_plain(sampling_pair, sampled_setup):
    return _sampled(sampling_pair, sampled_setup, None, 0, range(SAMPLES))


@pytest.mark.parametrize("draft", ["draft", "draft_subset"])
def test_coupled_speculative_sampling_equals_plain_sampling_token_for_token(sampling_pair, sampled_setup,
                                                                           sampled_plain, draft):
    spec = _sampled(sampling_pair, sampled_setup, draft, 3, range(200), coupled=True)
    plain = _sampled(sampling_pair, sampled_setup, None, 0, range(200), coupled=True)
    assert spec == plain == sampled_plain[:200]


@pytest.mark.parametrize("draft", ["draft", "draft_subset"])
def test_leviathan_speculative_sampling_keeps_the_masked_distribution(sampling_pair, sampled_setup, sampled_plain,
                                                                      draft):
    """Each position's marginal under speculation (γ = 3, seeds apart from plain's) against plain
    sampling's, two-sample chi-square; the mask holds in every sample, and lifts at the last."""
    _, stops = sampled_setup
    spec = _sampled(sampling_pair, sampled_setup, draft, 3, range(1 << 20, (1 << 20) + SAMPLES))
    for tokens in (spec, sampled_plain):
        assert all(len(t) >= SAMPLED_MIN and not set(t[:SAMPLED_MIN]) & set(stops) for t in tokens)
        assert sum(len(t) == SAMPLED_NEW and t[-1] in stops for t in tokens) > 50
    for position in range(SAMPLED_NEW):
        p_value = two_sample_p_value(Counter(t[position] for t in spec if len(t) > position),
                                     Counter(t[position] for t in sampled_plain if len(t) > position))
        assert p_value > THRESHOLD, (position, p_value)


# ----- the gateway: stop strings --------------------------------------------------------------------------
class _Replay:
    """Stands in for the router: plays back one event with the given tokens."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def submit(self, request):
        from gateway.ticket import Ticket
        from specstream.data.engine import SequenceEvent

        ticket = Ticket(dataclasses.replace(request, id="7"), number=1, enqueued_at=0.0, dispatched_at=0.0)
        ticket.events.put_nowait(SequenceEvent("7", list(self.tokens), finish_reason="length"))
        return ticket

    def cancel(self, ticket) -> None:
        pass


@pytest.mark.parametrize(("min_tokens", "text"), [(0, "ab"), (2, "abSTab"), (3, "abSTab"), (5, "abSTabSTcd")])
def test_stop_strings_are_looked_for_after_the_first_min_tokens_tokens(min_tokens, text):
    """Pieces "ab", "ST", "ab", "ST", "cd" (two tokens each) with stop string "ST": it ends the text
    only where its tokens come after the first min_tokens tokens (here counted in pieces)."""
    from gateway.request import generate
    from specstream.serving.metrics import GatewayMetrics

    pieces = ["ab", "ST", "ab", "ST", "cd"]
    tokens = [TT.encode(p)[1:] for p in pieces]
    assert all(len(t) == 2 for t in tokens)  # byte-level: two tokens a piece
    flat = [t for piece in tokens for t in piece]
    req = validate(generation_pb2.GenerateRequest(prompt="x", max_new_tokens=len(flat), stop=["ST"],
                                                  min_tokens=2 * min_tokens), LIMITS, TT)
    response = asyncio.run(generate(req, _Replay(flat), TT, GatewayMetrics()))
    assert response.text == text
