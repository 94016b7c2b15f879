"""Replicas following DNS while the gateway runs (gateway/membership.py), with a scripted resolver
whose answers change and replicas played as in test_gateway_router: a new address becomes a
replica that gets traffic, a vanished one drains (nothing new, its unstarted requests move, its
started ones finish there) and is then removed and closed, an address that comes back during the
drain is used again, and a failed resolution or a replica that cannot start changes nothing; a
replica joins only if it serves what the gateway serves."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from test_gateway_discovery import V4, fake_dns
from test_gateway_router import error_code, finished, replica, report, run_async, submit, token, written

from gateway.membership import Membership
from gateway.router import Router
from gateway.server import check_joins, common_info, live_draft_model
from specstream.data.batch_stats import BatchStats
from specstream.data.engine import Load, TargetInfo


class Scenario:
    """A router over the replicas the resolver's current answer names; `table` is edited between refreshes."""

    def __init__(self, *ips: str, fail: set[str] = frozenset()) -> None:
        self.table = {"targets": [(V4, ip) for ip in ips]}
        self.fail = fail  # addresses whose replica cannot start
        self.started: list[str] = []
        self.closed: list[str] = []
        self.changes = 0
        self.router = Router([self._replica(f"{ip}:7") for ip in ips], max_queue=10, on_serving_changed=self._changed)
        self.membership = Membership(["dns:///targets:7"], self.router, self._make, interval_s=60,
                                     getaddrinfo=self._resolve)

    def _resolve(self, *args, **kwargs):
        return fake_dns(self.table)(*args, **kwargs)

    def _replica(self, address: str):
        client = replica(address.rpartition(":")[0], max_slots=1)
        client.url = address
        original_close = client.close

        async def close() -> None:
            self.closed.append(address)
            await original_close()

        client.close = close
        return client

    async def _make(self, address: str):
        self.started.append(address)
        if address in self.fail:
            raise ConnectionError(f"{address} did not answer GetInfo")
        return self._replica(address)

    async def _changed(self) -> None:
        self.changes += 1

    def urls(self) -> list[str]:
        return [r.url for r in self.router.replicas]

    async def refresh(self) -> None:
        await self.membership.refresh()
        for _ in range(5):  # let the started add/drain tasks run
            await asyncio.sleep(0)


@run_async
async def test_a_new_address_becomes_a_replica_that_gets_traffic():
    s = Scenario("10.0.0.1")
    s.table["targets"].append((V4, "10.0.0.2"))
    await s.refresh()
    assert s.urls() == ["10.0.0.1:7", "10.0.0.2:7"] and s.started == ["10.0.0.2:7"] and s.changes == 1
    tickets = submit(s.router, 4)
    assert sorted(t.replica.url for t in tickets) == ["10.0.0.1:7"] * 2 + ["10.0.0.2:7"] * 2
    await s.refresh()  # nothing new: nothing started again
    assert s.started == ["10.0.0.2:7"]


@run_async
async def test_a_vanished_address_drains_then_is_removed_and_closed():
    s = Scenario("10.0.0.1", "10.0.0.2")
    kept, gone = s.router.replicas
    tickets = submit(s.router, 4)  # two on each: one running, one in its own queue
    on_gone = [t for t in tickets if t.replica is gone]
    report(gone, running=1, queued=1, events=[token(on_gone[0], 5)])  # the first has started there
    written(gone)
    s.table["targets"] = [(V4, "10.0.0.1")]
    await s.refresh()
    assert gone.draining and not gone.routable and s.urls() == ["10.0.0.1:7", "10.0.0.2:7"]
    assert written(gone)[1] == [on_gone[1].request.id]  # its unstarted one is cancelled there ...
    assert on_gone[1].replica is None and s.router.queued == 1  # ... and waits for the other replica
    assert on_gone[0].replica is gone and error_code(on_gone[0]) is None  # the started one stays
    assert submit(s.router, 1)[0].replica is None  # nothing new goes to it (kept is full)
    report(gone, running=0, queued=0, events=[finished(on_gone[0])])
    await asyncio.sleep(0.25)  # the drain notices its last request ended
    assert s.urls() == ["10.0.0.1:7"] and s.closed == ["10.0.0.2:7"]
    assert list(on_gone[0].events._queue)[-1].finish_reason  # it finished, not failed
    on_kept = [t for t in tickets if t.replica is kept]
    report(kept, running=0, queued=0, events=[finished(on_kept[0]), finished(on_kept[1])])
    assert on_gone[1].replica is kept


