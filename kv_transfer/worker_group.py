"""KVWorkerGroup: the engine's view of its TP ranks' connector workers (owned by its executor)."""
from __future__ import annotations

from typing import Any

from records.transfer import LoadSpec, RemotePrefill, TransferReport


class KVWorkerGroup:
    """The worker sides of all of one engine's TP ranks, as the engine sees them (owned by its
    executor). The engine's orders queue here (`hold_lease`, `end_leases`, `start_load`,
    `release_remote`) and go to every rank, in order, with the next step message, applied before
    that step's forward pass (so a lease's word is cleared before its freed blocks can be
    rewritten). Each rank's report comes back with its reply; `take_report` merges them: a pull is
    done when every rank has finished it (failed if any rank failed: only then may the engine reuse
    its blocks), and it then queues the release of the prefill engine's lease."""

    def __init__(self, engine_id: str, addresses: list[dict[str, Any]]) -> None:
        self.engine_id = engine_id              # rank 0's: the engine's id in RemotePrefill
        self.addresses = addresses              # per rank, for RemotePrefill.addresses
        self.num_ranks = len(addresses)
        self.ops: list[tuple[Any, ...]] = []
        self._loads: dict[str, tuple[LoadSpec, dict[int, str]]] = {}   # rid -> (spec, rank -> outcome)
        self._report = TransferReport()

    # --- orders -----------------------------------------------------------------------------------
    def hold_lease(self, slot: int, token: int, block_ids: list[int]) -> None:
        self.ops.append(("hold", slot, token, list(block_ids)))

    def end_leases(self, slots: list[int]) -> None:
        self.ops.append(("end", list(slots)))

    def start_load(self, spec: LoadSpec) -> None:
        self._loads[spec.request_id] = (spec, {})
        self.ops.append(("load", spec))

    def release_remote(self, remote: RemotePrefill) -> None:
        self.ops.append(("release", remote))

    def take_ops(self) -> list[tuple[Any, ...]]:
        ops, self.ops = self.ops, []
        return ops

    def has_pending(self) -> bool:
        """Orders not yet sent, or pulls some rank has not finished."""
        return bool(self.ops or self._loads)

    # --- reports ----------------------------------------------------------------------------------
    def collect(self, reports: list[TransferReport | None]) -> None:
        """Merge one reply per rank (in rank order)."""
        for rank, report in enumerate(reports):
            if report is None:
                continue
            self._report.released.extend(r for r in report.released if r not in self._report.released)
            for rid in report.loaded:
                self._outcome(rid, rank, "")
            for rid, reason in report.failed:
                self._outcome(rid, rank, reason or "failed")

    def _outcome(self, rid: str, rank: int, reason: str) -> None:
        entry = self._loads.get(rid)
        if entry is None:
            return
        spec, outcomes = entry
        outcomes[rank] = reason
        if len(outcomes) < self.num_ranks:
            return
        del self._loads[rid]
        failures = [f"rank {r}: {why}" if self.num_ranks > 1 else why
                    for r, why in sorted(outcomes.items()) if why]
        if failures:
            self._report.failed.append((rid, "; ".join(failures)))
        else:
            self._report.loaded.append(rid)

    def take_report(self) -> TransferReport:
        report, self._report = self._report, TransferReport()
        return report
