"""Request traces to replay (`pdserve simulate --trace FILE`, benchmarks/serve.py --dataset trace).

One JSON object a line, in either of two shapes (a file may mix them):

- Mooncake's (kvcache-ai/Mooncake FAST'25 traces): `timestamp` (ms from the start),
  `input_length`, `output_length` (tokens), `hash_ids` (the prompt's leading blocks of
  `block_tokens` = 512 tokens; equal ids are equal token blocks, so two requests sharing their
  first k ids share k x 512 prompt tokens). The tokens are made up: each id stands for one fixed
  block of tokens (`TraceTokens`), so a prefix cache sees the trace's reuse; prompt tokens past
  the ids are the request's own.
- pdserve's: `timestamp` (ms) and `prompt_token_ids` (a list of ints) or `prompt` (text, tokenized
  with the model's tokenizer), and `output_length` (or `max_tokens`).

A malformed line is a ValueError naming its line number and field, before anything runs.
"""
from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()                  # Mooncake: its leading blocks' ids
    prompt_token_ids: tuple[int, ...] | None = None  # pdserve's: the prompt itself
    prompt: str | None = None                        # pdserve's: text, tokenized when replayed


def _int(value: object, where: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where} must be an integer >= {low}; got {value!r}")
    return value


def parse_line(obj: object, where: str, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> TraceRequest:
    """One trace line's object; ValueError naming `where` (path:line) and the field."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a trace line is a JSON object; got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not ts >= 0:
        raise ValueError(f"{where}: timestamp must be a number of milliseconds >= 0; got {ts!r}")
    out_key = "max_tokens" if "max_tokens" in obj and "hash_ids" not in obj else "output_length"
    output_length = _int(obj.get(out_key), f"{where}: {out_key}", 1)
    if "hash_ids" in obj:
        unknown = sorted(set(obj) - {"timestamp", "input_length", "output_length", "hash_ids"})
        if unknown:
            raise ValueError(f"{where}: unknown fields {unknown} in a Mooncake line (timestamp, input_length, "
                             f"output_length, hash_ids)")
        input_length = _int(obj.get("input_length"), f"{where}: input_length", 1)
        ids = obj["hash_ids"]
        if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids):
            raise ValueError(f"{where}: hash_ids must be a list of integers >= 0")
        if len(ids) > -(-input_length // block_tokens):
            raise ValueError(f"{where}: hash_ids has {len(ids)} blocks of {block_tokens} tokens, more than "
                             f"input_length {input_length} fills")
        return TraceRequest(ts / 1000.0, input_length, output_length, tuple(ids))
    unknown = sorted(set(obj) - {"timestamp", "prompt", "prompt_token_ids", out_key})
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown} (a line has timestamp, prompt or prompt_token_ids, "
                         f"and output_length; or Mooncake's input_length and hash_ids)")
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                                         for t in ids):
            raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of token ids")
        return TraceRequest(ts / 1000.0, len(ids), output_length, prompt_token_ids=tuple(ids))
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: a line needs prompt (text), prompt_token_ids, or Mooncake's hash_ids")
    return TraceRequest(ts / 1000.0, 0, output_length, prompt=prompt)


def read_trace(path: str, block_tokens: int = MOONCAKE_BLOCK_TOKENS, limit: int | None = None,
               start_s: float = 0.0, duration_s: float | None = None) -> list[TraceRequest]:
    """The trace's requests in arrival order, from `start_s` for `duration_s` seconds (arrivals
    shifted to start at 0), at most `limit`. ValueError naming the line and field of a bad line."""
    requests = []
    try:
        f = open(path)
    except OSError as e:
        raise ValueError(f"--trace: cannot read {path}: {e}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None
            request = parse_line(obj, where, block_tokens)
            if request.arrival_s < start_s or (duration_s is not None and request.arrival_s >= start_s + duration_s):
                continue
            requests.append(request)
    if not requests:
        raise ValueError(f"--trace: {path} has no requests in the window asked for")
    requests.sort(key=lambda r: r.arrival_s)
    if limit is not None:
        requests = requests[:limit]
    first = requests[0].arrival_s if start_s else 0.0
    if first:
        requests = [TraceRequest(r.arrival_s - first, r.input_length, r.output_length, r.hash_ids,
                                 r.prompt_token_ids, r.prompt) for r in requests]
    return requests


def scale_trace(requests: list[TraceRequest], rate: float = 1.0, prompt: float = 1.0,
                output: float = 1.0) -> list[TraceRequest]:
    """The trace `rate` times faster, with prompts and outputs that many times as long (at least one
    token): a trace sized to another machine. A Mooncake request's prompt shrinks with its blocks
    (read it with block_tokens x `prompt` tokens per hash id), so the trace's reuse stays."""
    if min(rate, prompt, output) <= 0:
        raise ValueError(f"scale factors must be > 0; got rate {rate}, prompt {prompt}, output {output}")
    return [dataclasses.replace(r, arrival_s=r.arrival_s / rate,
                                input_length=max(1, round(r.input_length * prompt)) if r.hash_ids else r.input_length,
                                output_length=max(1, round(r.output_length * output))) for r in requests]


class TraceTokens:
    """The token ids a trace request's prompt stands for: each Mooncake hash id is one fixed block of
    `block_tokens` tokens (drawn from a generator seeded by the id), so prompts that share ids share
    their tokens; tokens past the ids are the request's own (seeded by its index). Text prompts are
    tokenized with `encode` (the model's tokenizer)."""

    def __init__(self, vocab_size: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS, seed: int = 0,
                 encode: Callable[[str], list[int]] | None = None, cache_blocks: int = 65536) -> None:
        self.low, self.high = min(16, vocab_size - 1), vocab_size     # past the usual special tokens
        self.block_tokens = block_tokens
        self.seed = seed
        self.encode = encode
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_blocks = cache_blocks

    def _block(self, hash_id: int) -> np.ndarray:
        block = self._blocks.get(hash_id)
        if block is None:
            rng = np.random.default_rng((self.seed, 0, hash_id))
            block = self._blocks[hash_id] = rng.integers(self.low, self.high, self.block_tokens, dtype=np.int64)
            if len(self._blocks) > self._cache_blocks:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(hash_id)
        return block

    def prompt(self, request: TraceRequest, index: int) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.prompt is not None:
            if self.encode is None:
                raise ValueError("a trace line with a text prompt needs the model's tokenizer")
            return self.encode(request.prompt)
        parts = [self._block(h) for h in request.hash_ids]
        rest = request.input_length - len(parts) * self.block_tokens
        if rest > 0:
            rng = np.random.default_rng((self.seed, 1, index))
            parts.append(rng.integers(self.low, self.high, rest, dtype=np.int64))
        return np.concatenate(parts)[:request.input_length].tolist()
