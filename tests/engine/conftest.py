"""Fixtures of the engine tests that load what tests/conftest.py must not import (transformers'
GGUF loader, the engine's weight readers)."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def embedded_gguf_tensors():
    """The embedded GGUF model's HF config as pdserve resolves it, and every tensor of the file as
    transformers' GGUF loader dequantizes it (`load_gguf_checkpoint`: what
    `from_pretrained(gguf_file=...)` loads into its model), read once per test process: each read
    costs ~8 s of CPU (gguf-py parses the tokenizer's arrays an element at a time), and two tests
    compare against it (the loaders' tensors, the model's greedy tokens)."""
    from engine.loading.weights import _gguf_weights
    from records.model_source import resolve_model

    path, gguf_file, hf_config = resolve_model(None)
    return hf_config, dict(_gguf_weights(os.path.join(path, gguf_file), hf_config))