@run_async
async def test_an_address_back_before_its_drain_ends_is_used_again():
    s = Scenario("10.0.0.1", "10.0.0.2")
    back = s.router.replicas[1]
    (ticket,) = [t for t in submit(s.router, 2) if t.replica is back]
    report(back, running=1, queued=0, events=[token(ticket, 5)])
    s.table["targets"] = [(V4, "10.0.0.1")]
    await s.refresh()
    assert back.draining
    s.table["targets"].append((V4, "10.0.0.2"))
    await s.refresh()
    assert not back.draining and back.routable and s.started == []
    report(back, running=0, queued=0, events=[finished(ticket)])
    await asyncio.sleep(0.25)
    assert s.urls() == ["10.0.0.1:7", "10.0.0.2:7"] and s.closed == []


@run_async
async def test_a_failed_resolution_or_a_replica_that_cannot_start_changes_nothing():
    s = Scenario("10.0.0.1", fail={"10.0.0.3:7"})
    s.table.clear()  # NXDOMAIN: a DNS hiccup must not drain everything
    await s.refresh()
    assert s.urls() == ["10.0.0.1:7"] and not s.router.replicas[0].draining and s.membership.resolutions == 0
    s.table["targets"] = [(V4, "10.0.0.1"), (V4, "10.0.0.3")]
    await s.refresh()
    assert s.urls() == ["10.0.0.1:7"] and s.started == ["10.0.0.3:7"]
    await s.refresh()  # tried again at the next resolution
    assert s.started == ["10.0.0.3:7"] * 2 and s.changes == 0


@run_async
async def test_the_last_replica_draining_away_leaves_the_gateway_not_serving():
    s = Scenario("10.0.0.1")
    (only,) = s.router.replicas
    s.table["targets"] = [(V4, "10.0.0.9")]
    s.fail = {"10.0.0.9:7"}
    await s.refresh()
    await asyncio.sleep(0.25)
    assert s.urls() == [] and not s.router.serving and s.closed == ["10.0.0.1:7"]


@run_async  # a client's channel needs a running loop
async def test_a_replica_joins_only_if_it_serves_what_the_gateway_serves():
    info = TargetInfo(model_name="m", vocab_size=300, eos_token_ids=[2], max_context_length=500, max_gamma=8)
    joining = replica("10.0.0.5", max_slots=1)
    joining.info = dataclasses.replace(info, max_context_length=1000)  # more room than the gateway needs: fine
    check_joins(info, joining)
    for name, value, match in [("model_name", "other", "model_name 'other'"), ("vocab_size", 301, "vocab_size 301"),
                               ("eos_token_ids", [2, 3], r"eos_token_ids \[2, 3\]"),
                               ("max_context_length", 499, "max_context_length 499 is below"),
                               ("max_gamma", 4, "max_gamma 4 is below")]:
        joining.info = dataclasses.replace(info, **{name: value})
        with pytest.raises(ValueError, match=match):
            check_joins(info, joining)


@run_async  # a client's channel needs a running loop
async def test_the_gateway_serves_what_every_replica_can_take():
    a, b = replica("10.0.0.1", max_slots=1), replica("10.0.0.2", max_slots=1)
    a.info = TargetInfo(model_name="m", vocab_size=300, max_context_length=500, max_gamma=8, default_gamma=6,
                        eos_token_ids=[2])
    b.info = dataclasses.replace(a.info, max_context_length=400, max_gamma=4)
    merged = common_info([a, b])
    assert (merged.max_context_length, merged.max_gamma, merged.default_gamma) == (400, 4, 4)
    assert (merged.model_name, merged.vocab_size, merged.eos_token_ids) == ("m", 300, [2])
    assert a.info.max_gamma == 8  # the replica's own info is left as it reported it
    b.info = dataclasses.replace(a.info, vocab_size=301)
    with pytest.raises(ValueError, match="disagree on vocab_size"):
        common_info([a, b])


def test_model_info_names_the_draft_the_replicas_use_now():
    """A draft that connects after the gateway read GetInfo (one still loading its model) is named
    from the replicas' load; replicas with different drafts are all named."""
    info = TargetInfo(model_name="m", vocab_size=300, max_context_length=500, max_gamma=8, default_gamma=6,
                      eos_token_ids=[2])  # read while no draft was connected: no draft name
    no_draft = Load(max_slots=1, free_slots=1, running=0, queued=0, draft_sequences=0, draft_connected=False,
                    batch=BatchStats("static", 1))
    with_draft = dataclasses.replace(no_draft, draft_connected=True, draft_model="feature-head")
    assert live_draft_model(info, [no_draft]) == ""
    assert live_draft_model(info, [no_draft, with_draft]) == "feature-head"
    other = dataclasses.replace(with_draft, draft_model="token-draft")
    assert live_draft_model(info, [other, with_draft, with_draft]) == "feature-head,token-draft"
    configured = dataclasses.replace(info, draft_model_name="token-draft")  # known at GetInfo, now disconnected
    assert live_draft_model(configured, [no_draft]) == "token-draft"
