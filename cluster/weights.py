"""A model's weights across its pools' replicas, as an RL trainer drives them (the manager's
`ModelWeights`; each replica's engine does its part: engine/weight_updates.py).

- **pause / resume** every replica at its next step boundary together (modes keep, abort, wait).
- **updates** reach every rank of every replica: from a checkpoint directory, from tensors (Ray
  object references: small models), or broadcast by the trainer over one weight-update group whose
  rank 0 is the trainer and whose other ranks are the replicas' ranks, in a fixed order
  (`group_size` says how many members the trainer's group has). Tensors and broadcasts are checked
  on every replica before any applies them (if one refuses, none changes); a checkpoint is checked
  by each replica against the same model before it loads, the same verdict everywhere. An update
  applies on all replicas while they are paused (a caller that did not pause gets a pause "keep"
  around it), so no request sees one replica's new weights next to another's old ones, and the
  version moves on everywhere at once.

A replica that joins the pools later (a scale-up, a replacement) or wakes from sleep loads the
model's checkpoint: after a group or tensor update, push the weights again (a wake sets the version
back to "0"); after a disk update the manager gives it the same update before it serves
(`on_join`, `woken`).
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from engine.weight_updates import PAUSE_MODES


class ModelWeights:
    def __init__(self) -> None:
        self.version = "0"
        self.paused: str | None = None
        self.disk: tuple[str, str] | None = None      # the last update from disk: (path, version)

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
                     | None = None, version: str | None = None) -> dict[str, Any]:
        """Run one update (`method`: update_weights, update_weights_from_disk or
        update_weights_from_distributed, with its arguments) on every replica, paused: checked
        first on all (`shapes`, where the caller knows them), then applied on all; the new version."""
        if shapes is not None:
            await _each(replicas, "check_weights", {n: list(s) for n, s in shapes.items()})
        version = str(version) if version is not None else _next(self.version)
        paused_here = self.paused is None
        if paused_here:
            await _each(replicas, "pause", "keep")
        try:
            await _each(replicas, method, *args, version)
        finally:
            if paused_here:
                await _each(replicas, "resume")
        self.version = version
        if method == "update_weights_from_disk":
            self.disk = (args[0], version)
        return self.state()

    async def call(self, replicas: dict[str, Any], op: str, *args: Any) -> Any:
        """The manager's entry (ClusterManager.weights): `op` over these replicas."""
        if op == "state":
            return self.state()
        if op == "check":                          # ({name: shape})
            await _each(replicas, "check_weights", args[0])
            return self.state()
        if op in ("pause", "resume", "group_size", "join_group"):
            return await getattr(self, op)(replicas, *args)
        if op == "update_from_disk":               # (path, version)
            return await self.update(replicas, "update_weights_from_disk", args[0], version=args[1])
        if op == "update_from_group":              # (names, dtypes, shapes, version)
            names, dtypes, shapes, version = args
            return await self.update(replicas, "update_weights_from_distributed", names, dtypes, shapes,
                                     shapes=dict(zip(names, shapes, strict=True)), version=version)
        if op == "update_from_tensors":            # ([a Ray object reference of [(name, tensor)]], version)
            (ref,), version = args
            return await self.update(replicas, "update_weights", ref, version=version)
        raise ValueError(f"op must be one of state, check, pause, resume, group_size, join_group, update_from_disk, "
                         f"update_from_group, update_from_tensors; got {op!r}")

    async def on_join(self, replica: Any) -> None:
        """A replica that joins after a disk update gets it before it serves."""
        if self.disk is not None:
            await replica.weights_call.remote("update_weights_from_disk", *self.disk)

    async def woken(self, replicas: dict[str, Any]) -> None:
        """The replicas woke from sleep, their engines built from the checkpoint: the last disk
        update again, or, after group or tensor updates (the trainer pushes the next ones), the
        checkpoint's version "0"."""
        if self.disk is not None:
            await asyncio.gather(*[self.on_join(h) for h in replicas.values()])
        else:
            self.version = "0"


async def _ranks(replicas: dict[str, Any]) -> dict[str, int]:
    """Each replica's number of ranks, in replica-id order."""
    ids = sorted(replicas)
    infos = await asyncio.gather(*[replicas[r].info.remote() for r in ids])
    return {r: info["num_ranks"] for r, info in zip(ids, infos, strict=True)}


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
