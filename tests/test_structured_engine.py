"""Constrained decoding in the target engine, exact under speculation (target_service/grammar_rows.py).

Plain constrained decoding is checked against an independent loop (full recomputation, the
grammar's mask on the logits, argmax); every speculative path (drafts that always, sometimes and
almost never agree, fixed and controlled γ, a model-free proposer) must give the same tokens
under the same constraint; sampled output must keep the masked distribution: coupled verification
token for token, Leviathan's rule by two-sample chi-square per position with a false-alarm rate
of 1e-3 each. The zoo's byte-level tokenizer is the grammar's.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
import torch

from draft_service.ngram import NgramProposer
from specstream.data.constraint import Constraint
from specstream.data.sampling import SamplingParams
from specstream.models.loader import load_model
from specstream.text.grammar import compiler_for
from specstream.text.tokenizer import TextTokenizer
from tests.support.chi_square import two_sample_p_value
from tests.support.engine_harness import run_engine

THRESHOLD = 1e-3  # per chi-square comparison: the chance a correct engine fails one
MAX_NEW = 24
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["n", "ok", "tag"], "additionalProperties": False}
CONSTRAINTS = {
    "regex": Constraint("regex", r"[a-z]{2,6}( [a-z]{2,6}){0,3}"),
    "choice": Constraint("choice", json.dumps(["alpha", "beta", "gamma", "delta"])),
    "json_schema": Constraint("json_schema", json.dumps(SCHEMA)),
    "grammar": Constraint("grammar", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'),
}
PROMPTS = [[0, 72, 101, 108, 108, 111], [0, 40, 41, 42], [0, 120, 121, 122, 97, 98], [0, 49, 50, 51, 52, 53, 54],
           [0, 33], [0, 100, 101, 102, 103, 104, 105, 106, 107]]


@pytest.fixture(scope="module")
def tokenizer(model_zoo) -> TextTokenizer:
    return TextTokenizer.from_dir(model_zoo["target"])


@pytest.fixture(scope="module")
def plain(model_zoo):
    """Constrained plain greedy decoding per constraint: (tokens, finish reasons)."""
    out = {}
    for name, constraint in CONSTRAINTS.items():
        tokens, finals = run_engine(model_zoo["target"], None, PROMPTS, 0, MAX_NEW, stop_ids=[1], eos_ids=[1],
                                    constraint=constraint)
        out[name] = tokens, [f.finish_reason for f in finals]
    return out


@torch.inference_mode()
def _reference(target, constraint: Constraint, prompt: list[int]) -> list[int]:
    """Greedy decoding by full recomputation, the grammar's mask on the logits, until EOS, the
    grammar's end or the budget: independent of the engine."""
    model = load_model(target)
    matcher = compiler_for(target).compile(constraint).matcher()
    tokens = list(prompt)
    while len(tokens) - len(prompt) < MAX_NEW and not matcher.stopped:
        cache = model.new_cache(1, len(tokens) + 1)
        logits = model(torch.tensor([tokens]), cache, torch.tensor([0]), torch.tensor([0]))[0, -1]
        allowed = torch.zeros(logits.shape[0], dtype=torch.bool)
        allowed[: matcher.vocab_size] = torch.from_numpy(matcher.allowed())
        token = int(torch.where(allowed, logits, float("-inf")).argmax())
        tokens.append(token)
        if token == 1:
            break
        assert matcher.consume([token]) == 1
    return tokens[len(prompt):]


def _valid(name: str, text: str) -> bool:
    if name == "regex":
        return re.fullmatch(CONSTRAINTS[name].source, text) is not None
    if name == "choice":
        return text in CONSTRAINTS[name].choices
    if name == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    return re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", text) is not None


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_plain_constrained_decoding_is_the_masked_argmax_and_ends_valid(model_zoo, tokenizer, plain, name):
    tokens, reasons = plain[name]
    for prompt, got in list(zip(PROMPTS, tokens))[::2]:
        assert got == _reference(model_zoo["target"], CONSTRAINTS[name], prompt)
    finished = 0
    for got, reason in zip(tokens, reasons):
        text = tokenizer.decode([t for t in got if t != 1])
        if reason in ("stop", "eos"):  # the grammar ended it (or let EOS win): the whole output is valid
            assert _valid(name, text), (name, text)
            finished += 1
        else:  # the budget cut it: a prefix the grammar accepts, reported as "length"
            assert reason == "length" and len(got) == MAX_NEW
            assert compiler_for(model_zoo["target"]).compile(CONSTRAINTS[name]).matcher().consume(got) == len(got)
    if name in ("choice", "regex"):  # short languages: every answer ends inside the budget
        assert finished == len(PROMPTS)


