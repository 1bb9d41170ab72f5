"""OpenAI request models (pydantic) and the conversion to SamplingParams (the parts responses are
built from: router/ingress/replies.py).

Unknown fields are rejected (400 naming the field) rather than silently ignored, except the few that
OpenAI clients send and that change nothing here (`user`, `metadata`, `store`, `service_tier`, ...);
known ones this server cannot honour are refused saying so. How a body becomes one of these records
(its JSON, nulls, the 400's wording) is router/ingress/request_body.py; the Responses API's request
is in router/ingress/responses_request.py.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from records.sampling_params import STRUCTURED_KINDS, SamplingParams, StructuredOutputsParams
from router.ingress.request_body import REQUEST_ID_PATTERN, RequestModel


class StreamOptions(RequestModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False     # vLLM's: with include_usage, the usage so far in every chunk

    def usage_per_chunk(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class JsonSchemaFormat(RequestModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON valid under a schema."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(RequestModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None        # OpenAI requires it; vLLM (and pdserve) default to the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)     # OpenAI's cap; a pool's max_num_seqs bounds it too (all run at once)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None      # token id (as a string, JSON's keys) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None      # vLLM's: only these may be sampled
    bad_words: list[str] | None = None              # vLLM's: words never generated (tokenized by the preparer)
    # OpenAI's fields that change no output here, accepted as vLLM accepts them: who asks (`user`,
    # `safety_identifier`), tags (`metadata`), OpenAI's own storage and tiers (nothing is stored;
    # every request has the one tier), and cache and session hints (prefix caching and prefix-aware
    # routing need none).
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    session_id: str | None = None       # vLLM's affinity hint: the prefix-aware router needs none
    # extras (vLLM's names)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, le=1)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0)
    priority: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # beam search (vLLM's names; engine/beam_search.py): best_of beams, the best n returned
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # the prompt's token ids and each choice's own in the response (vLLM's; what RL rollouts read
    # to train on exactly the tokens that were sampled)
    return_token_ids: bool = False
    # the prefix cache keys this request's blocks by the salt too, so requests without the same salt
    # (another tenant) neither reuse nor time its cached prompt (vLLM's)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # keep only the prompt's last k tokens (vLLM's; -1: as many as max_model_len holds); its first
    # k with truncation_side "right"
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: the response's id is "cmpl-" / "chatcmpl-" and this (an X-Request-Id header takes its
    # place, as in vLLM); the engine's own id adds a unique suffix, so equal ids never collide
    request_id: str | None = Field(None, pattern=REQUEST_ID_PATTERN)
    # vLLM's: logprobs name each token "token_id:<id>" (exact where a token alone is not valid UTF-8)
    return_tokens_as_token_ids: bool = False
    # vLLM's: False (with skip_special_tokens false) puts no space between two special tokens
    spaces_between_special_tokens: bool = True
    # the top-N logprobs of every prompt token (the first: null), as `prompt_logprobs` in a
    # completion's choices and at a chat response's top level; not streamed (as in vLLM)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # constrained output: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """The one output constraint this request asks for, or None; ValueError naming the fields if
        it asks for several or a malformed one."""
        sources: dict[str, dict[str, Any]] = {}
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            sources["response_format"] = {"json_object": True}
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema.schema is required when response_format.type is "
                                 "'json_schema'")
            sources["response_format"] = {"json": rf.json_schema.schema_}
        if self.structured_outputs is not None:
            sources["structured_outputs"] = self.structured_outputs
        legacy = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        for kind, value in legacy.items():
            if value is not None:
                sources[f"guided_{kind}"] = {kind: value}
        if len(sources) > 1:
            raise ValueError(f"only one of response_format, structured_outputs and guided_* may constrain the "
                             f"output; got {sorted(sources)}")
        if not sources:
            return None
        (field, spec), = sources.items()
        if not isinstance(spec, dict):
            raise ValueError(f"{field} must be an object with one of {', '.join(STRUCTURED_KINDS)}")
        try:
            return SamplingParams(structured_outputs=spec).structured_outputs
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None

    def sampling_kwargs(self, defaults: tuple[tuple[str, Any], ...] = ()) -> dict[str, Any]:
        """SamplingParams' keywords; `defaults` (the model's, ModelInfo.sampling_defaults) fill the
        fields this request left unset."""
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available with stream=true (as in vLLM); send the request "
                             "unstreamed")
        if self.use_beam_search and self.stream:
            raise ValueError("stream: beam search answers whole (stream=false): its beams change until the end")
        kwargs = dict(structured_outputs=self.structured(), use_beam_search=self.use_beam_search,
                      best_of=self.best_of, length_penalty=self.length_penalty, early_stopping=self.early_stopping,
                      n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                      min_p=self.min_p, seed=self.seed, presence_penalty=self.presence_penalty,
                      frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                      logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                      max_tokens=self.max_tokens, min_tokens=self.min_tokens, stop=self.stop,
                      stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, priority=self.priority,
                      skip_special_tokens=self.skip_special_tokens,
                      spaces_between_special_tokens=self.spaces_between_special_tokens,
                      include_stop_str_in_output=self.include_stop_str_in_output,
                      prompt_logprobs=self.prompt_logprobs,
                      extra_keys=() if self.cache_salt is None else (("cache_salt", self.cache_salt),))
        kwargs.update((name, value) for name, value in defaults if name not in self.model_fields_set)
        return kwargs


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    max_tokens: int | None = Field(16, ge=0)     # 0 only with echo: the prompt alone (below)
    add_special_tokens: bool = True             # vLLM's: the tokenizer's BOS etc. around a text prompt

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) alone, as OpenAI and vLLM answer it
        for scoring a text; the engine samples one token, which the response leaves out."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, defaults: tuple[tuple[str, Any], ...] = ()) -> SamplingParams:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be >= 1 (0 only with echo: the prompt alone); got 0")
        # echo with logprobs: the prompt's tokens get theirs too (OpenAI's legacy completions, vLLM;
        # what evaluation harnesses read to score a text's likelihood).
        echo_logprobs = self.echo and self.logprobs is not None
        if echo_logprobs and self.n != 1:
            raise ValueError(f"echo with logprobs needs n = 1 (the prompt's logprobs are returned once); "
                             f"got n={self.n}")
        kwargs = self.sampling_kwargs(defaults)
        if echo_logprobs and self.prompt_logprobs is None:
            kwargs["prompt_logprobs"] = self.logprobs
        if self.echo_only:
            kwargs["max_tokens"] = 1
        return SamplingParams(**kwargs, logprobs=self.logprobs)


# An earlier call comes back as clients stored it (a streamed one may keep its delta `index`):
# what else it carries is ignored rather than refused.
class FunctionCall(RequestModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallMessage(RequestModel):
    """A call in an earlier assistant message of the conversation."""
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None     # assistant: the calls it made
    tool_call_id: str | None = None                     # tool: the call this result answers


# OpenAI's limits on a function's name; it also keeps the name a plain JSON string in the grammar.
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"
MAX_TOOLS = 128
MAX_DOCUMENTS = 1024


class FunctionDefinition(RequestModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None       # a JSON schema of the arguments (None: any object)
    strict: bool | None = None


class Tool(RequestModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(RequestModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateOptions(RequestModel):
    """vLLM's chat-template extras, on chat completions and /tokenize (engine/text/tokenizer.py:
    apply_chat_template): the generation prompt, or the last (assistant) message continued, and
    more variables for the template (e.g. Qwen3's enable_thinking)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(_Common, ChatTemplateOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    modalities: list[Literal["text"]] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: the tokenizer's special tokens (a BOS) on top of what the template writes; off, as there
    add_special_tokens: bool = False
    # vLLM's: the answer starts with the last message's content where that is the assistant's (the
    # message continued: add_generation_prompt false, continue_final_message)
    echo: bool = False
    # vLLM's: False leaves the reasoning out of the response (a reasoning model's; its content stays)
    include_reasoning: bool = True
    # vLLM's: documents for a template that renders them (retrieval-augmented generation), each
    # {"title": ..., "text": ...}; a template that has no place for them ignores them
    documents: list[dict[str, str]] | None = Field(None, max_length=MAX_DOCUMENTS)

    def tool_list(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def effective_tool_choice(self) -> str | dict[str, Any]:
        """tool_choice with OpenAI's default ("auto" with tools, else "none"); ValueError naming
        the field when it asks for a tool that is not offered."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if choice.function.name not in names:
                raise ValueError(f"tool_choice.function.name: {choice.function.name!r} is not one of the "
                                 f"tools' names {names}")
            return choice.model_dump()
        if choice == "required" and not self.tools:
            raise ValueError("tool_choice: 'required' needs a non-empty tools list")
        return choice

    def to_sampling_params(self, tool_constraint: str | None = None,
                           defaults: tuple[tuple[str, Any], ...] = ()) -> SamplingParams:
        """`tool_constraint`: the structural tag that enforces the tool choice (engine/text/tool_calls.py),
        which takes the place of any other output constraint; `defaults`: see sampling_kwargs."""
        kwargs = self.sampling_kwargs(defaults)
        if tool_constraint is not None:
            if kwargs["structured_outputs"] is not None:
                raise ValueError("tool_choice: a required, named or strict tool call cannot be combined with "
                                 "response_format, structured_outputs or guided_*")
            kwargs["structured_outputs"] = StructuredOutputsParams(structural_tag=tool_constraint)
        if self.max_completion_tokens is not None:
            kwargs["max_tokens"] = self.max_completion_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return SamplingParams(**kwargs, logprobs=logprobs)


def plain_messages(messages: list[ChatMessage], images: list[tuple[str, str]] | None = None,
                   placeholder: str = "<image>") -> list[dict[str, Any]]:
    """Messages as the chat template takes them: text content parts joined, tool calls and the ids
    of tool results in OpenAI's shape. With `images` (a vision-language model's), each `image_url`
    part becomes `placeholder` in its message's text and (the part's name, its URL) is appended to
    `images`, in order; otherwise, and for any other kind of part, the part is refused."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):      # [{"type": "text", "text": ...}, {"type": "image_url", ...}]
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type")
                if kind == "image_url" and images is not None:
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    if not isinstance(url, str):
                        raise ValueError(f"messages[{i}].content[{j}].image_url must be {{'url': a data:image "
                                         f"URL}}; got {part.get('image_url')!r:.100}")
                    images.append((f"messages[{i}].content[{j}].image_url", url))
                    parts.append(placeholder)
                    continue
                if kind == "image_url":
                    raise ValueError(f"messages[{i}].content[{j}]: this model takes no images; send text parts")
                if kind != "text":
                    allowed = "'text' or 'image_url'" if images is not None else "'text'"
                    raise ValueError(f"messages[{i}].content[{j}].type must be {allowed}; got {kind!r}")
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        message: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


class TokenizeRequest(ChatTemplateOptions):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None      # None: True for a prompt, False for messages (as vLLM)
    return_token_strs: bool = False             # vLLM's: each token's string too (the vocabulary's)


class EmbeddingRequest(RequestModel):
    """OpenAI's /v1/embeddings body, with vLLM's extras (`truncate_prompt_tokens`,
    `add_special_tokens`, `normalize`, `priority`)."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    add_special_tokens: bool = True
    normalize: bool | None = None       # None: as the model's config says
    priority: int = 0


class DetokenizeRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(RequestModel):
    """vLLM's /v1/load_lora_adapter body."""
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(RequestModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None        # vLLM's; the name decides
