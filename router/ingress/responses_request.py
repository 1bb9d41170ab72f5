"""The request of OpenAI's Responses API (`POST /v1/responses`, router/ingress/responses_api.py) in its own
shape, and the chat completion it means (`ResponsesRequest.chat_body`: instructions as the system
message, input items as messages, function calls and their outputs as the assistant's tool calls
and tool messages, `text.format` as `response_format`)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from records.errors import InvalidRequestError
from router.ingress.protocol import MAX_TOOLS, TOOL_NAME_PATTERN
from router.ingress.request_body import RequestModel


class TextFormat(RequestModel):
    """`text.format`: plain text, any JSON object, or JSON valid under a schema (flat, unlike chat's
    `response_format.json_schema`)."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(RequestModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None


class FunctionTool(RequestModel):
    """A function the model may call (flat, unlike chat's `{"type", "function": {...}}`)."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(RequestModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class ResponsesRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    # Accepted and answered as they are here: nothing is stored, nothing is truncated.
    store: bool | None = None
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    # Extra outputs to include: none exist here, so only an empty list (which the OpenAI Agents
    # SDK sends on every call) is accepted.
    include: list[Any] | None = None

    def chat_body(self) -> dict[str, Any]:
        """The chat completion this request means; InvalidRequestError naming the field at fault."""
        if self.include:
            raise InvalidRequestError(f"include: not supported (no reasoning content, logprobs or tool outputs to "
                                      f"include); send [] or leave it out; got {self.include!r:.200}", param="include")
        if self.previous_response_id is not None:
            raise InvalidRequestError("previous_response_id: this server stores no responses; send the whole "
                                      "conversation as input", param="previous_response_id")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages += input_messages(self.input)
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "parallel_tool_calls": self.parallel_tool_calls}
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "user"):          # unset ones keep the model's defaults
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise InvalidRequestError("text.format.schema is required when text.format.type is 'json_schema'",
                                          param="text.format.schema")
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.schema_,
                **({"strict": fmt.strict} if fmt.strict is not None else {})}}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        return body


TEXT_PARTS = ("input_text", "output_text", "text")


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is the user's message; a list holds messages (`role` and
    `content`: a string or text parts), `function_call` items (the assistant's calls, joined into one
    assistant message) and `function_call_output` items (tool messages)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise InvalidRequestError("input must not be empty", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequestError(f"{where}.role must be one of user, system, developer, assistant; "
                                          f"got {role!r}", param=f"{where}.role")
            messages.append({"role": role, "content": _input_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name, arguments = (item.get(k) for k in ("call_id", "name", "arguments"))
            if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
                raise InvalidRequestError(f"{where}: a function_call needs call_id, name and arguments (strings)",
                                          param=where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)      # the calls of one turn, after its text
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise InvalidRequestError(f"{where}.call_id must be a string", param=f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _input_text(item.get("output"), f"{where}.output")})
        else:
            raise InvalidRequestError(f"{where}.type must be one of message, function_call, "
                                      f"function_call_output; got {kind!r}", param=f"{where}.type")
    return messages


def _input_text(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: its text, or chat content parts where it holds images (`input_image`:
    the chat API's `image_url` parts, checked where the chat's are)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "input_image":
                parts.append({"type": "image_url", "image_url": {"url": part.get("image_url")}})
                continue
            if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}: parts must be text ({', '.join(TEXT_PARTS)}) with a string "
                                          f"text, or input_image; got type {kind!r}", param=where)
            parts.append({"type": "text", "text": part["text"]})
        if any(p["type"] == "image_url" for p in parts):
            return parts
        return "".join(p["text"] for p in parts)
    raise InvalidRequestError(f"{where} must be a string or a list of text parts; got {type(content).__name__}",
                              param=where)