@pytest.mark.parametrize("draft_kind", ["same", "partial", "unrelated"])
@pytest.mark.parametrize("gamma", [3, None])
@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_speculative_greedy_equals_constrained_plain(model_zoo, plain, name, draft_kind, gamma):
    tokens, finals = run_engine(model_zoo["target"], model_zoo[draft_kind], PROMPTS, gamma, MAX_NEW, stop_ids=[1],
                                eos_ids=[1], constraint=CONSTRAINTS[name],
                                config={"calibrate": False, "gamma_policy": "fixed", "default_gamma": 3})
    want, reasons = plain[name]
    assert tokens == want
    assert [f.finish_reason for f in finals] == reasons
    if draft_kind == "same":
        # The draft is the target without the mask: a guess the grammar allows is the masked argmax
        # too, so every proposal left after the cut is accepted, unless the output ends inside the run.
        assert sum(f.stats.rejections for f in finals) <= sum(r != "length" for r in reasons)
        if name == "regex":  # elsewhere the free argmax is rarely the grammar's (`{`, `(`, a choice's letter)
            assert sum(f.stats.accepted_tokens for f in finals) > 0


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_a_grammar_aware_draft_is_kept_where_a_free_one_is_cut(model_zoo, plain, name):
    """The draft is the target itself: drafting from its masked distribution it guesses the
    target's masked argmax, so no guess is ever rejected (a pass may end inside the run where the
    output ends); the same draft unmasked has its guesses cut by the grammar. Both give
    constrained plain output."""
    runs = {}
    for aware in (True, False):
        tokens, finals = run_engine(model_zoo["target"], model_zoo["same"], PROMPTS, 3, MAX_NEW, stop_ids=[1],
                                    eos_ids=[1], constraint=CONSTRAINTS[name], grammar_draft=aware,
                                    config={"calibrate": False, "forced_tokens": False})
        assert tokens == plain[name][0]
        runs[aware] = finals
    assert sum(f.stats.rejections for f in runs[True]) == 0
    kept = {aware: sum(f.stats.accepted_tokens for f in finals) for aware, finals in runs.items()}
    generated = sum(len(t) for t in plain[name][0])
    assert kept[True] >= generated * 2 // 3  # 3 of every 4 tokens a pass, but for the ends of answers
    assert kept[True] > kept[False]


def test_the_constraint_and_penalties_travel_to_the_draft_with_the_first_item():
    from specstream.data.propose import ProposeItem
    from specstream.data.propose_wire import item_from_pb, item_to_pb

    from specstream.data.penalties import Penalties

    item = ProposeItem(3, 0, [7, 8, 9], 4, constraint=CONSTRAINTS["choice"], output_start=2, forced=[11, 12],
                       penalties=Penalties(presence=0.5, logit_bias=((4, -2.0),)))
    assert item_from_pb(3, item_to_pb(item)) == item and item.first_guess == 5
    free = ProposeItem(3, 5, [7], 4)
    assert item_from_pb(3, item_to_pb(free)) == free and not item_to_pb(free).HasField("constraint")


@pytest.mark.parametrize("gamma", [3, None])
def test_forced_tokens_alone_give_constrained_plain_output(model_zoo, plain, gamma):
    """No draft at all: a JSON schema's forced text (braces, keys, quotes) is proposed and
    accepted, and the output is constrained plain decoding's; without forced tokens nothing is."""
    steps: dict = {}
    tokens, finals = run_engine(model_zoo["target"], None, PROMPTS, gamma, MAX_NEW, stop_ids=[1], eos_ids=[1],
                                constraint=CONSTRAINTS["json_schema"], steps=steps,
                                config={"calibrate": False, "gamma_policy": "fixed", "default_gamma": 3})
    assert tokens == plain["json_schema"][0]
    forced = steps["metrics"].registry.get_sample_value("specstream:grammar_forced_tokens_total")
    accepted = sum(f.stats.accepted_tokens for f in finals)
    assert forced >= len(PROMPTS) and accepted >= len(PROMPTS)  # at least `{"n":` of each answer
    assert accepted <= forced  # nothing else proposed anything
    assert sum(f.stats.draft_tokens for f in finals) == forced  # forced tokens count as proposals (α <= 1)
    off, finals = run_engine(model_zoo["target"], None, PROMPTS, gamma, MAX_NEW, stop_ids=[1], eos_ids=[1],
                             constraint=CONSTRAINTS["json_schema"], config={"calibrate": False, "forced_tokens": False})
    assert off == tokens and sum(f.stats.accepted_tokens for f in finals) == 0


