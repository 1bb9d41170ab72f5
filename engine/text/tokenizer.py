"""Tokenizer loading, chat templates and incremental detokenization."""
from __future__ import annotations

import functools
import importlib
import json
import os
from collections.abc import Callable
from typing import Any

from records.errors import InvalidRequestError
from records.gguf_file import gguf_hf_dir


def load_tokenizer(path: str, gguf_file: str | None, hf_config: Any | None = None) -> Any | None:
    """The model's HF tokenizer, or None if the checkpoint ships none (token-id prompts only). A GGUF
    file's comes converted once and saved (records/gguf_file.py: gguf_hf_dir). `hf_config`: the
    model's config where the caller resolved it already (a FrozenConfig will do; `_known_config`)."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    try:
        if gguf_file is not None:
            path = gguf_hf_dir(path, gguf_file)
            if not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
                return None                 # the file has none
        return AutoTokenizer.from_pretrained(path, **_known_config(path, hf_config))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _known_config(path: str, hf_config: Any | None) -> dict[str, Any]:
    """AutoTokenizer's `config` argument, where handing it the resolved config changes nothing: the
    tokenizer's config names its class and no remote code (AutoTokenizer then reads only the config's
    model type and names). Without it AutoTokenizer resolves the model's config again, which imports
    transformers' config class for it: ~1.5 s of CPU in an engine replica, which needs nothing else
    of it (the chain reaches torch.distributed.tensor and sympy)."""
    if hf_config is None:
        return {}
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            declared = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(declared, dict) or not declared.get("tokenizer_class") or "auto_map" in declared:
        return {}
    return {"config": hf_config}


_SHARED: dict[tuple[str, str | None], Any] = {}       # (the 8 models last loaded, oldest first)


def shared_tokenizer(path: str, gguf_file: str | None, hf_config: Any | None = None) -> Any | None:
    """`load_tokenizer`, once per process for each model: what engines use (they never change it),
    so that the engines of one process share it (a replay's hundreds, a simulated replica host's;
    loading one takes seconds). A caller that changes its tokenizer (a chat template) loads its own."""
    return once_per_process(_SHARED, (path, gguf_file), lambda: load_tokenizer(path, gguf_file, hf_config))


def once_per_process(memo: dict, key: Any, load: Callable[[], Any]) -> Any:
    """`memo[key]`, made by `load()` the first time: a process's tokenizers of the 8 models it last
    loaded (the oldest dropped first)."""
    if key not in memo:
        if len(memo) == 8:
            del memo[next(iter(memo))]
        memo[key] = load()
    return memo[key]


def eos_token_ids(tokenizer: Any | None, hf_config: Any, path: str) -> frozenset[int]:
    """EOS ids from the tokenizer, the model config and generation_config.json."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    try:
        if os.path.isdir(path):   # its generation_config.json as GenerationConfig reads it, without transformers
            with open(os.path.join(path, "generation_config.json")) as f:
                generation = json.load(f)
            add(generation.get("eos_token_id") if isinstance(generation, dict) else None)
        else:
            from transformers import GenerationConfig  # noqa: PLC0415

            add(GenerationConfig.from_pretrained(path).eos_token_id)
    except (OSError, ValueError):
        pass
    return frozenset(ids)


def bad_words_token_ids(words: list[str], tokenizer: Any) -> list[list[int]]:
    """vLLM's reading of `bad_words`: each word's token ids as it would begin the text and, where the
    word after a space starts with another token and has as many, as it would follow another word
    (so that both "Paris" and " Paris" are kept out of the output)."""
    out: list[list[int]] = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out += [ids for ids in (alone, spaced if alone and spaced and spaced[0] != alone[0]
                                and len(spaced) == len(alone) else []) if ids]
    return out


