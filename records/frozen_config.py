"""FrozenConfig: a transformers model config's values, read once where the config was resolved, as
a plain object that pickles and unpickles without transformers.

An engine config crosses processes (the manager to each replica, a replica to each of its TP / PP
ranks). Carrying a transformers config made every receiving process import transformers' config
machinery to unpickle it: ~1.6 s of CPU in a process that has torch already, for every rank of a
TP x PP engine (a rank loads no tokenizer and needs nothing else of transformers). A ModelConfig now
pickles its config as this view (records/config.py: `ModelConfig.__getstate__`), so a process that
resolved the model reads the transformers object and every process it hands the config to reads
the same values from the view. What needs the transformers object itself (the GGUF loader's
skeleton model) resolves it again (`transformers_config`).
"""
from __future__ import annotations

import copy
import functools
import importlib.metadata
import logging
import os
import pickle
import types
from typing import Any

from records.cache_dirs import cache_root, file_key, source_digest, write_entry
from records.model_source import embedded_model_path, hub_snapshot, is_hub_id, resolve_model


class FrozenConfig:
    """Every non-callable attribute of a transformers config as it read when frozen (its fields,
    the class's defaults and properties, `attribute_map`'s aliases), nested configs frozen too, and
    its `to_dict()`. A missing attribute raises AttributeError, as on the config."""

    def __init__(self, values: dict[str, Any], as_dict: dict[str, Any], class_name: str, text: str) -> None:
        self._values = values
        self._dict = as_dict
        self._class_name = class_name
        self._repr = text

    @classmethod
    def of(cls, config: Any) -> FrozenConfig:
        """Freeze a transformers PretrainedConfig (a FrozenConfig is returned as it is)."""
        if isinstance(config, FrozenConfig):
            return config
        values = {}
        # Deprecated aliases among the properties log a warning when read; their values are kept
        # (as the config would answer) without the warning.
        quiet = logging.getLogger("transformers")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            for name in dir(config):
                if name.startswith("__"):
                    continue
                try:
                    value = getattr(config, name)
                except Exception:  # noqa: BLE001 - a property that does not apply to this config
                    continue
                if callable(value) or isinstance(value, types.ModuleType):
                    continue
                frozen = _frozen_value(value)
                if frozen is not _DROP:
                    values[name] = frozen
        finally:
            quiet.setLevel(level)
        return cls(values, config.to_dict(), type(config).__name__, repr(config))

    def __getattr__(self, name: str) -> Any:
        # (only called for names the object itself lacks: the config's values)
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(f"{self.__dict__.get('_class_name', 'config')} has no attribute {name!r}") from None

    def to_dict(self) -> dict[str, Any]:
        """The transformers config's `to_dict()`, as it was when frozen."""
        return copy.deepcopy(self._dict)

    def __repr__(self) -> str:
        # The config's own: an engine config's repr names a pool's replicas (cluster/pool.py: pool_tag).
        return self._repr


_DROP = object()
_PLAIN = (int, float, str, bool, type(None), bytes)


def _frozen_value(value: Any) -> Any:
    """A value as the view keeps it: plain data as it is, nested configs frozen, other objects of
    transformers as their `to_dict()` (or left out), a torch dtype by name, anything else as it is."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_frozen_value(v) for v in value]
        return type(value)(v for v in items if v is not _DROP)
    if isinstance(value, dict):
        items = {k: _frozen_value(v) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not _DROP}
    if isinstance(value, type) or callable(value):
        return _DROP                            # (classes: `sub_configs` names its configs' classes)
    if (type(value).__module__ or "").startswith("transformers"):
        from transformers import PretrainedConfig  # noqa: PLC0415 - loaded already where its objects are

        if isinstance(value, PretrainedConfig):
            return FrozenConfig.of(value)       # a nested config (a text or vision config)
        to_dict = getattr(value, "to_dict", None)
        return _frozen_value(to_dict()) if callable(to_dict) else _DROP
    if (type(value).__module__, type(value).__name__) == ("torch", "dtype"):
        return str(value).removeprefix("torch.")    # ("float32", as `to_dict()` writes it: no torch to unpickle)
    return value


def transformers_config(config: Any, path: str, gguf_file: str | None) -> Any:
    """The transformers object of a model's config: `config` itself, or, for a FrozenConfig, the
    model's config resolved again (records/model_source.py: resolve_model)."""
    if not isinstance(config, FrozenConfig):
        return config
    return resolve_model(path if gguf_file is None else os.path.join(path, gguf_file))[2]


def resolve_frozen(model: str | None) -> tuple[str, str | None, FrozenConfig]:
    """`resolve_model` with the config frozen: the same (dir, GGUF file name, config), the config as
    the view every process it is handed to reads. Kept under $PDSERVE_CONFIG_CACHE (else
    ~/.cache/pdserve/configs), keyed by the config's source file (config.json, or the GGUF file) with
    its size and mtime, the transformers version and this resolution's own code: while none of them
    changes, a process that needs only the config's values (an ingress, a launcher) reads it back
    and imports no transformers config class. Resolving in such a process took ~1.5 s of CPU for
    the first model and more for each further architecture (a Llama config's module pulls in
    torch.distributed.tensor and sympy; docs/perf/journal.md §50). Errors are `resolve_model`'s."""
    hub = is_hub_id(model)
    path = hub_snapshot(model) if hub else (embedded_model_path() if model is None else os.path.expanduser(model))
    key = _cache_key(path)
    file = os.path.join(cache_root("configs", "PDSERVE_CONFIG_CACHE"), key) if key else None
    if file is not None:
        try:
            with open(file, "rb") as f:
                cached = pickle.load(f)
            if isinstance(cached, tuple) and len(cached) == 3 and isinstance(cached[2], FrozenConfig):
                return cached
        except Exception:  # noqa: BLE001 - absent, truncated or another version's: resolved again
            pass
    path, gguf_file, config = resolve_model(path if hub else model)
    resolved = (path, gguf_file, FrozenConfig.of(config))
    if file is not None:
        _store(file, resolved)
    return resolved


def _cache_key(path: str) -> str | None:
    """The cache key of a model path, or None where it names no config file (resolve_model says why)."""
    source = path if path.endswith(".gguf") else os.path.join(path, "config.json")
    if not os.path.isfile(source):
        return None
    try:
        return file_key(source, importlib.metadata.version("transformers"), _resolving_code()) + ".pkl"
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None


@functools.cache
def _resolving_code() -> str:
    """A digest of how a config is resolved and frozen (this module and records/model_source.py)."""
    return source_digest(__file__, resolve_model.__code__.co_filename)


def _store(file: str, resolved: tuple) -> None:
    """A cache that cannot be written only costs the next process the resolution."""
    try:
        write_entry(file, pickle.dumps(resolved))
    except OSError:
        pass
