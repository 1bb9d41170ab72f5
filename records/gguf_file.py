"""A GGUF model file: its tensors and scalar metadata read once per process (`gguf_reader`), and
its HF config and tokenizer as transformers converts them, saved once (`gguf_hf_dir`).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from records.cache_dirs import cache_root, file_key


def gguf_reader(file: str) -> Any:
    """The GGUF file's tensors and scalar metadata: gguf-py's reader with the metadata's arrays
    skipped (`_tensor_reader`), once per process and version of the file (a load asks twice: the
    quantization check, the weights). The tokenizer's arrays, which pdserve reads from the converted
    tokenizer (gguf_hf_dir), made gguf-py's full parse take ~3.5 s of every process that resolved
    the embedded model (the launcher, the pools' manager, each replica)."""
    st = os.stat(file)
    return _gguf_reader(os.path.abspath(file), st.st_size, st.st_mtime_ns)


def gguf_architecture(reader: Any) -> str:
    """The architecture a GGUF file names (`general.architecture`: "llama", "qwen2", ...), or
    "unknown" where it names none."""
    field = reader.fields.get("general.architecture")
    return bytes(field.parts[field.data[0]]).decode() if field is not None else "unknown"


@functools.lru_cache(maxsize=4)
def _gguf_reader(file: str, size: int, mtime_ns: int) -> Any:
    return _tensor_reader()(file)


@functools.cache
def _tensor_reader() -> type:
    import struct  # noqa: PLC0415

    from gguf import GGUFReader, GGUFValueType  # noqa: PLC0415 - only GGUF models need it

    sizes = {int(t): GGUFReader.gguf_scalar_to_np[t]().itemsize for t in GGUFReader.gguf_scalar_to_np}

    class TensorReader(GGUFReader):
        """gguf-py's reader whose `fields` keep the scalars and strings but not the arrays: each
        array is stepped over by its lengths instead of becoming one numpy view per element (the
        tensors are gguf-py's own, from the same offsets)."""

        def _build_fields(self, offs: int, count: int) -> int:
            if self.byte_order != "I":      # a file of the other byte order: gguf-py's own walk
                return super()._build_fields(offs, count)
            buf = memoryview(self.data)
            for _ in range(int(count)):
                value = offs + 8 + struct.unpack_from("<Q", buf, offs)[0]      # past the key
                if struct.unpack_from("<I", buf, value)[0] != GGUFValueType.ARRAY:
                    offs = super()._build_fields(offs, 1)
                    continue
                item, n = struct.unpack_from("<IQ", buf, value + 4)
                end = value + 16
                if item == GGUFValueType.STRING:
                    for _ in range(n):
                        end += 8 + struct.unpack_from("<Q", buf, end)[0]
                elif item in sizes:
                    end += n * sizes[item]
                else:                       # arrays of arrays: gguf-py's own walk
                    end = super()._build_fields(offs, 1)
                offs = end
            return offs

    return TensorReader


def gguf_hf_dir(path: str, gguf_file: str) -> str:
    """A directory holding the GGUF file's HF config and tokenizer as transformers converts them
    (config.json; tokenizer.json, tokenizer_config.json and the chat template where the file has a
    tokenizer), converted once and kept under $PDSERVE_GGUF_CACHE (else ~/.cache/pdserve/gguf, else
    a temp dir), keyed by the file's path, size and mtime and the transformers version. Converting
    parses the whole file (~5 s for the embedded model, once for the config and the tokenizer
    together: `computed_once`), which every process that loads it would do (engine replicas, the
    ingress); the saved files load in a fraction of a second and are the same config and tokenizer
    (tests/engine/test_quant.py compares them).
    Raises what AutoConfig.from_pretrained(gguf_file=...) raises for a file it cannot read."""
    import transformers  # noqa: PLC0415 - heavy; configs import without it
    from transformers import AutoConfig, AutoTokenizer, modeling_gguf_pytorch_utils  # noqa: PLC0415

    root = _gguf_cache_root()
    target = os.path.join(root, file_key(os.path.join(path, gguf_file), transformers.__version__))
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    # Both conversions parse the whole file for its metadata (the tokenizer's, for the model type):
    # once is enough.
    with computed_once(modeling_gguf_pytorch_utils, "load_gguf_checkpoint", copies=True):
        config = AutoConfig.from_pretrained(path, gguf_file=gguf_file)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
        except (OSError, ValueError, TypeError, KeyError):
            tokenizer = None                # token-id prompts only (engine/text/tokenizer.py)
    os.makedirs(root, exist_ok=True)
    staging = tempfile.mkdtemp(dir=root, prefix=".staging-")
    try:
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        config.save_pretrained(staging)
        os.rename(staging, target)          # whole or not at all: another process may read it now
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)      # another process renamed its copy first
        if not os.path.isfile(os.path.join(target, "config.json")):
            raise
    return target


_PATCHING = threading.RLock()


@contextlib.contextmanager
def computed_once(module: Any, name: str, copies: bool = False) -> Iterator[None]:
    """While the block runs, `module.<name>` (a function of its arguments alone, which transformers'
    GGUF code looks up at each call and calls again and again with the same arguments) answers each
    set of arguments from its first call; with `copies`, each answer is a deep copy of that one, for
    callers that change what they get. One block at a time in a process: it patches the module."""
    with _PATCHING:
        function, answers = getattr(module, name), {}

        def once(*args: Any, **kwargs: Any) -> Any:
            try:
                key = (args, tuple(sorted(kwargs.items())))
                hash(key)
            except TypeError:
                return function(*args, **kwargs)
            if key not in answers:
                answers[key] = function(*args, **kwargs)
            return copy.deepcopy(answers[key]) if copies else answers[key]

        setattr(module, name, once)
        try:
            yield
        finally:
            setattr(module, name, function)


def _gguf_cache_root() -> str:
    return cache_root("gguf", "PDSERVE_GGUF_CACHE")