def tokenize_bad_words(params: Any, tokenizer: Any) -> None:
    """Fill a request's SamplingParams.bad_words_token_ids from its bad_words, where the request is
    tokenized (an ingress's preparer, or the engine for a request no ingress prepared), once;
    InvalidRequestError naming the field where the model has no tokenizer."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return
    if tokenizer is None:
        raise InvalidRequestError("bad_words: this model has no tokenizer to read them with", param="bad_words")
    params.bad_words_token_ids = bad_words_token_ids(params.bad_words, tokenizer)


# Template variables that apply_chat_template sets itself: chat_template_kwargs may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                      "continue_final_message", "tokenize", "return_dict", "chat_template"})


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                        continue_final_message: bool = False,
                        template_kwargs: dict[str, Any] | None = None,
                        chat_template: str | None = None, tokenize: bool = True,
                        documents: list[dict[str, str]] | None = None, add_special_tokens: bool = False) -> Any:
    """The conversation's prompt token ids (its text with `tokenize` False: a vision-language
    model's processor tokenizes it with its images; `tools` in OpenAI's shape, for templates that render
    them: engine/text/tool_calls.py prepares both), with vLLM's chat options: the generation prompt
    (default), or `continue_final_message` (the last message, an assistant's, left open for the
    model to continue), and `template_kwargs` (vLLM's chat_template_kwargs: more variables for the
    template, e.g. Qwen3's enable_thinking); `chat_template` in place of the tokenizer's (vLLM's);
    `documents` for a template that renders them; `add_special_tokens`: the tokenizer's own (a BOS)
    on top of what the template writes (vLLM's chat option, off by default there too). ValueError
    naming the field when there is no chat template, the options conflict, or the
    template refuses the conversation."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: send token ids")
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("this model has no chat template: send a plain prompt, or give one (LLM.chat's "
                         "chat_template, `pdserve serve --chat-template`, serving.chat_template)")
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message needs add_generation_prompt=false (the last message is "
                         "continued, not answered)")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message needs the last message to be the assistant's")
    clash = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or ()))
    if clash:
        raise ValueError(f"chat_template_kwargs must not set {clash}: those are the request's own fields")
    from jinja2 import TemplateError  # noqa: PLC0415

    extra = dict(template_kwargs or {}, **({} if documents is None else {"documents": documents}))
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message,
                                            tokenize=tokenize and not add_special_tokens,
                                            chat_template=chat_template, **extra)
    except TemplateError as e:       # the template refused the conversation (e.g. roles out of order)
        raise ValueError(f"messages: the model's chat template refused them: {e}") from None
    if not tokenize:
        return ids
    if add_special_tokens:
        return list(tokenizer.encode(ids, add_special_tokens=True))
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window (from `prefix_offset`) and emits only what was added since the last call,
    holding back text that ends in U+FFFD: a multi-byte character split across tokens appears only
    once all of its bytes have arrived.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Without spaces between special tokens (vLLM's option): a special token that follows another is
        # written as its own text; None where the option changes nothing.
        self._special: dict[int, str] | None = None
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._special = _added_tokens(tokenizer) or None
        self._last_special = False
        self.token_ids: list[int] = []
        # Start from a few prompt tokens so the first output token decodes with its left context
        # (a leading space, for instance).
        self.context = list(prompt_token_ids[-5:])
        self.prefix_offset = 0
        self.read_offset = len(self.context)
        self.output_text = ""

        # The Rust tokenizer itself where the HF decode only wraps it: the wrapper's argument
        # conversion and checks were four fifths of the time per token (docs/perf/journal.md §8).
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend if backend is not None and _decode_wraps_backend(type(tokenizer)) else None

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def update(self, new_token_ids: list[int]) -> str:
        """Append tokens; returns the new text (possibly empty) and extends `output_text`."""
        if self._special is not None:
            return "".join(self._update_one(t) for t in new_token_ids)
        return self._update(new_token_ids)

    def _update_one(self, token_id: int) -> str:
        delta = self._update([token_id])
        special = self._special.get(token_id)
        if special is not None and self._last_special and delta != special and delta.lstrip() == special:
            self.output_text = self.output_text[:len(self.output_text) - len(delta)] + special
            delta = special
        self._last_special = special is not None
        return delta

    def _update(self, new_token_ids: list[int]) -> str:
        self.token_ids.extend(new_token_ids)
        self.context.extend(new_token_ids)
        prefix_text = self._decode(self.context[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.context[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.context)
        self.output_text += delta
        return delta



def _added_tokens(tokenizer: Any) -> dict[int, str]:
    """The tokenizer's added (special) tokens by id: their text."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
        return {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {i: getattr(t, "content", str(t)) for i, t in decoder.items()}


@functools.cache
def _decode_wraps_backend(cls: type) -> bool:
    """Whether `cls.decode` (without clean-up) only wraps its Rust tokenizer's `decode`: fast
    tokenizers that do not override `_decode`, and the engine's BackendTokenizer."""
    if getattr(cls, "DECODES_WITH_BACKEND", False):
        return True
    for module, name in (("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
                         ("transformers.tokenization_utils_fast", "PreTrainedTokenizerFast")):
        try:
            base = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        if issubclass(cls, base) and cls._decode is base._decode:
            return True
    return False
