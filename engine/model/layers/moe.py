"""A mixture-of-experts MLP: a router picks each token's top-k experts, the experts (SiLU-gated
MLPs) run as grouped GEMMs over the tokens routed to them (the kernel set's `fused_moe`), and each
token's outputs are summed with its routing weights.

Parallelism over a stage's TP ranks, one of two layouts, both ending in the all-reduce a
row-parallel layer makes (every rank holds every token, as attention's TP leaves them):
- tensor parallel (default): every rank holds every expert, a 1/tp slice of its intermediate
  size (as vLLM without expert parallelism);
- expert parallel (`enable_expert_parallel`, ParallelState.expert_parallel): rank r holds experts
  [r * E/tp, (r+1) * E/tp) whole. With `moe_dispatch == "all2all"` each rank routes a 1/tp share of
  the tokens, sends each (token, expert) row to the rank holding the expert with an all-to-all,
  runs its experts, sends the outputs back the same way and the shares are gathered; with
  "allreduce" (default) each rank runs its experts on the tokens routed to them and the partial
  sums are all-reduced (one collective instead of three: the cheaper one while every rank holds
  every token). Both give the same tokens.

Per-rank expert load (tokens routed to each local expert, counted per step) is kept in
`expert_tokens` for the engine's stats.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.model.layers.linear import _copy_checked, _shard
from engine.model.parallel_state import get_parallel_state, tp_all_reduce
from kernels.dispatch import kernels_for

MOE_DISPATCH = ("allreduce", "all2all")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]): softmax over every expert (in fp32), the top k,
    renormalized to sum to 1 where the model does (Mixtral, Qwen3-MoE; Qwen2-MoE's
    `norm_topk_prob`), as transformers routes."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    kernels: ModuleType | None = None     # bound once by ModelRunner (bind_kernels); else looked up per call

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype, dispatch: str = "allreduce") -> None:
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.expert_parallel = state.expert_parallel and state.tp_size > 1
        if dispatch not in MOE_DISPATCH:
            raise ValueError(f"moe_dispatch must be one of {MOE_DISPATCH}; got {dispatch!r}")
        if self.expert_parallel:
            if num_experts % self.tp_size:
                raise ValueError(f"num_experts ({num_experts}) must be divisible by tensor_parallel_size "
                                 f"({self.tp_size}) with enable_expert_parallel")
            local_experts, local_inter = num_experts // self.tp_size, intermediate_size
        else:
            if intermediate_size % self.tp_size:
                raise ValueError(f"the experts' intermediate size ({intermediate_size}) must be divisible by "
                                 f"tensor_parallel_size ({self.tp_size}) (or enable_expert_parallel)")
            local_experts, local_inter = num_experts, intermediate_size // self.tp_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size, self.local_inter = intermediate_size, local_inter
        self.expert_start = self.tp_rank * local_experts if self.expert_parallel else 0
        self.dispatch = dispatch if self.expert_parallel else "allreduce"
        self.gate = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.gate.weight_loader = lambda p, t, s=None: _copy_checked(p.data, t)
        # w13: each expert's gate (w1) and up (w3) rows stacked; w2: its down projection
        self.w13 = nn.Parameter(torch.empty(local_experts, 2 * local_inter, hidden_size, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local_experts, hidden_size, local_inter, dtype=dtype), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        # (token, expert) rows routed to each local expert so far, and a last slot for the others'
        # (counted on the device: no host read per layer)
        self.register_buffer("expert_tokens", torch.zeros(local_experts + 1, dtype=torch.long), persistent=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
        """shard_id: (expert, 0 gate | 1 up) for w13, (expert, None) for w2; other ranks' experts
        are skipped."""
        expert, part = shard_id
        local = expert - self.expert_start
        if not 0 <= local < param.shape[0]:
            return
        size, rank = self.local_inter, (0 if self.expert_parallel else self.tp_rank)
        if param is self.w13:
            _copy_checked(param.data[local, part * size:(part + 1) * size],
                          _shard(loaded, 0, rank * size, size, self.intermediate_size))
        else:
            _copy_checked(param.data[local], _shard(loaded, 1, rank * size, size, self.intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] (every rank's the same) -> [T, hidden], summed over the ranks."""
        kernels = self.kernels or kernels_for(x)
        if self.dispatch == "all2all":
            return self._all_to_all(x, kernels)
        weights, ids = route(F.linear(x, self.gate), self.top_k, self.renormalize)
        self._count(ids)
        out = kernels.fused_moe(x, self.w13, self.w2, weights, ids, self.expert_start)
        return tp_all_reduce(out)

    def _count(self, ids: torch.Tensor) -> None:
        local, others = ids.flatten() - self.expert_start, self.expert_tokens.numel() - 1
        local = torch.where((local >= 0) & (local < others), local, others)
        self.expert_tokens.index_add_(0, local, torch.ones_like(local))

    def _all_to_all(self, x: torch.Tensor, kernels: ModuleType) -> torch.Tensor:
        """Expert parallelism with all-to-all dispatch and combine (see the module)."""
        state, n, num_tokens = get_parallel_state(), self.tp_size, x.shape[0]
        share = -(-num_tokens // n)
        mine = x[self.tp_rank * share:(self.tp_rank + 1) * share]
        weights, ids = route(F.linear(mine, self.gate), self.top_k, self.renormalize)
        per_rank = self.num_experts // n
        # (token, slot) rows sorted by the rank that holds their expert
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids // per_rank, stable=True)
        send_counts = torch.bincount(flat_ids // per_rank, minlength=n)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=state.tp_group)
        rows = mine[order // self.top_k]
        send_sizes, recv_sizes = send_counts.tolist(), recv_counts.tolist()
        recv_rows = rows.new_empty(sum(recv_sizes), x.shape[1])
        recv_ids = flat_ids.new_empty(sum(recv_sizes))
        _exchange(recv_rows, rows, recv_sizes, send_sizes, state.tp_group)
        _exchange(recv_ids, flat_ids[order], recv_sizes, send_sizes, state.tp_group)
        self._count(recv_ids[:, None])
        # each received row is one (token, expert) pair: weight 1 here, the sender weighs it
        ones = torch.ones(recv_ids.numel(), 1, dtype=torch.float32, device=x.device)
        outs = kernels.fused_moe(recv_rows, self.w13, self.w2, ones, recv_ids[:, None], self.expert_start)
        back = outs.new_empty(rows.shape)
        _exchange(back, outs, send_sizes, recv_sizes, state.tp_group)
        combined = torch.zeros(mine.shape, dtype=torch.float32, device=x.device)
        combined.index_add_(0, order // self.top_k, back.float() * weights.flatten()[order, None])
        return _gather_shares(combined.to(x.dtype), num_tokens, share, state.tp_group, n)


def _exchange(out: torch.Tensor, inp: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: Any) -> None:
    """all_to_all_single over dim 0 in fp32 where gloo needs it (it sums nothing, but has no bf16)."""
    if out.device.type == "cpu" and out.dtype in (torch.bfloat16, torch.float16):
        wide = out.float()
        dist.all_to_all_single(wide, inp.float().contiguous(), out_sizes, in_sizes, group=group)
        out.copy_(wide)
        return
    dist.all_to_all_single(out, inp.contiguous(), out_sizes, in_sizes, group=group)


def _gather_shares(mine: torch.Tensor, num_tokens: int, share: int, group: Any, n: int) -> torch.Tensor:
    """Every rank's share of the tokens, concatenated (the last shares may be short or empty)."""
    padded = mine.new_zeros(share, mine.shape[1])
    padded[:mine.shape[0]] = mine
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat(parts)[:num_tokens]
