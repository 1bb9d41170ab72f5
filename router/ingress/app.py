"""The OpenAI-compatible HTTP ingress: a Ray Serve deployment wrapping a FastAPI app.

`OpenAIIngress` (an endpoint per route) holds the plain classes, and `ingress_app(specs,
manager_links)` deploys it with the spec's Serve options: per served model
(router/ingress/served_models.py, which picks the model a request names) the protocol-neutral
`Frontend` (router/ingress/frontend.py: auth, admission, routing, metrics; its `RequestPreparer`,
router/ingress/preparer.py, validates and tokenizes), the HTTP API over it
(router/ingress/openai_api.py, router/ingress/responses_api.py) and the gRPC service over it
(router/ingress/grpc_api.py).

Endpoints: GET /v1/models (and /v1/models/{model}), POST /v1/completions, POST /v1/chat/completions
(both streaming as SSE ending in `data: [DONE]`), POST /v1/responses (streaming typed events), POST
/v1/embeddings, the Files API (POST, GET /v1/files, GET and DELETE /v1/files/{id}, GET
/v1/files/{id}/content) and the Batch API (POST, GET /v1/batches, GET /v1/batches/{id}, POST
/v1/batches/{id}/cancel), POST
/tokenize, POST /detokenize, GET /health (and /ping, as vLLM and SageMaker ask), GET /version, GET
/metrics (Prometheus), GET /openapi.json, POST /v1/load_lora_adapter and /v1/unload_lora_adapter
(with `lora.allow_runtime_updates`); and, beside HTTP, the gRPC Generation service through Serve's
gRPC proxy when `serving.grpc_port` is set.

Every error uses OpenAI's JSON shape `{"error": {"message", "type", "param", "code"}}`: 400 invalid
parameter or body (named; bodies must be JSON objects in UTF-8, nested at most
`request_body.MAX_JSON_DEPTH` deep), 401 bad API key, 404 unknown model or route, 405 wrong method, 413
body too large, 415 a body that is not `application/json`, 429 too many requests in flight, 500 a
request that failed while it ran, 503 no replica (or still starting). With an API key set,
everything but /health needs it (/metrics too, unless `serving.public_metrics`). Admission is
counted by tickets that every exit path releases (router/ingress/admission.py). A client that disconnects
aborts its request on the replica, which frees the request's blocks. The pieces: records/errors.py
(every error, with its HTTP status and gRPC code), router/ingress/http.py (the FastAPI app: key middleware,
exception handlers, OpenAPI, SSE), router/ingress/protocol.py (request records), router/ingress/request_body.py
(a body's JSON and its 400s).

Startup: with `serving.wait_for_pools` (the default) the ingress replica is ready to Serve only once
the pools serve, so the app's RUNNING status means ready (RayService upgrades switch on it).
Without it (what `pdserve serve` deploys) the ingress answers at once: while the pools start,
/health is 503 with the reason (and the reason a start failed, once it has), and requests are 503.
"""
# No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations at runtime
# (through Serve's class-based ingress) and would take a string "Request" for a query parameter.
import asyncio
import importlib.metadata
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from ray import serve

from engine.executor.ray_cluster import keep_serve_replica_on_loopback, prefer_head_node
from records.cache_dirs import cache_root
from records.errors import InvalidRequestError, PayloadTooLargeError, UnsupportedMediaTypeError
from records.serving import IngressSpec
from router.ingress.batches import Batches
from router.ingress.files import FileStore, expiry_seconds
from router.ingress.grpc_api import grpc_call
from router.ingress.http import fastapi_app, openapi_schema
from router.ingress.quota import LedgerCall, QuotaLedger
from router.ingress.request_body import with_request_id
from router.ingress.served_models import ModelServer, ServedModels
from router.ingress.weights_api import (
    adapter_arg,
    check_args,
    check_enabled,
    disk_args,
    distributed_args,
    group_args,
    pause_mode,
    weights_call,
)

logger = logging.getLogger(__name__)


# --- Ray Serve wiring ------------------------------------------------------------------------------
def pdserve_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:      # run from a source tree never installed
        return "unknown"