def test_a_tree_and_a_model_free_proposer_give_the_same_tokens(model_zoo, plain):
    """Trees are cut to their chain for constrained rows; prompt lookup's point masses are cut
    at their first refused token."""
    for name in ("regex", "json_schema"):
        tree, _ = run_engine(model_zoo["target"], model_zoo["partial"], PROMPTS, 3, MAX_NEW, stop_ids=[1],
                             eos_ids=[1], constraint=CONSTRAINTS[name],
                             config={"calibrate": False, "tree_branches": 2})
        lookup, _ = run_engine(model_zoo["target"], None, PROMPTS, 3, MAX_NEW, stop_ids=[1], eos_ids=[1],
                               constraint=CONSTRAINTS[name], proposer=NgramProposer(32, 512))
        assert tree == lookup == plain[name][0]


def test_mixed_batch_free_rows_are_untouched(model_zoo, plain):
    """Constrained and free rows side by side: each row gets what it gets alone."""
    free, _ = run_engine(model_zoo["target"], None, PROMPTS, 0, MAX_NEW, stop_ids=[1], eos_ids=[1])
    mixed = [CONSTRAINTS["regex"] if i % 2 else None for i in range(len(PROMPTS))]
    tokens, _ = run_engine(model_zoo["target"], model_zoo["partial"], PROMPTS, 3, MAX_NEW, stop_ids=[1], eos_ids=[1],
                           constraint=mixed, config={"calibrate": False})
    for i, got in enumerate(tokens):
        assert got == (plain["regex"][0][i] if i % 2 else free[i])


def test_a_target_without_a_tokenizer_refuses_a_constraint_naming_it(model_zoo):
    from target_service.connection import Connection
    from target_service.engine import Engine
    from specstream.data.config import ModelSpec, TargetConfig
    from specstream.data.engine import SequenceRequest

    engine = Engine(load_model(model_zoo["target"]), TargetConfig(model=ModelSpec(str(model_zoo["target"])),
                                                                  calibrate=False), None)
    conn = Connection()
    engine.submit(conn, [SequenceRequest("r", [0, 5], 4, constraint=CONSTRAINTS["regex"])])
    [event] = conn.outbox.get_nowait().events
    assert event.finish_reason == "error"
    assert event.error.field == "constraint.regex" and "no tokenizer" in str(event.error)


class _SlowCompiler:
    """The target's compiler, taking ``seconds`` longer to compile each constraint (in the caller's
    thread, as a costly schema would); a grammar compiled once is cached, as the real one's."""

    def __init__(self, compiler, seconds: float) -> None:
        self._compiler, self.seconds, self.threads = compiler, seconds, set()

    def cached(self, constraint):
        return self._compiler.cached(constraint)

    def compile(self, constraint):
        import threading
        import time

        self.threads.add(threading.current_thread().name)
        time.sleep(self.seconds)
        return self._compiler.compile(constraint)


