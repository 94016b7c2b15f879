"""How the model writes text its grammar allows alone (specstream/text/token_habits.py), on
SmolLM2's real tokenizer: a rule is learned where the model's tokens and the canonical ones part
between common byte boundaries, dropped where they agree again, not learned from tokens that stop
short of the text's end or are not its bytes; ``Matcher.likely`` proposes the learned way; the
target's drafting learns it from committed tokens over passes and proposes it on the next key."""

from __future__ import annotations

import json
from types import SimpleNamespace

from specstream.data.constraint import Constraint
from specstream.text.token_habits import TokenHabits
from target_service.drafting import Drafting
from target_service.gamma import GammaController
from tests.support.smollm2_grammar import compiler, tokenizer  # noqa: F401 - fixtures

PERSON = Constraint("json_schema", json.dumps({
    "type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
    "required": ["name", "city"], "additionalProperties": False}))


def _ids(tokenizer, *pieces: str) -> list[int]:
    """Each piece encoded on its own: a tokenization other than the whole text's canonical one."""
    return [t for piece in pieces for t in tokenizer.tokenizer.encode(piece, add_special_tokens=False).ids]


def test_a_rule_is_learned_where_the_models_tokens_part_from_the_canonical_ones(compiler, tokenizer):
    habits = TokenHabits(lambda t: tokenizer.tokenizer.decode([t]).encode())
    canonical = _ids(tokenizer, 'name":"')  # name, '":"'
    written = _ids(tokenizer, "name", '":', '"', "Marie")  # the model's way, and on past the text
    assert len(canonical) == 2 and len(written) == 4
    assert habits.learn(canonical, written)  # reached the text's end
    assert habits.rewrite(canonical) == written[:3]
    assert habits.rewrite(_ids(tokenizer, ',"city":"')) == _ids(tokenizer, ',"city', '":', '"')  # every key's end
    assert habits.learn(_ids(tokenizer, '":"'), _ids(tokenizer, '":"'))  # written canonically: the rule goes
    assert habits.rewrite(canonical) == canonical and len(habits) == 0


def test_nothing_is_learned_from_tokens_short_of_the_texts_end_or_not_its_bytes(tokenizer):
    habits = TokenHabits(lambda t: tokenizer.tokenizer.decode([t]).encode())
    canonical = _ids(tokenizer, 'name":"')
    assert not habits.learn(canonical, _ids(tokenizer, "name", '":'))  # '":"' not written to its end yet
    assert len(habits) == 0
    assert habits.learn(canonical, _ids(tokenizer, "age", '":', '"'))  # not the text: ignored
    assert len(habits) == 0


def test_the_target_learns_the_models_way_over_passes_and_proposes_it_at_the_next_key(compiler, tokenizer):
    """Drafting._forced: the likely tokens after ``{"name`` are the canonical ``":"``; the model
    writes ``":`` (refusing it) and then ``"``; the next key's likely tokens end the model's way."""
    drafting = Drafting(None, GammaController("goodput", 4, 8), tokenizer.vocab_size)
    matcher = compiler.compile(PERSON).matcher()
    seq = SimpleNamespace(seq_id=1, tokens=_ids(tokenizer, "Extract:"), matcher=matcher, gamma=4, remaining=50)

    def commit(*pieces: str) -> None:
        tokens = _ids(tokenizer, *pieces)
        assert matcher.consume(tokens) == len(tokens)
        seq.tokens += tokens

    commit('{"')
    assert drafting._forced(seq) == _ids(tokenizer, "name", '":"')  # nothing learned yet: canonical
    commit("name", '":')  # a pass: name accepted, '":"' refused, '":' the target's own
    drafting._forced(seq)
    commit('"', "Ada")
    drafting._forced(seq)
    commit('",')
    assert drafting._forced(seq) == _ids(tokenizer, '"city', '":', '"')
