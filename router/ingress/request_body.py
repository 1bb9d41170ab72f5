"""A request body, from its bytes to a validated record: the JSON object (UTF-8, no NaN, nesting
bounded), the base of every request model (unknown fields refused, a null counted as the field not
sent), the 400 a validation error becomes (naming the field, saying why a known but unsupported
one is refused), and the X-Request-Id header read into a body. The records themselves:
router/ingress/protocol.py and router/ingress/responses_request.py.
"""
from __future__ import annotations

import json
import re
import types
from collections.abc import Mapping
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic.fields import FieldInfo

from records.errors import InvalidRequestError


class RequestModel(BaseModel):
    """A request body (or a part of one). An explicit null counts as the field not sent: OpenAI's
    reference marks its optional fields nullable, and clients in several languages send every field
    they have, the unset ones as null (`"temperature": null`, `"functions": null`), which vLLM
    accepts too. A null is kept only where it means something other than the default (a field
    that admits None with another default: a completion's `max_tokens`, where null is no limit)
    and on a required field (whose error then names it)."""
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or None not in data.values():
            return data
        fields = {f.alias or name: f for name, f in cls.model_fields.items()} | cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or _null_means_something(fields.get(key))}


def _null_means_something(field: FieldInfo | None) -> bool:
    return field is not None and (field.is_required() or (field.default is not None and _admits_none(field.annotation)))


def _admits_none(annotation: Any) -> bool:
    return annotation is type(None) or (get_origin(annotation) in (Union, types.UnionType)
                                        and type(None) in get_args(annotation))


MAX_JSON_DEPTH = 64      # nesting of a request body's arrays and objects


def parse_json_object(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object; ValueError saying what is wrong (not JSON, not UTF-8, NaN or
    Infinity, nested deeper than MAX_JSON_DEPTH, not an object)."""
    try:
        data = json.loads(body or b"{}", parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise ValueError(f"request body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    except RecursionError:
        raise ValueError(f"request body nests arrays and objects more than {MAX_JSON_DEPTH} deep") from None
    except ValueError as e:                 # JSONDecodeError, or a NaN / Infinity constant
        raise ValueError(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"request body must be a JSON object; got {type(data).__name__}")
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"request body nests arrays and objects more than {MAX_JSON_DEPTH} deep")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# OpenAI's (or vLLM's) request fields that this server knows and refuses, each with why: answering
# without them would change what the client asked for.
UNSUPPORTED = {
    "suffix": "not supported (insertion; vLLM refuses it too)",
    "functions": "not supported (OpenAI's deprecated form); use tools",
    "function_call": "not supported (OpenAI's deprecated form); use tool_choice",
    "audio": "not supported: this server generates text only",
    "prediction": "not supported (predicted outputs)",
    "reasoning_effort": "not supported: the served model has no reasoning modes",
    "verbosity": "not supported",
    "web_search_options": "not supported: this server has no web search",
    "reasoning": "not supported: the served model has no reasoning modes",
    "chat_template": "not taken from a request (nor by vLLM, unless trusted): the server's is set with "
                     "`pdserve serve --chat-template` or serving.chat_template",
    "kv_transfer_params": "not needed: prefill/decode disaggregation is the cluster's own (mode: pd in the "
                          "cluster spec), and its router moves the KV",
    "prompt_embeds": "not supported: prompts are text or token ids",
    "vllm_xargs": "not supported: this server has no custom logits processors to pass arguments to",
    "logprob_token_ids": "not supported; use logprobs (completions) or top_logprobs (chat)",
    "thinking_token_budget": "not supported; bound the answer with max_tokens",
    "stream_interval": "not taken per request: the engine's is set in the cluster spec (engine.stream_interval)",
    "repetition_detection": "not supported",
    "watermarking": "not supported",
    "return_token_offsets": "not supported; return_token_ids gives the ids, /detokenize their text",
    "return_prompt_text": "not supported; return_token_ids gives the prompt's ids",
    "routed_experts_prompt_start": "not supported",
    "mm_processor_kwargs": "not supported: images are processed as the model's processor's defaults say",
    "media_io_kwargs": "not supported: images are base64 data: URLs",
    "mm_payload": "not supported",
    "return_mm_kwargs": "not supported",
    "ec_transfer_params": "not needed: the cluster's encode pool hands image embeddings on itself",
}


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    """(message naming the field and what is allowed, the field's dotted path) for a 400."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if not isinstance(p, int)) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        msg = UNSUPPORTED.get(loc or "", "unknown field")
    got = repr(first.get("input"))
    got = got if len(got) <= 200 else got[:200] + "..."
    shown = "" if first.get("type") in ("missing", "extra_forbidden") else f"; got {got}"
    return f"{loc}: {msg}{shown}", loc


# A request id (the body's `request_id` or an X-Request-Id header): printable ASCII, as it goes into
# the response, logs and traces.
REQUEST_ID_PATTERN = r"^[ -~]{1,256}$"


def with_request_id(body: dict[str, Any], headers: Mapping[str, str]) -> dict[str, Any]:
    """A completion's or a chat's body with its X-Request-Id header as its request_id where the body
    names none (vLLM reads the header first; here the body's wins, because Serve's proxy gives every
    request it forwards a header of its own, and so the response's id is then Serve's request id);
    InvalidRequestError naming the header when it is not a request id."""
    header = headers.get("x-request-id")
    if header is None or body.get("request_id") is not None:
        return body
    if not re.fullmatch(REQUEST_ID_PATTERN, header):
        raise InvalidRequestError(f"the X-Request-Id header must be 1 to 256 printable ASCII characters; got "
                                  f"{header[:40]!r}", param="X-Request-Id")
    return {**body, "request_id": header}
