"""dtype names, as records keep them (torch's attribute names, so that configs import without
torch): the model's (float32, bfloat16, float16) and the KV cache's, which may also be fp8."""
from __future__ import annotations

from typing import Any

# Accepted names -> the canonical one (torch's attribute name); a record keeps names, not torch
# dtypes, so that configs import without torch.
_DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}     # bytes per element
# kv_cache_dtype: "auto" (the model's dtype) or fp8 e4m3 (vLLM's names; "fp8" is e4m3), stored as
# torch's float8_e4m3fn with a scale per layer for K and one for V (kernels/reference.py: quantize_kv).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_KV_DTYPE = "float8_e4m3fn"
KV_DTYPE_SIZES = {**DTYPE_SIZES, FP8_KV_DTYPE: 1}


def resolve_dtype(dtype: Any, config_dtype: Any) -> str:
    """Map a user dtype ("auto", a name, or a torch.dtype) to its canonical name (float32, bfloat16
    or float16); "auto" takes the model config's (`config_dtype`, a name or a torch.dtype), else
    float32."""
    if not isinstance(dtype, str):                  # a torch.dtype
        name = str(dtype).removeprefix("torch.")
        if name not in DTYPE_SIZES:
            raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {dtype}")
        return name
    if dtype == "auto":
        return _DTYPES.get(str(config_dtype).removeprefix("torch."), "float32")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16'; got {dtype!r}")
    return _DTYPES[dtype]
