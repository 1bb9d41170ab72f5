"""Batched LoRA on a linear layer: every adapter slot's A and B, and one step's rows per slot.

A layer with adapters holds, for each of `max_loras` slots, A as [rank, subs, input] and B (scaled
by alpha / r) as [output, rank], where `subs` are the fused outputs of the layer (q, k, v of
`qkv_proj`; gate, up of `gate_up_proj`; one otherwise). Slots are zero beyond their adapter's rank
and for the modules it does not target, and only an adapter's own rank is multiplied.

One step's rows come in groups, one per slot in use (`LoRAContext`, set by engine/lora_slots.py
before the forward pass): a slice where the slot's rows are contiguous (a prefill chunk), an index
tensor where they are not (decode rows are ordered by context length). Each group costs two small
matmuls per fused output, the segmented form of Punica's SGMV: the rows of one adapter multiply
that adapter's A and B in place, so nothing is gathered per row; rows of the base model cost
nothing. Under tensor parallelism A and B are sharded like the base weight (`Linear.lora_shard`):
a column-parallel layer splits B's rows, a row-parallel one A's columns, whose partial products
are then summed by the layer's own all-reduce.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRAContext:
    """One step's rows per adapter slot, shared by every LoRA layer of a model: (slot, rows, rank)."""
    groups: list[tuple[int, slice | torch.Tensor, int]] = field(default_factory=list)


class LoRAStack:
    """The adapter slots of one linear layer: `a` [slots, max_rank, subs, input], `b` [slots,
    output, max_rank] (this rank's shards), and `subs`, each fused output's (offset, size)."""

    def __init__(self, context: LoRAContext, slots: int, max_rank: int, input_size: int,
                 subs: list[tuple[int, int]], dtype: torch.dtype, device: torch.device) -> None:
        self.context = context
        self.subs = subs
        output_size = sum(size for _, size in subs)
        self.a = torch.zeros(slots, max_rank, len(subs), input_size, dtype=dtype, device=device)
        self.b = torch.zeros(slots, output_size, max_rank, dtype=dtype, device=device)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def set(self, slot: int, sub: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Put an adapter's (already sharded, already scaled) A [r, input] and B [size, r] for fused
        output `sub` into `slot`."""
        rank = a.shape[0]
        offset, size = self.subs[sub]
        self.a[slot, :rank, sub].copy_(a)
        self.b[slot, offset:offset + size, :rank].copy_(b)

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += B A x for each row's adapter (rows of the base model are left as they are)."""
        subs = len(self.subs)
        for slot, rows, rank in self.context.groups:
            xs = x[rows]
            # [n, rank * subs], column j * subs + i = rank j of fused output i
            shrunk = xs @ self.a[slot, :rank].reshape(rank * subs, -1).t()
            if subs == 1:
                delta = shrunk @ self.b[slot, :, :rank].t()
            else:
                delta = torch.cat([shrunk[:, i::subs] @ self.b[slot, offset:offset + size, :rank].t()
                                   for i, (offset, size) in enumerate(self.subs)], dim=1)
            if isinstance(rows, slice):
                out[rows] += delta
            else:
                out.index_add_(0, rows, delta)
        return out
