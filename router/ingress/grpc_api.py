"""The gRPC Generation service (pdserve_proto/pdserve.proto) on the same frontend as HTTP.

`GenerationService` is the plain core over the protocol-neutral frontend (router/ingress/frontend.py): it
turns a GenerateRequest into the body of a POST /v1/completions (so validation, tokenization,
admission, routing and metrics are the HTTP path's, not a copy) and the router's StepDeltas into
GenerateResponse messages. The Serve ingress
deployment (router/ingress/app.py) exposes it as methods named like the RPCs; Serve's gRPC proxy
(`gRPCOptions(grpc_servicer_functions=["pdserve_proto.serve_proxy.add_GenerationServicer_to_server"])`) calls
them, so HTTP and gRPC clients share one router, its pools and its metrics.

Errors answer with their own `grpc_code` (records/errors.py): INVALID_ARGUMENT (details name the
field), UNAUTHENTICATED (send `authorization: Bearer <key>` metadata when the server has an API
key), NOT_FOUND (model), RESOURCE_EXHAUSTED (too many requests in flight), UNAVAILABLE (starting,
no replica), INTERNAL. A cancelled call cancels the replica-side generator,
which aborts the request on its engine replica (freeing its blocks), exactly like an HTTP
disconnect.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc

from pdserve_proto import pb2
from records.errors import PDServeError
from router.ingress.frontend import Frontend, served_error
from router.ingress.replies import UsageCounter, new_id

logger = logging.getLogger(__name__)

# SamplingOptions fields that are `optional` scalars (copied when set) and repeated ones (when non-empty).
_SCALARS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "min_tokens",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "n",
            "skip_special_tokens", "include_stop_str_in_output", "priority")
_REPEATED = ("stop", "stop_token_ids")


def _structured(message: Any) -> dict[str, Any]:
    """A StructuredOutputs message as the HTTP API's `structured_outputs` object."""
    which = message.WhichOneof("constraint")
    if which is None:
        return {}                       # refused by the validation, naming structured_outputs
    if which == "json_schema":
        return {"json": message.json_schema}
    if which == "choice":
        return {"choice": list(message.choice.choices)}
    return {which: getattr(message, which)}


