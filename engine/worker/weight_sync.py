"""Weight updates into a loaded model, in place (a trainer's new weights between RL rollouts): from a
checkpoint directory, from tensors, or broadcast over a collective group the trainer joins.

Every update is checked whole before anything changes (`WeightSync.check`): each name must be one
the model's checkpoint had, with the shape it had there, so a wrong name or shape leaves the old
weights serving. Names and shapes are the HF checkpoint's (`q_proj`, not the fused `qkv_proj`; whole
tensors, not TP shards): the model's loader cuts each rank's share, as at load. A layer kept
quantized (GGUF blocks, an int8 checkpoint's Q8_0 blocks, fp8) takes the new dense tensor quantized
to its own type (engine/loading/quant_checkpoint.py: quantize_to), its dense copy made again.

`WeightUpdateGroup` is a torch.distributed group of its own (gloo on CPU, NCCL on GPU) made from a
TCP store, beside the default group the engine's TP ranks use: rank 0 is the trainer, an engine's
ranks follow from the `rank_offset` it is given. Both sides hold one.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.loading.weights import checkpoint_shapes, iterate_weights


def check_shapes(shapes: dict[str, Sequence[int]], known: dict[str, tuple[int, ...]], whose: str, naming: str,
                 has: str) -> None:
    """ValueError naming the first of an update's tensors (name -> shape) that `known` (those of
    `whose`, named as `naming` names them) does not have with that shape."""
    if not shapes:
        raise ValueError("update_weights: no tensors given")
    for name, shape in shapes.items():
        expected = known.get(name)
        if expected is None:
            raise ValueError(f"update_weights: {name!r} is not a tensor of {whose} (its names are {naming}, "
                             f"e.g. {', '.join(sorted(known)[:3])})")
        if tuple(shape) != tuple(expected):
            raise ValueError(f"update_weights: {name!r} has shape {list(shape)}; {has} {list(expected)}")


class WeightUpdateGroup:
    """One member of a weight-update group: `broadcast` sends (rank 0, the trainer) or receives."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 backend: str = "gloo", timeout_s: float = 600.0) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl'; got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}); got {rank}")
        timeout = timedelta(seconds=timeout_s)
        # Every member connects before the group forms (the trainer's store waits for them all).
        self.store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(dist.PrefixStore("pdserve-weights", self.store), rank, world_size,
                                               timeout)
        else:
            self.group = dist.ProcessGroupNCCL(dist.PrefixStore("pdserve-weights", self.store), rank, world_size)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`tensor` from rank `src` into every member's `tensor` (in place)."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()
        return tensor


class WeightSync:
    """A loaded model's update side: the checkpoint's names and shapes (recorded at load by
    `recording`), the check, and the in-place load."""

    def __init__(self, dense_copies: bool = False) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.group: WeightUpdateGroup | None = None
        self.dense_copies = dense_copies        # quantized layers keep a dense copy (quantization "...+dense")

    def recording(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """`weights` as they stream into the model at load, their names and shapes noted."""
        for name, tensor in weights:
            self.shapes[name] = tuple(tensor.shape)
            yield name, tensor

    def check(self, model: torch.nn.Module, shapes: dict[str, Sequence[int]]) -> None:
        """ValueError naming the first tensor the model's checkpoint does not have with this shape;
        nothing changes either way."""
        check_shapes(shapes, self.shapes, "this model's checkpoint", "HF's", "this model's checkpoint has")

    def apply(self, model: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the (checked) tensors into the model in place, then redo what loading does after
        (prepacked GEMM weights, quantized layers' dense copies)."""
        model.load_weights(weights, dense_copies=self.dense_copies, partial=True)

    def from_disk(self, model: Any, path: str, hf_config: Any) -> None:
        self.check(model, checkpoint_shapes(path, "update_weights_from_disk:"))
        self.apply(model, iterate_weights(path, None, hf_config))

    def join(self, master_address: str, master_port: int, rank: int, world_size: int, backend: str) -> None:
        self.group = WeightUpdateGroup(master_address, master_port, rank, world_size, backend)

    def receive(self, names: list[str], dtypes: list[str], shapes: list[Sequence[int]],
                device: torch.device) -> list[tuple[str, torch.Tensor]]:
        """Each tensor from the group's rank 0, in order. The trainer sends them after this rank was
        asked (all ranks check first: a refused update sends nothing)."""
        if self.group is None:
            raise ValueError("update_weights: no weight-update group (init_weights_update_group first)")
        received = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device)
            received.append((name, self.group.broadcast(tensor)))
        return received
