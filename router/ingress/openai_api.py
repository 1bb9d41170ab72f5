"""The OpenAI-compatible HTTP API over the frontend: request bodies read with their limits,
completions and chat completions answered whole or streamed (SSE: the role goes out with the first
token, as vLLM does; usage last when asked, or in every chunk with vLLM's continuous_usage_stats),
their ids (vLLM's request_id). Logprobs are written by router/ingress/logprob_shapes.py.
Validation, admission, routing and metrics are the frontend's (router/ingress/frontend.py), shared
with gRPC; the Responses API is router/ingress/responses_api.py.
"""
# No `from __future__ import annotations`: FastAPI reads annotations at runtime.
import base64
import dataclasses
import json
import math
import struct
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from engine.text.reasoning import ReasoningStream, split_reasoning
from engine.text.tool_calls import ToolFormat
from engine.text.tool_parser import ToolCallStream, coalesce, read_through
from records.deltas import StepDelta
from records.errors import (
    AuthenticationError,
    ClientClosedError,
    InvalidRequestError,
    PayloadTooLargeError,
    RequestFailedError,
    UnsupportedMediaTypeError,
)
from records.sampling_params import SamplingParams
from records.serving import BATCH_BAND
from router.ingress.admission import Ticket
from router.ingress.frontend import BAND, TENANT, Frontend, served_error
from router.ingress.http import sse_response
from router.ingress.logprob_shapes import LogprobShapes
from router.ingress.protocol import ChatCompletionRequest, CompletionRequest
from router.ingress.replies import ChoiceAccumulator, UsageCounter, error_body, new_id, now
from router.ingress.request_body import parse_json_object


