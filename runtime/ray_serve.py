"""`llmc serve --ray`: the OpenAI-compatible server (server/) as N Ray Serve replicas behind Ray's HTTP proxy.

    handle = deploy(make_app, RayServeOptions(replicas=2, num_cpus=1), host="127.0.0.1", port=8000)

Two deployments:
- `LlmcReplica` (N replicas, or autoscaled): each calls `make_app()` once, which loads the artifact (its
  manifest hashes verified by CompiledModel.load, so a copy on each node is checked) and returns the very
  app `llmc serve` runs (server.create_app: limits, auth, metrics, formats), plus a close callback. A request
  reaches that app through ASGI in-process; the replica streams back its id, the response start, then the
  body chunks.
- `LlmcIngress` (one replica, no engine): reads the body (up to the server's max_body_bytes: 413 past it),
  takes the prompt or chat messages as a routing hint, and calls the replicas through a DeploymentHandle
  whose request router is `PrefixAffinityRequestRouter` (prefix_router.py's policy). Every response carries
  the replica that served it in `x-llmc-replica`.

Faults: a replica that dies is restarted by Ray (and one whose engine loop failed fails its health check,
so Ray replaces it too). A request that had not reached a replica yet when it died is sent again to another
(generation has no side effects); one that a dead replica had accepted fails with a 503 OpenAI error body,
code "replica_died", or, once its stream has started, an SSE error event and [DONE]: the client may retry.

Ray is an optional dependency (`pip install 'llmc[ray]'`): this module imports it at the top, and only
`llmc serve --ray` imports this module.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from llmc.runtime.prefix_router import PrefixAffinity, routing_prompt
from llmc.runtime.server import ApiError, ServerLimits, error_body, error_response, read_body

logger = logging.getLogger("llmc.ray_serve")

REPLICA_HEADER = "x-llmc-replica"
APP_NAME = "llmc"
_REPLICA_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)
_HOP_BY_HOP = {"transfer-encoding", "connection", "keep-alive"}


@dataclasses.dataclass(frozen=True)
class RayServeOptions:
    """How the replicas are deployed. num_cpus / num_gpus: each replica's Ray resources (the CPU target:
    its threads; a CUDA target: one GPU). autoscaling: Ray Serve's autoscaling_config (min_replicas,
    max_replicas, target_ongoing_requests, ...) instead of a fixed `replicas`."""

    replicas: int = 1
    num_cpus: float = 1
    num_gpus: float = 0
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # the replica processes' environment
    autoscaling: dict[str, Any] | None = None
    max_ongoing_requests: int = 320  # per replica: its engine's max_num_seqs + max_waiting_requests
    limits: ServerLimits = ServerLimits()
    imbalance: int = 8  # requests in flight between the busiest and the idlest replica still counted as balanced
    max_attempts: int = 3  # a request not yet accepted by a replica that died is sent again, this often in all


# ----------------------------------------------------------------------------------------------------------
# The request router


class PrefixAffinityRequestRouter(FIFOMixin, RequestRouter):
    """Ray Serve's side of prefix_router.PrefixAffinity: loads from Ray's queue-length cache (probed by Ray
    for the replicas this returns), the prompt from the ingress's call (`prompt` of its payload)."""

    def initialize_state(self, imbalance: int = 8, **kwargs) -> None:
        self.affinity = PrefixAffinity(imbalance=imbalance)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {rid: self.replica_queue_len_cache.get(r.replica_id) or 0 for rid, r in by_id.items()}
        ranks = self.affinity.choose(_prompt_of(pending_request), loads)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.affinity.record(_prompt_of(pending_request), replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id.unique_id)


def _prompt_of(pending_request: PendingRequest | None) -> str:
    if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], dict):
        return ""
    return pending_request.args[0].get("prompt", "")


# ----------------------------------------------------------------------------------------------------------
# The replicas: one engine and server.create_app's app each


