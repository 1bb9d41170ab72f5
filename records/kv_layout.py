"""The KV layout two engines must share to exchange blocks, and how their ranks map onto each
other: by layer across pipeline stages (each stage holds a range of the layers) and by head across
TP ranks (`kv_sources`: which source ranks hold the layers and heads a destination rank keeps).
How a model's layers share the blocks (KVGroups) is records/kv_groups.py."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from records.dtypes import KV_DTYPE_SIZES
from records.errors import KVLayoutMismatch
from records.model_source import even_layer_partition

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
    pp_rank: int = 0
    pp_size: int = 1
    layer_partition: tuple[int, ...] = ()   # layers per pipeline stage; () = the even split
    # Hybrid allocation (records/kv_groups.py): num_layers counts the slot tensors, and each request's table
    # interleaves this many groups' tables; 1: one table, a tensor per layer.
    num_groups: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_partition", tuple(int(n) for n in self.layer_partition))

    @classmethod
    def from_config(cls, config: EngineConfig, tp_rank: int = 0, pp_rank: int = 0) -> KVLayout:
        mc = config.model_config
        dtype = config.kv_dtype
        scales = config.cache_config.kv_scales
        if scales:      # an fp8 cache's bytes mean the same only under the same per-layer scales
            dtype += ":scales-" + hashlib.sha256(json.dumps(scales).encode()).hexdigest()[:12]
        raw = {k: v for k, v in mc.hf_config.to_dict().items()
               if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")}
        digest = hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]
        model, num_layers, num_kv_heads, head_dim = f"{mc.architecture}:{digest}", mc.num_layers, mc.num_kv_heads, \
            mc.head_dim
        groups, partition = config.kv_groups, config.parallel_config.layer_partition
        if groups.hybrid:           # one stage (EngineConfig.kv_groups): its slot tensors are its "layers"
            num_layers, partition = groups.num_slots, ()
        if config.simulation is not None:       # the simulated model's KV (its blocks are never read)
            shape = config.simulation.profile.model
            model, num_layers, num_kv_heads, head_dim = (f"simulated:{shape.name}:{digest}", shape.num_layers,
                                                         shape.num_kv_heads, shape.head_dim)
        return cls(model=model, num_layers=num_layers,
                   block_size=config.cache_config.block_size, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, dtype=dtype, tp_rank=tp_rank,
                   tp_size=config.parallel_config.tensor_parallel_size, pp_rank=pp_rank,
                   pp_size=config.parallel_config.pipeline_parallel_size,
                   layer_partition=partition, num_groups=groups.num_groups)

    @property
    def rank(self) -> int:
        """This rank's number in its engine (stage-major, as engine/model/parallel_state.py)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def partition(self) -> tuple[int, ...]:
        """Layers per pipeline stage."""
        return self.layer_partition or tuple(even_layer_partition(self.num_layers, self.pp_size))

    def stage_layers(self, stage: int) -> range:
        """The global layer numbers pipeline stage `stage` holds."""
        sizes = self.partition
        start = sum(sizes[:stage])
        return range(start, start + sizes[stage])

    @property
    def layers(self) -> range:
        """The global layer numbers this rank holds (its KV tensors, in order)."""
        return self.stage_layers(self.pp_rank)

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
        """Raise KVLayoutMismatch naming the first field on which the remote engine differs, or the
        field of its layout that cannot be mapped onto this one. TP sizes, PP sizes and layer splits
        may differ: each rank pulls the layers and heads it keeps (`kv_sources`)."""
        for name in ("model", "num_layers", "num_groups", "block_size", "num_kv_heads", "head_dim", "dtype"):
            mine, theirs = getattr(self, name), getattr(remote, name)
            if mine != theirs:
                raise KVLayoutMismatch(
                    f"kv_transfer_params: the prefill engine's {name} is {theirs!r} but this engine's "
                    f"is {mine!r}; prefill and decode engines must have the same {name}")
        sizes = remote.partition
        if len(sizes) != remote.pp_size or sum(sizes) != remote.num_layers or min(sizes) < 1:
            raise KVLayoutMismatch(
                f"kv_transfer_params: the prefill engine's layer_partition {list(sizes)} does not split its "
                f"{remote.num_layers} layers into its pipeline_parallel_size={remote.pp_size} stages; its "
                f"layers cannot be mapped onto this engine's")
        if remote.tp_size < 1 or (remote.num_kv_heads % remote.tp_size and remote.tp_size % remote.num_kv_heads):
            raise KVLayoutMismatch(
                f"kv_transfer_params: the prefill engine's tensor_parallel_size {remote.tp_size} does not "
                f"split its {remote.num_kv_heads} KV heads; its heads cannot be mapped onto this engine's")

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


@dataclass(frozen=True, slots=True)
class KVSource:
    """One part of a destination rank's pull: the `heads` part of layers `layers` (global numbers),
    held by the source engine's rank `src_rank` (stage-major)."""
    src_rank: int
    layers: range
    heads: HeadSlice
    src_first: int          # global number of the source rank's first layer
    dst_first: int          # global number of the destination rank's first layer

    @property
    def src_layers(self) -> range:
        """`layers` as indices into the source rank's KV tensors."""
        return range(self.layers.start - self.src_first, self.layers.stop - self.src_first)

    @property
    def dst_layers(self) -> range:
        """`layers` as indices into the destination rank's KV tensors."""
        return range(self.layers.start - self.dst_first, self.layers.stop - self.dst_first)


def kv_sources(src: KVLayout, dst: KVLayout) -> list[KVSource]:
    """Where destination rank `dst` (its stage's layers, its TP rank's heads) finds its KV among the
    source engine's ranks: for each source stage whose layers overlap its own, the source TP ranks
    of that stage that hold its heads (`head_slices`). Every part is a distinct source rank."""
    mine = dst.layers
    parts = []
    for stage in range(src.pp_size):
        theirs = src.stage_layers(stage)
        lo, hi = max(mine.start, theirs.start), min(mine.stop, theirs.stop)
        if lo < hi:
            parts += [KVSource(stage * src.tp_size + h.src_rank, range(lo, hi), h, theirs.start, mine.start)
                      for h in head_slices(src, dst)]
    return parts


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
