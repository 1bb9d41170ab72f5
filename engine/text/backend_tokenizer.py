"""BackendTokenizer: a model's tokenizer as an engine decodes with it, read back without transformers.

An engine replica needs little of its tokenizer: to decode (its detokenizer, a logprob's token text)
and the EOS token. Loading the HF tokenizer for that imported transformers: ~2.6 of the ~3.3 cpu-s of
an engine's start after torch (docs/perf/journal.md §51), paid again by every replica, rank-0 worker
and restarted or woken replica on the machine. So the first engine process on a machine that loads a
model's HF tokenizer keeps what decoding needs when the HF decode is its Rust tokenizer's own (a fast
tokenizer whose class does not override decoding, no clean-up of spaces applied): the Rust tokenizer
as the HF class left it, and the plain values an engine reads (`KEPT`). It lies under
$PDSERVE_TOKENIZER_CACHE (else ~/.cache/pdserve/tokenizers), keyed by the tokenizer's files with
their sizes and mtimes, the transformers and tokenizers versions and this module's code; a later
process reads it back with the `tokenizers` library alone. Anything else (encoding text, chat
templates, grammars) is the HF tokenizer's, loaded on first use (`BackendTokenizer.hf`).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
from typing import Any

from engine.text.tokenizer import once_per_process, shared_tokenizer
from records.cache_dirs import cache_root, file_key, source_digest, write_entry

# The HF tokenizer's plain values an engine may read; the rest comes from the HF tokenizer itself.
KEPT = ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "all_special_ids", "all_special_tokens",
        "vocab_size", "model_max_length")
KEEP_ENTRIES = 32                 # models kept per machine (the newest)
# The files a tokenizer is read from (those present key its cache entry).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")


class BackendTokenizer:
    """Decodes as the model's HF tokenizer does (`decode`, the `KEPT` values) with its Rust
    tokenizer; for anything else, the HF tokenizer (`hf`, loaded on first use)."""

    DECODES_WITH_BACKEND = True       # (engine/text/tokenizer.py's detokenizer calls `_tokenizer` itself)

    def __init__(self, backend: Any, values: dict[str, Any], path: str, gguf_file: str | None,
                 hf_config: Any | None = None) -> None:
        self._tokenizer = backend       # (the name HF tokenizers give their Rust tokenizer)
        self._values = values
        self._source = (path, gguf_file, hf_config)
        self._hf: Any = None

    @property
    def hf(self) -> Any:
        """The model's HF tokenizer (loaded once per process)."""
        if self._hf is None:
            self._hf = shared_tokenizer(*self._source)
        return self._hf

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        if clean_up_tokenization_spaces:           # (kept only where the HF tokenizer applies none)
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                  clean_up_tokenization_spaces=True)
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name: str) -> Any:
        # (only called for names the object itself lacks)
        values = self.__dict__.get("_values")
        if values is None or name.startswith("__"):
            raise AttributeError(name)
        if name in values:
            return values[name]
        return getattr(self.hf, name)


def hf_tokenizer(tokenizer: Any) -> Any:
    """The HF tokenizer behind an engine's tokenizer (itself where it is one; None stays None)."""
    return tokenizer.hf if isinstance(tokenizer, BackendTokenizer) else tokenizer


_IN_PROCESS: dict[tuple[str, str | None], Any] = {}


def engine_tokenizer(path: str, gguf_file: str | None, hf_config: Any | None = None) -> Any | None:
    """The tokenizer an engine decodes with, once per process for each model (the engines of a
    process share it, as `shared_tokenizer`'s): a BackendTokenizer where this machine kept one for
    the model, else `shared_tokenizer`'s HF tokenizer (None where the model has none), kept for the
    next process when its decode is its Rust tokenizer's."""
    return once_per_process(_IN_PROCESS, (path, gguf_file), lambda: _load(path, gguf_file, hf_config))


def _load(path: str, gguf_file: str | None, hf_config: Any | None) -> Any | None:
    file = _cache_file(path, gguf_file)
    if file is not None:
        kept = _read(file, path, gguf_file, hf_config)
        if kept is not None:
            return kept
    tokenizer = shared_tokenizer(path, gguf_file, hf_config)
    if file is not None and tokenizer is not None and _decodes_with_its_backend(tokenizer):
        _store(file, tokenizer)
    return tokenizer


def _decodes_with_its_backend(tokenizer: Any) -> bool:
    """Whether the HF tokenizer's `decode` (with its class's defaults) is its Rust tokenizer's decode:
    neither `decode` nor `_decode` overridden, no clean-up of spaces."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase  # noqa: PLC0415 - loaded with it

    from engine.text.tokenizer import _decode_wraps_backend  # noqa: PLC0415

    cls = type(tokenizer)
    return (getattr(tokenizer, "_tokenizer", None) is not None and _decode_wraps_backend(cls)
            and cls.decode is PreTrainedTokenizerBase.decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False))


def _read(file: str, path: str, gguf_file: str | None, hf_config: Any | None) -> BackendTokenizer | None:
    try:
        with open(file) as f:
            kept = json.load(f)
        from tokenizers import Tokenizer  # noqa: PLC0415

        return BackendTokenizer(Tokenizer.from_str(kept["backend"]), kept["values"], path, gguf_file, hf_config)
    except Exception:  # noqa: BLE001 - absent, truncated or another version's: loaded again
        return None


def _store(file: str, tokenizer: Any) -> None:
    """Keep the entry and the `KEEP_ENTRIES` newest ones (one is a tokenizer.json: megabytes); a
    cache that cannot be written only costs the next process the HF tokenizer's load."""
    values = {name: getattr(tokenizer, name, None) for name in KEPT}
    root = os.path.dirname(file)
    try:
        write_entry(file, json.dumps({"backend": tokenizer._tokenizer.to_str(), "values": values}).encode())
        entries = sorted((e for e in os.scandir(root) if e.name.endswith(".json")), key=lambda e: e.stat().st_mtime)
        for old in entries[:-KEEP_ENTRIES]:
            os.unlink(old.path)
    except (OSError, TypeError, ValueError):    # (a value that is not plain data: kept nowhere)
        pass


def _cache_file(path: str, gguf_file: str | None) -> str | None:
    """The cache entry of a model's tokenizer, or None where its files are not local."""
    if gguf_file is not None:
        sources = [os.path.join(path, gguf_file)]     # (its tokenizer comes converted from the file)
    else:
        sources = [os.path.join(path, name) for name in TOKENIZER_FILES]
    sources = [s for s in sources if os.path.isfile(s)]
    if not sources:
        return None
    try:
        versions = [importlib.metadata.version("transformers"), importlib.metadata.version("tokenizers"),
                    _reading_code()]
        keys = [file_key(s, *versions) for s in sources]
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    name = hashlib.sha256("|".join(keys).encode()).hexdigest()[:32] + ".json"
    return os.path.join(cache_root("tokenizers", "PDSERVE_TOKENIZER_CACHE"), name)


@functools.cache
def _reading_code() -> str:
    """A digest of how a tokenizer is loaded and kept (this module and engine/text/tokenizer.py)."""
    return source_digest(__file__, shared_tokenizer.__code__.co_filename)
