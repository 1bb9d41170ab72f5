"""Batched LoRA on a linear layer: every adapter slot's A and B, and one step's rows per slot.

A layer with adapters holds, for each of `max_loras` slots, A as [rank, subs, input] and B
transposed (scaled by alpha / r) as [rank, output], where `subs` are the fused outputs of the layer
(q, k, v of `qkv_proj`; gate, up of `gate_up_proj`; one otherwise). Slots are zero beyond their
adapter's rank and for the modules it does not target, and only an adapter's own rank is multiplied.

One step's rows come in groups, one per slot in use (`LoRAContext`, set by engine/worker/lora_slots.py
before the forward pass), and the kernel set's `lora_add` (kernels/reference.py states the
contract) adds B A x to each group's rows: the segmented form of Punica's SGMV, where the rows of one
adapter multiply that adapter's A and B, which are read once for all of them; rows of the base
model cost nothing. Under tensor parallelism A and B are sharded like the base weight
(`Linear.lora_shard`): a column-parallel layer splits B's rows, a row-parallel one A's columns,
whose partial products are then summed by the layer's own all-reduce.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass
class LoRAContext:
    """One step's adapter groups, shared by every LoRA layer of a model: group g is the rows
    rows[starts[g]:starts[g + 1]] (on the model's device) under slot slots[g], of rank ranks[g]
    (starts, slots, ranks: int64 CPU tensors). No groups: no row uses an adapter."""
    kernels: ModuleType | None = None
    rows: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    num_groups: int = 0


class LoRAStack:
    """The adapter slots of one linear layer: `a` [slots, max_rank, subs, input], `bt` [slots,
    max_rank, output] (this rank's shards), and `sub_offsets`, where each fused output starts."""

    def __init__(self, context: LoRAContext, slots: int, max_rank: int, input_size: int,
                 subs: list[tuple[int, int]], dtype: torch.dtype, device: torch.device) -> None:
        self.context = context
        self.subs = subs
        output_size = sum(size for _, size in subs)
        self.sub_offsets = torch.tensor([offset for offset, _ in subs] + [output_size], dtype=torch.long)
        self.a = torch.zeros(slots, max_rank, len(subs), input_size, dtype=dtype, device=device)
        self.bt = torch.zeros(slots, max_rank, output_size, dtype=dtype, device=device)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()

    def set(self, slot: int, sub: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Put an adapter's (already sharded, already scaled) A [r, input] and B [size, r] for fused
        output `sub` into `slot`."""
        rank = a.shape[0]
        offset, size = self.subs[sub]
        self.a[slot, :rank, sub].copy_(a)
        self.bt[slot, :rank, offset:offset + size].copy_(b.t())

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += B A x for each row's adapter (rows of the base model are left as they are)."""
        ctx = self.context
        if not ctx.num_groups:
            return out
        return ctx.kernels.lora_add(x, out, self.a, self.bt, ctx.rows, ctx.starts, ctx.slots, ctx.ranks,
                                    self.sub_offsets)
