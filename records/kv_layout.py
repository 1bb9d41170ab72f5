"""The KV layout two engines must share to exchange blocks, and how their TP ranks' heads map
onto each other (`head_slices`: which source ranks hold the heads a destination rank keeps)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from records.dtypes import KV_DTYPE_SIZES
from records.errors import KVLayoutMismatch

if TYPE_CHECKING:
    from records.config import EngineConfig


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What must agree between two engines for their blocks to be interchangeable."""
    model: str            # architecture and a digest of the model config (not of the weights)
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str            # the cache's dtype; for fp8 with scales other than 1.0, also a digest of them
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def from_config(cls, config: EngineConfig, tp_rank: int = 0) -> KVLayout:
        mc = config.model_config
        dtype = config.kv_dtype
        scales = config.cache_config.kv_scales
        if scales:      # an fp8 cache's bytes mean the same only under the same per-layer scales
            dtype += ":scales-" + hashlib.sha256(json.dumps(scales).encode()).hexdigest()[:12]
        raw = {k: v for k, v in mc.hf_config.to_dict().items()
               if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")}
        digest = hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return cls(model=f"{mc.architecture}:{digest}", num_layers=mc.num_layers,
                   block_size=config.cache_config.block_size, num_kv_heads=mc.num_kv_heads,
                   head_dim=mc.head_dim, dtype=dtype, tp_rank=tp_rank,
                   tp_size=config.parallel_config.tensor_parallel_size)

    @property
    def local_kv_heads(self) -> int:
        """KV heads one rank holds (each head on tp / num_kv_heads ranks when tp > num_kv_heads)."""
        return max(1, self.num_kv_heads // self.tp_size)

    def rank_heads(self, rank: int) -> range:
        """The global KV heads that TP rank `rank` holds, in its local order."""
        if self.tp_size > self.num_kv_heads:
            head = rank // (self.tp_size // self.num_kv_heads)
            return range(head, head + 1)
        per = self.num_kv_heads // self.tp_size
        return range(rank * per, (rank + 1) * per)

    def check_compatible(self, remote: KVLayout) -> None:
        """Raise KVLayoutMismatch naming the first field on which the remote engine differs. TP sizes
        may differ: each rank pulls the heads it keeps (`head_slices`)."""
        for name in ("model", "num_layers", "block_size", "num_kv_heads", "head_dim", "dtype"):
            mine, theirs = getattr(self, name), getattr(remote, name)
            if mine != theirs:
                raise KVLayoutMismatch(
                    f"kv_transfer_params: the prefill engine's {name} is {theirs!r} but this engine's "
                    f"is {mine!r}; prefill and decode engines must have the same {name}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's K (or V) in one layer, on one rank."""
        return self.block_size * self.local_kv_heads * self.head_bytes

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token's K (or V)."""
        return self.head_dim * KV_DTYPE_SIZES[self.dtype.split(":")[0]]


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """`count` consecutive KV heads that a destination rank takes from one source rank."""
    src_rank: int
    src_start: int         # first head, in the source rank's local head order
    dst_start: int         # where it lands, in the destination rank's local head order
    count: int

    def covers(self, src: KVLayout, dst: KVLayout) -> bool:
        """True when it moves whole blocks (every head of both ranks)."""
        return self.count == src.local_kv_heads == dst.local_kv_heads


def head_slices(src: KVLayout, dst: KVLayout) -> list[HeadSlice]:
    """Where destination rank `dst.tp_rank` finds each KV head it keeps among the source engine's
    ranks (a replicated head is taken from the source rank with the destination's number when that
    rank holds it, else from its first holder), merged into runs of consecutive heads."""
    slices: list[HeadSlice] = []
    for local, head in enumerate(dst.rank_heads(dst.tp_rank)):
        holders = [r for r in range(src.tp_size) if head in src.rank_heads(r)]
        rank = dst.tp_rank if dst.tp_rank in holders else holders[0]
        offset = src.rank_heads(rank).index(head)
        last = slices[-1] if slices else None
        if (last is not None and last.src_rank == rank and last.src_start + last.count == offset
                and last.dst_start + last.count == local):
            slices[-1] = HeadSlice(rank, last.src_start, last.dst_start, last.count + 1)
        else:
            slices.append(HeadSlice(rank, offset, local, 1))
    return slices
