"""OpenAI's Responses API (`POST /v1/responses`, what the `openai` SDK's `client.responses` calls),
as vLLM serves it: text, function calls and, under a reasoning parser, the thinking as a `reasoning`
item, whole or streamed as typed events, on the chat path. A request is read in its own shape
(fields named as the Responses API names them), turned into the chat completion it means
(instructions as the system message, input items as messages, function calls and their outputs as
the assistant's tool calls and tool messages, `text.format` as `response_format`), and run through
the frontend as a chat completion is: the same validation, chat template, tool-call grammar,
admission and routing. Nothing is stored (`store` is accepted and answered false;
`previous_response_id` is refused), as vLLM by default.
"""
from __future__ import annotations

import copy
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from engine.text.reasoning import ReasoningStream
from engine.text.tool_calls import ToolFormat
from engine.text.tool_parser import ToolCallDelta, ToolCallStream, coalesce, read_through
from records.deltas import StepDelta
from records.errors import InvalidRequestError
from router.ingress.frontend import Frontend
from router.ingress.http import sse_response
from router.ingress.replies import UsageCounter, now
from router.ingress.responses_request import FunctionChoice, ResponsesRequest

# What the chat path calls a field, and what a Responses client sent it as (for its 400s).
_CHAT_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def _renamed(err: InvalidRequestError) -> InvalidRequestError:
    message = re.sub(r"\b(messages|max_tokens|response_format)\b", lambda m: _CHAT_NAMES[m.group(1)], err.message)
    param = err.param
    for chat, ours in _CHAT_NAMES.items():
        if param is not None and (param == chat or param.startswith((chat + ".", chat + "["))):
            param = ours + param[len(chat):]
    return InvalidRequestError(message, param=param)


class ResponsesAPI:
    """POST /v1/responses: a response object, or its events as SSE."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def create(self, data: dict[str, Any]) -> Response:
        req: ResponsesRequest = self.frontend.preparer.parse(ResponsesRequest, data)
        chat = req.chat_body()
        try:
            prep = await self.frontend.preparer.prepare_chat(chat)
            chat_req, params, ids, tools = prep.request, prep.params, prep.prompts[0], prep.tool_format
        except InvalidRequestError as e:
            raise _renamed(e) from None
        ticket = await self.frontend.admit([ids], params)
        run = _Run(self, req, params, ids, tools, self.frontend.preparer.thinking(chat_req))
        events = run.events(self.frontend.run([ids], params, run.id, ticket, prep.images))
        if req.stream:
            return sse_response(events, ticket, named=True)
        try:
            async for _ in events:
                pass
            return JSONResponse(run.response())
        finally:
            ticket.release()


class _Run:
    """One response as it is generated: its output items (reasoning, a message, function calls)
    opened and closed in order, and the events that say so (sequence-numbered). `thinking`: None
    without a reasoning parser, else whether the answer starts in reasoning."""

    def __init__(self, api: ResponsesAPI, req: ResponsesRequest, params: Any, ids: list[int],
                 tools: ToolFormat | None, thinking: bool | None = None) -> None:
        self.api, self.req, self.params, self.prompt_tokens = api, req, params, len(ids)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = now()
        self.reader = ToolCallStream(tools.name) if tools is not None else None
        self.thinker = ReasoningStream(thinking) if thinking is not None else None
        self.reasoning_tokens = 0       # of the chunks that began in the thinking
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None        # the item being written
        self.call_index: int | None = None             # which call the open function_call item is
        self.usage = UsageCounter()
        self.finish_reason: str | None = None
        self.seq = 0

    async def events(self, deltas: AsyncIterator[tuple[int, StepDelta]]) -> AsyncIterator[dict[str, Any]]:
        yield self._event("response.created", response=self.response(in_progress=True))
        yield self._event("response.in_progress", response=self.response(in_progress=True))
        async for _, delta in deltas:
            self.usage.add(delta)
            for c in delta.choices:
                text, calls, reasoning, final = c.text, [], "", c.finish_reason is not None
                if self.thinker is not None:
                    if self.thinker.in_reasoning:
                        self.reasoning_tokens += len(c.token_ids)
                    reasoning, text = read_through(self.thinker, text, final)
                for event in self._reasoning(reasoning):
                    yield event
                if self.reader is not None:         # tool calls are read from the content
                    text, calls = read_through(self.reader, text, final)
                for event in self._text(text):
                    yield event
                for d in coalesce(calls):
                    for event in self._call(d):
                        yield event
                if c.finish_reason is not None:
                    self.finish_reason = c.finish_reason
                    self.api.frontend.count_finished(c.finish_reason)
        for event in self._close():
            yield event
        final = self.response()
        yield self._event(f"response.{final['status']}", response=final)

    def response(self, in_progress: bool = False) -> dict[str, Any]:
        """The response object: as it starts (no output yet), or whole (completed, or incomplete where
        max_output_tokens cut it off)."""
        req, params = self.req, self.params
        status = "in_progress" if in_progress else "incomplete" if self.finish_reason == "length" else "completed"
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        done = not in_progress
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.api.frontend.preparer.response_model(params), "output": self.output if done else [],
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
            "temperature": params.temperature, "top_p": params.top_p,
            "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionChoice)
            else req.tool_choice or ("auto" if req.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "truncation": "disabled", "store": False, "metadata": req.metadata or {}, "user": req.user,
            "usage": self._usage() if done else None, "weight_version": self.usage.weight_version,
        }

    def _usage(self) -> dict[str, Any]:
        body = self.usage.body(self.prompt_tokens)
        return {"input_tokens": body["prompt_tokens"], "input_tokens_details": body["prompt_tokens_details"],
                "output_tokens": body["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": body["total_tokens"]}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _text(self, text: str) -> list[dict[str, Any]]:
        return self._part_delta("message", text)

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        return self._part_delta("reasoning", text)

    def _part_delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        """`text` added to the open message's output_text or reasoning item's reasoning_text (one
        opened, and the open item closed, when it is not of that kind)."""
        if not text:
            return []
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            if kind == "message":
                item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                        "role": "assistant", "content": []}
                part = {"type": "output_text", "text": "", "annotations": []}
            else:
                item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "status": "in_progress",
                        "summary": [], "content": []}
                part = {"type": "reasoning_text", "text": ""}
            events += self._add(item)
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self.output) - 1, content_index=0, part=dict(part)))
            item["content"].append({**part, "logprobs": []} if kind == "message" else part)
        item = self.open
        item["content"][0]["text"] += text
        delta_event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(delta_event, item_id=item["id"], output_index=len(self.output) - 1,
                                  content_index=0, delta=text, **extra))
        return events

    def _call(self, d: ToolCallDelta) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != "function_call" or self.call_index != d.index:
            events += self._close()
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": d.id or "",
                    "name": d.name or "", "arguments": "", "status": "in_progress"}
            self.call_index = d.index
            events += self._add(item)
        item = self.open
        item["arguments"] += d.arguments
        if d.arguments:
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=len(self.output) - 1, delta=d.arguments))
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self.open = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1,
                            item=copy.deepcopy(item))]

    def _close(self) -> list[dict[str, Any]]:
        """The open item's closing events, its status then completed."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, events = len(self.output) - 1, []
        item["status"] = "completed"
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            if item["type"] == "message":
                events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=part["text"], logprobs=[]))
            else:
                events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=part["text"]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events
