"""Which target replicas the gateway uses, kept in step with DNS while it runs.

Every `interval_s` the configured target entries are resolved again (gateway/discovery.py; a
headless Service lists one address per ready pod, so the HPA's new pods appear there):

- an address with no replica gets one, started in the background (`make_replica`: connect, check
  that it serves what the others serve) and added to the router once it answers; one that fails
  to start is tried again at the next resolution;
- a replica whose address is gone is *drained*: it takes nothing new, hands back the requests
  that had not started, finishes the others, and is then removed from the router and closed. If
  its address comes back first, it is taken into use again.

A resolution that fails (the name does not resolve right now) changes nothing: a DNS hiccup must
not drain every replica. IP-literal entries always resolve to themselves, so their replicas stay.
Each change to the set of replicas is passed on to the router's `recheck_serving` (the gateway's
health may have changed).

Knows nothing about gRPC or tokens: replicas are made by `make_replica` and used through the
`Replica` protocol (gateway/ticket.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from gateway.discovery import Resolver, resolve_targets
from gateway.router import Router
from gateway.ticket import Replica

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.1  # how often a draining replica is checked for its last request


class Membership:
    def __init__(self, entries: list[str], router: Router, make_replica: Callable[[str], Awaitable[Replica]],
                 interval_s: float, getaddrinfo: Resolver = socket.getaddrinfo) -> None:
        self.entries = entries
        self.router = router
        self.make_replica = make_replica  # a started, checked replica for an address; raises if it cannot be
        self.interval_s = interval_s
        self._getaddrinfo = getaddrinfo
        self._starting: dict[str, asyncio.Task[None]] = {}  # address -> its replica being started
        self._draining: dict[str, asyncio.Task[None]] = {}  # address -> waiting for its last request
        self.resolutions = 0  # refreshes that resolved (for tests and logs)

    async def run(self) -> None:
        """Refreshes every `interval_s` until cancelled."""
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                await self.refresh()
        finally:
            for task in [*self._starting.values(), *self._draining.values()]:
                task.cancel()

    async def refresh(self) -> None:
        """Resolves the entries once and adds, drains or takes back replicas to match."""
        try:
            addresses = await asyncio.to_thread(resolve_targets, self.entries, self._getaddrinfo)
        except ValueError as exc:
            log.warning("re-resolving the targets failed (%s); keeping the %d replica(s) in use",
                        exc, len(self.router.replicas))
            return
        self.resolutions += 1
        wanted = set(addresses)
        current = {r.url: r for r in self.router.replicas}
        for address in addresses:
            if address not in current and address not in self._starting:
                self._starting[address] = asyncio.create_task(self._add(address), name=f"add-target {address}")
        for url, replica in current.items():
            if url not in wanted and url not in self._draining:
                log.info("target %s left DNS; draining it (%d request(s) to finish)", url, replica.outstanding)
                await replica.drain(True)
                self._draining[url] = asyncio.create_task(self._remove_when_idle(replica),
                                                          name=f"drain-target {url}")
            elif url in wanted and url in self._draining:
                log.info("target %s is back in DNS; using it again", url)
                self._draining.pop(url).cancel()
                await replica.drain(False)

    async def _add(self, address: str) -> None:
        try:
            replica = await self.make_replica(address)
        except Exception as exc:  # noqa: BLE001 - logged; the next resolution tries again
            log.warning("new target %s not added: %s", address, exc)
            return
        finally:
            self._starting.pop(address, None)
        self.router.add(replica)
        log.info("target %s added (%d replica(s))", address, len(self.router.replicas))
        await self.router.recheck_serving()

    async def _remove_when_idle(self, replica: Replica) -> None:
        while replica.outstanding:
            await asyncio.sleep(DRAIN_POLL_S)
        self._draining.pop(replica.url, None)
        self.router.remove(replica)
        log.info("target %s drained and removed (%d replica(s) left)", replica.url, len(self.router.replicas))
        await replica.close()
        await self.router.recheck_serving()