def _int_param(query: Any, name: str, default: int) -> int:
    """A positive integer query parameter; InvalidRequestError naming it."""
    value = query.get(name)
    if value is None:
        return default
    if not value.isdigit() or int(value) < 1:
        raise InvalidRequestError(f"{name} must be a positive integer; got {value!r}", name)
    return int(value)


# (Serve pickles the class when it decorates it, with the module globals its methods use as they
# are then: every one of them is defined above it.)
def quota_ledger(name: str, limits: dict[str, tuple[int | None, int | None]]) -> LedgerCall:
    """A call to the app's shared QuotaLedger actor (made by the first ingress replica to ask; made
    again, with full buckets, if it is lost with that replica)."""
    import ray  # noqa: PLC0415

    holder: list[Any] = []

    def handle(fresh: bool = False) -> Any:
        if fresh or not holder:
            holder[:] = [ray.remote(QuotaLedger).options(name=name, get_if_exists=True, num_cpus=0,
                                                        max_concurrency=1, **prefer_head_node()).remote(limits)]
        return holder[0]

    async def call(method: str, *args: Any) -> Any:
        try:
            return await getattr(handle(), method).remote(*args)
        except ray.exceptions.RayActorError:
            logger.warning("the quota ledger %s was lost; making it again", name)
            return await getattr(handle(fresh=True), method).remote(*args)

    return call


