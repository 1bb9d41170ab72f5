"""A model's weights across its pools' replicas, as an RL trainer drives them (the manager's
`ModelWeights`; each replica's engine does its part: engine/weight_updates.py).

- **pause / resume** every replica at its next step boundary together (modes keep, abort, wait).
- **updates** reach every rank of every replica: from a checkpoint directory, from tensors (Ray
  object references: small models), or broadcast by the trainer over one weight-update group whose
  rank 0 is the trainer and whose other ranks are the replicas' ranks, in a fixed order
  (`group_size` says how many members the trainer's group has). Tensors and broadcasts are checked
  on every replica before any applies them (if one refuses, none changes); a checkpoint is checked
  by each replica against the same model before it loads, the same verdict everywhere. An update
  applies on all replicas while they are paused (a caller that did not pause gets a pause "wait"
  around it: running requests finish first, so no sequence spans two versions unless the caller
  paused with "keep"), so no request sees one replica's new weights next to another's old ones,
  and the version moves on everywhere at once.

An update may be of a LoRA adapter the model serves instead (the update ops' last argument, a
LoRARequest: an RL policy trained as an adapter over a frozen base; PEFT names).

A replica that joins the pools later (a scale-up, a replacement) or wakes from sleep loads the
model's checkpoint: after a group or tensor update, push the weights again (a wake sets the version
back to "0"); after disk updates the manager gives it the same updates (the model's last, each
adapter's last) before it serves (`on_join`, `woken`).
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from engine.weight_updates import PAUSE_MODES
from records.lora import LoRARequest


class ModelWeights:
    def __init__(self) -> None:
        self.version = "0"
        self.paused: str | None = None
        # The last update from disk of the model (key None) and of each adapter (its name), in the
        # order they happened: (path, version, adapter).
        self.disk: dict[str | None, tuple[str, str, LoRARequest | None]] = {}

    def state(self) -> dict[str, Any]:
        return {"weight_version": self.version, "paused": self.paused}

    async def pause(self, replicas: dict[str, Any], mode: str = "keep") -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}; got {mode!r}")
        await _each(replicas, "pause", mode)
        self.paused = mode
        return self.state()

    async def resume(self, replicas: dict[str, Any]) -> dict[str, Any]:
        await _each(replicas, "resume")
        self.paused = None
        return self.state()

    async def group_size(self, replicas: dict[str, Any]) -> int:
        """Members of the weight-update group: the trainer and every rank of every replica."""
        return 1 + sum((await _ranks(replicas)).values())

    async def join_group(self, replicas: dict[str, Any], master_address: str, master_port: int,
                         backend: str = "gloo") -> int:
        """Every replica's ranks join the trainer's group (ranks 1 ... in replica-id order); returns
        its size. Blocks until the trainer has formed its side (WeightUpdateGroup(rank=0))."""
        ranks = await _ranks(replicas)
        offsets, first = {}, 1
        for replica, n in ranks.items():
            offsets[replica], first = first, first + n
        await asyncio.gather(*[replicas[r].weights_call.remote("init_weights_update_group", master_address,
                                                               master_port, offset, first, backend)
                               for r, offset in offsets.items()])
        return first

    async def update(self, replicas: dict[str, Any], method: str, *args: Any, shapes: dict[str, Sequence[int]]
                     | None = None, version: str | None = None, lora: LoRARequest | None = None) -> dict[str, Any]:
        """Run one update (`method`: update_weights, update_weights_from_disk or
        update_weights_from_distributed, with its arguments) of the model or adapter `lora` on every
        replica, paused: checked first on all (`shapes`, where the caller knows them), then applied
        on all; the new version."""
        if shapes is not None:
            await _each(replicas, "check_weights", {n: list(s) for n, s in shapes.items()}, lora)
        version = str(version) if version is not None else _next(self.version)
        paused_here = self.paused is None
        if paused_here:
            await _each(replicas, "pause", "wait")
        try:
            await _each(replicas, method, *args, version, lora)
        finally:
            if paused_here:
                await _each(replicas, "resume")
        self.version = version
        if method == "update_weights_from_disk":
            key = lora.lora_name if lora is not None else None
            self.disk.pop(key, None)
            self.disk[key] = (args[0], version, lora)
        return self.state()

    async def call(self, replicas: dict[str, Any], op: str, *args: Any) -> Any:
        """The manager's entry (ClusterManager.weights): `op` over these replicas."""
        if op == "state":
            return self.state()
        if op in ("pause", "resume", "group_size", "join_group"):
            return await getattr(self, op)(replicas, *args)
        # The update ops' arguments, then the adapter they update (a LoRARequest; absent or None: the model).
        if op == "check":                          # ({name: shape}, lora?)
            shapes, lora = _with_adapter(args, 1)
            await _each(replicas, "check_weights", *shapes, lora)
            return self.state()
        if op == "update_from_disk":               # (path, version, lora?)
            (path, version), lora = _with_adapter(args, 2)
            return await self.update(replicas, "update_weights_from_disk", path, version=version, lora=lora)
        if op == "update_from_group":              # (names, dtypes, shapes, version, lora?)
            (names, dtypes, shapes, version), lora = _with_adapter(args, 4)
            return await self.update(replicas, "update_weights_from_distributed", names, dtypes, shapes,
                                     shapes=dict(zip(names, shapes, strict=True)), version=version, lora=lora)
        if op == "update_from_tensors":            # ([a Ray object reference of [(name, tensor)]], version, lora?)
            ((ref,), version), lora = _with_adapter(args, 2)
            return await self.update(replicas, "update_weights", ref, version=version, lora=lora)
        raise ValueError(f"op must be one of state, check, pause, resume, group_size, join_group, update_from_disk, "
                         f"update_from_group, update_from_tensors; got {op!r}")

    async def on_join(self, replica: Any) -> None:
        """A replica that joins after disk updates gets them before it serves."""
        for path, version, lora in self.disk.values():
            await replica.weights_call.remote("update_weights_from_disk", path, version, lora)

    async def woken(self, replicas: dict[str, Any]) -> None:
        """The replicas woke from sleep, their engines built from the checkpoint: the disk updates
        again, or, after group or tensor updates only (the trainer pushes the next ones), the
        checkpoint's version "0"."""
        if self.disk:
            await asyncio.gather(*[self.on_join(h) for h in replicas.values()])
        else:
            self.version = "0"


