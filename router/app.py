"""The OpenAI-compatible HTTP ingress: a Ray Serve deployment wrapping a FastAPI app.

`OpenAIServer` is the plain core (tokenize, validate, route, shape responses); `build_app(config)`
applies Ray Serve to it. Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(both streaming as SSE ending in `data: [DONE]`), POST /tokenize, POST /detokenize, GET /health,
GET /metrics (Prometheus), GET /openapi.json; and, beside HTTP, the gRPC Generation service
(router/grpc_api.py) through Serve's gRPC proxy when `serving.grpc_port` is set.

Every error uses OpenAI's JSON shape `{"error": {"message", "type", "param", "code"}}`: 400 invalid
parameter or body (named; bodies must be JSON objects in UTF-8, nested at most
`protocol.MAX_JSON_DEPTH` deep), 401 bad API key, 404 unknown model or route, 405 wrong method, 413 body too large, 415 a body
that is not `application/json`, 429 too many requests in flight, 500 a request that failed while it
ran, 503 no replica (or still starting). With an API key set, everything but /health needs it
(/metrics too, unless `serving.public_metrics`). Admission is counted by tickets that every exit
path releases (router/admission.py). A client that disconnects aborts its request on the replica,
which frees the request's blocks. The pieces: router/errors.py (HTTPError, error_for),
router/http.py (the FastAPI app: key middleware, FastAPI's own errors, OpenAPI, SSE),
router/protocol.py (request and response records).

Startup: with `serving.wait_for_pools` (the default) the ingress replica is ready to Serve only once
the pools serve, so the app's RUNNING status means ready (RayService upgrades switch on it).
Without it (what `pdserve serve` deploys) the ingress answers at once: while the pools start,
/health is 503 with the reason (and the reason a start failed, once it has), and requests are 503.
"""# No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations at runtime
# (through Serve's class-based ingress) and would take a string "Request" for a query parameter.
import asyncio
import hmac
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError

from cluster.config import ClusterConfig
from engine.outputs import Logprob
from engine.sampling_params import SamplingParams, validate_request
from engine.tokenizer import apply_chat_template, load_tokenizer
from router.admission import Admission, Ticket
from router.errors import HTTPError
from router.grpc_api import GenerationService, grpc_metadata, refuse
from router.http import fastapi_app, guard, openapi_schema, sse_response
from router.metrics import ServingMetrics
from router.pd import PDRouter, RequestRouter
from router.policy import PolicyConfig, RoutingPolicy
from router.protocol import (
    ChatCompletionRequest,
    ChoiceAccumulator,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    UsageCounter,
    new_id,
    now,
    parse_json_object,
    plain_messages,
    validation_message,
)

logger = logging.getLogger(__name__)


