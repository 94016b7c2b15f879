"""The gateway process: the public `Generation` servicer, and the OpenAI-compatible HTTP front
(gateway/http/) when `http_port` is set, both over one `Gateway` core (gateway/service.py).

Thin: admission, validation and the request pipeline are the core's. Health is SERVING while at
least one target replica is routable (connected, serving, not declared hung, not draining): the
router passes each change on (`Router(on_serving_changed=...)`), once the first replicas are all
routable.
Replicas come from the target entries, re-resolved every `target_resolve_interval_s`
(gateway/membership.py); one added later must serve what the first ones serve (`check_joins`).
Both fronts share the gRPC server's certificates and tokens (`ServiceServer.certificates`,
`.tokens`), so one SIGHUP reloads them for both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc

from gateway.discovery import resolve_targets
from gateway.membership import Membership
from gateway.prefix_routing import PrefixRouting
from gateway.router import Router
from gateway.service import Gateway
from gateway.target_client import TargetClient
from specstream.data.config import GatewayConfig
from specstream.data.engine import Load, TargetInfo
from specstream.data.engine_wire import batch_stats_to_pb
from specstream.models.registry import resolve_model
from specstream.serving.grpc_server import ServiceServer
from specstream.serving.metrics import GatewayMetrics
from specstream.text.tokenizer import TextTokenizer
from specstream_pb import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's `authorization` metadata (its bearer token, checked by AuthInterceptor), if any."""
    return next((value for key, value in context.invocation_metadata() or () if key == "authorization"), None)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """The gRPC front: protobuf in, the gateway core, protobuf out."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Generate(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        return await self.gateway.generate_samples(
            await self.gateway.admit_samples(request, authorization=_authorization(context)))

    async def GenerateStream(self, request, context: grpc.aio.ServicerContext):  # noqa: N802
        valids = await self.gateway.admit_samples(request, authorization=_authorization(context))
        try:
            async for chunk in self.gateway.stream_samples(valids):
                yield chunk
        finally:  # also for samples whose streams never began (their own release never ran)
            for valid in valids:
                self.gateway.release(valid)

    async def GetModelInfo(self, request, context):  # noqa: N802
        gateway = self.gateway
        info, replicas = gateway.info, gateway.router.replicas
        live = [r.load for r in replicas if r.connected]
        return generation_pb2.ModelInfo(
            target_model=info.model_name, draft_model=live_draft_model(info, live), vocab_size=info.vocab_size,
            max_context_length=info.max_context_length, max_new_tokens_limit=gateway.limits.max_new_tokens,
            max_gamma=info.max_gamma, default_gamma=info.default_gamma, eos_token_ids=list(gateway.eos_ids),
            running_sequences=sum(load.running for load in live), queued_sequences=sum(load.queued for load in live),
            free_slots=sum(load.free_slots for load in live),
            draft_sequences=sum(load.draft_sequences for load in live),
            draft_connected=bool(live) and all(load.draft_connected for load in live),
            gateway_in_flight=gateway.in_flight, gateway_queued=gateway.router.queued,
            replicas=[_replica_pb(i, r, gateway.config.expose_replica_addresses) for i, r in enumerate(replicas)],
            has_chat_template=gateway.tokenizer.chat_template is not None)


def live_draft_model(info: TargetInfo, live: list[Load]) -> str:
    """The draft the live replicas use now: a draft may connect (or be replaced) after the gateway
    read the targets' GetInfo. Replicas with different drafts are all named, comma-separated."""
    names = sorted({load.draft_model for load in live if load.draft_model})
    return ",".join(names) if names else info.draft_model_name


def _replica_pb(index: int, replica: TargetClient, expose: bool) -> generation_pb2.ReplicaInfo:
    """One replica's state for the public GetModelInfo; its internal address only when `expose`
    (an operator's choice), else its position: callers need no map of the internal network."""
    load = replica.load
    return generation_pb2.ReplicaInfo(
        address=replica.url if expose else f"replica-{index}", connected=replica.connected, serving=replica.serving,
        running=load.running, queued=load.queued, free_slots=load.free_slots, max_slots=load.max_slots,
        routed=replica.routed, requeued=replica.requeued, batch=batch_stats_to_pb(load.batch), resumed=replica.resumed,
        stalls=replica.stalls, draining=replica.draining)


def common_info(replicas: list[TargetClient]) -> TargetInfo:
    """What every replica serves: they must run the same model and vocabulary; a request must fit
    the smallest context and γ limit among them, since it may be moved to any of them."""
    first = replicas[0].info
    for replica in replicas[1:]:
        info = replica.info
        for name in ("model_name", "vocab_size", "eos_token_ids"):
            if getattr(info, name) != getattr(first, name):
                raise ValueError(f"target replicas disagree on {name}: {replicas[0].url} has "
                                 f"{getattr(first, name)!r}, {replica.url} has {getattr(info, name)!r}")
    max_gamma = min(r.info.max_gamma for r in replicas)
    return dataclasses.replace(first, max_context_length=min(r.info.max_context_length for r in replicas),
                               max_gamma=max_gamma, default_gamma=min(first.default_gamma, max_gamma))