def grpc_status(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, details) for an ingress error; details name the offending field."""
    err: PDServeError = served_error(error)
    message = err.message
    if err.param and not message.startswith(err.param):
        message = f"{err.param}: {message}"
    return grpc.StatusCode[err.grpc_code], message


class GenerationService:
    def __init__(self, server: Frontend) -> None:
        self.server = server

    # --- shared checks -----------------------------------------------------------------------------
    def check_auth(self, metadata: Sequence[tuple[str, Any]]) -> None:
        """UNAUTHENTICATED unless metadata carries `authorization: Bearer <key>` (when a key is set)."""
        sent = next((str(v) for k, v in metadata if k.lower() == "authorization"), "")
        self.server.check_key(sent, "metadata authorization: Bearer <key>")

    def completion_body(self, request: Any) -> dict[str, Any]:
        """The POST /v1/completions body equivalent to a GenerateRequest (unset fields omitted, so
        the HTTP path's defaults and validation apply)."""
        body: dict[str, Any] = {"model": request.model or self.server.preparer.model_name}
        which = request.WhichOneof("prompt")
        if which == "text":
            body["prompt"] = request.text
        elif which == "token_ids":
            body["prompt"] = list(request.token_ids.ids)
        s = request.sampling
        for name in _SCALARS:
            if s.HasField(name):
                body[name] = getattr(s, name)
        for name in _REPEATED:
            if len(getattr(s, name)):
                body[name] = list(getattr(s, name))
        if s.HasField("structured_outputs"):
            body["structured_outputs"] = _structured(s.structured_outputs)
        return body

    # --- RPCs --------------------------------------------------------------------------------------
    async def generate(self, request: Any, metadata: Sequence[tuple[str, Any]]) -> AsyncIterator[Any]:
        """Stream GenerateResponses: one per engine step per choice, then one carrying usage.
        Raises a PDServeError (see `grpc_status`) before the first message when the request is
        refused."""
        server = self.server
        self.check_auth(metadata)
        prep = await server.preparer.prepare_completion(self.completion_body(request))
        params, prompts = prep.params, prep.prompts
        ticket = await server.admit(prompts, params)
        rid = new_id("cmpl")
        n = params.n
        usage = UsageCounter()
        async for i, delta in server.run(prompts, params, rid, ticket):
            usage.add(delta)
            for c in delta.choices:
                if c.finish_reason is not None:
                    server.count_finished(c.finish_reason)
                yield pb2.GenerateResponse(
                    id=rid, index=i * n + c.index, token_ids=c.token_ids, text=c.text,
                    logprobs=self._logprobs(c.token_ids, c.logprobs) if params.logprobs is not None else (),
                    finish_reason=c.finish_reason or "",
                    stop_reason="" if c.stop_reason is None else str(c.stop_reason),
                    weight_version=delta.weight_version or "")
        yield pb2.GenerateResponse(id=rid, index=-1, usage=pb2.Usage(
            prompt_tokens=sum(len(p) for p in prompts), completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens))

    def tokenize(self, request: Any, metadata: Sequence[tuple[str, Any]]) -> Any:
        self.check_auth(metadata)
        body: dict[str, Any] = {"model": request.model or None, "prompt": request.text}
        if request.HasField("add_special_tokens"):
            body["add_special_tokens"] = request.add_special_tokens
        out = self.server.preparer.tokenize(body)
        return pb2.TokenizeResponse(tokens=out["tokens"], count=out["count"], max_model_len=out["max_model_len"])

    def models(self, metadata: Sequence[tuple[str, Any]]) -> Any:
        self.check_auth(metadata)
        return pb2.ModelsResponse(models=[pb2.ModelCard(id=m["id"], owned_by=m["owned_by"],
                                                        max_model_len=m["max_model_len"])
                                          for m in self.server.preparer.models()["data"]])

    async def health(self) -> Any:
        if self.server.not_ready is not None:
            return pb2.HealthResponse(healthy=False)
        ok, pools = await self.server.health()
        return pb2.HealthResponse(healthy=ok, pools={name: pb2.PoolHealth(replicas=replicas)
                                                     for name, replicas in pools.items()})

    def _logprobs(self, token_ids: list[int], logprobs: list[dict] | None) -> list[Any]:
        out = []
        text = self.server.preparer.token_text
        for tid, entry in zip(token_ids, logprobs or []):
            chosen = entry.get(tid)
            top = entry.items()                 # (ranked by the engine)
            out.append(pb2.TokenLogprob(
                token_id=tid, logprob=chosen.logprob if chosen else 0.0, token=text(tid, chosen),
                top=[pb2.TopLogprob(token_id=t, logprob=lp.logprob, token=text(t, lp)) for t, lp in top]))
        return out



# --- the ingress deployment's gRPC methods (router/ingress/app.py) call these -----------------------------
def grpc_metadata(grpc_context: Any) -> list[tuple[str, Any]]:
    return list(grpc_context.invocation_metadata()) if grpc_context is not None else []


class GRPCRefusal(RuntimeError):
    """What a gRPC method raises after setting its status code (one string argument, so that it
    pickles back to Serve's proxy, which keeps the code set on the context before the raise)."""


def refuse(server: Frontend, grpc_context: Any, error: BaseException) -> GRPCRefusal:
    """Set the status code for `error` on the call; the exception to raise."""
    code, details = grpc_status(error)
    server.metrics.requests.errors.inc(code=f"grpc_{code.name.lower()}")
    if code.name == "INTERNAL":
        logger.exception("gRPC call failed")
    if grpc_context is not None:
        grpc_context.set_code(code)
        grpc_context.set_details(details)
    return GRPCRefusal(details)


@asynccontextmanager
async def grpc_call(server: Frontend, grpc_context: Any) -> AsyncIterator[list[tuple[str, Any]]]:
    """Around one RPC of the ingress deployment: yields the call's metadata; a failure sets the
    call's status code and raises GRPCRefusal (a cancelled call passes through untouched)."""
    try:
        yield grpc_metadata(grpc_context)
    except Exception as e:  # noqa: BLE001 - every failure answers with a status code
        raise refuse(server, grpc_context, e) from None


__all__ = ["GRPCRefusal", "GenerationService", "grpc_call", "grpc_metadata", "grpc_status", "refuse"]
