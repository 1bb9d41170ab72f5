"""Paged attention for one layer: store this step's K/V into their slots, then attend.

The batch is laid out decodes first (one token each, batched in one kernel call), then prefill
segments (chunked prefill and prefix-cache hits included). K/V are written before attention reads
them, so a request may read blocks that another request of the same step is filling.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

from kernels.dispatch import kernels_for


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor                          # [num_tokens]
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None     # [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor | None = None         # [num_decodes]
    prefill_block_tables: list[torch.Tensor] = field(default_factory=list)
    prefill_query_lens: list[int] = field(default_factory=list)
    prefill_seq_lens: list[int] = field(default_factory=list)


class Attention(nn.Module):
    kernels: ModuleType | None = None     # bound once by ModelRunner (bind_kernels); else looked up per call

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """query: [T, H, d]; key/value: [T, kvh, d]; returns [T, H, d]."""
        k = self.kernels or kernels_for(query)
        k.write_kv(key, value, kv_cache, meta.slot_mapping)
        num_decode = meta.num_decode_tokens
        if num_decode == query.shape[0]:
            return k.decode_attention(query, kv_cache, meta.decode_block_tables,
                                      meta.decode_seq_lens, self.scale)
        out = torch.empty_like(query)
        if num_decode:
            out[:num_decode] = k.decode_attention(query[:num_decode], kv_cache, meta.decode_block_tables,
                                                  meta.decode_seq_lens, self.scale)
        out[num_decode:] = k.prefill_attention(query[num_decode:], kv_cache, meta.prefill_block_tables,
                                               meta.prefill_query_lens, meta.prefill_seq_lens, self.scale)
        return out
