"""SamplingParams: what to generate and how to pick each token (vLLM-compatible names).

Validation happens in `__post_init__`: bad values raise ValueError naming the field and the
allowed range, before anything reaches the engine. Every value a step will use is checked here, so
that no request can make a step raise: integers fit int64 (seeds: torch's full seed range), floats
are finite, and the list fields are capped (`MAX_STOP_STRINGS` strings of at most
`MAX_STOP_STRING_CHARS` characters, `MAX_STOP_TOKEN_IDS` stop tokens). What depends on the model
(token ids below the vocabulary, lengths within max_model_len, n within max_num_seqs) is checked by
`validate_request` below (once a request: by the HTTP ingress, or by the offline engine), and
what depends on one engine's limits by `check_limits` (every engine a prepared request reaches).
"""
from __future__ import annotations

import json
import math
from array import array
from dataclasses import dataclass, field
from typing import Any

from records.errors import InvalidRequestError
from records.lora import LoRARequest

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# torch.Generator.manual_seed takes [-2**63, 2**64): every such seed is accepted.
SEED_MIN, SEED_MAX = INT64_MIN, (1 << 64) - 1
# Stop strings are searched in the text after every token, and the longest one minus a character is
# held back from a stream until it cannot start a stop string: both are bounded here (OpenAI allows
# 4 strings; vLLM no limit).
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_ALLOWED_TOKEN_IDS = 1 << 20
MAX_BAD_WORDS = 256
MAX_START_AFTER_TOKENS = 64         # structured_outputs.start_after: searched for in the output each step
# What the engine returns for a request each step it advances (vLLM's RequestOutputKind): the whole
# output so far, only what is new since the last one (the serving path), or nothing until it ends
# (the offline `LLM`, which reads only the final outputs).
OUTPUT_KINDS = ("cumulative", "delta", "final_only")
# How an embedding request pools its prompt's final hidden states (after the model's last norm):
# the last token's, the mean over every token, or the first token's (a sentence-transformers "cls").
POOLING = ("last", "mean", "cls")


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's `structured_outputs`): exactly one of a JSON
    schema (`json`: a dict or its JSON text), a regular expression, a list of choices, an EBNF
    grammar (GBNF/xgrammar syntax), `json_object=True` (any JSON object), or an xgrammar
    `structural_tag` (a dict or its JSON text: free text with tagged, schema-checked spans, as tool
    calls use: engine/text/tool_calls.py). The engine masks every token the constraint does not allow at
    each step (engine/sample/structured_output.py).

    `start_after` (token ids): the constraint starts after the first place the output holds these
    tokens in a row, and the output is free until then: a thinking model's `</think>`, which the
    server sets under a reasoning parser so that the model thinks freely and the constraint shapes
    the answer (vLLM's default). Empty: constrained from the first token."""
    json: Any = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: Any = None
    start_after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        _check(len(given) == 1, "structured_outputs", f"exactly one of {STRUCTURED_KINDS}",
               given or "none")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json must be a JSON schema (an object); it does not "
                                     f"parse: {e}") from e
            else:
                parsed = self.json
            _check(isinstance(parsed, dict), "structured_outputs.json", "a JSON schema (an object)",
                   type(parsed).__name__)
        if isinstance(self.structural_tag, dict):
            object.__setattr__(self, "structural_tag", json.dumps(self.structural_tag, sort_keys=True))
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value != ""), f"structured_outputs.{name}",
                   "a non-empty string", value)
        if self.choice is not None:
            _check(isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
                   and all(isinstance(c, str) for c in self.choice), "structured_outputs.choice",
                   "a non-empty list of strings", self.choice)
            object.__setattr__(self, "choice", tuple(self.choice))
        _check(isinstance(self.json_object, bool), "structured_outputs.json_object", "true or false", self.json_object)
        _check(isinstance(self.start_after, (list, tuple)) and len(self.start_after) <= MAX_START_AFTER_TOKENS
               and all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.start_after),
               "structured_outputs.start_after", f"a list of at most {MAX_START_AFTER_TOKENS} token ids",
               self.start_after)
        object.__setattr__(self, "start_after", tuple(self.start_after))

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): what a compiled grammar is cached under."""
        kind = self.kind
        if kind == "json":
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        elif kind == "choice":
            text = json.dumps(list(self.choice))
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        return kind, text


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                      # -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16          # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None          # top-N logprobs per generated token (plus the chosen one)
    prompt_logprobs: int | None = None   # top-N logprobs per prompt token
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit before sampling (OpenAI's)
    allowed_token_ids: list[int] | None = None   # only these may be sampled (vLLM's); None: any
    # Words never generated (vLLM's bad_words): a word's last token is masked wherever the output
    # ends with its other tokens. `bad_words_token_ids` are the words tokenized as vLLM reads them
    # (engine/text/tokenizer.py: bad_words_token_ids), set where the request is tokenized.
    bad_words: str | list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    skip_special_tokens: bool = True
    # vLLM's: False (with skip_special_tokens False) writes a special token that follows another
    # as its bare text, with no space a tokenizer's decoder might put before it
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    priority: int = 0                    # lower runs first under scheduling_policy="priority"
    extra_keys: tuple = field(default_factory=tuple)  # e.g. a cache salt: part of the block hash
    output_kind: str = "cumulative"      # one of OUTPUT_KINDS
    structured_outputs: StructuredOutputsParams | None = None   # a dict of its fields is accepted too
    lora_request: LoRARequest | None = None   # run under this adapter (records/lora.py; LLM.generate's argument)
    # An embedding, not a generation: the prompt is run and its hidden states pooled (POOLING),
    # L2-normalized with `normalize`; nothing is sampled (RequestOutput.embedding; LLM.embed).
    pooling: str | None = None
    normalize: bool = True
    # Beam search (vLLM's names; engine/beam_search.py): `best_of` beams (default n), the best n
    # returned, ranked by sum of logprobs / length ** length_penalty; early_stopping True, False
    # or "never", as transformers' generate takes them. Greedy scoring: temperature is not used.
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            fields = (*STRUCTURED_KINDS, "start_after")
            unknown = sorted(set(self.structured_outputs) - set(fields))
            _check(not unknown, "structured_outputs", f"fields among {fields}", unknown)
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "None, a StructuredOutputsParams or a dict of its fields",
               type(self.structured_outputs).__name__)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.stop, (list, tuple)) or self.stop is None, "stop",
               "a string or a list of strings", self.stop)
        self.stop = list(self.stop or [])
        _check(isinstance(self.stop_token_ids, (list, tuple)) or self.stop_token_ids is None,
               "stop_token_ids", "a list of token ids", self.stop_token_ids)
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_int("n", self.n, 1, INT64_MAX)
        _check_float("temperature", self.temperature, ">= 0", self.temperature >= 0)
        _check_float("top_p", self.top_p, "in (0, 1]", 0 < self.top_p <= 1)
        _check(_is_int(self.top_k) and (self.top_k == -1 or 1 <= self.top_k <= INT64_MAX), "top_k",
               "-1 (disabled) or an integer in [1, 2**63 - 1] (values above the vocabulary keep every token)",
               self.top_k)
        _check_float("min_p", self.min_p, "in [0, 1]", 0 <= self.min_p <= 1)
        _check_float("presence_penalty", self.presence_penalty, "in [-2, 2]", -2 <= self.presence_penalty <= 2)
        _check_float("frequency_penalty", self.frequency_penalty, "in [-2, 2]",
                     -2 <= self.frequency_penalty <= 2)
        _check_float("repetition_penalty", self.repetition_penalty, "in (0, 2]",
                     0 < self.repetition_penalty <= 2)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, INT64_MAX, " (or None)")
        _check_int("min_tokens", self.min_tokens, 0, INT64_MAX)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, 20, " (or None)")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, 20, " (or None)")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings",
               f"{len(self.stop)} strings")
        _check(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop), "stop",
               f"non-empty strings of at most {MAX_STOP_STRING_CHARS} characters", self.stop)
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"at most {MAX_STOP_TOKEN_IDS} token ids", f"{len(self.stop_token_ids)} ids")
        _check(all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids), "stop_token_ids",
               "non-negative token ids", self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            _check(isinstance(ids, (list, tuple)) and 0 < len(ids) <= MAX_ALLOWED_TOKEN_IDS
                   and all(_is_int(t) and 0 <= t <= INT64_MAX for t in ids), "allowed_token_ids",
                   f"a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} non-negative token ids (or None)", ids)
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
            _check(isinstance(words, (list, tuple)) and len(words) <= MAX_BAD_WORDS
                   and all(isinstance(w, str) and w.strip() and len(w) <= MAX_STOP_STRING_CHARS for w in words),
                   "bad_words", f"a list of at most {MAX_BAD_WORDS} non-blank strings of at most "
                   f"{MAX_STOP_STRING_CHARS} characters (or None)", self.bad_words)
            self.bad_words = list(words)
        if self.bad_words_token_ids is not None:
            ids = self.bad_words_token_ids
            _check(isinstance(ids, (list, tuple)) and all(
                isinstance(w, (list, tuple)) and w and all(_is_int(t) and 0 <= t <= INT64_MAX for t in w) for w in ids),
                "bad_words_token_ids", "lists of non-negative token ids, one a word (or None)", ids)
            self.bad_words_token_ids = [list(w) for w in ids]
        if self.seed is not None:
            _check_int("seed", self.seed, SEED_MIN, SEED_MAX, " (or None)")
        _check_int("priority", self.priority, INT64_MIN, INT64_MAX)
        _check(self.output_kind in OUTPUT_KINDS, "output_kind", f"one of {OUTPUT_KINDS}", self.output_kind)
        self.extra_keys = tuple(self.extra_keys)
        if self.best_of is not None and not self.use_beam_search:
            # OpenAI's default (best_of 1 = n 1) means nothing more; sampling more candidates to return
            # the best n is not done here (nor by vLLM's current engine, which ignores it)
            _check(self.best_of == self.n, "best_of", f"n ({self.n}) without use_beam_search (more candidates "
                   "than n are a beam search's width)", self.best_of)
            self.best_of = None
        if self.best_of is not None:
            _check_int("best_of", self.best_of, self.n, 10, f" (>= n, {self.n})")
        _check_float("length_penalty", self.length_penalty, "", True)
        _check(self.early_stopping in (True, False, "never"), "early_stopping", 'true, false or "never"',
               self.early_stopping)
        if self.use_beam_search:
            _check(self.n <= 10, "n", "<= 10 with use_beam_search", self.n)
        _check(self.pooling is None or self.pooling in POOLING, "pooling", f"None or one of {POOLING}", self.pooling)
        if self.pooling is not None:
            _check(self.n == 1, "n", "1 for an embedding", self.n)
            _check(self.logprobs is None and self.prompt_logprobs is None, "logprobs",
                   "None for an embedding", self.logprobs if self.logprobs is not None else self.prompt_logprobs)
            _check(self.structured_outputs is None, "structured_outputs", "None for an embedding",
                   self.structured_outputs)
        _check(self.lora_request is None or isinstance(self.lora_request, LoRARequest), "lora_request",
               "None or a LoRARequest", type(self.lora_request).__name__)

    @property
    def cache_keys(self) -> tuple:
        """What the block hashes of this request's KV are keyed by besides its tokens: `extra_keys`
        and its adapter (records/hashing.py)."""
        return self.extra_keys if self.lora_request is None else (*self.extra_keys, self.lora_request.cache_key)

    @property
    def adapter_name(self) -> str:
        """The name of the LoRA adapter this request runs under ("" for the base model)."""
        return "" if self.lora_request is None else self.lora_request.lora_name

    @property
    def reads_whole_prompt(self) -> bool:
        """Whether every prompt position must be computed here (prompt logprobs, mean or first-token
        pooling): such a request takes no prefix-cache or offload-tier hits."""
        return self.prompt_logprobs is not None or self.pooling in ("mean", "cls")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def clone(self) -> SamplingParams:
        return SamplingParams(**{f: getattr(self, f) for f in self.__dataclass_fields__})


def _logit_bias(bias: object) -> dict[int, float] | None:
    """OpenAI's logit_bias as {token id: bias}: keys ints or their decimal strings (JSON's object
    keys), values in [-100, 100] (-100 bans a token, 100 all but forces it); None when empty."""
    _check(isinstance(bias, dict), "logit_bias", "a mapping of token ids to numbers", bias)
    out = {}
    for key, value in bias.items():
        tid = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        _check(_is_int(tid) and 0 <= tid <= INT64_MAX, "logit_bias", "keyed by non-negative token ids", key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and -100 <= value <= 100
        _check(ok, "logit_bias", "a mapping to numbers in [-100, 100]", {key: value})
        out[tid] = float(value)
    return out or None


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        shown = repr(value)
        raise ValueError(f"{name} must be {allowed}; got {shown[:200]}{'...' if len(shown) > 200 else ''}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, lo: int, hi: int, extra: str = "") -> None:
    _check(_is_int(value) and lo <= value <= hi, name,  # type: ignore[operator]
           f"an integer in [{_bound(lo)}, {_bound(hi)}]{extra}", value)


def _bound(v: int) -> str:
    named = {INT64_MIN: "-2**63", INT64_MAX: "2**63 - 1", SEED_MAX: "2**64 - 1"}
    return named.get(v, str(v))


def _check_float(name: str, value: object, allowed: str, in_range: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    _check(ok and in_range, name, f"a finite number {allowed}", value)


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
                     max_model_len: int, max_num_seqs: int | None = None) -> None:
    """Raise InvalidRequestError (a ValueError) naming the field if the request cannot run on a model
    with this vocabulary, context length and batch size (the ingress's preparer and the offline
    engine call it, once a request). With SamplingParams' own checks, nothing that passes can make a
    step raise."""
    if not prompt_token_ids:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    try:     # C-level: a 100k-token prompt is checked in about a millisecond
        packed = array("q", prompt_token_ids)         # TypeError for a non-integer, OverflowError past int64
        ok = min(packed) >= 0 and max(packed) < vocab_size
    except (TypeError, OverflowError):
        ok = False
    if not ok:
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        raise InvalidRequestError(f"prompt_token_ids must be integers in [0, {vocab_size}); got {bad[:5]}",
                                  param="prompt")
    check_limits(len(prompt_token_ids), params, max_model_len, max_num_seqs)   # (the lengths first, as before)
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidRequestError(f"stop_token_ids must be token ids in [0, {vocab_size}); got {bad[:5]}",
                                  param="stop_token_ids")
    spec = params.structured_outputs
    bad = [t for t in spec.start_after if t >= vocab_size] if spec is not None else []
    if bad:
        raise InvalidRequestError(f"structured_outputs.start_after must be token ids in [0, {vocab_size}); "
                                  f"got {bad[:5]}", param="structured_outputs")
    bad = [t for t in params.logit_bias or () if t >= vocab_size]
    if bad:
        raise InvalidRequestError(f"logit_bias must be keyed by token ids in [0, {vocab_size}); got {bad[:5]}",
                                  param="logit_bias")
    bad = [t for t in params.allowed_token_ids or () if t >= vocab_size]
    if bad:
        raise InvalidRequestError(f"allowed_token_ids must be token ids in [0, {vocab_size}); got {bad[:5]}",
                                  param="allowed_token_ids")
    bad = [t for word in params.bad_words_token_ids or () for t in word if t >= vocab_size]
    if bad:
        raise InvalidRequestError(f"bad_words must tokenize to ids in [0, {vocab_size}); got {bad[:5]}",
                                  param="bad_words")


def check_limits(num_prompt_tokens: int, params: SamplingParams, max_model_len: int,
                 max_num_seqs: int | None = None) -> None:
    """The part of `validate_request` that depends on one engine's limits, not on the model: what an
    engine checks of a request its ingress prepared (its ids already checked against the vocabulary)."""
    limit = max_model_len
    if num_prompt_tokens >= limit:
        raise InvalidRequestError(f"prompt has {num_prompt_tokens} tokens; max_model_len is {limit}, "
                                  f"so the prompt must have fewer than {limit} tokens", param="prompt")
    room = limit - num_prompt_tokens
    if params.max_tokens is not None and params.max_tokens > room:
        raise InvalidRequestError(f"max_tokens must be <= {room} for this "
                                  f"{num_prompt_tokens}-token prompt (max_model_len={limit}); "
                                  f"got {params.max_tokens}", param="max_tokens")
    if params.min_tokens > room:
        raise InvalidRequestError(f"min_tokens must be <= {room} for this {num_prompt_tokens}-token prompt "
                                  f"(max_model_len={limit}); got {params.min_tokens}", param="min_tokens")
    if max_num_seqs is not None and params.n > max_num_seqs:
        raise InvalidRequestError(f"n must be <= {max_num_seqs} (max_num_seqs: the sequences that run at "
                                  f"once); got {params.n}", param="n")
    if params.prompt_logprobs is not None and params.n > 1:
        raise InvalidRequestError("prompt_logprobs must be None when n > 1", param="prompt_logprobs")