class OpenAIAPI:
    """The HTTP endpoints' bodies: JSON in, JSON or an SSE stream out."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.preparer = frontend.preparer

    @property
    def model_name(self) -> str:
        return self.preparer.model_name

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object; PayloadTooLargeError, UnsupportedMediaTypeError or
        InvalidRequestError saying what is wrong with it."""
        ctype = request.headers.get("content-type")
        if ctype is not None:
            mime = ctype.split(";")[0].strip().lower()
            if mime != "application/json" and not mime.endswith("+json"):
                raise UnsupportedMediaTypeError(f"Content-Type must be application/json; got {mime!r}",
                                                "content-type")
        limit = self.frontend.config.serving.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLargeError(f"request body is {declared} bytes; the limit is {limit}")
        try:
            body = await request.body()
        except ClientDisconnect:
            raise ClientClosedError("the client closed the connection before its body arrived") from None
        if len(body) > limit:
            raise PayloadTooLargeError(f"request body is {len(body)} bytes; the limit is {limit}")
        try:
            return parse_json_object(body)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None

    async def completions(self, data: dict[str, Any]) -> Response:
        prep = await self.preparer.prepare_completion(data)
        req, params, prompts = prep.request, prep.params, prep.prompts
        echo = self._echo_texts(req, prompts) if req.echo else None
        ticket = await self.frontend.admit(prompts, params)
        rids = _request_ids("cmpl", req)
        if params.use_beam_search:
            return JSONResponse(await self._beams(rids, req, "text_completion", prompts, params, ticket, echo))
        if req.stream:
            return sse_response(self._stream_completion(rids, req, prompts, echo, params, ticket), ticket)
        try:
            return JSONResponse(await self._full_completion(rids, req, prompts, echo, params, ticket))
        finally:
            ticket.release()

    async def chat(self, data: dict[str, Any]) -> Response:
        prep = await self.preparer.prepare_chat(data)
        req, params, ids, tools = prep.request, prep.params, prep.prompts[0], prep.tool_format
        thinking = self.preparer.thinking(req)
        if params.use_beam_search and tools is not None:
            raise InvalidRequestError("tools are not supported with use_beam_search", param="tools")
        ticket = await self.frontend.admit([ids], params)
        rids = _request_ids("chatcmpl", req)
        if params.use_beam_search:
            return JSONResponse(await self._beams(rids, req, "chat.completion", [ids], params, ticket))
        if req.stream:
            return sse_response(self._stream_chat(rids, req, ids, params, tools, ticket, thinking, prep.images), ticket)
        try:
            return JSONResponse(await self._full_chat(rids, req, ids, params, tools, ticket, thinking, prep.images))
        finally:
            ticket.release()

    async def embeddings(self, data: dict[str, Any]) -> Response:
        """/v1/embeddings: each input's vector (floats, or base64 of little-endian float32 as the
        `openai` client asks by default), truncated to `dimensions` (and normalized again) where the
        model allows it."""
        prep = self.preparer.prepare_embedding(data)
        return JSONResponse(await self.embed(prep, await self.frontend.admit(prep.prompts, prep.params)))

    async def embed(self, prep: Any, ticket: Ticket) -> dict[str, Any]:
        """The embeddings response body of an admitted, prepared embeddings request."""
        req, params, prompts = prep.request, prep.params, prep.prompts
        vectors: list[list[float] | None] = [None] * len(prompts)
        try:
            async for i, delta in self.frontend.run(prompts, params, new_id("embd"), ticket):
                if delta.embedding is not None:
                    vectors[i] = delta.embedding
        finally:
            ticket.release()
        out = []
        for i, vector in enumerate(vectors):
            if vector is None:
                raise RequestFailedError(f"input {i} ended without its embedding")
            if req.dimensions is not None and req.dimensions < len(vector):
                vector = vector[:req.dimensions]
                if params.normalize:
                    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
                    vector = [v / norm for v in vector]
            body: Any = vector
            if req.encoding_format == "base64":
                body = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
            out.append({"object": "embedding", "index": i, "embedding": body})
            self.frontend.count_finished("stop")
        tokens = sum(len(p) for p in prompts)
        return {"object": "list", "data": out, "model": self.preparer.response_model(params),
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def execute(self, url: str, body: dict[str, Any], owner: str) -> tuple[int, dict[str, Any]]:
        """One request of a batch (router/ingress/batches.py): the endpoint's own code, under the
        batch's owner and in the Batch band; (HTTP status, response or error body)."""
        tenant = self.frontend.tenants.by_name.get(owner)
        tokens = (TENANT.set(tenant), BAND.set(BATCH_BAND))
        try:
            if tenant is None:
                raise AuthenticationError(f"the tenant {owner!r} that created this batch is no longer configured")
            call = {"/v1/chat/completions": self.chat, "/v1/completions": self.completions,
                    "/v1/embeddings": self.embeddings}[url]
            response = await call(dict(body, stream=False) if url != "/v1/embeddings" else body)
            return response.status_code, json.loads(response.body)
        except Exception as e:  # noqa: BLE001 - every failure is that line's error, in its file
            err = served_error(e)
            self.frontend.metrics.requests.errors.inc(code=str(err.status))
            return err.status, error_body(err.message, err.err_type, err.status, err.param)
        finally:
            TENANT.reset(tokens[0])
            BAND.reset(tokens[1])

    def _shapes(self, req: Any) -> LogprobShapes:
        return LogprobShapes(self.preparer.token_text, req.return_tokens_as_token_ids)

    async def _beams(self, rids: tuple[str, str], req: Any, kind: str, prompts: list[list[int]],
                     params: SamplingParams, ticket: Ticket, echo: list[str] | None = None) -> dict[str, Any]:
        """A beam search's response (engine/beam_search.py): the best n beams of each prompt, best
        first, as the choices of a completion or a chat completion. `rids`: _request_ids'."""
        (rid, engine_id), shapes = rids, self._shapes(req)
        results = await self.frontend.beam_search(prompts, params, engine_id, ticket)
        tokenizer, choices, generated = self.preparer.tokenizer, [], 0
        for p, beams in enumerate(results):
            for beam in beams:
                text = tokenizer.decode(beam.token_ids, skip_special_tokens=params.skip_special_tokens)
                generated += len(beam.token_ids)
                self.frontend.count_finished(beam.finish_reason)
                stop = beam.token_ids[-1] if beam.finish_reason == "stop" else None
                choice: dict[str, Any] = {"index": len(choices), "finish_reason": beam.finish_reason,
                                          "stop_reason": stop, "logprobs": None}
                if kind == "chat.completion":
                    choice["message"] = {"role": "assistant", "content": text}
                    if beam.logprobs is not None:
                        choice["logprobs"] = shapes.chat(beam.token_ids, beam.logprobs, params.logprobs or 0)
                else:
                    choice["text"] = text if echo is None else echo[p] + text
                    if beam.logprobs is not None:
                        choice["logprobs"] = shapes.completion(beam.token_ids, beam.logprobs)
                choices.append(choice)
        num_prompt = sum(len(p) for p in prompts)
        return {"id": rid, "object": kind, "created": now(), "model": self.preparer.response_model(params),
                "choices": choices, "usage": {"prompt_tokens": num_prompt, "completion_tokens": generated,
                                              "total_tokens": num_prompt + generated}}

    def _echo_texts(self, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """Each prompt as `echo` puts it before its completions: the text sent, or the ids decoded
        (always when truncate_prompt_tokens may have cut the text)."""
        if req.truncate_prompt_tokens is None and isinstance(req.prompt, str):
            return [req.prompt]
        if req.truncate_prompt_tokens is None and req.prompt and isinstance(req.prompt[0], str):
            return list(req.prompt)
        if self.preparer.tokenizer is None:
            raise InvalidRequestError("echo of token-id prompts needs the tokenizer, which this server does not load",
                                      param="echo")
        return [self.preparer.tokenizer.decode(ids) for ids in prompts]

    async def _full_completion(self, rids: tuple[str, str], req: CompletionRequest, prompts: list[list[int]],
                               echo: list[str] | None, params: SamplingParams, ticket: Ticket) -> dict[str, Any]:
        """The whole completion; with the request's `prompt_logprobs` (vLLM's) each choice carries its
        prompt's, with `return_token_ids` (vLLM's) its prompt's and its own token ids."""
        (rid, engine_id), n, shapes = rids, params.n, self._shapes(req)
        choices = [ChoiceAccumulator() for _ in range(len(prompts) * n)]
        prompt_lps: list[list] = [[] for _ in prompts]      # echo with logprobs: the prompts' own
        usage = UsageCounter()
        async for i, delta in self.frontend.run(prompts, params, engine_id, ticket, response_id=rid):
            delta = _prompt_only(delta) if req.echo_only else delta
            usage.add(delta)
            prompt_lps[i] += delta.prompt_logprobs or []
            for c in delta.choices:
                choices[i * n + c.index].add(c, delta.weight_version)
        out = []
        for idx, acc in enumerate(choices):
            p = idx // n
            self.frontend.count_finished(acc.finish_reason)
            out.append({"index": idx, "text": acc.text if echo is None else echo[p] + acc.text,
                        "finish_reason": acc.finish_reason, "stop_reason": acc.stop_reason,
                        "logprobs": shapes.completion(acc.token_ids, acc.logprobs,
                                                      *(() if echo is None else (prompts[p], prompt_lps[p])))
                        if params.logprobs is not None else None, "weight_versions": acc.weight_versions})
            if req.prompt_logprobs is not None:
                out[-1]["prompt_logprobs"] = shapes.prompt(prompt_lps[p], params.prompt_logprobs)
            if req.return_token_ids:
                out[-1].update(prompt_token_ids=prompts[p], token_ids=acc.token_ids)
        return {"id": rid, "object": "text_completion", "created": now(), "model": self.preparer.response_model(params),
                "choices": out, "usage": usage.body(sum(len(p) for p in prompts)),
                "weight_version": usage.weight_version}

    async def _stream_completion(self, rids: tuple[str, str], req: CompletionRequest, prompts: list[list[int]],
                                 echo: list[str] | None, params: SamplingParams, ticket: Ticket) -> AsyncIterator[dict]:
        (rid, engine_id), n, options, shapes = rids, params.n, req.stream_options, self._shapes(req)
        created, model = now(), self.preparer.response_model(params)
        usage = UsageCounter()
        num_prompt = sum(len(p) for p in prompts)
        per_chunk = options is not None and options.usage_per_chunk()
        prompt_lps: list[list] = [[] for _ in prompts]
        started: set[int] = set()       # the choices whose first chunk (the echo, the prompt's ids) went out
        async for i, delta in self.frontend.run(prompts, params, engine_id, ticket, response_id=rid):
            delta = _prompt_only(delta) if req.echo_only else delta
            usage.add(delta)
            prompt_lps[i] += delta.prompt_logprobs or []
            for c in delta.choices:
                if c.finish_reason is not None:
                    self.frontend.count_finished(c.finish_reason)
                idx, text, prompt = i * n + c.index, c.text, ()
                first = idx not in started
                started.add(idx)
                if echo is not None and first:
                    # A choice's first delta comes with or after the prompt's last logprobs.
                    text, prompt = echo[i] + text, (prompts[i], prompt_lps[i])
                choice = {"index": idx, "text": text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                          "logprobs": shapes.completion(c.token_ids, c.logprobs, *prompt)
                          if params.logprobs is not None else None}
                if req.return_token_ids:
                    choice.update({"prompt_token_ids": prompts[i]} if first else {}, token_ids=c.token_ids)
                chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": [choice], "weight_version": delta.weight_version}
                yield {**chunk, "usage": usage.body(num_prompt)} if per_chunk else chunk
        if options is not None and options.include_usage:
            yield {"id": rid, "object": "text_completion", "created": created, "model": model,
                   "choices": [], "usage": usage.body(num_prompt)}

    async def _full_chat(self, rids: tuple[str, str], req: ChatCompletionRequest, ids: list[int],
                         params: SamplingParams, tools: ToolFormat | None, ticket: Ticket,
                         thinking: bool | None = None, images: tuple = ()) -> dict[str, Any]:
        """The whole chat completion; with the request's `prompt_logprobs` (vLLM's) the prompt's at
        the top level, as vLLM returns them, with `return_token_ids` (vLLM's) the prompt's ids there
        and each choice's own; with a reasoning parser (`thinking` not None: whether the answer starts
        in reasoning) the reasoning apart from the content (unless include_reasoning is false); with
        echo the continued message's text first."""
        (rid, engine_id), shapes, echo = rids, self._shapes(req), _chat_echo(req)
        choices = [ChoiceAccumulator() for _ in range(params.n)]
        usage = UsageCounter()
        prompt_lps: list = []
        async for _, delta in self.frontend.run([ids], params, engine_id, ticket, images, rid):
            usage.add(delta)
            prompt_lps += delta.prompt_logprobs or []
            for c in delta.choices:
                choices[c.index].add(c, delta.weight_version)
        out = []
        for idx, acc in enumerate(choices):
            self.frontend.count_finished(acc.finish_reason)
            reasoning, text = (None, acc.text) if thinking is None else split_reasoning(acc.text, thinking)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish_reason = acc.finish_reason
            if tools is not None:
                content, calls = tools.parse(text or "")
                message = {"role": "assistant", "content": content, "tool_calls": [c.body() for c in calls]}
                finish_reason = _with_tool_calls(finish_reason, bool(calls))
            if thinking is not None:
                message["reasoning"] = reasoning if req.include_reasoning else None
            if echo:
                message["content"] = echo + (message["content"] or "")
            out.append({"index": idx, "message": message,
                        "finish_reason": finish_reason, "stop_reason": acc.stop_reason,
                        "logprobs": shapes.chat(acc.token_ids, acc.logprobs, params.logprobs or 0)
                        if req.logprobs else None, "weight_versions": acc.weight_versions})
            if req.return_token_ids:
                out[-1]["token_ids"] = acc.token_ids
        body = {"id": rid, "object": "chat.completion", "created": now(), "model": self.preparer.response_model(params),
                "choices": out, "usage": usage.body(len(ids)), "weight_version": usage.weight_version}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = shapes.prompt(prompt_lps, params.prompt_logprobs)
        if req.return_token_ids:
            body["prompt_token_ids"] = ids
        return body

    async def _stream_chat(self, rids: tuple[str, str], req: ChatCompletionRequest, ids: list[int],
                           params: SamplingParams, tools: ToolFormat | None, ticket: Ticket,
                           thinking: bool | None = None, images: tuple = ()) -> AsyncIterator[dict]:
        created, options, logprobs, token_ids = now(), req.stream_options, req.logprobs, req.return_token_ids
        (rid, engine_id), shapes, echo = rids, self._shapes(req), _chat_echo(req)
        per_chunk = options is not None and options.usage_per_chunk()
        base = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": self.preparer.response_model(params)}
        usage = UsageCounter()
        started: set[int] = set()       # choices whose role went out: with their first token, as vLLM
        # per choice: the reasoning split first, then tool calls read out of the content
        readers = {} if tools is None else {i: ToolCallStream(tools.name) for i in range(params.n)}
        thinkers = {} if thinking is None else {i: ReasoningStream(thinking) for i in range(params.n)}
        prompt_sent = False             # the prompt's ids (return_token_ids) go with the first chunk
        if echo:                        # the continued message's text, each choice's role with it (as vLLM)
            for i in range(params.n):
                started.add(i)
                chunk = {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": echo},
                                              "logprobs": None, "finish_reason": None}]}
                yield {**chunk, "usage": usage.body(len(ids))} if per_chunk else chunk
        async for _, delta in self.frontend.run([ids], params, engine_id, ticket, images, rid):
            usage.add(delta)
            for c in delta.choices:
                if c.finish_reason is not None:
                    self.frontend.count_finished(c.finish_reason)
                text, finish_reason, call_deltas, reasoning = c.text, c.finish_reason, [], ""
                thinker, reader = thinkers.get(c.index), readers.get(c.index)
                final = c.finish_reason is not None
                if thinker is not None:
                    reasoning, text = read_through(thinker, text, final)
                    reasoning = reasoning if req.include_reasoning else ""
                if reader is not None:
                    text, deltas = read_through(reader, text, final)
                    if final:
                        finish_reason = _with_tool_calls(c.finish_reason, reader.calls > 0)
                    call_deltas = [d.body() for d in coalesce(deltas)]
                if ((reader or thinker) and c.index in started
                        and not (text or reasoning or call_deltas or finish_reason or logprobs or token_ids)):
                    continue    # text held back while a tag may be starting: nothing to send (as vLLM)
                message: dict[str, Any] = ({"content": text} if text or (c.finish_reason is None and not reasoning)
                                           else {})
                first, prompt_sent = not prompt_sent, True
                if c.index not in started:
                    started.add(c.index)
                    message = {"role": "assistant", "content": text}
                if reasoning:
                    message["reasoning"] = reasoning
                if call_deltas:
                    message["tool_calls"] = call_deltas
                chunk = {**base, "choices": [{
                    "index": c.index, "delta": message,
                    "logprobs": shapes.chat(c.token_ids, c.logprobs, params.logprobs or 0)
                    if logprobs else None,
                    "finish_reason": finish_reason, "stop_reason": c.stop_reason}],
                    "weight_version": delta.weight_version}
                if token_ids:               # vLLM's: the prompt's ids in the first chunk, each choice's own
                    chunk["choices"][0]["token_ids"] = c.token_ids
                    if first:
                        chunk["prompt_token_ids"] = ids
                yield {**chunk, "usage": usage.body(len(ids))} if per_chunk else chunk
        if options is not None and options.include_usage:
            yield {**base, "choices": [], "usage": usage.body(len(ids))}


def _request_ids(prefix: str, req: Any) -> tuple[str, str]:
    """(the response's id, the engine's): the client's `request_id` after the prefix (vLLM's) or a
    new one; the engine's then takes a unique suffix, so two clients' equal ids never meet in a
    replica (it begins with the response's id: traces and logs name it)."""
    if req.request_id is None:
        rid = new_id(prefix)
        return rid, rid
    rid = f"{prefix}-{req.request_id}"
    return rid, new_id(rid)


def _chat_echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's text where it is the assistant's (the one continued),
    else nothing."""
    last = req.messages[-1]
    if not req.echo or last.role != "assistant" or not last.content:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(str(part.get("text", "")) for part in last.content if part.get("type") == "text")


def _prompt_only(delta: StepDelta) -> StepDelta:
    """A StepDelta of echo with max_tokens 0 (CompletionRequest.echo_only) without the one token the
    engine sampled: its text, id, logprobs and count leave the response, the finish reason stays."""
    return dataclasses.replace(delta, choices=[dataclasses.replace(c, token_ids=[], text="", logprobs=None)
                                               for c in delta.choices])


def _with_tool_calls(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason for an answer that called tools: "tool_calls" where it stopped on its
    own (a call cut off by max_tokens stays "length")."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason
