"""The paged engine: one replica's scheduler, KV cache and model, in rooms: `core/` (scheduler and
blocks), `executor/`, `worker/`, `model/`, `sample/`, `loading/`, `text/`, `spec_decode/`, and the
fronts at the top (`llm_engine`, `async_engine`, `llm`, `output_processor`).

    from engine import LLM, SamplingParams
    llm = LLM()                       # the embedded SmolLM2-135M-Instruct
    out = llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0))

The names below load on first use (PEP 562), so that importing a room such as `engine.text` (what
the HTTP ingress needs) does not import the model, the executor and the workers. Nothing inside
pdserve imports through this package (tests/unit/test_layers.py checks it).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"LLM": "engine.llm", "SamplingParams": "records.sampling_params",
            "StructuredOutputsParams": "records.sampling_params", "LoRARequest": "records.lora",
            "RequestOutput": "records.outputs", "CompletionOutput": "records.outputs"}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
