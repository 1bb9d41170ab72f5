"""CUDA graphs of the decode step: one captured forward per batch-size bucket, replayed with the
batch padded up to the bucket.

A decode step of a large model is hundreds of small kernel launches; at small batch the CPU time to
launch them exceeds the GPU time to run them. Replaying a captured graph launches them all at once.
The graph reads its inputs from static buffers: input ids, positions, slot mapping, block tables
padded to the longest possible sequence, and sequence lengths. Padded rows write no K/V (slot -1,
which the Triton write kernel skips) and attend to nothing (length 0), so they change nothing.
Prefill and mixed steps, batches above the largest bucket, and pipeline or tensor parallel ranks run
eagerly. Only the hidden states are captured; logits and sampling run after the replay, on the
real rows.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.model.layers.attention import AttentionMetadata


class CudaGraphRunner:
    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], sizes: tuple[int, ...],
                 max_blocks_per_seq: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = tuple(sorted(sizes))
        n = self.sizes[-1]
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(n, **long)
        self.positions = torch.zeros(n, **long)
        self.slot_mapping = torch.full((n,), -1, **long)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **long)
        self.seq_lens = torch.zeros(n, **long)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:batch], num_decode_tokens=batch,
                                 decode_block_tables=self.block_tables[:batch],
                                 decode_seq_lens=self.seq_lens[:batch])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, all in one memory pool (a smaller graph's buffers
        fit inside the largest one's). The buffers hold padding values: nothing is written to KV."""
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for batch in reversed(self.sizes):
                args = (self.input_ids[:batch], self.positions[:batch], self.kv_caches, self._meta(batch))
                self.model(*args)                   # warm-up: Triton compiles outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    hidden = self.model(*args)
                pool = graph.pool()
                self.graphs[batch] = (graph, hidden)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.sizes if b >= batch), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
            ) -> torch.Tensor | None:
        """The decode step's hidden states [batch, hidden] by replay, or None when no bucket fits
        (the caller runs eagerly). The result is a view of the graph's output: use it before the
        next replay."""
        n = input_ids.shape[0]
        batch = self.bucket(n)
        if batch is None or meta.num_decode_tokens != n:
            return None
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:batch].fill_(-1)
        self.seq_lens[:n].copy_(meta.decode_seq_lens)
        self.seq_lens[n:batch].zero_()
        # Columns past a row's own blocks are never read (only positions < its length are), so
        # stale entries there need no clearing.
        self.block_tables[:n, :meta.decode_block_tables.shape[1]].copy_(meta.decode_block_tables)
        graph, hidden = self.graphs[batch]
        graph.replay()
        return hidden[:n]
