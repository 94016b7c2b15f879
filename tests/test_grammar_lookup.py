"""The grammar-aware lookup of constrained sequences (draft_service/grammar_lookup.py) on SmolLM2's
real tokenizer: a JSON value copied from the prompt is found after its quote (words matched
without their leading space), the grammar's likely tokens are guessed where it allows one text
but several tokenizations, a copy the grammar refuses is never proposed, the lookup's tokens and
matcher are left as they were, and its matcher follows tokens the model behind it holds."""

from __future__ import annotations

import json

from draft_service.grammar_lookup import GrammarLookup
from draft_service.ngram import NgramIndex
from specstream.data.constraint import Constraint
from specstream.data.propose import ProposeItem
from tests.support.smollm2_grammar import compiler, tokenizer  # noqa: F401 - fixtures

PERSON = Constraint("json_schema", json.dumps({
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                                     "city": {"type": "string", "maxLength": 40}},
    "required": ["name", "age", "city"], "additionalProperties": False}))
PROMPT = "Extract the person as JSON: Marie Curie, 66, lived in Paris."


def _start(compiler, tokenizer, output: str, space_free: bool = True):
    """A lookup with one constrained sequence: the prompt, then ``output`` so far."""
    prompt = tokenizer.encode(PROMPT)
    tokens = prompt + tokenizer.encode(output)
    lookup = GrammarLookup(compiler)
    sequence = NgramIndex(1, 4, compiler.space_free_ids if space_free else None)
    sequence.extend(tokens)
    item = ProposeItem("s", 0, tokens, 8, constraint=PERSON, output_start=len(prompt))
    row = lookup.sync(item, sequence.tokens)
    assert row is not None
    return lookup, sequence, row


def test_a_value_copied_from_the_prompt_is_found_after_its_quote(compiler, tokenizer):
    """``"Marie`` (no space: it follows a quote) matches the prompt's `` Marie``: the guesses go on
    with `` Curie`` and the rest of the prompt while the grammar allows them (a string may hold
    them). Matched by the ids themselves, the n-grams do not find the word: only the spelling
    lookup, matching the value as text, does (tests/test_spelling.py)."""
    lookup, sequence, row = _start(compiler, tokenizer, '{"name":"Marie')
    chain = lookup.chain("s", row, sequence, [], 8)
    assert tokenizer.decode(chain).startswith(" Curie, 66")
    lookup, sequence, row = _start(compiler, tokenizer, '{"name":"Marie', space_free=False)
    assert tokenizer.decode(lookup.chain("s", row, sequence, [], 8)).startswith(" Curie")
    lookup.spelling = None
    assert lookup.chain("s", row, sequence, [], 8) == []


def test_the_grammars_likely_tokens_are_guessed_where_it_allows_one_text(compiler, tokenizer):
    """After ``{"name`` the grammar allows only the text ``":"``, but as the one token ``":"`` or as
    ``":`` then a token starting with a quote: not forced, so the target does not propose it. The
    lookup guesses its canonical tokenization."""
    lookup, sequence, row = _start(compiler, tokenizer, '{"name')
    assert row.matcher.forced() == []  # nothing certain here
    chain = lookup.chain("s", row, sequence, [], 8)
    assert chain[:1] == tokenizer.encode('":"')


def test_copies_the_grammar_refuses_are_never_guessed_and_the_structure_goes_on(compiler, tokenizer):
    """In the age, after ``6`` lookup copies what followed the prompt's latest ``6``: ``, lived in``.
    The grammar takes ``,`` (the number ends) and refuses `` lived`` (a key must follow), so the
    grammar's likely text ``"city":"`` follows instead, and the chain is valid JSON so far."""
    lookup, sequence, row = _start(compiler, tokenizer, '{"name":"Marie Curie","age":6')
    chain = lookup.chain("s", row, sequence, [], 8)
    assert tokenizer.decode(chain).startswith(',"city":"')
    assert row.matcher.valid_prefix(chain) == len(chain)


def test_the_lookup_and_its_matcher_are_left_as_they_were(compiler, tokenizer):
    """Forced tokens are context for one call only; the chain is the same when asked again, and the
    matcher allows what it allowed before."""
    lookup, sequence, row = _start(compiler, tokenizer, '{"name":"Marie Curie","age":66')
    before, allowed = list(sequence.tokens), row.matcher.allowed()
    forced = tokenizer.encode(',"')
    first = lookup.chain("s", row, sequence, forced, 6)
    assert first and lookup.chain("s", row, sequence, forced, 6) == first
    assert sequence.tokens == before and (row.matcher.allowed() == allowed).all()


def test_the_matcher_follows_tokens_the_model_behind_it_holds(compiler, tokenizer):
    """A token draft behind the lookup keeps its guesses: the next item rolls back to a length the
    matcher was never fed. The matcher follows the lookup's tokens instead of dropping the row."""
    lookup, sequence, row = _start(compiler, tokenizer, '{"name":"Marie')
    held = tokenizer.encode(" Curie")  # the model's guesses, kept by the lookup's history
    sequence.extend(held)
    append = tokenizer.encode('","')
    sequence.extend(append)
    item = ProposeItem("s", len(sequence) - len(append), append, 8)
    row = lookup.sync(item, sequence.tokens)
    assert row is not None
    assert tokenizer.decode(lookup.chain("s", row, sequence, [], 3)).startswith("age")


def test_space_free_ids_map_a_word_to_its_bare_piece(tokenizer):
    ids = tokenizer.space_free_ids()
    (spaced,), (bare,) = tokenizer.encode(" Paris"), tokenizer.encode("Paris")
    assert len(ids) == tokenizer.vocab_size and spaced != bare
    assert (ids[spaced], ids[bare]) == (bare, bare)