class OpenAIServer:
    """Everything the ingress does, independent of how it is deployed."""

    def __init__(self, config: ClusterConfig, replicas: dict[str, Any] | None = None,
                 prefill_replicas: dict[str, Any] | None = None, manager: Any = None) -> None:
        """replicas: the decode pool's actor handles; prefill_replicas: the prefill pool's (only in
        disaggregated mode); manager: the ClusterManager's handle, told about replicas that fail
        and followed for the pools' membership (`follow_membership`). Without replicas the server
        is starting: `attach()` gives it the pools once they are up."""
        self.config = config
        info = config.engine_config("decode").model_info()
        self.vocab_size, self.max_model_len, self.max_num_seqs = info.vocab_size, info.max_model_len, info.max_num_seqs
        self.model_name = config.serving.served_model_name or _default_name(info.model, info.gguf_file)
        self.tokenizer = load_tokenizer(info.model, info.gguf_file)
        self.metrics = ServingMetrics()
        # One policy per pool: a shared one would share round-robin's counter, and with the decode
        # pool routed first on every request, the prefill pick would see every other count only.
        def policy() -> RoutingPolicy:
            return RoutingPolicy(PolicyConfig(config.routing.name, config.routing.load_weight,
                                              config.routing.imbalance_threshold),
                                 info.max_num_seqs)
        self.manager = manager
        report = lambda replica_id: self.manager.report_failure.remote(replica_id)  # noqa: E731
        on_failure = report if manager is not None else None
        decode = RequestRouter("decode", replicas or {}, info.block_size, policy(), self.metrics,
                               config.routing.stats_interval_s, on_failure)
        self.pools: dict[str, RequestRouter] = {"decode": decode}
        self.router: RequestRouter | PDRouter = decode
        if config.mode == "disaggregated":
            prefill = RequestRouter("prefill", prefill_replicas or {}, info.block_size, policy(),
                                    self.metrics, config.routing.stats_interval_s, on_failure)
            self.pools["prefill"] = prefill
            self.router = PDRouter(prefill, decode, self.metrics,
                                   config.disaggregation.min_remote_prefill_tokens)
        self.admission = Admission(config.serving.max_in_flight, lambda n: self.metrics.in_flight.set(n))
        # None once serving; else why not yet ("starting: ...") or why never ("failed: ...").
        self.not_ready: str | None = None if replicas else "starting: the engine pools are loading"
        self.api_key = config.serving.api_key
        env = config.serving.api_key_env
        if env is not None and self.api_key is None:
            self.api_key = os.environ.get(env)
            if not self.api_key:      # fail closed: never serve openly because a Secret is missing
                raise ValueError(f"serving.api_key_env names {env!r}, which is not set in the ingress's "
                                 f"environment")

    def attach(self, manager: Any, pools: dict[str, dict[str, Any]]) -> None:
        """Start serving: the manager and the pools' replicas (pool -> replica id -> handle)."""
        self.manager = manager
        for name, router in self.pools.items():
            router.on_replica_failure = lambda replica_id: self.manager.report_failure.remote(replica_id)
            router.set_replicas(pools.get(name, {}))
        self.router.start()
        self.not_ready = None

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    # --- checks shared by every endpoint -----------------------------------------------------------
    def is_authorized(self, headers: Any) -> bool:
        if self.api_key is None:
            return True
        return hmac.compare_digest(headers.get("authorization", "").encode(), f"Bearer {self.api_key}".encode())

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object; HTTPError 413 / 415 / 400 saying what is wrong with it."""
        ctype = request.headers.get("content-type")
        if ctype is not None:
            mime = ctype.split(";")[0].strip().lower()
            if mime != "application/json" and not mime.endswith("+json"):
                raise HTTPError(415, f"Content-Type must be application/json; got {mime!r}",
                                param="content-type")
        limit = self.config.serving.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HTTPError(413, f"request body is {declared} bytes; the limit is {limit}")
        body = await request.body()
        if len(body) > limit:
            raise HTTPError(413, f"request body is {len(body)} bytes; the limit is {limit}")
        try:
            return parse_json_object(body)
        except ValueError as e:
            raise HTTPError(400, str(e)) from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise HTTPError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                            "not_found_error", "model")

    def parse(self, cls: type, data: dict[str, Any]) -> Any:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            message, param = validation_message(e)
            raise HTTPError(400, message, param=param) from None

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        try:
            return req.to_sampling_params()
        except ValueError as e:
            raise HTTPError(400, str(e)) from None

    def validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        try:
            validate_request(ids, params, self.vocab_size, self.max_model_len, self.max_num_seqs)
        except ValueError as e:
            raise HTTPError(400, str(e), param="prompt") from None

    def admit(self, count: int) -> Ticket:
        """Admit `count` requests: a ticket to release when they end, or HTTPError 503 / 429."""
        if self.not_ready is not None:
            raise HTTPError(503, f"the server is not ready ({self.not_ready})", "service_unavailable")
        if not self.router.replicas:
            raise HTTPError(503, "no engine replica is available", "service_unavailable")
        ticket = self.admission.admit(count)
        if ticket is None:
            raise HTTPError(429, f"{self.in_flight} requests in flight; the limit is "
                                 f"{self.config.serving.max_in_flight}: retry later", "rate_limit_error")
        return ticket

    # --- prompts -----------------------------------------------------------------------------------
    def completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise HTTPError(400, "prompt must not be empty", param="prompt")
        limit = self.config.serving.max_in_flight
        if len(prompts) > limit:
            raise HTTPError(400, f"prompt: a batch may hold at most {limit} prompts (serving.max_in_flight); "
                                 f"got {len(prompts)}", param="prompt")
        out = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise HTTPError(400, "this model has no tokenizer: send token ids", param="prompt")
                out.append(self.tokenizer.encode(p))
            else:
                out.append(list(p))
        return out

    def chat_prompt(self, messages: list[Any]) -> list[int]:
        try:
            return apply_chat_template(self.tokenizer, plain_messages(messages))
        except ValueError as e:
            raise HTTPError(400, str(e), param="messages") from None

    # --- generation --------------------------------------------------------------------------------
    async def run(self, prompts: list[list[int]], params: SamplingParams, request_id: str, ticket: Ticket
                  ) -> AsyncIterator[tuple[int, Any]]:
        """Stream (prompt index, StepDelta) over all prompts of one HTTP request; releases `ticket`
        when it ends, however it ends."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, ids: list[int]) -> None:
            try:
                async for delta in self.router.generate(f"{request_id}-{i}", ids, params):
                    queue.put_nowait((i, delta))
            except Exception as e:  # noqa: BLE001 - surfaced to the consumer below
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(prompts)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield i, item
        finally:
            # Nothing here may come after an await: a cancelled request is cancelled again at each.
            ticket.release()
            for t in tasks:                 # a disconnect cancels the pumps, which abort on the replicas
                t.cancel()

    def count_finished(self, reason: str | None) -> None:
        self.metrics.requests.inc(finished_reason=reason or "abort")

    # --- endpoint bodies ---------------------------------------------------------------------------
    def prepare_completion(self, data: dict[str, Any]
                           ) -> tuple[CompletionRequest, SamplingParams, list[list[int]]]:
        """Validate a completion body (HTTP's, or the one a gRPC GenerateRequest maps to) and
        tokenize its prompts; HTTPError naming the field."""
        req: CompletionRequest = self.parse(CompletionRequest, data)
        self.check_model(req.model)
        params = self.sampling_params(req)
        prompts = self.completion_prompts(req.prompt)
        for ids in prompts:
            self.validate_prompt(ids, params)
        return req, params, prompts

    async def completions(self, data: dict[str, Any]) -> Response:
        req, params, prompts = self.prepare_completion(data)
        ticket = self.admit(len(prompts))
        rid = new_id("cmpl")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return sse_response(self._stream_completion(rid, req, prompts, params, include_usage, ticket), ticket)
        try:
            return JSONResponse(await self._full_completion(rid, req, prompts, params, ticket))
        finally:
            ticket.release()

    async def chat(self, data: dict[str, Any]) -> Response:
        req: ChatCompletionRequest = self.parse(ChatCompletionRequest, data)
        self.check_model(req.model)
        params = self.sampling_params(req)
        ids = self.chat_prompt(req.messages)
        self.validate_prompt(ids, params)
        ticket = self.admit(1)
        rid = new_id("chatcmpl")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return sse_response(self._stream_chat(rid, ids, params, include_usage, req.logprobs, ticket), ticket)
        try:
            return JSONResponse(await self._full_chat(rid, ids, params, req.logprobs, ticket))
        finally:
            ticket.release()

    async def _full_completion(self, rid: str, req: CompletionRequest, prompts: list[list[int]],
                               params: SamplingParams, ticket: Ticket) -> dict[str, Any]:
        n = params.n
        choices = [ChoiceAccumulator() for _ in range(len(prompts) * n)]
        usage = UsageCounter()
        async for i, delta in self.run(prompts, params, rid, ticket):
            usage.add(delta)
            for c in delta.choices:
                choices[i * n + c.index].add(c)
        out = []
        for idx, acc in enumerate(choices):
            text = acc.text
            if req.echo:
                text = self.tokenizer.decode(prompts[idx // n]) + text
            self.count_finished(acc.finish_reason)
            out.append({"index": idx, "text": text, "finish_reason": acc.finish_reason,
                        "stop_reason": acc.stop_reason,
                        "logprobs": self._completion_logprobs(acc.token_ids, acc.logprobs)
                        if params.logprobs is not None else None})
        return {"id": rid, "object": "text_completion", "created": now(), "model": self.model_name,
                "choices": out, "usage": usage.body(sum(len(p) for p in prompts))}

    async def _stream_completion(self, rid: str, req: CompletionRequest, prompts: list[list[int]],
                                 params: SamplingParams, include_usage: bool, ticket: Ticket
                                 ) -> AsyncIterator[dict]:
        n = params.n
        created = now()
        usage = UsageCounter()
        async for i, delta in self.run(prompts, params, rid, ticket):
            usage.add(delta)
            for c in delta.choices:
                if c.finish_reason is not None:
                    self.count_finished(c.finish_reason)
                yield {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                       "choices": [{"index": i * n + c.index, "text": c.text, "finish_reason": c.finish_reason,
                                    "stop_reason": c.stop_reason,
                                    "logprobs": self._completion_logprobs(c.token_ids, c.logprobs)
                                    if params.logprobs is not None else None}]}
        if include_usage:
            yield {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": [], "usage": usage.body(sum(len(p) for p in prompts))}

    async def _full_chat(self, rid: str, ids: list[int], params: SamplingParams, logprobs: bool,
                         ticket: Ticket) -> dict[str, Any]:
        choices = [ChoiceAccumulator() for _ in range(params.n)]
        usage = UsageCounter()
        async for _, delta in self.run([ids], params, rid, ticket):
            usage.add(delta)
            for c in delta.choices:
                choices[c.index].add(c)
        out = []
        for idx, acc in enumerate(choices):
            self.count_finished(acc.finish_reason)
            out.append({"index": idx, "message": {"role": "assistant", "content": acc.text},
                        "finish_reason": acc.finish_reason, "stop_reason": acc.stop_reason,
                        "logprobs": self._chat_logprobs(acc.token_ids, acc.logprobs, params.logprobs or 0)
                        if logprobs else None})
        return {"id": rid, "object": "chat.completion", "created": now(), "model": self.model_name,
                "choices": out, "usage": usage.body(len(ids))}

    async def _stream_chat(self, rid: str, ids: list[int], params: SamplingParams, include_usage: bool,
                           logprobs: bool, ticket: Ticket) -> AsyncIterator[dict]:
        created = now()
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        usage = UsageCounter()
        started: set[int] = set()       # choices whose role went out: with their first token, as vLLM
        async for _, delta in self.run([ids], params, rid, ticket):
            usage.add(delta)
            for c in delta.choices:
                if c.finish_reason is not None:
                    self.count_finished(c.finish_reason)
                message: dict[str, Any] = {"content": c.text} if c.text or c.finish_reason is None else {}
                if c.index not in started:
                    started.add(c.index)
                    message = {"role": "assistant", "content": c.text}
                yield {**base, "choices": [{
                    "index": c.index, "delta": message,
                    "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, params.logprobs or 0)
                    if logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
        if include_usage:
            yield {**base, "choices": [], "usage": usage.body(len(ids))}

    # --- logprobs shapes ---------------------------------------------------------------------------
    def _token_text(self, token_id: int, lp: Logprob | None = None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None
                             ) -> dict[str, Any]:
        logprobs = logprobs or []
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for tid, entry in zip(token_ids, logprobs):
            text = self._token_text(tid, entry.get(tid))
            tokens.append(text)
            token_lps.append(entry[tid].logprob if tid in entry else None)
            tops.append({self._token_text(t, lp): lp.logprob for t, lp in entry.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
                       num_top: int) -> dict[str, Any]:
        """OpenAI chat shape: the chosen token's logprob and the `num_top` most likely tokens."""
        content = []
        for tid, entry in zip(token_ids, logprobs or []):
            text = self._token_text(tid, entry.get(tid))
            chosen = entry.get(tid)
            top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:num_top]
            content.append({
                "token": text, "logprob": chosen.logprob if chosen else None, "bytes": list(text.encode()),
                "top_logprobs": [{"token": self._token_text(t, lp), "logprob": lp.logprob,
                                  "bytes": list(self._token_text(t, lp).encode())} for t, lp in top]})
        return {"content": content}

    # --- small endpoints ---------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": now(),
                                            "owned_by": "pdserve", "max_model_len": self.max_model_len}]}

    def tokenize(self, data: dict[str, Any]) -> dict[str, Any]:
        req: TokenizeRequest = self.parse(TokenizeRequest, data)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise HTTPError(400, "give exactly one of prompt or messages", param="prompt")
        if self.tokenizer is None:
            raise HTTPError(400, "this model has no tokenizer")
        if req.prompt is not None:
            tokens = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            tokens = self.chat_prompt(req.messages)
        return {"tokens": list(tokens), "count": len(tokens), "max_model_len": self.max_model_len}

    def detokenize(self, data: dict[str, Any]) -> dict[str, Any]:
        req: DetokenizeRequest = self.parse(DetokenizeRequest, data)
        self.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise HTTPError(400, f"tokens must be integers in [0, {self.vocab_size}); got {bad[:5]}", param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    async def health(self) -> tuple[bool, dict[str, dict[str, bool]]]:
        """Ready when every pool has at least one healthy replica; pool -> replica id -> healthy."""
        stats = await self.router.refresh_stats()
        detail = {name: {r: bool(stats.get(r, {}).get("healthy", False)) and r not in pool.down
                         for r in pool.replicas} for name, pool in self.pools.items()}
        return all(any(replicas.values()) for replicas in detail.values()), detail

    async def follow_membership(self) -> None:
        """Keep each pool's router in line with the manager's pools (long poll): replicas dropped
        for failing health checks leave, replacements join."""
        version = -1
        while True:
            try:
                version, pools = await self.manager.membership.remote(version, 5.0)
            except Exception:
                logger.exception("following the pools' membership failed")
                await asyncio.sleep(1.0)
                continue
            for name, replicas in pools.items():
                if name in self.pools:
                    self.pools[name].set_replicas(replicas)

    async def render_metrics(self) -> str:
        await self.router.refresh_stats()
        return self.metrics.render()


def _default_name(model: str, gguf_file: str | None) -> str:
    if gguf_file:
        return gguf_file.removesuffix(".gguf")
    return os.path.basename(os.path.normpath(model))


# --- Ray Serve wiring ------------------------------------------------------------------------------
def build_app(config: ClusterConfig) -> Any:
    """The Serve application: the ingress deployment bound to this cluster config."""
    from ray import serve  # noqa: PLC0415

    @serve.deployment(name="openai-ingress", num_replicas=config.serving.ingress_replicas,
                      ray_actor_options={"num_cpus": config.serving.ingress_num_cpus},
                      max_ongoing_requests=max(config.serving.max_in_flight * 2, 100))
    @serve.ingress(fastapi_app)
    class OpenAIIngress:
        async def __init__(self, config_json: str) -> None:
            # The pools come up in the background; with serving.wait_for_pools this replica is ready
            # (to Serve) only once they serve, else it answers at once (/health says why not ready).
            from engine.ray_cluster import keep_serve_replica_on_loopback  # noqa: PLC0415

            keep_serve_replica_on_loopback()
            cfg = ClusterConfig.model_validate_json(config_json)
            self.server = OpenAIServer(cfg)
            fastapi_app.state.server = self.server
            self._membership: asyncio.Task | None = None
            self._startup = asyncio.get_running_loop().create_task(self._start(cfg))
            if cfg.serving.wait_for_pools:
                await self._startup
                if self.server.not_ready is not None:
                    raise RuntimeError(f"the engine pools did not start: {self.server.not_ready}")

        async def _start(self, cfg: ClusterConfig) -> None:
            from cluster.manager import get_or_create_manager  # noqa: PLC0415

            try:
                manager = get_or_create_manager(cfg)
                await manager.ready.remote()
                _, pools = await manager.membership.remote()
            except Exception as e:  # noqa: BLE001 - reported by /health
                cause = getattr(e, "cause", None) or e
                self.server.not_ready = f"failed: {cause}"
                logger.error("the engine pools failed to start: %s", cause)
                return
            self.server.attach(manager, pools)
            self._membership = asyncio.get_running_loop().create_task(self.server.follow_membership())

        @fastapi_app.get("/v1/models")
        async def models(self, request: Request) -> Response:
            async def handler() -> Response:
                return JSONResponse(self.server.models())
            return await guard(self.server, request, handler, body=False)

        @fastapi_app.post("/v1/completions")
        async def completions(self, request: Request) -> Response:
            return await guard(self.server, request, self.server.completions)

        @fastapi_app.post("/v1/chat/completions")
        async def chat(self, request: Request) -> Response:
            return await guard(self.server, request, self.server.chat)

        @fastapi_app.post("/tokenize")
        async def tokenize(self, request: Request) -> Response:
            async def handler(data: dict) -> Response:
                return JSONResponse(self.server.tokenize(data))
            return await guard(self.server, request, handler)

        @fastapi_app.post("/detokenize")
        async def detokenize(self, request: Request) -> Response:
            async def handler(data: dict) -> Response:
                return JSONResponse(self.server.detokenize(data))
            return await guard(self.server, request, handler)

        @fastapi_app.get("/health")
        async def health(self) -> Response:
            if self.server.not_ready is not None:
                status, _, reason = self.server.not_ready.partition(": ")
                return JSONResponse({"healthy": False, "status": status, "reason": reason}, status_code=503)
            ok, pools = await self.server.health()
            return JSONResponse({"healthy": ok, "status": "ready" if ok else "degraded", "pools": pools},
                                status_code=200 if ok else 503)

        @fastapi_app.get("/metrics")
        async def metrics(self) -> Response:
            return PlainTextResponse(await self.server.render_metrics(),
                                     media_type="text/plain; version=0.0.4")

        @fastapi_app.get("/openapi.json")
        async def openapi(self, request: Request) -> Response:
            return JSONResponse(openapi_schema(request.app))

        # --- gRPC (Serve's gRPC proxy calls the methods named like the RPCs) ---------------------
        async def Generate(self, request: Any, grpc_context: Any = None) -> AsyncIterator[Any]:  # noqa: N802
            service = GenerationService(self.server)
            try:
                async for message in service.generate(request, grpc_metadata(grpc_context)):
                    yield message
            except Exception as e:
                raise refuse(self.server, grpc_context, e) from None

        async def Tokenize(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
            try:
                return GenerationService(self.server).tokenize(request, grpc_metadata(grpc_context))
            except Exception as e:
                raise refuse(self.server, grpc_context, e) from None

        async def Models(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
            try:
                return GenerationService(self.server).models(grpc_metadata(grpc_context))
            except Exception as e:
                raise refuse(self.server, grpc_context, e) from None

        async def Health(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
            return await GenerationService(self.server).health()

    return OpenAIIngress.bind(config.model_dump_json())