def check_joins(info: TargetInfo, replica: TargetClient) -> None:
    """A replica added while the gateway runs must serve the same model and vocabulary, and take
    every request the gateway already accepts (its limits were fixed from the first replicas)."""
    new = replica.info
    for name in ("model_name", "vocab_size", "eos_token_ids"):
        if getattr(new, name) != getattr(info, name):
            raise ValueError(f"it has {name} {getattr(new, name)!r}, the gateway serves {getattr(info, name)!r}")
    for name in ("max_context_length", "max_gamma"):
        if getattr(new, name) < getattr(info, name):
            raise ValueError(f"its {name} {getattr(new, name)} is below the gateway's {getattr(info, name)}")


async def _wait_routable(replicas: list[TargetClient], timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not all(r.routable for r in replicas):
        if loop.time() > deadline:
            down = [r.url for r in replicas if not r.routable]
            raise TimeoutError(f"target replicas {down} not connected and serving after {timeout_s:.0f}s")
        await asyncio.sleep(0.02)


def _target_client(config: GatewayConfig, address: str) -> TargetClient:
    return TargetClient(address, options=config.target_channel_options(), retry_s=config.retry_s,
                        stall=config.stall, security=config.target_security)


def _follow_dns(config: GatewayConfig, router: Router, info: TargetInfo) -> asyncio.Task[None] | None:
    """Re-resolves the target entries every `target_resolve_interval_s` (None: never)."""
    if config.target_resolve_interval_s == 0:
        return None

    async def join(address: str) -> TargetClient:
        replica = _target_client(config, address)
        try:
            await replica.start(timeout_s=config.connect_timeout_s)
            check_joins(info, replica)
        except BaseException:
            await replica.close()
            raise
        return replica

    membership = Membership(config.target_addresses, router, join, interval_s=config.target_resolve_interval_s)
    return asyncio.create_task(membership.run(), name="target-membership")


async def serve(config: GatewayConfig) -> None:
    tokenizer = TextTokenizer.from_dir(resolve_model(config.tokenizer_path))
    addresses = resolve_targets(config.target_addresses)
    replicas = [_target_client(config, a) for a in addresses]
    await asyncio.gather(*(r.start(timeout_s=config.connect_timeout_s) for r in replicas))
    info = common_info(replicas)
    # Health follows the replicas only once all the configured ones are routable (_wait_routable
    # below): until then the gateway is NOT_SERVING, however many already are.
    health_follows = False
    health_lock = asyncio.Lock()

    async def follow_replicas() -> None:  # NOT_SERVING while no replica can take requests
        if not health_follows:
            return
        async with health_lock:  # reads the state inside, so concurrent changes end in the latest one
            await server.set_serving(router.serving)

    router = Router(replicas, max_queue=config.max_queue, backlog=config.replica_backlog,
                    on_serving_changed=follow_replicas,
                    prefixes=PrefixRouting(imbalance=config.prefix_routing_imbalance)
                    if config.prefix_routing_imbalance >= 0 else None)
    metrics = GatewayMetrics()
    gateway = Gateway(config, router, info, tokenizer, metrics)
    metrics.watch_requests(in_flight=lambda: gateway.in_flight, queued=lambda: router.queued)
    server = ServiceServer(config.server, [SERVICE_NAME], metrics.registry)
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(gateway), server.server)
    stopping = asyncio.Event()
    http = None
    if config.http_port is not None:
        # Imported only for an HTTP front: a gRPC-only gateway never loads the web stack (FastAPI,
        # pydantic, uvicorn), which the GPU check therefore does not carry (tools/gpu_check.py).
        from gateway.http.app import build_app
        from gateway.http.server import HttpServer

        app = build_app(gateway, metrics.registry if config.server.metrics_port is not None else None,
                        ready=lambda: not stopping.is_set(), max_body_bytes=config.server.max_message_bytes,
                        tokens=server.tokens)
        http = HttpServer(app, config.server.host, config.http_port, config.server.grace_s, server.certificates)
    await server.start()
    if http is not None:
        await http.start()
    await _wait_routable(replicas, config.connect_timeout_s)
    health_follows = True
    await follow_replicas()
    resolving = _follow_dns(config, router, info)
    log.info("gateway serving on %s%s -> %d target replica(s) %s (%s)", server.address,
             f" (HTTP on {http.address})" if http else "", len(replicas), ", ".join(addresses), info.model_name)

    async def close() -> None:
        if resolving is not None:
            resolving.cancel()
        await asyncio.gather(*(r.close() for r in router.replicas))

    async def stop_http() -> None:
        stopping.set()  # /health reads 503 from now on
        if http is not None:
            await http.stop()

    await server.serve_forever(on_stop=close, stop_beside=stop_http)