async def _ranks(replicas: dict[str, Any]) -> dict[str, int]:
    """Each replica's number of ranks, in replica-id order."""
    ids = sorted(replicas)
    infos = await asyncio.gather(*[replicas[r].info.remote() for r in ids])
    return {r: info["num_ranks"] for r, info in zip(ids, infos, strict=True)}


def _with_adapter(args: tuple[Any, ...], n: int) -> tuple[tuple[Any, ...], LoRARequest | None]:
    """An op's `n` arguments and the adapter after them (None: the model's own weights)."""
    if not n <= len(args) <= n + 1:
        raise ValueError(f"expected {n} arguments and an optional adapter; got {len(args)}")
    return args[:n], args[n] if len(args) > n else None


def _next(version: str) -> str:
    return str(int(version) + 1) if version.isdigit() else f"{version}+1"


async def _each(replicas: dict[str, Any], method: str, *args: Any) -> list[Any]:
    """`weights_call(method, *args)` on every replica at once; the first failure raised, naming
    its replica (ValueError for a refusal)."""
    ids = sorted(replicas)
    results = await asyncio.gather(*[replicas[r].weights_call.remote(method, *args) for r in ids],
                                   return_exceptions=True)
    for replica, result in zip(ids, results, strict=True):
        if isinstance(result, BaseException):
            cause = getattr(result, "cause", None) or result
            if isinstance(cause, ValueError):
                raise ValueError(f"{replica}: {cause}") from None
            raise RuntimeError(f"{replica}: {cause!r}") from None
    return results