def test_a_constraint_compiles_off_the_event_loop_while_other_streams_run(model_zoo, plain):
    """A slow compile (3 s) holds up only its own request: a free request submitted with it runs to its end
    meanwhile, a cancel during the compile ends that request, a compiler error ends its request naming
    the field, and the compiled request then decodes exactly as constrained plain."""
    import asyncio
    import time

    from specstream.data.config import ModelSpec, TargetConfig
    from specstream.data.engine import SequenceRequest
    from target_service.connection import Connection
    from target_service.engine import Engine

    slow = _SlowCompiler(compiler_for(model_zoo["target"]), seconds=3.0)
    engine = Engine(load_model(model_zoo["target"]), TargetConfig(model=ModelSpec(str(model_zoo["target"])),
                                                                  calibrate=False, max_gamma=8), None, grammars=slow)

    async def main():
        loop = asyncio.create_task(engine.run())
        conn = Connection()
        engine.attach(conn)
        started = time.monotonic()
        engine.submit(conn, [
            SequenceRequest("c", PROMPTS[0], MAX_NEW, frozenset([1]), frozenset([1]), constraint=CONSTRAINTS["regex"]),
            SequenceRequest("x", PROMPTS[1], MAX_NEW, constraint=CONSTRAINTS["choice"]),
            SequenceRequest("bad", PROMPTS[2], MAX_NEW, constraint=Constraint("regex", "(unclosed")),
            SequenceRequest("f", PROMPTS[3], MAX_NEW),
        ])
        assert {s.request_id for s in engine.compiling} == {"c", "x", "bad"} and engine.load().queued == 4
        engine.cancel(conn, ["x"])
        tokens, ended = {}, {}
        while len(ended) < 4:
            message = await asyncio.wait_for(conn.outbox.get(), 30)
            for event in message.events:
                tokens.setdefault(event.id, []).extend(event.token_ids)
                if event.finish_reason is not None:
                    ended[event.id] = (event.finish_reason, event.error, time.monotonic() - started)
        loop.cancel()
        return tokens, ended

    tokens, ended = asyncio.run(main())
    assert ended["f"][0] == "length" and ended["f"][2] < slow.seconds  # ran while the others compiled
    assert ended["x"][0] == "cancelled" and ended["x"][2] < slow.seconds
    assert ended["bad"][0] == "error" and ended["bad"][2] >= slow.seconds
    assert ended["bad"][1].field == "constraint.regex" and ended["bad"][1].code.name == "INVALID_ARGUMENT"
    assert tokens["c"] == plain["regex"][0][0] and ended["c"][2] >= slow.seconds
    assert slow.threads and all(name.startswith("grammar-compile") for name in slow.threads)
    assert not engine.compiling and not engine.by_request


# ----- sampled --------------------------------------------------------------------------------------------
SAMPLES = 1500
# sampling_pair's 32-token models read as the first 32 ids of a byte tokenizer without merges: ids 8..16
# are the characters ' to /, one token each. The draft puts mass where the target has little
# (tests/conftest.py) and most of it on ids this grammar refuses, so most sampled guesses are cut.
SYMBOLS = Constraint("regex", "['-/]{6}")
# Two free symbols, two forced commas, two free: the forced ones are point masses before the
# draft's sampled guesses (with q) in one row.
FORCED_SYMBOLS = Constraint("regex", "['-/]{2},,['-/]{2}")


@pytest.fixture(scope="module")
def symbol_pair(sampling_pair, tmp_path_factory):
    import shutil

    from specstream.text.tokenizer import BOS_TOKEN, EOS_TOKEN, build_byte_level_tokenizer, save_tokenizer_files

    root = tmp_path_factory.mktemp("symbol_pair")
    tok = build_byte_level_tokenizer(vocab_size=258)
    for name in ("target", "draft"):
        shutil.copytree(sampling_pair[name], root / name)
        save_tokenizer_files(tok, root / name, bos=BOS_TOKEN, eos=EOS_TOKEN)
    return {"target": root / "target", "draft": root / "draft", "tokenizer": TextTokenizer.from_dir(root / "target")}


def _sampled(pair, draft, gamma, seeds, coupled=False, constraint=SYMBOLS, aware=True, steps=None,
             prompt=(5, 9, 17, 3, 22), proposer=None) -> list[str]:
    params = [SamplingParams(temperature=1.0, seed=s) for s in seeds]
    config = {"calibrate": False, **({"speculative_sampling": "coupled"} if coupled else {})}
    tokens, finals = run_engine(pair["target"], pair[draft] if draft else None, [list(prompt)] * len(seeds),
                                gamma, 7, stop_ids=[1, 31], eos_ids=[1, 31], sampling=params, max_slots=64,
                                constraint=constraint, config=config, grammar_draft=aware, steps=steps,
                                proposer=proposer)
    texts = [pair["tokenizer"].decode(t) for t in tokens]
    assert all(f.finish_reason == "stop" and re.fullmatch(constraint.source, text) for text, f in zip(texts, finals))
    return texts


@pytest.fixture(scope="module")
def sampled_plain(symbol_pair):
    return _sampled(symbol_pair, None, 0, range(SAMPLES))


def test_coupled_speculative_sampling_equals_constrained_plain_sampling(symbol_pair, sampled_plain):
    spec = _sampled(symbol_pair, "draft", 3, range(300), coupled=True)
    assert spec == sampled_plain[:300]


