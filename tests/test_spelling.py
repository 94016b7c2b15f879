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


def test_served_with_the_spelling_lookup_the_answer_equals_constrained_plain_decoding(tok, monkeypatch) -> None:
    """Through the engine on the real pair (prompt lookup then the feature draft, γ 4, greedy), a JSON
    answer whose values the answer spells in other tokens than the prompt (`"Ber` `lin`, `"Os` `lo`)
    is token for token constrained plain decoding's, and the spelling lookup's guesses were kept."""
    from draft_service.build import build_proposer
    from specstream.data.config import DraftConfig, ModelSpec, TargetConfig
    from specstream.data.engine import SequenceRequest, Speculation
    from specstream.models.loader import load_model
    from specstream.models.registry import DRAFTS, resolve_dtype
    from specstream.serving.compute import on_torch_thread
    from specstream.text.grammar import GrammarCompiler
    from target_service.engine import Engine
    from target_service.inprocess import run_requests
    from target_service.local_draft import LocalDraft
    from tools.bench.structured import WORKLOADS

    kept: list[list[int]] = []
    guesses = PromptSpelling.guesses

    def counted(self, *args):
        out = guesses(self, *args)
        kept.append(out)
        return out

    monkeypatch.setattr(PromptSpelling, "guesses", counted)
    target_dir, dtype = resolve_model("smollm2"), resolve_dtype("auto")
    target = on_torch_thread(load_model, target_dir, dtype=dtype, weights="auto")
    workload = next(w for w in WORKLOADS if w.name == "json-nested")
    stop = frozenset(t for t in (tok.end_of_turn_id, *tok.eos_token_ids) if t is not None)
    config = TargetConfig(model=ModelSpec(str(target_dir), dtype), max_slots=4, max_seq_len=1024, max_gamma=8)

    def answers(speculation: Speculation, draft) -> list[list[int]]:
        engine = Engine(target, config, draft, grammars=GrammarCompiler(tok))
        requests = [SequenceRequest(str(i), tok.encode_chat(workload.messages(q)), 64, stop, stop, speculation,
                                    constraint=workload.constraint) for i, q in enumerate(workload.questions)]
        return [list(r.token_ids) for r in run_requests(engine, requests)]

    plain = answers(Speculation("off"), None)
    draft = on_torch_thread(build_proposer, DraftConfig(ModelSpec(str(DRAFTS / "smollm2-135m-feature"), dtype),
                                                        max_slots=4, max_seq_len=1024, proposer="ngram+model",
                                                        ngram_min=2))
    assert answers(Speculation("fixed", 4), LocalDraft(draft)) == plain
    assert all(workload.valid(tok.decode([t for t in a if t not in stop])) for a in plain)
    spelled = [tok.decode(g) for g in kept if g]
    # Berlin's and Oslo's rest as the prompt has them (then its full stop: the chat template's end
    # of turn follows it there, not a space; the target refuses it)
    assert any(text.startswith(("lin", "lo")) for text in spelled), spelled
