"""PromptSpelling (draft_service/spelling.py): a JSON string value continued as the prompt spells it,
on the real SmolLM2 tokenizer, where the answer's tokens differ from the prompt's."""

from __future__ import annotations

import pytest

from specstream.models.registry import resolve_model
from specstream.text.tokenizer import TextTokenizer
from draft_service.spelling import PromptSpelling


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_dir(resolve_model("smollm2"))


def _guesses(tok: TextTokenizer, prompt: str, answer: str, room: int = 8) -> str:
    prompt_ids = tok.encode(prompt)
    ids = prompt_ids + tok.encode(answer)
    return tok.decode(PromptSpelling(tok).guesses("k", ids, len(prompt_ids), room))


def test_a_word_the_answer_spells_in_other_tokens_is_finished_as_the_prompt_has_it(tok) -> None:
    prompt = "Extract the order: Jane Doe wants express shipping to Berlin."
    # the prompt's " Berlin" is one token; after a quote the answer writes "Ber" "lin"
    assert tok.encode(' Berlin') != tok.encode('Ber') + tok.encode('lin')
    assert _guesses(tok, prompt, '{"city":"Ber') == "lin"  # the sentence's full stop ends the copy
    # then the prompt's own next tokens, as far as room allows or the phrase goes
    assert _guesses(tok, prompt, '{"name":"Jane', room=2) == " Doe"  # " Do" "e"
    assert _guesses(tok, prompt, '{"name":"Jane') == " Doe wants express shipping to Berlin"
    prompt = "Alan Turing was 41 and lived in Manchester, England."
    assert _guesses(tok, prompt, '{"city":"M') == "anchester"  # the comma ends it
    assert _guesses(tok, prompt, '{"name":"Al') == "an Turing was 41 and lived"  # room: 8 tokens


def test_an_email_goes_on_through_its_dots_and_room_bounds_the_guesses(tok) -> None:
    prompt = "Tom Lee, tom.lee@mail.com, standard delivery to Oslo."
    assert _guesses(tok, prompt, '{"email":"tom') == ".lee@mail.com"
    assert _guesses(tok, prompt, '{"email":"tom', room=2) == tok.decode(tok.encode(".lee@mail.com")[:2])


def test_nothing_is_guessed_outside_a_value_the_prompt_holds(tok) -> None:
    prompt = "Extract the person: Marie Curie, 66, lived in Paris."
    assert _guesses(tok, prompt, '{"name":"') == ""  # a value's first token is the model's choice
    assert _guesses(tok, prompt, '{"name":"Marie Curie",') == ""  # after the closing quote: not a value
    assert _guesses(tok, prompt, '{"name":"Xavier') == ""  # not in the prompt
    assert _guesses(tok, prompt, '{"name":"Marie', room=0) == ""
    assert PromptSpelling(tok).guesses("k", tok.encode(prompt), len(tok.encode(prompt)), 4) == []  # no output yet
