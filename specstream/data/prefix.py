"""How a prompt's prefix is named for reuse: full blocks of ``BLOCK`` tokens, each keyed by a hash
chain over every token before it and the request's cache salt.

Block i's key is ``blake2b(key of block i-1, tokens of block i)``, the chain starting from the
salt, so a key names the whole prefix up to the end of its block, and two requests with different
salts never share a key. The target's prefix cache (specstream/models/prefix_cache.py) indexes the
blocks it holds by these keys; the gateway's cache-aware routing can compute the same keys without
the model (this module imports no torch). A key is a lookup, never a proof: whoever reuses a
prefix compares its tokens and salt first, so a collision costs a miss, never a wrong token.

Knows nothing about K/V or slots.
"""

from __future__ import annotations

import hashlib
from array import array

__all__ = ["BLOCK", "MAX_SALT_CHARS", "block_keys", "caller_salt", "reusable_blocks"]

BLOCK = 16  # tokens per block: the unit of matching and of sharing (full blocks only)
MAX_SALT_CHARS = 256  # a cache salt's length, at most (request_rules.check_cache_salt)


def block_keys(tokens: list[int], salt: str = "", blocks: int | None = None) -> list[bytes]:
    """The keys of the first ``blocks`` full blocks of ``tokens`` (all of them when None)."""
    full = len(tokens) // BLOCK if blocks is None else min(blocks, len(tokens) // BLOCK)
    key = hashlib.blake2b(salt.encode(), digest_size=16, person=b"specstream-salt").digest()
    out = []
    for i in range(full):
        h = hashlib.blake2b(key, digest_size=16, person=b"specstream-block")
        h.update(array("I", tokens[i * BLOCK:(i + 1) * BLOCK]).tobytes())
        key = h.digest()
        out.append(key)
    return out


def reusable_blocks(prompt_len: int) -> int:
    """Full blocks of a prompt that may come from a cache: its last token is always computed (its
    logits give the first generated token), so the blocks before it."""
    return max(prompt_len - 1, 0) // BLOCK


def caller_salt(authorization: str | None, salt: str) -> str:
    """The salt a caller's prompts are cached under: with a bearer token, a digest of the token and
    the request's own salt (so callers with different tokens never share, whatever salts they
    send); without one, the request's salt as it is."""
    if not authorization:
        return salt
    return hashlib.blake2b(authorization.encode() + b"\0" + salt.encode(), digest_size=32,
                           person=b"specstream-user").hexdigest()