async def _call_asgi(app, request: dict) -> AsyncIterator[dict | bytes]:
    """Run one HTTP request through an ASGI app: its response start ({"status", "headers"}), then body chunks.
    Closing the iterator early tells the app that the client left (so the server aborts the request)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request["method"],
        "scheme": "http",
        "path": request["path"],
        "raw_path": request["path"].encode(),
        "root_path": "",
        "query_string": request["query"].encode(),
        "client": ("127.0.0.1", 0),
        "server": None,
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request["headers"]],
    }
    messages: asyncio.Queue = asyncio.Queue()
    client_gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request["body"], "more_body": False}
        await client_gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                yield {"status": message["status"], "headers": headers}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
    finally:
        client_gone.set()
        await asyncio.gather(task, return_exceptions=True)


@serve.deployment(name="LlmcReplica")
class LlmcReplica:
    def __init__(self, make_app: Callable[[], tuple[Any, Callable[[], None]]]):
        self.app, self._close = make_app()
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def __call__(self, request: dict) -> AsyncIterator[dict | bytes]:
        yield {"replica": self.replica_id}  # accepted: from here on, a death fails the request instead of resending it
        async for item in _call_asgi(self.app, request):
            yield item

    def check_health(self) -> None:
        if not self.app.state.llmc.engine.healthy:
            raise RuntimeError("the engine loop failed")  # Ray replaces the replica

    async def __del__(self):
        await self.app.state.llmc.engine.shutdown()
        self._close()


# ----------------------------------------------------------------------------------------------------------
# The ingress


def _replica_died(message: str) -> dict:
    body = error_body(f"{message}; the request may be sent again", 503)
    body["error"]["code"] = "replica_died"
    return body


@serve.deployment(name="LlmcIngress")
class LlmcIngress:
    def __init__(self, replicas, max_body_bytes: int, max_attempts: int):
        self.replicas = replicas.options(stream=True)
        self.max_body_bytes, self.max_attempts = max_body_bytes, max_attempts

    async def __call__(self, request: Request) -> Response:
        try:
            body = await read_body(request, self.max_body_bytes)
        except ApiError as e:
            return error_response(e.message, e.status, e.param, e.code, e.headers)
        payload = {
            "method": request.method,
            "path": request.url.path,
            "query": request.url.query,
            "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw],
            "body": body,
            "prompt": routing_prompt(request.url.path, body),
        }
        for attempt in range(1, self.max_attempts + 1):
            stream = self.replicas.remote(payload)
            try:
                accepted = await stream.__anext__()
            except _REPLICA_GONE as e:
                logger.warning("replica gone before accepting a request (attempt %d): %s", attempt, e)
                continue
            try:
                start = await stream.__anext__()
                headers = {k: v for k, v in start["headers"] if k.lower() not in _HOP_BY_HOP}
                headers[REPLICA_HEADER] = accepted["replica"]
                if headers.get("content-type", "").startswith("text/event-stream"):
                    return StreamingResponse(_sse_rest(stream, accepted["replica"]), start["status"], headers)
                # A whole body comes in full before the answer starts: a replica that dies after its response
                # start still gets the retryable 503, not headers followed by a cut connection.
                body = b"".join([chunk async for chunk in stream])
            except _REPLICA_GONE:
                return JSONResponse(
                    _replica_died(f"replica {accepted['replica']} died"),
                    503,
                    headers={REPLICA_HEADER: accepted["replica"]},
                )
            except asyncio.CancelledError:  # the client left: the replica's generator closes, the server aborts
                stream.cancel()
                raise
            return Response(body, start["status"], headers)
        return error_response(
            f"no replica accepted the request in {self.max_attempts} attempts; retry later", 503, code="no_replica"
        )


async def _sse_rest(stream, replica: str) -> AsyncIterator[bytes]:
    """An SSE stream's chunks after the response start; a replica that dies mid-stream ends it with an error
    event and [DONE]."""
    finished = False
    try:
        async for chunk in stream:
            yield chunk
        finished = True
    except _REPLICA_GONE:
        finished = True
        yield f"data: {json.dumps(_replica_died(f'replica {replica} died'))}\n\ndata: [DONE]\n\n".encode()
    finally:
        if not finished:
            stream.cancel()  # the client left: the replica's generator closes, and the server aborts the request


# ----------------------------------------------------------------------------------------------------------
# Deploying


def build_app(make_app: Callable, options: RayServeOptions):
    """The Ray Serve application: the ingress over the replicas."""
    scaling = (
        {"autoscaling_config": options.autoscaling}
        if options.autoscaling is not None
        else {"num_replicas": options.replicas}
    )
    actor_options = {"num_cpus": options.num_cpus, "num_gpus": options.num_gpus}
    if options.env:
        actor_options["runtime_env"] = {"env_vars": dict(options.env)}
    replicas = LlmcReplica.options(
        **scaling,
        ray_actor_options=actor_options,
        max_ongoing_requests=options.max_ongoing_requests,
        graceful_shutdown_timeout_s=options.limits.shutdown_timeout_s,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRequestRouter, request_router_kwargs={"imbalance": options.imbalance}
        ),
    ).bind(make_app)
    ingress = LlmcIngress.options(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
    return ingress.bind(replicas, options.limits.max_body_bytes, options.max_attempts)


def start_ray(address: str | None, num_cpus: float | None) -> None:
    """Connect to the cluster at `address`, or start a local one on loopback with `num_cpus` logical CPUs."""
    if address is not None:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            object_store_memory=200 << 20,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
        )


def deploy(make_app: Callable, options: RayServeOptions, *, host: str, port: int):
    """Start Serve's HTTP proxy on host:port and the application at `/`; a handle to the ingress once every
    replica is up."""
    serve.start(http_options={"host": host, "port": port})
    return serve.run(build_app(make_app, options), name=APP_NAME, route_prefix="/")


def shutdown() -> None:
    serve.shutdown()
    ray.shutdown()
