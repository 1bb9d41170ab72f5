"""GGUF's quantized weight blocks, the format (llama.cpp's ggml-common.h): their layout, and
dequantizing and quantizing them in torch (the oracle of the block kernels: kernels/reference.py,
kernels/cpu_ops.py, kernels/triton_quant.py; a weight update into a layer kept in blocks quantizes
as llama.cpp does: engine/worker/weight_sync.py).
"""
from __future__ import annotations

import torch

# Each row of a quantized weight [out_features, in_features] is a run of blocks of 32 input
# features, stored as in the GGUF file (llama.cpp's ggml-common.h):
#   Q8_0: fp16 scale d, 32 int8 q             (34 bytes): w = d * q
#   Q4_0: fp16 scale d, 16 bytes of nibbles   (18 bytes): w = d * (q - 8)
#   Q4_1: fp16 scale d, fp16 min m, 16 bytes  (20 bytes): w = d * q + m
# Byte j of the nibbles holds element j in its low half and element j + 16 in its high half.
GGUF_BLOCK = 32
GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def dequantize_gguf(blocks: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [rows, blocks_per_row * 32] that uint8 `blocks` [rows, blocks_per_row * block bytes]
    of GGUF type `qtype` hold, computed in fp32 as llama.cpp does, then rounded to `dtype`."""
    if qtype not in GGUF_BLOCK_BYTES:
        raise ValueError(f"GGUF type must be one of {sorted(GGUF_BLOCK_BYTES)}; got {qtype!r}")
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, GGUF_BLOCK_BYTES[qtype])
    d = b[..., 0:2].contiguous().view(torch.float16).float()                  # [rows, n, 1]
    if qtype == "Q8_0":
        w = b[..., 2:].contiguous().view(torch.int8).float() * d
    else:
        qs = b[..., 4:] if qtype == "Q4_1" else b[..., 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)                            # [rows, n, 32]
        if qtype == "Q4_0":
            w = d * (q.to(torch.int8) - 8).float()
        else:
            w = d * q.float() + b[..., 2:4].contiguous().view(torch.float16).float()
    return w.reshape(rows, -1).to(dtype)


def quantize_gguf(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """A dense weight [rows, cols] (cols a multiple of 32) as uint8 GGUF blocks of `qtype`, byte for
    byte as llama.cpp's reference quantizers (gguf-py's `quants.quantize`) make them, in fp32: Q8_0
    d = max|x| / 127, q = round-half-away(x / d); Q4_0 d = (the value of largest magnitude) / -8,
    q = trunc(x / d + 8.5) in [0, 15]; Q4_1 d = (max - min) / 15, m = min, q = trunc((x - m) / d + 0.5)
    in [0, 15]. (A weight update into a layer kept in blocks: engine/worker/weight_sync.py.)"""
    if qtype not in GGUF_BLOCK_BYTES:
        raise ValueError(f"GGUF type must be one of {sorted(GGUF_BLOCK_BYTES)}; got {qtype!r}")
    rows, cols = weight.shape
    if cols % GGUF_BLOCK:
        raise ValueError(f"a {qtype} weight needs input features in blocks of {GGUF_BLOCK}; got {cols}")
    x = weight.float().reshape(rows, -1, GGUF_BLOCK)
    if qtype == "Q8_0":
        d = x.abs().amax(dim=-1, keepdim=True) / 127
        scaled = x * torch.where(d == 0, 0.0, 1 / d)
        a = scaled.abs()
        q = (torch.sign(scaled) * (a.floor() + (2 * (a - a.floor())).floor())).to(torch.int8).view(torch.uint8)
        parts = [d.to(torch.float16).view(torch.uint8), q]
    else:
        if qtype == "Q4_0":
            d = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True)) / -8
            q = torch.trunc(x * torch.where(d == 0, 0.0, 1 / d) + 8.5)
            head = [d]
        else:
            low, high = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
            d = (high - low) / 15
            q = torch.trunc((x - low) * torch.where(d == 0, 0.0, 1 / d) + 0.5)
            head = [d, low]
        q = q.clamp(0, 15).to(torch.uint8)
        parts = [h.to(torch.float16).view(torch.uint8) for h in head] + [q[..., :16] | (q[..., 16:] << 4)]
    return torch.cat(parts, dim=-1).reshape(rows, -1)
