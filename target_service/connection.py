"""One gateway's `Connect` stream as the engine sees it: a place to put outgoing messages.

The engine calls `send` from its loop; the servicer drains `outbox` into the gRPC stream. Knows
nothing about sequences.
"""

from __future__ import annotations

import asyncio
import itertools

from specstream.data.engine import EngineMessage

_ids = itertools.count(1)


class Connection:
    def __init__(self) -> None:
        self.conn_id = next(_ids)
        self.outbox: asyncio.Queue[EngineMessage | None] = asyncio.Queue()

    def send(self, message: EngineMessage) -> None:
        self.outbox.put_nowait(message)

    def close(self) -> None:
        """Ends the outgoing stream after what is already queued."""
        self.outbox.put_nowait(None)

    def __hash__(self) -> int:
        return self.conn_id

    def __repr__(self) -> str:
        return f"Connection({self.conn_id})"
