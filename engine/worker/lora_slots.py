"""The adapter pool of one model replica rank: host copies, device slots, and each step's rows.

`LoRASlots` gives the model's adapter targets (q/k/v, o, gate/up, down of every decoder layer on
this pipeline stage) a `LoRAStack` of `max_loras` slots. Before each forward pass, `prepare` finds
the slot of every scheduled request's adapter, loading the ones not in a slot into the least
recently used slot that this step does not need (the scheduler admits at most `max_loras` distinct
adapters among running requests, so one is always free), and tells the layers which rows use which
slot. Adapter tensors are read from their PEFT directory once and kept in host memory, at most
`max_cpu_loras` of them (least recently used leave first): a slot is refilled from there, which
on a GPU is the host-to-device copy S-LoRA describes.

The adapter was checked against the model when its request was admitted (`records.lora.read_adapter`,
from the files' headers); here the tensors themselves are read.

A weight update of an adapter (RL with LoRA: the trainer's adapter tensors, engine/weight_updates.py)
replaces some or all of its tensors: they are kept beside its directory's and win over them
whenever the adapter is read (now, or again after it left host memory); its slot and host copy go,
so the next step that needs it loads the new values.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from types import ModuleType

import torch
from safetensors.torch import load_file
from torch import nn

from engine.model.layers.linear import Linear
from engine.model.layers.lora import LoRAContext, LoRAStack
from engine.worker.weight_sync import check_shapes
from records.lora import ADAPTER_WEIGHTS, LoRAConfig, LoRARequest, read_adapter
from records.step import ScheduledRequest

# PEFT module -> (our fused layer under the decoder layer, which of its outputs)
_TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
            "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
            "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
            "down_proj": ("mlp.down_proj", 0)}

AdapterKey = tuple[str, str, str]


class LoRASlots:
    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device,
                 kernels: ModuleType) -> None:
        self.model = model
        self.config = config
        self.dtype, self.device = dtype, device
        self.context = LoRAContext(kernels)
        self.stacks: list[LoRAStack] = []
        for layer in model.layers:
            for path in dict.fromkeys(p for p, _ in _TARGETS.values()):
                try:
                    linear = layer.get_submodule(path)
                except AttributeError:
                    continue            # a mixture-of-experts MLP: no LoRA there (records/lora.py refuses it)
                assert isinstance(linear, Linear)
                linear.lora = LoRAStack(self.context, config.max_loras, config.max_lora_rank, linear.input_size,
                                        linear.lora_subs(), dtype, device)
                self.stacks.append(linear.lora)
        self.slot_of: OrderedDict[AdapterKey, int] = OrderedDict()    # least recently used first
        self.rank_of: dict[int, int] = {}
        self.host: OrderedDict[AdapterKey, tuple[int, list[tuple[Linear, int, torch.Tensor, torch.Tensor]]]] = \
            OrderedDict()
        self.loads = 0                      # adapters read from disk (for tests and metrics)
        self.updated: dict[AdapterKey, dict[str, torch.Tensor]] = {}    # adapter -> tensors an update gave

    def check_update(self, lora: LoRARequest, shapes: dict[str, Sequence[int]]) -> None:
        """ValueError naming a tensor (PEFT name) the adapter does not have with that shape."""
        info = read_adapter(lora.lora_path, self.model.config, self.config.max_lora_rank)
        check_shapes(shapes, info.shapes, "this adapter", "PEFT's", "this adapter's is")

    def update(self, lora: LoRARequest, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace these tensors of the adapter (`check_update` passed) from the next step on."""
        key = lora.cache_key
        self.updated.setdefault(key, {}).update((name, t.detach().to("cpu", copy=True)) for name, t in weights)
        self.host.pop(key, None)
        self.slot_of.pop(key, None)         # (its slot is free: refilled with the new values when needed)

    def prepare(self, batch: list[ScheduledRequest]) -> None:
        """Point the LoRA layers at this step's rows per adapter slot (the batch in the order its
        tokens are laid out: `ModelRunner._prepare`)."""
        loras = [r.sampling_params.lora_request if r.sampling_params is not None else None for r in batch]
        needed = {lora.cache_key for lora in loras if lora is not None}
        rows: dict[int, list[int]] = {}            # slot -> its rows, in batch order
        start = 0
        for req, lora in zip(batch, loras):
            n = len(req.token_ids)
            if lora is not None:
                rows.setdefault(self._slot(lora, needed), []).extend(range(start, start + n))
            start += n
        ctx = self.context
        ctx.num_groups = len(rows)
        if not rows:
            return
        slots = list(rows)
        ctx.rows = torch.tensor([r for slot in slots for r in rows[slot]], dtype=torch.long, device=self.device)
        bounds = [0]
        for slot in slots:
            bounds.append(bounds[-1] + len(rows[slot]))
        ctx.starts = torch.tensor(bounds, dtype=torch.long)
        ctx.slots = torch.tensor(slots, dtype=torch.long)
        ctx.ranks = torch.tensor([self.rank_of[slot] for slot in slots], dtype=torch.long)

    def _slot(self, lora: LoRARequest, needed: set[AdapterKey]) -> int:
        key = lora.cache_key
        slot = self.slot_of.get(key)
        if slot is not None:
            self.slot_of.move_to_end(key)
            return slot
        used = set(self.slot_of.values())
        free = [s for s in range(self.config.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next((k for k in self.slot_of if k not in needed), None)
            if victim is None:
                raise RuntimeError(f"more than max_loras={self.config.max_loras} adapters in one step")
            slot = self.slot_of.pop(victim)
        rank, tensors = self._host(lora)
        for stack in self.stacks:
            stack.clear(slot)
        for linear, sub, a, b in tensors:
            a, b = linear.lora_shard(sub, a, b)
            linear.lora.set(slot, sub, a, b)        # type: ignore[union-attr]
        self.slot_of[key] = slot
        self.rank_of[slot] = rank
        return slot

    def _host(self, lora: LoRARequest) -> tuple[int, list[tuple[Linear, int, torch.Tensor, torch.Tensor]]]:
        """The adapter's (rank, [(layer, fused output, A, scaled B)]) on this stage, read once."""
        key = lora.cache_key
        held = self.host.get(key)
        if held is not None:
            self.host.move_to_end(key)
            return held
        info = read_adapter(lora.lora_path, self.model.config, self.config.max_lora_rank)
        raw = {**load_file(f"{lora.lora_path}/{ADAPTER_WEIGHTS}"), **self.updated.get(key, {})}
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for name, (layer, module, which) in info.tensors.items():
            pairs.setdefault((layer, module), {})[which] = raw[name]
        tensors = []
        for (layer, module), ab in sorted(pairs.items()):
            if not self.model.start_layer <= layer < self.model.end_layer:
                continue                                    # another pipeline stage's
            path, sub = _TARGETS[module]
            linear = self.model.layers[layer - self.model.start_layer].get_submodule(path)
            b = (ab["B"].float() * info.scaling).to(self.dtype)
            tensors.append((linear, sub, ab["A"].to(self.dtype), b))
        held = self.host[key] = (info.rank, tensors)
        self.loads += 1
        while len(self.host) > self.config.cpu_capacity:
            self.host.popitem(last=False)
        return held


