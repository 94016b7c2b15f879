"""Greedy draft proposals with a per-sequence KV cache.

Each item says: keep the first `rollback_to` tokens of the sequence (an O(1) length reset), append
the tokens the target committed since, then guess `gamma` tokens greedily. The guesses are fed
back into the cache as they are made, so the next call only rolls back what the target rejected.
Knows nothing about gRPC or about the target: keys are opaque.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass

import torch

import kernels
from specstream.models import CausalLM


@dataclass
class ProposeItem:
    key: Hashable
    rollback_to: int
    append: list[int]
    gamma: int


@dataclass
class Proposal:
    tokens: list[int]
    length: int  # tokens the cache now holds for the sequence (0: state lost or refused)


class DraftProposer:
    def __init__(self, model: CausalLM, max_slots: int, max_seq_len: int) -> None:
        self.model = model
        self.max_len = min(max_seq_len, model.config.max_position_embeddings)
        self.cache = model.new_cache(max_slots, self.max_len)
        self.slots: dict[Hashable, int] = {}

    @property
    def held(self) -> int:
        return len(self.slots)

    @property
    def name(self) -> str:
        return self.model.config.name

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def free_slots(self) -> int:
        return self.cache.num_free

    def release(self, keys: list[Hashable]) -> None:
        for key in keys:
            slot = self.slots.pop(key, None)
            if slot is not None:
                self.cache.free(slot)

    @torch.inference_mode()
    def propose(self, items: list[ProposeItem]) -> list[Proposal]:
        out = [Proposal([], 0) for _ in items]
        rows, gammas = [], []
        for i, item in enumerate(items):
            slot = self._sync(item)
            if slot is None:
                continue
            out[i].length = item.rollback_to  # the appended tokens are only fed when guessing
            gamma = min(item.gamma, self.max_len - item.rollback_to - len(item.append))
            if gamma > 0:
                rows.append((i, item, slot))
                gammas.append(gamma)
        if not rows:
            return out
        guesses = self._guess(rows, gammas)
        for (i, item, slot), gamma, tokens in zip(rows, gammas, guesses):
            out[i].tokens = tokens[:gamma]
            # Holds the appended tokens and every guess but the last (which was never fed).
            out[i].length = item.rollback_to + len(item.append) + gamma - 1
            self.cache.set_length(slot, out[i].length)
        return out

    def _sync(self, item: ProposeItem) -> int | None:
        """Rolls the sequence back to `rollback_to`; None when its state is gone or no slot is free."""
        slot = self.slots.get(item.key)
        if slot is None:
            if item.rollback_to != 0 or (slot := self.cache.alloc()) is None:
                return None
            self.slots[item.key] = slot
        if item.rollback_to > self.cache.length(slot) or not item.append \
                or item.rollback_to + len(item.append) > self.max_len \
                or max(item.append) >= self.model.config.vocab_size:
            self.release([item.key])
            return None
        self.cache.set_length(slot, item.rollback_to)
        return slot

    def _guess(self, rows: list[tuple[int, ProposeItem, int]], gammas: list[int]) -> list[list[int]]:
        """Appends each row's tokens, then decodes max(gammas) greedy tokens for all rows at once."""
        batch = len(rows)
        first = torch.empty(batch, dtype=torch.int64, device=self.model.device)  # [B]
        by_len: dict[int, list[int]] = defaultdict(list)
        for b, (_, item, _) in enumerate(rows):
            by_len[len(item.append)].append(b)
        for length, members in by_len.items():  # rows appending equally many tokens share a forward
            ids = torch.tensor([rows[b][1].append for b in members], dtype=torch.int64)  # [b, length]
            slots = torch.tensor([rows[b][2] for b in members], dtype=torch.int64)
            start = torch.tensor([rows[b][1].rollback_to for b in members], dtype=torch.int64)
            logits = self.model(ids, self.cache, slots, start, last_only=True)  # [b, 1, V]
            first[members] = kernels.argmax(logits[:, -1])
        slots = torch.tensor([slot for _, _, slot in rows], dtype=torch.int64)  # [B]
        pos = torch.tensor([item.rollback_to + len(item.append) for _, item, _ in rows], dtype=torch.int64)
        guesses = [first]
        # Tokens stay on the device between draft steps; one host transfer at the end. A row whose
        # γ is smaller than the batch's keeps being fed; its extra positions lie past its length
        # (clamped to the last cache position, which that row never counts as valid).
        for _ in range(max(gammas) - 1):
            logits = self.model(guesses[-1][:, None], self.cache, slots, pos.clamp(max=self.max_len - 1))
            guesses.append(kernels.argmax(logits[:, -1]))  # [B]
            pos = pos + 1
        return torch.stack(guesses, dim=1).tolist()  # [B, max gamma]