@pytest.mark.parametrize("aware", [False, True])
def test_leviathan_speculative_sampling_keeps_the_constrained_distribution(symbol_pair, sampled_plain, aware):
    """A draft that knows nothing of the grammar: a refused guess is kept as the row's last
    proposal, rejected with certainty, and the residual is sampled. A grammar-aware draft: its
    guesses are drawn from its masked, renormalised q, which is what it sends. Every answer is in
    the language; each character's marginal, and the pair of the second and third, match plain's
    (two-sample chi-square, false alarm 1e-3 each)."""
    steps: dict = {}
    spec = _sampled(symbol_pair, "draft", 3, range(1 << 20, (1 << 20) + SAMPLES), aware=aware, steps=steps)
    # The masked draft guesses nothing the grammar refuses; the free one mostly does (the fixture's draft).
    cut = steps["metrics"].registry.get_sample_value("specstream:grammar_cut_draft_tokens_total")
    assert cut == 0 if aware else cut > SAMPLES

    def cells(texts: list[str]) -> list[Counter]:
        return [Counter(t[i] for t in texts) for i in range(6)] + [Counter(t[1:3] for t in texts)]

    assert len(cells(sampled_plain)[0]) >= 4  # the constrained distribution is not a point mass
    for i, (a, b) in enumerate(zip(cells(spec), cells(sampled_plain))):
        p_value = two_sample_p_value(a, b)
        assert p_value > THRESHOLD, (i, p_value)


def test_forced_tokens_before_sampled_guesses_keep_the_constrained_distribution(symbol_pair):
    """Forced commas (point masses) go into the draft's context and before its guesses with q:
    each free character's marginal matches plain's (two-sample chi-square, false alarm 1e-3 each),
    and coupled verification gives plain's very text."""
    plain = _sampled(symbol_pair, None, 0, range(SAMPLES), constraint=FORCED_SYMBOLS)
    spec = _sampled(symbol_pair, "draft", 3, range(1 << 21, (1 << 21) + SAMPLES), constraint=FORCED_SYMBOLS)
    for i in (0, 1, 4, 5):
        a, b = Counter(t[i] for t in spec), Counter(t[i] for t in plain)
        assert len(b) >= 3  # not a point mass
        p_value = two_sample_p_value(a, b)
        assert p_value > THRESHOLD, (i, p_value)
    coupled = _sampled(symbol_pair, "draft", 3, range(300), coupled=True, constraint=FORCED_SYMBOLS)
    assert coupled == plain[:300]


def test_grammar_aware_lookup_before_sampled_guesses_keeps_the_constrained_distribution(symbol_pair):
    """Served as the default pair serves it (prompt lookup in front of the draft model), a
    constrained sampled row gets the grammar-aware lookup's point masses (draft_service/grammar_lookup.py:
    copies of the symbols its prompt repeats, the forced commas' likely tokens), then the model's
    guesses with q: no guess is cut, and each free character's marginal matches plain's (two-sample
    chi-square, false alarm 1e-3 each)."""
    from draft_service.combined import NgramPlusModelProposer
    from draft_service.proposer import DraftProposer

    prompt = (5, 9, 10, 9, 10, 11, 9, 10, 3, 22)  # symbols ' ( ) repeated: lookup has something to copy
    plain = _sampled(symbol_pair, None, 0, range(SAMPLES), constraint=FORCED_SYMBOLS, prompt=prompt)
    model = DraftProposer(load_model(symbol_pair["draft"]), 64, 512, grammars=compiler_for(symbol_pair["target"]))
    recorder = _Recorder(NgramPlusModelProposer(model, 64, min_n=2))
    steps: dict = {}
    spec = _sampled(symbol_pair, None, 3, range(1 << 22, (1 << 22) + SAMPLES), constraint=FORCED_SYMBOLS,
                    prompt=prompt, proposer=recorder, steps=steps)
    looked_up = sum(len(reply.tokens) for _, reply in recorder.items if reply.source == "ngram")
    assert looked_up > SAMPLES  # the lookup guessed (more than once a sequence)
    assert steps["metrics"].registry.get_sample_value("specstream:grammar_cut_draft_tokens_total") == 0
    for i in (0, 1, 4, 5):
        a, b = Counter(t[i] for t in spec), Counter(t[i] for t in plain)
        assert len(b) >= 3  # not a point mass
        p_value = two_sample_p_value(a, b)
        assert p_value > THRESHOLD, (i, p_value)


