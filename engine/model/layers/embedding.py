"""Token embedding, split over the TP ranks by vocabulary rows (the LM head shares the layout:
its weight is this one when embeddings are tied, and `ParallelLMHead` otherwise)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.loading.weights import GGUFWeight
from engine.model.layers.cpu_gemm import Packed, linear
from engine.model.layers.linear import _copy_checked
from engine.model.parallel_state import get_parallel_state, tp_all_gather, tp_all_reduce
from kernels.cpu_ops import gguf_dense_min_rows
from kernels.dispatch import kernels_for
from kernels.gguf_format import GGUF_BLOCK, GGUF_BLOCK_BYTES, dequantize_gguf


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
        self.hidden_size, self.dtype = hidden_size, dtype
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.qtype: str | None = None
        self.dense: torch.Tensor | None = None      # a GGUF head's dense copy (quantization="gguf+dense")
        self.dense_min_rows = gguf_dense_min_rows(dtype)    # the rows from which the head multiplies it
        self.logit_blocks: torch.Tensor | None = None   # a GGUF head's blocks in its kernel set's form (at load)
        self.int8_activations = False       # the head times int8-quantized hidden states (quantize_activations)

    def quantize_as(self, qtype: str) -> None:
        """Keep the table in GGUF blocks of `qtype` (rows dequantized as they are looked up; the tied
        LM head multiplies the blocks)."""
        if qtype not in GGUF_BLOCK_BYTES or self.hidden_size % GGUF_BLOCK:
            raise ValueError(f"a GGUF embedding must be one of {sorted(GGUF_BLOCK_BYTES)} with a hidden size in "
                             f"blocks of {GGUF_BLOCK}; got {qtype!r}, {self.hidden_size}")
        self.qtype = qtype
        row_bytes = self.hidden_size // GGUF_BLOCK * GGUF_BLOCK_BYTES[qtype]
        self.weight = nn.Parameter(torch.empty(self.per_rank, row_bytes, dtype=torch.uint8, device=self.weight.device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | GGUFWeight, shard_id: object = None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {self.vocab_size} rows")
        param.data.zero_()           # padding rows: zero weights (GGUF: zero scales)
        _copy_checked(param.data[:self.end - self.start], loaded.narrow(0, self.start, self.end - self.start))

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qtype is None:
            return F.embedding(ids, self.weight)
        flat = ids.reshape(-1)
        rows = dequantize_gguf(self.weight.index_select(0, flat), self.qtype, self.dtype)
        return rows.reshape(*ids.shape, self.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._rows(input_ids)
        mine = (input_ids >= self.start) & (input_ids < self.end)
        out = self._rows((input_ids - self.start) * mine)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return tp_all_reduce(out)

    def logits(self, hidden: torch.Tensor, packed: Packed | None) -> torch.Tensor:
        """This rank's logits [N, per_rank] in hidden's dtype: hidden times the table's transpose."""
        if self.qtype is None:
            return linear(hidden, self.weight, None, packed)
        if self.dense is not None and hidden.shape[0] >= self.dense_min_rows:
            return linear(hidden, self.dense, None, packed)
        kernels = kernels_for(hidden)
        multiply = kernels.gguf_linear_int8 if self.int8_activations else kernels.gguf_linear
        return multiply(hidden, self.logit_blocks, self.qtype)

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Per-rank logits over this rank's vocabulary rows -> [N, vocab_size] on every rank."""
        return tp_all_gather(local_logits)[..., :self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """The untied LM head: the same vocabulary split; logits come from `LlamaForCausalLM`."""
