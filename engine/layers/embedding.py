"""Token embedding, split over the TP ranks by vocabulary rows (the LM head shares the layout:
its weight is this one when embeddings are tied, and `ParallelLMHead` otherwise)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import _copy_checked
from engine.parallel_state import get_parallel_state, tp_all_gather, tp_all_reduce


class VocabParallelEmbedding(nn.Module):
    """Each TP rank holds rows [rank * per_rank, + per_rank) of the (zero-padded) vocabulary; a
    lookup embeds the ids in this rank's range, zeroes the others and all-reduces."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        state = get_parallel_state()
        self.vocab_size, self.tp_size = vocab_size, state.tp_size
        self.per_rank = -(-vocab_size // state.tp_size)
        self.start = state.tp_rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {self.vocab_size} rows")
        param.data.zero_()
        _copy_checked(param.data[:self.end - self.start], loaded[self.start:self.end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.start) & (input_ids < self.end)
        out = F.embedding((input_ids - self.start) * mine, self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return tp_all_reduce(out)

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Per-rank logits over this rank's vocabulary rows -> [N, vocab_size] on every rank."""
        return tp_all_gather(local_logits)[..., :self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """The untied LM head: the same vocabulary split; logits come from `LlamaForCausalLM`."""
