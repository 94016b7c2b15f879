"""Which replica already holds a request's prompt: an approximate per-replica index of the prompt
blocks routed there, as SGLang's cache-aware router keeps.

Each replica's index holds the block keys (specstream/data/prefix.py: hash-chained blocks of 16
tokens, salted as the target salts them) of the prompts this gateway sent it, the most recent
``capacity`` keys at most, least recently routed forgotten first. It is an estimate: the target
may have evicted a prefix the index still names, and other gateways' requests are not in it; a
wrong guess costs a prefill, never a wrong token (the target checks every token it reuses).

``PrefixRouting.choose`` picks, among the replicas with room, the one whose index holds the
longest prefix of the request, unless that replica is loaded more than ``imbalance`` requests
above the least loaded one (then the least loaded, as without this index): a hot prompt does not
pile every request onto one replica. Requests with no cached prefix anywhere go by load alone.

Knows nothing about streams or protobuf; the router (gateway/router.py) calls it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

from specstream.data.engine import SequenceRequest
from specstream.data.prefix import BLOCK, block_keys, reusable_blocks

__all__ = ["PrefixRouting"]

R = TypeVar("R")


class PrefixRouting:
    def __init__(self, capacity: int = 65536, imbalance: int = 4) -> None:
        """``capacity``: block keys kept per replica (16 bytes each, plus the dict's own); ``imbalance``:
        requests in use above the least loaded replica past which load decides alone."""
        self.capacity = capacity
        self.imbalance = imbalance
        self._index: dict[str, OrderedDict[bytes, None]] = {}  # replica url -> its keys, least recent first

    def keys(self, request: SequenceRequest) -> list[bytes]:
        """The keys of the prompt blocks the target could reuse."""
        return block_keys(request.prompt_token_ids, request.cache_salt, reusable_blocks(len(request.prompt_token_ids)))

    def matched(self, url: str, keys: list[bytes]) -> int:
        """Prompt tokens the replica at ``url`` is believed to hold: its longest run of leading keys."""
        index = self._index.get(url)
        n = 0
        while index is not None and n < len(keys) and keys[n] in index:
            n += 1
        return n * BLOCK

    def choose(self, candidates: Sequence[R], keys: list[bytes], url: Callable[[R], str],
               load: Callable[[R], float], used: Callable[[R], int]) -> tuple[R, int] | None:
        """Of ``candidates`` (replicas with room), the one to send to and the prompt tokens it is
        believed to hold; None when there are none. ``load``: what plain routing minimises (the
        candidate with the least wins); ``used``: requests a replica holds now."""
        if not candidates:
            return None
        least = min(candidates, key=load)
        best, best_match = least, self.matched(url(least), keys)
        for replica in candidates:
            match = self.matched(url(replica), keys)
            if match > best_match and used(replica) - used(least) <= self.imbalance:
                best, best_match = replica, match
        return best, best_match

    def routed(self, url: str, keys: list[bytes]) -> None:
        """``keys`` were sent to the replica at ``url``: the most recent in its index."""
        index = self._index.setdefault(url, OrderedDict())
        for key in keys:
            index[key] = None
            index.move_to_end(key)
        while len(index) > self.capacity:
            index.popitem(last=False)

    def forget(self, url: str) -> None:
        """A replica removed (or restarted: its cache is gone)."""
        self._index.pop(url, None)
