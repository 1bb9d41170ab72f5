"""How a model's layers share the KV cache's blocks: one table for all, or vLLM's hybrid allocation
where local (sliding-window) and global layers mix."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVGroups:
    """How the layers share the KV cache's blocks.

    Usually one group: a block holds a page (block_size tokens of K and V) in every layer, and a
    request has one block table. Where local (sliding-window) and global layers mix (Gemma 2, 3) and
    the hybrid allocation is on (vLLM's hybrid KV cache manager), the layers form groups of equal
    size S (`num_slots`): the global layers in groups of S, then the local ones (the last padded).
    The cache is S slot tensors; layer number i of each group keeps its pages in slot tensor i, so a
    block is S pages wherever it is used, and every group draws its blocks from the one pool with a
    table of its own. A request's table is then the groups' tables interleaved: logical block j of
    group g is entry j * num_groups + g. A local group releases the blocks behind its window, so a
    long sequence holds about (global layers x length + local layers x window) of KV, not every
    layer's whole length. Block ids, copies, swaps, tier slots and transfers stay per block: each
    moves a block's S pages, whichever group holds it."""
    windows: tuple[int | None, ...]          # per group: its layers' window (None: global)
    layer_slots: tuple[tuple[int, int], ...]  # per layer: (group, slot tensor)
    num_slots: int

    @classmethod
    def of(cls, layer_windows: tuple[int | None, ...], hybrid: bool) -> KVGroups:
        """The grouping for layers with these windows (model_source.attention_windows): hybrid when
        asked and the layers mix global ones with local ones of one window; else one group (with the
        window where every layer has the same one)."""
        global_layers = [i for i, w in enumerate(layer_windows) if w is None]
        local_layers = [i for i, w in enumerate(layer_windows) if w is not None]
        local_windows = {layer_windows[i] for i in local_layers}
        n = len(layer_windows)
        if not (hybrid and global_layers and local_layers and len(local_windows) == 1):
            common = set(layer_windows)
            window = common.pop() if len(common) == 1 else None
            return cls((window,), tuple((0, i) for i in range(n)), n)
        size = min(len(global_layers), len(local_layers))
        window = local_windows.pop()
        windows: list[int | None] = []
        slots: dict[int, tuple[int, int]] = {}
        for layers, kind in ((global_layers, None), (local_layers, window)):
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start:start + size]):
                    slots[layer] = (len(windows), slot)
                windows.append(kind)
        return cls(tuple(windows), tuple(slots[i] for i in range(n)), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        return self.num_groups > 1
