"""Lookup that follows a constrained sequence's grammar: the grammar's likely tokens and the
prompt's words, guessed at no model cost.

A JSON answer is mostly structure and copies. The target proposes the grammar's *forced* tokens
itself (the only tokens allowed: certain). This proposer guesses the rest that needs no model:

- **the grammar's likely tokens**: where the grammar allows one text but more than one way to
  tokenize it (after a key, ``":"`` may be the one token ``":"`` or ``":`` then ``"``), the
  canonical tokenization of that text (``Matcher.likely``; the target proposes them too, after
  its forced tokens, so here they matter after guesses the lookup made);
- **lookup**: elsewhere, the sequence's lookup (prompt lookup's n-grams, or suffix drafting)
  from the tokens so far and the guesses before, its n-grams matched by ``space_free_ids`` for
  prompt lookup (NgramIndex ``canonical``: a value that starts after a quote, ``"Marie``, finds
  the prompt's `` Marie``), cut where the grammar refuses a guess.
- **spelling**: where lookup has nothing, the string value being written continued as the prompt
  spells it, on text rather than tokens (``PromptSpelling``: after ``"Ber`` the rest of the
  prompt's `` Berlin``, ``lin``), cut where the grammar refuses a guess.

They alternate until γ guesses, or none has one. A guess the target refuses ends the chain
as any guess does; every guess is a point mass (q_width 0), so greedy and sampled requests alike
keep the target's output (its distribution) exactly: the target verifies them against its masked p
(target_service/grammar_rows.py, settle.py).

The proposer keeps its own matcher per constrained sequence (``DraftGrammars``, as the draft model
keeps one), at the tokens the lookup holds; a sequence without one (no compiler, a constraint it
cannot compile) is looked up as free text, and the target cuts what its grammar refuses.
Knows nothing about gRPC or the target.
"""

from __future__ import annotations

from collections.abc import Hashable

from draft_service.grammar_state import DraftGrammars, GrammarRow
from draft_service.ngram import NgramIndex
from draft_service.spelling import PromptSpelling
from draft_service.suffix import SuffixSequence
from specstream.data.propose import ProposeItem
from specstream.text.grammar import GrammarCompiler

__all__ = ["GrammarLookup"]


class GrammarLookup:
    """The constrained sequences' matchers of a lookup, and their chains of guesses."""

    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler
        self.grammars = DraftGrammars(compiler)
        self.spelling = PromptSpelling(compiler.text_tokenizer) if compiler is not None else None

    def sync(self, item: ProposeItem, tokens: list[int]) -> GrammarRow | None:
        """The item's matcher at the lookup's ``tokens`` (the item applied; None: free text, or
        looked up unmasked)."""
        return self.grammars.follow(item, tokens) if self.compiler is not None else None

    def release(self, keys: list[Hashable]) -> None:
        self.grammars.release(keys)
        if self.spelling is not None:
            self.spelling.release(keys)

    def chain(self, key: Hashable, row: GrammarRow, sequence: NgramIndex | SuffixSequence, forced: list[int],
              gamma: int) -> list[int]:
        """Up to ``gamma`` guesses after ``forced`` (the target's forced tokens, context here): the
        grammar's likely tokens where it has some, else lookup's, each cut where the grammar refuses.
        ``sequence`` and ``row`` are left as they were (the tokens the lookup holds)."""
        length = len(sequence)
        chain: list[int] = []
        if row.take(forced):
            sequence.extend(forced)
            while len(chain) < gamma and not row.matcher.stopped:
                room = gamma - len(chain)
                guesses = row.matcher.likely()[:room]
                if not guesses:
                    guesses = sequence.proposal(room, 0)[0]
                if not guesses and self.spelling is not None:
                    guesses = self.spelling.guesses(key, sequence.tokens, row.start, room)
                guesses = guesses[:row.matcher.valid_prefix(guesses)]
                if not guesses or not row.take(guesses):
                    break
                sequence.extend(guesses)
                chain += guesses
            sequence.truncate(length)
        self.grammars.hold(key, length)
        return chain
