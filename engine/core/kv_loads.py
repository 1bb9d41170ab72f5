"""KVLoads: the scheduler's side of a prefill/decode split.

On the decode side, a remotely prefilled request is admitted into WAITING_FOR_REMOTE_KVS: its blocks
are allocated and their pull is queued with the connector. When the pull ends the request rejoins
the queue's front with its KV computed; a failed pull starts over locally (policy "recompute") or
ends the request with a KVTransferError ("fail"). A request aborted mid-pull keeps its blocks until
the pull ends (it may still write into them). On the prefill side, a request that finished its
prompt for a remote decode keeps its blocks; the engine puts them under a lease.

This holds that bookkeeping; the Scheduler owns the queues and calls in at admission, abort and
finish, so the request's status changes stay in one place.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import records.clock as clock
from engine.core.kv_cache_manager import KVCacheManager
from records.errors import KVTransferError
from records.request import PEER_PREFIX, Request, RequestStatus

if TYPE_CHECKING:
    from kv_transfer.base import KVConnectorScheduler


class KVLoads:
    def __init__(self, connector: KVConnectorScheduler, kv_cache_manager: KVCacheManager,
                 failure_policy: str = "recompute") -> None:
        self.connector = connector
        self.kv = kv_cache_manager
        self.failure_policy = failure_policy
        self.loading: dict[str, tuple[Request, int]] = {}   # pulling KV: (request, tokens to pull)
        self.aborted: dict[str, Request] = {}               # aborted mid-pull: freed when it ends
        self.new_leased: list[Request] = []                 # finished, blocks kept for a remote decode

    def start(self, request: Request, hits: list, num_hit: int) -> bool | None:
        """Start a remotely prefilled request's pull. True: it is now WAITING_FOR_REMOTE_KVS (the
        caller takes it off the waiting queue); False: nothing to pull (P's lease is released; it
        runs like any request); None: its blocks do not fit now."""
        num_external = self.connector.num_external_tokens(request, num_hit)
        if num_external == 0:
            self.connector.plan_release(request)
            request.remote_prefill = None
            return False
        if self.kv.allocate_slots(request, num_external, hits, cache=False) is None:
            return None
        self.kv.record_prefix_lookup(request.num_tokens, num_hit)
        request.num_cached_tokens = request.num_computed_tokens = num_hit
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = (request, num_external)
        request.pull_start = request.scheduled_time = clock.monotonic()
        request.pull_tokens = num_external
        self.connector.plan_load(request, self.kv.block_ids(request.request_id), num_hit, num_external)
        return True

    def abort(self, request: Request, status: RequestStatus) -> None:
        """End a request mid-pull: its blocks are freed when the pull ends."""
        del self.loading[request.request_id]
        request.status = status
        self.aborted[request.request_id] = request

    def drop_unstarted(self, request: Request) -> None:
        """A remotely prefilled request ended before its pull started: free P's lease now."""
        self.connector.plan_release(request)

    def keep_for_lease(self, request: Request) -> bool:
        """True if a finished request's blocks stay for a remote decode (taken by take_new_leased)."""
        if not self.connector.wants_lease(request):
            return False
        self.new_leased.append(request)
        return True

    def take_new_leased(self) -> list[Request]:
        leased, self.new_leased = self.new_leased, []
        return leased

    def finish(self, loaded: list[str], failed: list[tuple[str, str]]
               ) -> tuple[list[Request], list[Request]]:
        """Apply finished pulls. Returns (to requeue at the queue's front, WAITING with their KV
        computed or reset to start over; to end with FINISHED_ERROR, their error set). Requests
        aborted mid-pull are freed now."""
        requeue, errored = [], []
        for rid, reason in [(rid, None) for rid in loaded] + list(failed):
            aborted = self.aborted.pop(rid, None)
            if aborted is not None:
                self.connector.plan_release(aborted)         # P's blocks are not needed any more
                self.kv.free(aborted)
                continue
            if rid not in self.loading:
                continue
            request, num_external = self.loading.pop(rid)
            # Every rank is done with P's blocks (or gave up): P may free them (best effort: P may
            # be gone, and then its lease has ended anyway).
            self.connector.plan_release(request)
            # A peer's cached prefix (lease_prefix) is an optimization: losing it always recomputes.
            peer = request.remote_prefill is not None and request.remote_prefill.request_id.startswith(PEER_PREFIX)
            request.remote_prefill = None
            request.pull_end = clock.monotonic()
            stale, request.kv_stale = request.kv_stale, False     # pulled KV of weights replaced meanwhile
            if reason is not None:
                self.connector.num_load_failures += 1
                request.pull_error = reason
            if reason is None and not stale:
                request.num_computed_tokens += num_external
                self.kv.cache_full_blocks(request, request.num_computed_tokens)
            elif stale or self.failure_policy == "recompute" or peer:
                self.kv.free(request)
                request.num_computed_tokens = request.num_cached_tokens = 0
            else:
                request.stop_reason = f"KV transfer failed: {reason}"
                request.error = KVTransferError(request.stop_reason)
                errored.append(request)
                continue
            request.status = RequestStatus.WAITING
            requeue.append(request)
        return requeue, errored
