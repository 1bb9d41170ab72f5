"""Paged attention for one layer: store this step's K/V into their slots, then attend.

The batch is laid out decodes first (one token each, batched in one kernel call), then prefill
segments (chunked prefill and prefix-cache hits included). K/V are written before attention reads
them, so a request may read blocks that another request of the same step is filling.

`AttentionBackend` is how a model attends, chosen once per ModelRunner over its kernel set (the C++
CPU kernels, the torch reference or Triton): it builds a step's `AttentionMetadata` once (including
the prefill segments packed as its kernels read them, which every layer then shares), runs each
layer's attention, and says whether its decode steps can be captured in CUDA graphs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from types import ModuleType
from typing import Any

import torch
from torch import nn

from kernels import reference
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
    prefill_packed: Any = None          # the backend's kernels' form of the prefill segments
    # Per prefill segment, position ranges whose tokens see one another both ways (an image's in
    # Gemma 3: kernels/reference.py's prefill_attention, the only one with such a mask); None: none.
    prefill_spans: list[list[tuple[int, int]]] | None = None
    # With hybrid KV groups (records/kv_groups.py: KVGroups): each group's metadata (its slots and
    # tables), this one being group 0's; a layer reads its own group's.
    groups: list[AttentionMetadata] = field(default_factory=list)


class AttentionBackend:
    def __init__(self, kernels: ModuleType, device: torch.device | str) -> None:
        self.kernels = kernels
        self.device = torch.device(device)

    @property
    def can_capture_cuda_graphs(self) -> bool:
        """Whether a decode step can be captured and replayed with padded rows (slot -1, length 0)."""
        return self.device.type == "cuda" and getattr(self.kernels, "CUDA_GRAPHS", False)

    def metadata(self, slot_mapping: torch.Tensor, decode_block_tables: torch.Tensor | None = None,
                 decode_seq_lens: torch.Tensor | None = None,
                 prefill_block_tables: list[torch.Tensor] | None = None,
                 prefill_query_lens: list[int] | None = None,
                 prefill_seq_lens: list[int] | None = None,
                 prefill_spans: list[list[tuple[int, int]]] | None = None) -> AttentionMetadata:
        """The step's metadata, for every layer (call once per step)."""
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=0 if decode_seq_lens is None else int(decode_seq_lens.shape[0]),
            decode_block_tables=decode_block_tables, decode_seq_lens=decode_seq_lens,
            prefill_block_tables=prefill_block_tables or [], prefill_query_lens=prefill_query_lens or [],
            prefill_seq_lens=prefill_seq_lens or [], prefill_spans=prefill_spans)
        if meta.prefill_query_lens:
            meta.prefill_packed = self.kernels.pack_prefill(meta.prefill_block_tables, meta.prefill_query_lens,
                                                            meta.prefill_seq_lens, self.device)
        return meta

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
               window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """query: [T, H, d]; key/value: [T, kvh, d]; returns [T, H, d]. k_scale/v_scale: an fp8
        cache's scales; window, softcap: the layer's sliding window and score cap (0: none; see
        kernels/reference.py)."""
        k = self.kernels
        k.write_kv(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)
        num_decode = meta.num_decode_tokens
        shape = dict(window=window, softcap=softcap) if window or softcap else {}
        if num_decode == query.shape[0]:
            return k.decode_attention(query, kv_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
                                      k_scale, v_scale, **shape)
        if meta.prefill_spans is not None:
            prefill = reference.prefill_attention(
                query[num_decode:], kv_cache, meta.prefill_block_tables, meta.prefill_query_lens,
                meta.prefill_seq_lens, scale, None, k_scale, v_scale, window, softcap, meta.prefill_spans)
        else:
            prefill = k.prefill_attention(query[num_decode:], kv_cache, meta.prefill_block_tables,
                                          meta.prefill_query_lens, meta.prefill_seq_lens, scale, meta.prefill_packed,
                                          k_scale, v_scale, **shape)
        if not num_decode:
            return prefill
        out = torch.empty_like(query)
        out[:num_decode] = k.decode_attention(query[:num_decode], kv_cache, meta.decode_block_tables,
                                              meta.decode_seq_lens, scale, k_scale, v_scale, **shape)
        out[num_decode:] = prefill
        return out


@lru_cache(maxsize=None)
def _default_backend(kernels: ModuleType, device_type: str) -> AttentionBackend:
    return AttentionBackend(kernels, device_type)


class Attention(nn.Module):
    backend: AttentionBackend | None = None   # bound once by ModelRunner (bind_kernels); else per call

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int | None = None,
                 softcap: float | None = None) -> None:
        """window: the layer's sliding window in tokens (None: the whole context); softcap: its
        attention-score cap (Gemma 2's `attn_logit_softcapping`; None: none)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.window, self.softcap = window or 0, softcap or 0.0
        # An fp8 KV cache's scales for this layer (EngineConfig.cache_config.kv_scales; set by the
        # worker): stored K = K / k_scale, V likewise.
        self.k_scale, self.v_scale = 1.0, 1.0
        self.kv_group = 0           # its hybrid KV group (ModelRunner.set_kv_groups)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """query: [T, H, d]; key/value: [T, kvh, d]; returns [T, H, d]."""
        backend = self.backend or _default_backend(kernels_for(query), query.device.type)
        if meta.groups:
            meta = meta.groups[self.kv_group]
        return backend.attend(query, key, value, kv_cache, meta, self.scale, self.k_scale, self.v_scale,
                              self.window, self.softcap)