@serve.ingress(fastapi_app)
class OpenAIIngress:
    """The ingress deployment's replica: the served models (`ServedModels`, a Frontend and the HTTP
    and gRPC APIs each), the Files and Batch APIs, and an endpoint per route. `ingress_app` applies
    Serve's deployment options from the spec."""

    async def __init__(self, specs_json: list[str], manager_links: list[Callable[[], Any]]) -> None:
        # The pools come up in the background; with serving.wait_for_pools this replica is ready
        # (to Serve) only once they serve, else it answers at once (/health says why not ready).
        keep_serve_replica_on_loopback()
        specs = [IngressSpec.model_validate_json(j) for j in specs_json]
        spec = specs[0]
        self.models = ServedModels(specs)
        # The API keys, tenants and body limits are the shared serving section's: any model's
        # frontend answers for them (the first's).
        self.server = self.models.first.frontend
        self.api = self.models.first.api
        tenants = self.server.tenants
        if spec.serving.ingress_replicas > 1 and any(t.max_concurrent or t.requests or t.tokens
                                                     for t in tenants.by_name.values()):
            # Limits that hold over every ingress replica, not each (router/ingress/quota.py).
            tenants.share(spec.serving.ingress_replicas, quota_ledger(f"pdserve-quota-{spec.name}", tenants.limits()))
        # The Files and Batch APIs' state on disk (shared by this app's ingress replicas).
        root = spec.serving.files_dir or os.path.join(cache_root("files", "PDSERVE_FILES_DIR"), spec.name)
        self.files = FileStore(os.path.join(root, "files"), spec.serving.max_file_bytes)
        self.batches = Batches(os.path.join(root, "batches"), self.files, self.models.execute,
                               lambda: 2 * max(1, int(self.models.dispatch_limit() * spec.serving.batch_share)))
        fastapi_app.state.server = self.server
        self._membership: list[asyncio.Task] = []
        self._startup = asyncio.get_running_loop().create_task(self._start_all(manager_links))
        if spec.serving.wait_for_pools:
            await self._startup
            not_ready = self.models.not_ready()
            if not_ready is not None:
                raise RuntimeError(f"the engine pools did not start: {not_ready}")

    async def _start_all(self, manager_links: list[Callable[[], Any]]) -> None:
        await asyncio.gather(*(self._start(server, link)
                               for server, link in zip(self.models.servers, manager_links)))
        resumed = self.batches.resume()          # batches an earlier ingress left unfinished
        if resumed:
            logger.info("resumed %d batches: %s", len(resumed), ", ".join(resumed))

    async def _start(self, server: ModelServer, manager_link: Callable[[], Any]) -> None:
        frontend = server.frontend
        try:
            manager = manager_link()
            # The spec this ingress serves: the manager reconciles its pools to it (a RayService
            # update of serveConfigV2 reaches the pools this way); None: whatever it serves.
            ready = asyncio.ensure_future(manager.ready.remote(getattr(manager_link, "config_json", None)))
            while not ready.done():     # (a model waiting for room says so while it waits)
                status = await manager.status.remote()
                frontend.not_ready = (f"waiting: {status['reason']}" if status["phase"] == "waiting"
                                      else "starting: the engine pools are loading")
                await asyncio.wait([ready], timeout=2.0)
            await ready
            _, pools = await manager.membership.remote()
        except Exception as e:  # noqa: BLE001 - reported by /health
            cause = getattr(e, "cause", None) or e
            frontend.not_ready = f"failed: {cause}"
            logger.error("the engine pools of %s failed to start: %s", server.name, cause)
            return
        frontend.attach(manager, pools)
        self._membership.append(asyncio.get_running_loop().create_task(frontend.follow_membership()))

    async def _body(self, request: Request) -> tuple[ModelServer, dict[str, Any]]:
        """The request's JSON body and the model it names."""
        body = await self.api.read_json(request)
        return self.models.pick(body.get("model")), body

    @fastapi_app.get("/v1/models")
    async def list_models(self) -> Response:
        return JSONResponse(self.models.models(await self.models.weight_versions()))

    # `path`: model names such as "meta-llama/Llama-3.1-8B" hold slashes
    @fastapi_app.get("/v1/models/{model:path}")
    async def model(self, model: str) -> Response:
        return JSONResponse(self.models.model(model))

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        server, body = await self._body(request)
        with server.frontend.observe(request.headers, "/v1/completions"):
            return await server.api.completions(with_request_id(body, request.headers))

    @fastapi_app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        server, body = await self._body(request)
        with server.frontend.observe(request.headers, "/v1/chat/completions"):
            return await server.api.chat(with_request_id(body, request.headers))

    @fastapi_app.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        server, body = await self._body(request)
        with server.frontend.observe(request.headers, "/v1/embeddings"):
            return await server.api.embeddings(body)

    # --- the Files and Batch APIs (router/ingress/files.py, batches.py) ---------------------
    @fastapi_app.post("/v1/files")
    async def upload_file(self, request: Request) -> Response:
        owner = self.server.tenant_of(request.headers).name
        ctype = request.headers.get("content-type", "")
        if not ctype.lower().startswith("multipart/form-data"):
            raise UnsupportedMediaTypeError(f"Content-Type must be multipart/form-data; got {ctype!r}",
                                            "content-type")
        limit = self.files.max_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit + (64 << 10):
            raise PayloadTooLargeError(f"the upload is {declared} bytes; files may hold {limit} "
                                       f"(serving.max_file_bytes)", "file")
        form = await request.form(max_files=1, max_fields=8)
        upload, purpose = form.get("file"), form.get("purpose")
        if upload is None or isinstance(upload, str):
            raise InvalidRequestError("file must be a file part of the form", "file")
        expiry = None
        if "expires_after[anchor]" in form or "expires_after[seconds]" in form:   # how clients send it
            expiry = expiry_seconds({k: form.get(f"expires_after[{k}]") for k in ("anchor", "seconds")},
                                    "expires_after")
        data = await upload.read(limit + 1)
        return JSONResponse(self.files.create(upload.filename or "upload", str(purpose), data, owner, expiry))

    @fastapi_app.get("/v1/files")
    async def list_files(self, request: Request) -> Response:
        q = request.query_params
        return JSONResponse(self.files.list(self.server.tenant_of(request.headers).name, q.get("purpose"),
                                            _int_param(q, "limit", 10000), q.get("after"),
                                            q.get("order", "desc")))

    @fastapi_app.get("/v1/files/{file_id}")
    async def get_file(self, file_id: str, request: Request) -> Response:
        return JSONResponse(self.files.get(file_id, self.server.tenant_of(request.headers).name))

    @fastapi_app.get("/v1/files/{file_id}/content")
    async def file_content(self, file_id: str, request: Request) -> Response:
        path = self.files.content_path(file_id, self.server.tenant_of(request.headers).name)
        return FileResponse(path, media_type="application/octet-stream")

    @fastapi_app.delete("/v1/files/{file_id}")
    async def delete_file(self, file_id: str, request: Request) -> Response:
        return JSONResponse(self.files.delete(file_id, self.server.tenant_of(request.headers).name))

    @fastapi_app.post("/v1/batches")
    async def create_batch(self, request: Request) -> Response:
        owner = self.server.tenant_of(request.headers).name
        return JSONResponse(self.batches.create(await self.api.read_json(request), owner))

    @fastapi_app.get("/v1/batches")
    async def list_batches(self, request: Request) -> Response:
        q = request.query_params
        return JSONResponse(self.batches.list(self.server.tenant_of(request.headers).name,
                                              _int_param(q, "limit", 20), q.get("after")))

    @fastapi_app.get("/v1/batches/{batch_id}")
    async def get_batch(self, batch_id: str, request: Request) -> Response:
        return JSONResponse(self.batches.get(batch_id, self.server.tenant_of(request.headers).name))

    @fastapi_app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(self, batch_id: str, request: Request) -> Response:
        return JSONResponse(self.batches.cancel(batch_id, self.server.tenant_of(request.headers).name))

    @fastapi_app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        server, body = await self._body(request)
        with server.frontend.observe(request.headers, "/v1/responses"):
            return await server.responses.create(body)

    @fastapi_app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        return PlainTextResponse(self.models.load_adapter(await self.api.read_json(request)))

    @fastapi_app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        return PlainTextResponse(self.models.unload_adapter(await self.api.read_json(request)))

    # --- sleep mode (vLLM's endpoints; `model` names one of several; router/ingress/cold_model.py) ---
    @fastapi_app.post("/sleep")
    async def sleep(self, request: Request) -> Response:
        q = request.query_params
        level = q.get("level", "1")
        if level not in ("1", "2"):
            raise InvalidRequestError(f"level must be 1 or 2; got {level!r}", "level")
        server = self.models.pick(q.get("model"))
        out = await server.frontend.cold.sleep(int(level))
        return JSONResponse({"model": server.name, "is_sleeping": True, **out})

    @fastapi_app.post("/wake_up")
    async def wake_up(self, request: Request) -> Response:
        server = self.models.pick(request.query_params.get("model"))
        return JSONResponse({"model": server.name, "is_sleeping": False, **await server.frontend.cold.wake()})

    @fastapi_app.get("/is_sleeping")
    async def is_sleeping(self, request: Request) -> Response:
        server = self.models.pick(request.query_params.get("model"))
        return JSONResponse(await server.frontend.cold.is_sleeping())

    # --- a trainer's weight updates, pause and resume (RL: router/ingress/weights_api.py) -----------
    async def _weights(self, request: Request, op: str, args: Callable[[dict], tuple] | None = None,
                       read_body: bool = True) -> Response:
        """ModelWeights' `op` on the model the request names, with `args` read from its JSON body."""
        body = await self.api.read_json(request) if read_body and args is not None else {}
        server = self.models.pick(body.get("model") or request.query_params.get("model"))
        check_enabled(server.frontend.config.serving, request.url.path)
        out = await weights_call(server.frontend.cold.manager(), op, *(args(body) if args is not None else ()),
                                 *adapter_arg(op, body, server.frontend.preparer.adapters))
        return JSONResponse({"model": server.name, **out})

    @fastapi_app.post("/pause")
    async def pause(self, request: Request) -> Response:
        return await self._weights(request, "pause", lambda _: (pause_mode(request.query_params),), read_body=False)

    @fastapi_app.post("/resume")
    async def resume(self, request: Request) -> Response:
        return await self._weights(request, "resume")

    @fastapi_app.get("/get_weight_version")
    async def get_weight_version(self, request: Request) -> Response:
        return await self._weights(request, "state")

    @fastapi_app.get("/weight_update_group_size")
    async def weight_update_group_size(self, request: Request) -> Response:
        return await self._weights(request, "group_size")

    @fastapi_app.post("/init_weights_update_group")
    async def init_weights_update_group(self, request: Request) -> Response:
        return await self._weights(request, "join_group", group_args)

    @fastapi_app.post("/update_weights_from_disk")
    async def update_weights_from_disk(self, request: Request) -> Response:
        return await self._weights(request, "update_from_disk", disk_args)

    @fastapi_app.post("/check_weights")
    async def check_weights(self, request: Request) -> Response:
        return await self._weights(request, "check", check_args)

    @fastapi_app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(self, request: Request) -> Response:
        return await self._weights(request, "update_from_group", distributed_args)

    @fastapi_app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        server, body = await self._body(request)
        return JSONResponse(server.frontend.preparer.tokenize(body))

    @fastapi_app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        server, body = await self._body(request)
        return JSONResponse(server.frontend.preparer.detokenize(body))

    @fastapi_app.get("/health")
    async def health(self) -> Response:
        not_ready = self.models.not_ready()
        if not_ready is not None:
            status, _, reason = not_ready.partition(": ")
            return JSONResponse({"healthy": False, "status": status, "reason": reason}, status_code=503)
        ok, detail = await self.models.health()
        return JSONResponse({"healthy": ok, "status": "ready" if ok else "degraded",
                             **(detail if self.models.several else {"pools": detail})},
                            status_code=200 if ok else 503)

    @fastapi_app.get("/ping")
    @fastapi_app.post("/ping")
    async def ping(self) -> Response:
        return await self.health()

    @fastapi_app.get("/version")
    async def version(self) -> Response:
        return JSONResponse({"version": pdserve_version()})

    @fastapi_app.get("/metrics")
    async def metrics(self) -> Response:
        return PlainTextResponse(await self.models.render_metrics(),
                                 media_type="text/plain; version=0.0.4")

    def observability(self) -> dict:
        """`pdserve status`: what this ingress replica saw (Frontend.observability)."""
        return self.models.observability()

    @fastapi_app.get("/admin/status", include_in_schema=False)        # not OpenAI's API
    async def admin_status(self) -> Response:
        return JSONResponse(await self.models.admin_status())

    @fastapi_app.post("/admin/scale", include_in_schema=False)
    async def admin_scale(self, request: Request) -> Response:
        return JSONResponse(await self.models.admin_scale(await self.api.read_json(request)))

    @fastapi_app.get("/openapi.json")
    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_schema(request.app))

    # --- gRPC (Serve's gRPC proxy calls the methods named like the RPCs) ---------------------
    async def Generate(self, request: Any, grpc_context: Any = None) -> AsyncIterator[Any]:  # noqa: N802
        async with grpc_call(self.server, grpc_context) as metadata:
            server = self.models.pick(request.model or None)
            with server.frontend.observe(dict(metadata), "pdserve.Generation/Generate"):
                async for message in server.grpc.generate(request, metadata):
                    yield message

    async def Tokenize(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        async with grpc_call(self.server, grpc_context) as metadata:
            return self.models.pick(request.model or None).grpc.tokenize(request, metadata)

    async def Models(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        async with grpc_call(self.server, grpc_context) as metadata:
            return self.models.grpc_models(metadata)

    async def Health(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        return await self.models.grpc_health()


def ingress_app(specs: list[IngressSpec], manager_links: list[Callable[[], Any]]) -> Any:
    """The Serve application: the ingress deployment serving these models (one spec each, sharing
    their serving section). `manager_links[i]()` returns the handle of model i's manager (creating
    it on first use), which owns its pools; the launcher (cluster/app.py) hands them over, so that
    this package never imports cluster/."""
    serving = specs[0].serving
    # On the head node where it has room (a resource the spec names decides instead): a replica's
    # 0.1 CPU on a worker node could leave it too small for an engine replica.
    where = {} if serving.ingress_resources else prefer_head_node()
    deployment = serve.deployment(OpenAIIngress, name="openai-ingress", num_replicas=serving.ingress_replicas,
                                  ray_actor_options={"num_cpus": serving.ingress_num_cpus,
                                                     "resources": dict(serving.ingress_resources), **where},
                                  max_ongoing_requests=max(serving.max_in_flight * 2, 100),
                                  graceful_shutdown_timeout_s=serving.ingress_drain_timeout_s)
    return deployment.bind([s.model_dump_json() for s in specs], manager_links)

