"""Constraints (specstream/data/constraint.py) and their grammars on SmolLM2's real tokenizer
(specstream/text/grammar.py, llguidance): a valid answer passes token by token and may end, an
invalid one is cut where it breaks, masked random decoding always yields output its schema
validates (``jsonschema``), rollback restores the mask, and bad constraints are refused naming the
field and the compiler's reason."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from specstream.data.constraint import MAX_CHOICES, MAX_SOURCE_BYTES, Constraint
from specstream.data.errors import InvalidArgumentError
from specstream.text.grammar import fill_masks, mask_words, sole_tokens, unpack
from specstream.text.tokenizer import TextTokenizer
from tests.support.smollm2_grammar import compiler, tokenizer  # noqa: F401 - fixtures

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False},
             {"name": "Ada Lovelace", "age": 36}),
    "nested": ({"type": "object", "properties": {"user": {"type": "object", "properties": {
                   "id": {"type": "integer"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                   "required": ["id", "zip"], "additionalProperties": False}},
                "required": ["user"], "additionalProperties": False},
               {"user": {"id": 7, "zip": "75001"}}),
    "array": ({"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                   "type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                                     "qty": {"type": "integer", "minimum": 1}},
                   "required": ["sku", "qty"], "additionalProperties": False}}},
               "required": ["items"], "additionalProperties": False},
              {"items": [{"sku": "A-1", "qty": 2}, {"sku": "B-22", "qty": 1}]}),
    "enum": ({"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
              "required": ["sentiment"], "additionalProperties": False},
             {"sentiment": "negative"}),
}


def _ids(tokenizer: TextTokenizer, text: str) -> list[int]:
    return tokenizer.tokenizer.encode(text, add_special_tokens=False).ids


def _walk(matcher, ids: list[int]) -> bool:
    """Whether every token is in the mask of its position, each committed in turn."""
    for token in ids:
        if not matcher.allowed()[token]:
            return False
        assert matcher.consume([token]) == 1
    return True


@pytest.mark.parametrize("shape", sorted(SCHEMAS))
def test_a_valid_answer_passes_token_by_token_and_may_end(tokenizer, compiler, shape) -> None:
    schema, instance = SCHEMAS[shape]
    matcher = compiler.compile(Constraint("json_schema", json.dumps(schema))).matcher()
    assert _walk(matcher, _ids(tokenizer, json.dumps(instance, separators=(",", ":"))))
    assert matcher.accepting
    assert all(matcher.allowed()[e] for e in tokenizer.eos_token_ids)


def test_an_invalid_answer_is_cut_where_it_breaks(tokenizer, compiler) -> None:
    schema, _ = SCHEMAS["flat"]
    matcher = compiler.compile(Constraint("json_schema", json.dumps(schema))).matcher()
    good, bad = _ids(tokenizer, '{"name":"x","age":'), _ids(tokenizer, '"old"}')
    assert matcher.consume(good + bad) == len(good)  # the string where an integer must be: refused
    assert not matcher.allowed()[bad[0]]
    assert not matcher.accepting


@pytest.mark.parametrize("shape", sorted(SCHEMAS))
def test_masked_random_decoding_always_gives_output_the_schema_validates(tokenizer, compiler, shape) -> None:
    """Random logits, masked, sampled until the grammar lets EOS win: 20 answers per schema, every one
    parsed and validated by jsonschema (no model: the mask alone must make it valid)."""
    schema, _ = SCHEMAS[shape]
    grammar = compiler.compile(Constraint("json_schema", json.dumps(schema)))
    gen = torch.Generator().manual_seed(1)
    eos = list(tokenizer.eos_token_ids)
    for _ in range(20):
        matcher, out = grammar.matcher(), []
        for _ in range(400):
            allowed = matcher.allowed()
            logits = torch.randn(matcher.vocab_size, generator=gen)
            logits[eos] += 4.0 if matcher.accepting else 0.0  # end soon once it may
            token = int(torch.where(torch.from_numpy(allowed), logits, -torch.inf).argmax())
            if token in eos:
                break
            assert matcher.consume([token]) == 1
            out.append(token)
        else:
            pytest.fail(f"{shape}: no end within 400 tokens: {tokenizer.decode(out)!r}")
        jsonschema.validate(json.loads(tokenizer.decode(out)), schema)


def test_rollback_restores_the_mask(tokenizer, compiler) -> None:
    schema, instance = SCHEMAS["nested"]
    matcher = compiler.compile(Constraint("json_schema", json.dumps(schema))).matcher()
    ids = _ids(tokenizer, json.dumps(instance, separators=(",", ":")))
    assert matcher.consume(ids[:4]) == 4
    before = matcher.allowed()
    assert matcher.consume(ids[4:9]) == 5
    assert not np.array_equal(matcher.allowed(), before)
    matcher.rollback(5)
    assert np.array_equal(matcher.allowed(), before)
    assert _walk(matcher, ids[4:]) and matcher.accepting


def _library_mask(matcher) -> np.ndarray:
    """llguidance's own mask of a matcher's next position (its executor: no forced-token shortcut)
    -> bool [V]."""
    return unpack(fill_masks([(matcher, [])], threads=True)[0][0], matcher.vocab_size)


@pytest.mark.parametrize("threads", [True, False], ids=["llguidance-threads", "inline"])
def test_batch_masks_equal_the_masks_step_by_step_and_leave_the_matchers_where_they_were(tokenizer, compiler,
                                                                                          threads) -> None:
    """fill_masks: the k+1 masks of several rows' guesses in one call are each the mask llguidance
    gives a matcher after consuming the guesses one by one, on its threads and inline (where forced
    positions take the forced token's bit instead); no matcher moves."""
    rows, expected = [], []
    for shape in ("flat", "nested", "array", "enum"):
        schema, instance = SCHEMAS[shape]
        grammar = compiler.compile(Constraint("json_schema", json.dumps(schema)))
        ids = _ids(tokenizer, json.dumps(instance, separators=(",", ":")))
        matcher, walker = grammar.matcher(), grammar.matcher()
        assert matcher.consume(ids[:2]) == 2 and walker.consume(ids[:2]) == 2
        guesses = ids[2:7]
        assert matcher.valid_prefix(guesses) == len(guesses)
        steps = [_library_mask(walker)]
        for token in guesses:
            assert walker.consume([token]) == 1
            steps.append(_library_mask(walker))
        rows.append((matcher, guesses))
        expected.append((np.stack(steps), matcher.allowed()))
    rows.append((grammar.matcher(), []))  # a row with no guesses: the mask of its next position alone
    expected.append((_library_mask(grammar.matcher())[None], grammar.matcher().allowed()))
    for (matcher, _), masks, (steps, before) in zip(rows, fill_masks(rows, threads=threads), expected):
        assert masks.shape[0] == steps.shape[0]
        assert np.array_equal(unpack(masks, matcher.vocab_size), steps)
        assert np.array_equal(matcher.allowed(), before)


@pytest.mark.parametrize("threads", [True, False], ids=["llguidance-threads", "inline"])
def test_guesses_that_end_the_grammar_leave_the_matcher_able_to_go_on(tokenizer, compiler, threads) -> None:
    """A regex that has ended after its last digit allows only EOS: guesses ending with EOS get
    the masks llguidance gives (EOS alone, then nothing: never reached), and the matcher is left
    where it was, not failed, and takes the same tokens after."""
    matcher = compiler.compile(Constraint("regex", "[0-9]{2}-[0-9]{2}")).matcher()
    ids = _ids(tokenizer, "12-3")
    assert matcher.consume(ids) == len(ids)
    eos = tokenizer.eos_token_ids[0]
    guesses = [*_ids(tokenizer, "4"), eos]
    assert matcher.valid_prefix(guesses) == len(guesses)
    (masks,) = fill_masks([(matcher, guesses)], threads=threads)
    allowed = unpack(masks, matcher.vocab_size)
    assert np.flatnonzero(allowed[1]).tolist() == [eos] and not allowed[2].any()
    assert matcher.failed is None and matcher.consume(guesses[:1]) == 1 and matcher.stopped


def test_where_the_grammar_forces_a_token_its_mask_allows_that_token_alone(tokenizer, compiler) -> None:
    """What the inline fill and the target's skipped output layer rely on (``Matcher.fill``,
    target_service/settle.py ``_logits``): at every position of random masked walks through each
    schema, a regex and a Lark grammar where ``forced()`` names tokens, llguidance's own mask allows
    exactly the first of them."""
    rng = np.random.default_rng(0)
    checked = 0
    constraints = [Constraint("json_schema", json.dumps(schema)) for schema, _ in SCHEMAS.values()]
    constraints += [Constraint("regex", r"id-[0-9]{3}: (yes|no)"),
                    Constraint("grammar", 'start: "call(" NAME ", " NUM ")"\nNAME: /[a-z]{2,8}/\nNUM: /[0-9]{1,3}/')]
    for constraint in constraints:
        grammar = compiler.compile(constraint)
        for _ in range(10):
            matcher = grammar.matcher()
            for _ in range(60):
                allowed = np.flatnonzero(_library_mask(matcher))
                forced = matcher.forced()
                if forced:
                    assert allowed.tolist() == [forced[0]]
                    checked += 1
                if matcher.stopped or not len(allowed):
                    break
                assert matcher.consume([int(rng.choice(allowed))]) == 1
    assert checked > 100


def test_sole_tokens_name_the_one_token_a_mask_allows() -> None:
    vocab = 100
    words = mask_words(vocab)
    masks = np.zeros((5, words), dtype=np.int32)
    masks[1].view(np.uint32)[0] = 1 << 5  # token 5
    masks[2].view(np.uint32)[0] = 1 << 31  # token 31: the int32's sign bit
    masks[3].view(np.uint32)[3] = 1 << 3  # token 99, the last word
    masks[4].view(np.uint32)[1] = 0b11  # tokens 32 and 33: not one
    assert sole_tokens(masks) == [None, 5, 31, 99, None]
    assert sole_tokens(masks[1:4].reshape(3, 1, words)) == [5, 31, 99]


def test_forced_tokens_are_what_the_grammar_allows_alone(tokenizer, compiler) -> None:
    schema, _ = SCHEMAS["enum"]
    matcher = compiler.compile(Constraint("json_schema", json.dumps(schema))).matcher()
    forced = matcher.forced()
    assert tokenizer.decode(forced) == '{"sentiment":"'  # one object, one required key: nothing to guess
    assert matcher.consume(forced) == len(forced)
    assert matcher.allowed().sum() > 1  # then the model chooses among the three


@pytest.mark.parametrize("kind, source, good, bad", [
    ("regex", r"[0-9]{3}-[0-9]{4}", "555-1234", "55a"),
    ("grammar", 'start: "yes" | "no" | "maybe"', "maybe", "yep"),
    ("choice", json.dumps(['po"s\\itive', "né gative", "x"]), "né gative", "ne"),
    ("json_object", "", '{"any":[1,{"b":null}]}', "[1]"),
])
def test_each_kind_of_constraint(tokenizer, compiler, kind, source, good, bad) -> None:
    grammar = compiler.compile(Constraint(kind, source))
    matcher = grammar.matcher()
    assert _walk(matcher, _ids(tokenizer, good)) and matcher.accepting
    bad_ids = _ids(tokenizer, bad)
    assert grammar.matcher().consume(bad_ids) < len(bad_ids) or not grammar.matcher().accepting


def test_a_compiled_grammar_is_kept_by_its_source_and_each_sequence_has_its_own_place(tokenizer, compiler) -> None:
    grammar = compiler.compile(Constraint("regex", "a+b"))
    assert grammar is compiler.compile(Constraint("regex", "a+b"))
    one, other = grammar.matcher(), grammar.matcher()
    ids = _ids(tokenizer, "aab")
    assert one.consume(ids) == len(ids) and one.accepting
    assert not other.accepting and _walk(other, ids) and other.accepting


@pytest.mark.parametrize("kind, source, field, reason", [
    ("json_schema", '{"type": "strin"}', "constraint.json_schema", "strin"),
    ("json_schema", '{"type": "string", "format": "weird"}', "constraint.json_schema", "weird"),
    ("regex", "a(b", "constraint.regex", "unclosed group"),
    ("grammar", "start: undefined_rule", "constraint.grammar", "undefined_rule"),
    ("grammar", "start: r0\nr0: r0 r0", "constraint.grammar", "allows no output"),  # compiles, but its language is empty
])
def test_the_compiler_refuses_a_bad_constraint_naming_the_field_and_its_reason(compiler, kind, source, field,
                                                                               reason) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        compiler.compile(Constraint(kind, source))
    assert err.value.field == field and err.value.value == source
    assert reason in err.value.reason, err.value.reason


@pytest.mark.parametrize("kind, source, field, reason", [
    ("xml", "<a/>", "constraint", "must be one of"),
    ("json_schema", "", "constraint.json_schema", "must not be empty"),
    ("json_schema", "[1, 2]", "constraint.json_schema", "must be a JSON object"),
    ("json_schema", "{", "constraint.json_schema", "is not JSON"),
    ("json_object", "{}", "constraint.json_object", "takes no source"),
    ("choice", "[]", "constraint.choice", "non-empty strings"),
    ("choice", '["a", ""]', "constraint.choice", "non-empty strings"),
    ("choice", json.dumps(["c"] * (MAX_CHOICES + 1)), "constraint.choice", "non-empty strings"),
    ("regex", "a" * (MAX_SOURCE_BYTES + 1), "constraint.regex", f"at most {MAX_SOURCE_BYTES} bytes"),
])
def test_a_constraint_checks_itself_when_built(kind, source, field, reason) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        Constraint(kind, source)
    assert err.value.field == field
    assert re.search(re.escape(reason), err.value.reason), err.value.reason


def test_the_mask_is_stricter_than_validate_tokens_so_masks_decide(tokenizer, compiler) -> None:
    """llguidance's validate_tokens takes tokens its mask refuses (a key's '":' where the mask allows
    only the canonical '":"'): output is decided by the masks, never by checking a token alone
    (target_service/grammar_rows.py fills every verified node's mask)."""
    schema = {"type": "object", "properties": {"category": {"enum": ["billing", "bug"]}}, "required": ["category"],
              "additionalProperties": False}
    matcher = compiler.compile(Constraint("json_schema", json.dumps(schema))).matcher()
    assert matcher.consume(_ids(tokenizer, '{"category')) == len(_ids(tokenizer, '{"category'))
    short, canonical = tokenizer.tokenizer.token_to_id('":'), tokenizer.tokenizer.token_to_id('":"')
    allowed = matcher.allowed()
    assert allowed[canonical] and not allowed[short]
    assert matcher.valid_prefix([short]) == 1


def test_bench_constraint_cost_times_or_refuses_each_case_on_the_real_tokenizer(compiler) -> None:
    """`specstream bench constraint-cost`'s offline part: a costly case compiles within its limits
    and its masks are timed; a broken one is refused with the compiler's reason, and timed too."""
    from tools.bench.constraint_cost import CASES, Case, offline

    nested = offline(compiler, next(c for c in CASES if c.name == "schema: nested 40 deep"))
    assert nested["compiled"] and 0 < nested["compile_ms"] < 5000 and nested["first_mask_ms"] > 0 < nested["mask_ms"]
    broken = offline(compiler, Case("broken", Constraint("regex", "(unclosed")))
    assert broken["compiled"] is False and broken["compile_ms"] > 0 and broken["reason"]
    assert offline(compiler, Case("none")) == {"source_kib": 0.0, "compiled": None, "compile_ms": None}


def test_likely_tokens_are_the_forced_text_canonically_tokenized(compiler, tokenizer):
    """Where the grammar allows one text but several tokenizations of it (after a key, ``":"`` or
    ``":`` then a token starting with a quote), nothing is forced and ``likely()`` is that text as
    the tokenizer encodes it; where tokens are forced, the likely ones begin with them."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    grammar = compiler.compile(Constraint("json_schema", json.dumps(schema)))
    matcher = grammar.matcher()
    assert matcher.consume(tokenizer.encode('{"name')) == len(tokenizer.encode('{"name'))
    assert matcher.forced() == [] and matcher.likely() == tokenizer.encode('":"')
    matcher = grammar.matcher()
    matcher.consume(tokenizer.encode('{"name":"Ada"'))
    forced, likely = matcher.forced(), matcher.likely()
    assert forced and likely[:len(forced)] == forced and tokenizer.decode(likely) == ',"age":'
    assert matcher.valid_prefix(likely) == len(likely)


def test_ends_after_says_where_only_the_end_can_follow(compiler, tokenizer) -> None:
    """``Matcher.ends_after``: after the last value's closing, JSON allows only the output's end;
    before it, more. The matcher is left where it was."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    matcher = compiler.compile(Constraint("json_schema", json.dumps(schema))).matcher()
    assert matcher.consume(tokenizer.encode('{"a":1')) == len(tokenizer.encode('{"a":1'))
    allowed = matcher.allowed()
    assert matcher.ends_after(tokenizer.encode("}"))
    assert not matcher.ends_after([]) and not matcher.ends_after(tokenizer.encode("2"))
    assert not matcher.ends_after(tokenizer.encode("]"))  # refused: not an end
    assert (matcher.allowed() == allowed).all()