def test_a_feature_draft_drafts_from_its_masked_distribution(feature_pair, model_zoo, plain):
    """The feature draft (a head over the target's features) holds its own matcher too: its
    guesses are never cut by the grammar, the free head's are; both give constrained plain output."""
    cut = {}
    for aware in (True, False):
        steps: dict = {}
        tokens, _ = run_engine(feature_pair["target"], feature_pair["draft"], PROMPTS, 3, MAX_NEW, stop_ids=[1],
                               eos_ids=[1], constraint=CONSTRAINTS["json_schema"], grammar_draft=aware, steps=steps,
                               config={"calibrate": False, "forced_tokens": aware})
        assert tokens == plain["json_schema"][0]
        cut[aware] = steps["metrics"].registry.get_sample_value("specstream:grammar_cut_draft_tokens_total")
    assert cut[True] == 0 < cut[False]


class _Recorder:
    """A proposer that passes every call through, keeping the items it was asked."""

    def __init__(self, inner) -> None:
        self.inner, self.items = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, items):
        replies = self.inner.propose(items)
        self.items += list(zip(items, replies))
        return replies


@pytest.mark.parametrize("lookup", [False, True])
def test_a_feature_draft_guesses_on_after_forced_tokens(feature_pair, model_zoo, plain, lookup):
    """A pass with forced tokens asks the feature draft too (ProposeItem.forced): it feeds them its
    own features and guesses on from its masked distribution, so no guess of it is ever cut. Served
    as the pair serves it, behind prompt lookup, a constrained row is looked up first, from after its
    forced tokens, along its grammar (draft_service/grammar_lookup.py: the lookup keeps a matcher of
    its own, so no guess of it is cut either), and drafted by the model (the constraint reaches it)
    where lookup has nothing. Constrained plain output either way."""
    from draft_service.combined import NgramPlusModelProposer
    from draft_service.feature import FeatureProposer
    from specstream.models.feature_draft import load_feature_draft

    model = FeatureProposer(load_feature_draft(feature_pair["draft"], Path), 16, 512,
                            grammars=compiler_for(feature_pair["target"]))
    recorder = _Recorder(NgramPlusModelProposer(model, 16, min_n=1) if lookup else model)
    steps: dict = {}
    tokens, _ = run_engine(feature_pair["target"], None, PROMPTS, 3, MAX_NEW, stop_ids=[1], eos_ids=[1],
                           constraint=CONSTRAINTS["json_schema"], proposer=recorder, steps=steps,
                           config={"calibrate": False, "gamma_policy": "fixed", "default_gamma": 3})
    assert tokens == plain["json_schema"][0]
    cut = steps["metrics"].registry.get_sample_value("specstream:grammar_cut_draft_tokens_total")
    after_forced = [(item, reply) for item, reply in recorder.items if item.forced and item.gamma]
    assert after_forced and any(reply.tokens and reply.source == "model" for _, reply in after_forced)
    for item, reply in after_forced:  # the draft holds what was committed, not the forced tokens
        assert reply.length == item.rollback_to + len(item.append) and reply.source in ("model", "ngram")
    asked_lookup = [reply for _, reply in recorder.items if reply.source == "ngram"]
    assert bool(asked_lookup) == lookup
    assert cut == 0  # neither the masked model's guesses nor the grammar-aware lookup's are ever cut


def test_a_constraint_submitted_with_no_event_loop_running_compiles_there(model_zoo):
    """Driving the engine by hand (no loop running), submit compiles in place: the request queues
    with its matcher, or ends with the compiler's reason."""
    from specstream.data.config import ModelSpec, TargetConfig
    from specstream.data.engine import SequenceRequest
    from target_service.connection import Connection
    from target_service.engine import Engine

    engine = Engine(load_model(model_zoo["target"]), TargetConfig(model=ModelSpec(str(model_zoo["target"])),
                                                                  calibrate=False), None,
                    grammars=compiler_for(model_zoo["target"]))
    conn = Connection()
    engine.submit(conn, [SequenceRequest("ok", [0, 5], 4, constraint=CONSTRAINTS["regex"]),
                         SequenceRequest("bad", [0, 5], 4, constraint=Constraint("regex", "(unclosed"))])
    assert [s.request_id for s in engine.waiting] == ["ok"] and engine.waiting[0].matcher is not None
    [event] = conn.outbox.get_nowait().events
    assert event.id == "bad" and event.error.field == "constraint.regex" and not engine.compiling
