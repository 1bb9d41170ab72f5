"""Request preparation: a request body in, one `Prepared` record out (the parsed request, its
sampling parameters, its prompts as token ids, the format its tool calls come in), or an
InvalidRequestError / NotFoundError naming the field. `RequestPreparer` holds what that takes: the
model's tokenizer, limits and sampling defaults (a `ModelInfo`, resolved where the ingress runs),
the chat template and tool-call format, and the LoRA adapters served by name; it also answers the
small calls that need only those (models, tokenize, detokenize, adapter loading). Shared by the HTTP
and gRPC APIs through the frontend (router/ingress/frontend.py), which admits and runs what this
prepares.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import os
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from engine.beam_search import check_beam_params
from engine.text.images import ImageProcessor
from engine.text.reasoning import THINK_END, thinks
from engine.text.tokenizer import apply_chat_template, eos_token_ids, load_tokenizer, tokenize_bad_words
from engine.text.tool_calls import ToolFormat
from records.errors import InvalidRequestError, NotFoundError
from records.lora import LoRARequest, read_adapter
from records.model_source import is_hub_id, is_vision_language
from records.multimodal import ImageInput
from records.outputs import Logprob
from records.sampling_params import SamplingParams, StructuredOutputsParams, validate_request
from records.serving import IngressSpec
from router.ingress.protocol import (
    ChatCompletionRequest,
    ChatTemplateOptions,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    plain_messages,
)
from router.ingress.replies import now
from router.ingress.request_body import validation_message


def check_beams(params: SamplingParams) -> SamplingParams:
    """The params, once beam search (when asked) can take them; ValueError naming what it cannot."""
    if params.use_beam_search:
        check_beam_params(params)
    return params


@dataclass(slots=True)
class Prepared:
    """A validated request, ready to admit and run: `prompts` are token ids (one per prompt of a
    completion; a chat's one); `tool_format` is the format to read tool calls in, None when the
    request offers no tools to call."""
    request: Any                    # CompletionRequest | ChatCompletionRequest
    params: SamplingParams
    prompts: list[list[int]]
    tool_format: ToolFormat | None = None
    images: tuple[ImageInput, ...] = ()     # a chat's images (a vision-language model: records/multimodal.py)


class RequestPreparer:
    """Turns request bodies into `Prepared` records for one served model (and its adapters)."""

    def __init__(self, config: IngressSpec) -> None:
        self.config = config
        engine = config.engine_config()
        info = self.info = engine.model_info()
        self.hf_config = engine.model_config.hf_config
        # What an adapter loaded at runtime is checked against: the model's config and the rank limit.
        self._adapter_limits = (self.hf_config, engine.lora_config.max_lora_rank
                                if engine.lora_config is not None else 0)
        self.vocab_size, self.max_model_len, self.max_num_seqs = info.vocab_size, info.max_model_len, info.max_num_seqs
        # The names requests may use for the base model; responses name the first (as vLLM's).
        self.model_names = config.serving.served_model_names or [
            config.model if is_hub_id(config.model) else _default_name(info.model, info.gguf_file)]
        self.model_name = self.model_names[0]
        # LoRA adapters served under their own names (name -> request), from the spec and the
        # runtime endpoints; ids count up as vLLM's do.
        self.adapters: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)
        for name, path in (config.lora.modules if config.lora is not None else {}).items():
            if name in self.model_names:
                raise ValueError(f"lora.modules.{name}: the base model is served under that name "
                                 f"(serving.served_model_name: {self.model_names})")
            self.adapters[name] = LoRARequest(name, next(self._lora_ids), path)
        self.tokenizer = load_tokenizer(info.model, info.gguf_file, self.hf_config)
        if config.serving.chat_template is not None and self.tokenizer is not None:
            self.tokenizer.chat_template = config.serving.chat_template     # vLLM's --chat-template
        # How the model writes tool calls (None: no chat template, so no chat and no tools).
        self.tool_format = (ToolFormat.of(self.tokenizer, config.serving.tool_call_parser)
                            if getattr(self.tokenizer, "chat_template", None) else None)

    # --- checks ------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); NotFoundError naming the
        models this server serves."""
        if model is None or model in self.model_names:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            served = [*self.model_names, *self.adapters]
            raise NotFoundError(f"model {model!r} does not exist; this server serves {served}", "model")
        return adapter

    def response_model(self, params: SamplingParams) -> str:
        """The `model` a response names: the adapter's name, or the base model's."""
        return params.adapter_name or self.model_name

    def parse(self, cls: type, data: dict[str, Any]) -> Any:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            message, param = validation_message(e)
            raise InvalidRequestError(message, param=param) from None

    def sampling_params(self, req: CompletionRequest) -> SamplingParams:
        try:
            return check_beams(req.to_sampling_params(self.info.sampling_defaults))
        except ValueError as e:
            raise InvalidRequestError(str(e), param=field_named(str(e), req)) from None

    @functools.cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's end-of-sequence ids, as its engines read them (beam search ends beams on them)."""
        return frozenset(eos_token_ids(self.tokenizer, self.hf_config, self.info.model))

    def truncated(self, ids: list[int], keep: int | None, side: str | None = None) -> list[int]:
        """The prompt's last `keep` tokens (vLLM's truncate_prompt_tokens; -1: max_model_len's worth),
        its first with `side` "right" (vLLM's truncation_side)."""
        if keep is None or len(ids) <= (keep := self.max_model_len if keep == -1 else keep):
            return ids
        return ids[:keep] if side == "right" else ids[len(ids) - keep:]

    def validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """Check a prompt and its parameters against the model (its bad_words tokenized here, once)."""
        tokenize_bad_words(params, self.tokenizer)
        try:
            validate_request(ids, params, self.vocab_size, self.max_model_len, self.max_num_seqs)
        except InvalidRequestError:
            raise
        except ValueError as e:
            raise InvalidRequestError(str(e), param="prompt") from None

    async def compile_constraint(self, spec: StructuredOutputsParams | None, param: str) -> None:
        """Compile a request's output constraint here (cached per schema), so that one that cannot
        compile is a 400 naming `param` before any replica sees it. On a worker thread: xgrammar
        releases the GIL, and the first compile in a process also builds the tokenizer's table
        (about a second), which would otherwise hold up every stream through this ingress."""
        if spec is None:
            return

        def compile_here() -> None:
            # xgrammar (and the torch it imports, 1.5 s) loads with the first constrained request,
            # not with every ingress replica.
            from engine.sample.structured_output import compiler_for  # noqa: PLC0415

            compiler_for(self.info.model, self.info.gguf_file, self.vocab_size, self.tokenizer).compile(spec)

        try:
            await asyncio.to_thread(compile_here)
        except ValueError as e:
            raise InvalidRequestError(f"tools: {e}" if param == "tools" else str(e), param=param) from None

    # --- prompts -----------------------------------------------------------------------------------
    def completion_prompts(self, prompt: Any, add_special_tokens: bool = True, field: str = "prompt"
                           ) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise InvalidRequestError(f"{field} must not be empty", param=field)
        limit = self.config.serving.max_in_flight
        if len(prompts) > limit:
            raise InvalidRequestError(f"{field}: a batch may hold at most {limit} prompts (serving.max_in_flight); "
                                      f"got {len(prompts)}", param=field)
        out = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise InvalidRequestError("this model has no tokenizer: send token ids", param=field)
                out.append(self.tokenizer.encode(p, add_special_tokens=add_special_tokens))
            else:
                out.append(list(p))
        return out

    def chat_prompt(self, messages: list[Any], options: ChatTemplateOptions,
                    tools: list[dict[str, Any]] | None = None, add_special_tokens: bool = False,
                    documents: list[dict[str, str]] | None = None) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The conversation's prompt token ids and, for a vision-language model, its images (each
        `image_url` part a placeholder in the text, expanded by the model's processor);
        `add_special_tokens` and `documents` as engine/text/tokenizer.py: apply_chat_template takes them."""
        images: list[tuple[str, str]] | None = [] if self.image_processor is not None else None
        try:
            conversation = plain_messages(messages, images, getattr(self.image_processor, "placeholder", ""))
            if self.tool_format is not None:
                conversation, tools = self.tool_format.template_inputs(conversation, tools)
            # the prompt's ids, or with images its text, which the processor tokenizes with them
            rendered = apply_chat_template(self.tokenizer, conversation, tools, options.add_generation_prompt,
                                           options.continue_final_message, options.chat_template_kwargs,
                                           tokenize=not images, documents=documents,
                                           add_special_tokens=add_special_tokens)
            if not images:
                return rendered, ()
        except ValueError as e:
            part = re.match(r"messages\[\d+\](\.content\[\d+\])?", str(e))       # the part at fault, if named
            raise InvalidRequestError(str(e), param=part.group(0) if part else "messages") from None
        assert self.image_processor is not None
        fields, sources = [f for f, _ in images], [url for _, url in images]
        try:
            return self.image_processor.process(rendered, sources, fields, add_special_tokens=add_special_tokens)
        except ValueError as e:
            raise InvalidRequestError(str(e), param=next((f for f in fields if str(e).startswith(f)), "messages")
                                      ) from None

    @functools.cached_property
    def image_processor(self) -> ImageProcessor | None:
        """The model's image processor (a vision-language model's; None for any other)."""
        if not is_vision_language(self.hf_config):
            return None
        return ImageProcessor(self.info.model, self.hf_config.vision_language, self.info.media)

    async def prepare_completion(self, data: dict[str, Any]) -> Prepared:
        """Validate a completion body (HTTP's, or the one a gRPC GenerateRequest maps to) and
        tokenize its prompts; InvalidRequestError naming the field."""
        req: CompletionRequest = self.parse(CompletionRequest, data)
        lora = self.check_model(req.model)
        params = self.sampling_params(req)
        params.lora_request = lora
        prompts = [self.truncated(ids, req.truncate_prompt_tokens, req.truncation_side)
                   for ids in self.completion_prompts(req.prompt, req.add_special_tokens)]
        for ids in prompts:
            self.validate_prompt(ids, params)
        await self.compile_constraint(params.structured_outputs, "structured_outputs")
        return Prepared(req, params, prompts)

    async def prepare_chat(self, data: dict[str, Any]) -> Prepared:
        """Validate a chat completion body and apply the chat template (with the tools unless
        tool_choice is "none"): one prompt."""
        req: ChatCompletionRequest = self.parse(ChatCompletionRequest, data)
        lora = self.check_model(req.model)
        tools, constraint, tool_format = self.tool_setup(req)
        try:
            params = check_beams(req.to_sampling_params(constraint, self.info.sampling_defaults))
        except ValueError as e:
            raise InvalidRequestError(str(e), param="tool_choice" if constraint else field_named(str(e), req)
                                      ) from None
        params.lora_request = lora
        if tool_format is not None and tool_format.special_tag:
            params.skip_special_tokens = False      # else the detokenizer drops the call tags
        if (params.structured_outputs is not None and not params.structured_outputs.start_after
                and not self.config.serving.structured_outputs_in_reasoning and self.thinking(req)):
            # The model thinks freely; the constraint shapes what follows `</think>` (vLLM's rule).
            params.structured_outputs = dataclasses.replace(params.structured_outputs,
                                                            start_after=self.think_end_ids)
        if not is_vision_language(self.hf_config):
            ids, images = self.chat_prompt(req.messages, req, tools, req.add_special_tokens, req.documents)
        else:       # images decoded, fetched where allowed and processed (the processor loaded, the first
            # time): off the ingress's event loop
            ids, images = await asyncio.to_thread(self.chat_prompt, req.messages, req, tools, req.add_special_tokens,
                                                  req.documents)
        if images and (req.truncate_prompt_tokens is not None or params.use_beam_search):
            raise InvalidRequestError("truncate_prompt_tokens and use_beam_search do not take images",
                                      param="use_beam_search" if params.use_beam_search else "truncate_prompt_tokens")
        ids = self.truncated(ids, req.truncate_prompt_tokens, req.truncation_side)
        self.validate_prompt(ids, params)
        # A tool choice's grammar that cannot compile is the tools' schemas' fault.
        await self.compile_constraint(params.structured_outputs, "tools" if constraint else "structured_outputs")
        return Prepared(req, params, [ids], tool_format, images)

    def prepare_embedding(self, data: dict[str, Any]) -> Prepared:
        """Validate an embeddings body and tokenize its inputs (one prompt each): the params pool
        as the model's config says; InvalidRequestError naming the field."""
        req: EmbeddingRequest = self.parse(EmbeddingRequest, data)
        lora = self.check_model(req.model)
        if req.dimensions is not None and req.dimensions != self.hidden_size and not self.matryoshka:
            raise InvalidRequestError(f"dimensions: this model's embeddings have {self.hidden_size} dimensions and "
                                      f"it is not trained for fewer (no matryoshka_dimensions in its config); "
                                      f"got {req.dimensions}", param="dimensions")
        if req.dimensions is not None and req.dimensions > self.hidden_size:
            raise InvalidRequestError(f"dimensions must be <= {self.hidden_size}; got {req.dimensions}",
                                      param="dimensions")
        mode, normalize = self.info.pooling
        params = SamplingParams(max_tokens=1, pooling=mode, priority=req.priority, detokenize=False,
                                normalize=normalize if req.normalize is None else req.normalize,
                                lora_request=lora)
        prompts = [self.truncated(ids, req.truncate_prompt_tokens)
                   for ids in self.completion_prompts(req.input, req.add_special_tokens, "input")]
        for ids in prompts:
            try:
                validate_request(ids, params, self.vocab_size, self.max_model_len)
            except ValueError as e:
                raise InvalidRequestError(str(e).replace("prompt", "input", 1), param="input") from None
        return Prepared(req, params, prompts)

    @functools.cached_property
    def hidden_size(self) -> int:
        return int(self.hf_config.hidden_size)

    @functools.cached_property
    def matryoshka(self) -> bool:
        """Whether the model is trained to embed in fewer dimensions (its config says so, as
        vLLM reads it: `matryoshka_dimensions` or `is_matryoshka`)."""
        config = self.hf_config
        return bool(getattr(config, "matryoshka_dimensions", None) or getattr(config, "is_matryoshka", False))

    def thinking(self, req: ChatCompletionRequest) -> bool | None:
        """With a reasoning parser (serving.reasoning_parser), whether this request's answer starts in
        reasoning (engine/text/reasoning.py); None without one."""
        parser = self.config.serving.reasoning_parser
        return None if parser is None else thinks(parser, req.chat_template_kwargs)

    @functools.cached_property
    def think_end_ids(self) -> tuple[int, ...]:
        """The token ids of `</think>` (one special token in Qwen3's and DeepSeek-R1's vocabularies),
        encoded once per process rather than per request."""
        return tuple(self.tokenizer.encode(THINK_END, add_special_tokens=False))

    def tool_setup(self, req: ChatCompletionRequest
                   ) -> tuple[list[dict[str, Any]] | None, str | None, ToolFormat | None]:
        """(tools for the template, the structural tag that enforces tool_choice, the format to
        parse calls in); InvalidRequestError naming tools or tool_choice."""
        try:
            choice = req.effective_tool_choice()
        except ValueError as e:
            raise InvalidRequestError(str(e), param="tool_choice") from None
        if choice == "none" or not req.tools:
            return None, None, None
        if self.tool_format is None:
            raise InvalidRequestError("tools: this model has no chat template to give them to", param="tools")
        tools = req.tool_list()
        try:
            constraint = self.tool_format.constraint(tools, choice, req.parallel_tool_calls)
        except ValueError as e:
            raise InvalidRequestError(f"tools: {e}", param="tools") from None
        return tools, constraint, self.tool_format

    def token_text(self, token_id: int, lp: Logprob | None = None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    # --- small endpoints ---------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        created = now()
        base = {"id": self.model_name, "object": "model", "created": created, "owned_by": "pdserve",
                "root": self.info.model, "parent": None, "max_model_len": self.max_model_len}
        names = [{**base, "id": name} for name in self.model_names]     # a card per name, as vLLM's
        adapters = [{**base, "id": name, "root": lora.lora_path, "parent": self.model_name}
                    for name, lora in self.adapters.items()]
        return {"object": "list", "data": [*names, *adapters]}

    def model(self, name: str) -> dict[str, Any]:
        """OpenAI's GET /v1/models/{model}: the card of the base model or an adapter this server
        serves; NotFoundError naming the served models otherwise."""
        self.check_model(name)
        return next(card for card in self.models()["data"] if card["id"] == name)

    def load_adapter(self, data: dict[str, Any]) -> str:
        """vLLM's /v1/load_lora_adapter: serve the PEFT adapter at `lora_path` under `lora_name`
        (checked here against the model and max_lora_rank; each replica reads it when a request
        first needs it, so the path must be readable on every node). Adapters live in this ingress's
        table: a spec with several ingress replicas lists them in `lora.modules` instead."""
        self._check_runtime_updates()
        req: LoadLoRAAdapterRequest = self.parse(LoadLoRAAdapterRequest, data)
        if req.lora_name in self.model_names or req.lora_name in self.adapters:
            raise InvalidRequestError(f"lora_name {req.lora_name!r} is already served; unload it first",
                                      param="lora_name")
        try:
            read_adapter(req.lora_path, *self._adapter_limits)
        except ValueError as e:
            raise InvalidRequestError(str(e), param="lora_path") from None
        self.adapters[req.lora_name] = LoRARequest(req.lora_name, next(self._lora_ids), req.lora_path)
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    def unload_adapter(self, data: dict[str, Any]) -> str:
        """vLLM's /v1/unload_lora_adapter: stop serving `lora_name` (requests running under it
        finish; the replicas' slots and cached blocks for it are reused as others need them)."""
        self._check_runtime_updates()
        req: UnloadLoRAAdapterRequest = self.parse(UnloadLoRAAdapterRequest, data)
        if self.adapters.pop(req.lora_name, None) is None:
            raise NotFoundError(f"lora_name {req.lora_name!r} is not loaded; loaded: {sorted(self.adapters)}",
                                "lora_name")
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."

    def _check_runtime_updates(self) -> None:
        lora = self.config.lora
        if lora is None or not lora.allow_runtime_updates:
            raise NotFoundError("loading and unloading LoRA adapters at runtime is off; enable it with "
                                "lora.allow_runtime_updates: true in the cluster spec")

    def tokenize(self, data: dict[str, Any]) -> dict[str, Any]:
        req: TokenizeRequest = self.parse(TokenizeRequest, data)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer")
        if req.prompt is not None:
            tokens = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        else:       # (vLLM's default for a conversation: the template's special tokens alone)
            tokens, _ = self.chat_prompt(req.messages, req, add_special_tokens=bool(req.add_special_tokens))
        strs = self.tokenizer.convert_ids_to_tokens(list(tokens)) if req.return_token_strs else None
        return {"tokens": list(tokens), "count": len(tokens), "max_model_len": self.max_model_len, "token_strs": strs}

    def detokenize(self, data: dict[str, Any]) -> dict[str, Any]:
        req: DetokenizeRequest = self.parse(DetokenizeRequest, data)
        self.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"tokens must be integers in [0, {self.vocab_size}); got {bad[:5]}",
                                      param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}


def _default_name(model: str, gguf_file: str | None) -> str:
    if gguf_file:
        return gguf_file.removesuffix(".gguf")
    return os.path.basename(os.path.normpath(model))


def field_named(message: str, req: Any) -> str | None:
    """The request field a SamplingParams error begins with ("top_k must be ..."), for the 400's
    `param`; None where it names none of the request's fields."""
    first = message.split(" ", 1)[0].rstrip(":")
    return first if first in type(req).model_fields else None
