"""This process's place among its engine's ranks, and the collectives the parallel layers use.

Ranks are numbered stage-major: rank = pp_rank * tp_size + tp_rank, so a stage's TP ranks are
consecutive (and placed on one node, see cluster/placement.py). One rank per process (a Ray worker
actor); a process that never calls `init_parallel_state` is the single rank of a 1x1 engine and
every collective here is the identity. Backend: NCCL on CUDA, gloo on CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from records.model_source import even_layer_partition


@dataclass(slots=True)
class ParallelState:
    rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None
    layer_partition: tuple[int, ...] = ()     # layers per stage (ParallelConfig); () = an even split
    expert_parallel: bool = False             # MoE experts split over the TP ranks (engine/model/layers/moe.py)
    moe_dispatch: str = "allreduce"           # how expert parallelism moves tokens (moe.MOE_DISPATCH)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The rank whose output the executor reads: TP rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    @property
    def prev_rank(self) -> int:
        return self.rank - self.tp_size

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp_size


_state = ParallelState()


def get_parallel_state() -> ParallelState:
    return _state


def init_parallel_state(rank: int, tp_size: int, pp_size: int, init_method: str, device: torch.device,
                        timeout_s: float = 300.0, layer_partition: tuple[int, ...] = (),
                        expert_parallel: bool = False, moe_dispatch: str = "allreduce") -> ParallelState:
    """Join the engine's process group and build the TP group of this rank's stage. Every rank
    creates every stage's group, in the same order (torch.distributed requires it)."""
    global _state
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tp_size * pp_size,
                            timeout=timedelta(seconds=timeout_s))
    tp_group = None
    for stage in range(pp_size):
        group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
        if stage == rank // tp_size:
            tp_group = group
    _state = ParallelState(rank=rank, tp_rank=rank % tp_size, tp_size=tp_size, pp_rank=rank // tp_size,
                           pp_size=pp_size, tp_group=tp_group, layer_partition=tuple(layer_partition),
                           expert_parallel=expert_parallel, moe_dispatch=moe_dispatch)
    return _state


def reset_parallel_state() -> None:
    """Back to a single rank (tests that build layers for several ranks in one process)."""
    global _state
    _state = ParallelState()


def set_parallel_state(state: ParallelState) -> None:
    """Pretend to be a given rank without process groups (shard-loading tests)."""
    global _state
    _state = state


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the stage's TP ranks (in place when there are several). gloo sums in fp32."""
    s = _state
    if s.tp_size == 1:
        return x
    if x.device.type == "cpu" and x.dtype != torch.float32:
        y = x.float()
        dist.all_reduce(y, group=s.tp_group)
        return y.to(x.dtype)
    dist.all_reduce(x, group=s.tp_group)
    return x


def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Concatenate the TP ranks' shards along the last dimension."""
    s = _state
    if s.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(s.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=s.tp_group)
    return torch.cat(parts, dim=-1)


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int, partition: tuple[int, ...] = ()
                   ) -> tuple[int, int]:
    """The [start, end) of stage `pp_rank`'s layers: `partition` (layers per stage, as the engine
    config resolved it: ParallelConfig.layer_partition), or the even split."""
    sizes = list(partition) or even_layer_partition(num_layers, pp_size)
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def pp_send(tensor: torch.Tensor) -> dist.Work:
    """Start sending hidden states to the same TP rank of the next stage (as bytes: any dtype);
    wait on the returned work before the tensor is reused."""
    return dist.isend(tensor.contiguous().view(-1).view(torch.uint8), _state.next_rank)


def pp_recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(out.view(-1).view(torch.uint8), _state.prev_rank)
    return out
