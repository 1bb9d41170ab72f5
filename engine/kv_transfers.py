"""KVTransfers: an engine's KV transfers over its connector, from a request's first sight to its
blocks' release, in one place (the engine holds one when it has a connector).

A request that arrives with `kv_transfer_params` is attached here (`attach`): a prefill for a
remote decode (`do_remote_decode`: it runs to its first token and its blocks go under a lease,
`start_leases`), possibly after pulling its prefix from a peer, or a decode that pulls its prompt's
KV from the prefill engine that leased it (`remote_prefill`: the scheduler parks it while the pull
runs, engine/core/kv_loads.py). Each step the engine asks `poll` first (finished pulls back to the
queue, or failed; released, aborted and expired leases ended) and `dispatch` after scheduling (the
new pulls and releases to every rank's worker side). `lease_prefix` lends a peer replica the
leading blocks of a prompt this engine holds (loaded back from its offload tier first, when that
is where they are).
"""
from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from records.engine_stats import KVTransferStats
from records.outputs import RequestOutput
from records.request import PEER_PREFIX, Request
from records.step import SchedulerOutput

if TYPE_CHECKING:
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.core.scheduler import Scheduler
    from engine.executor.base import Executor
    from engine.output_processor import OutputProcessor
    from kv_transfer.base import KVConnectorScheduler


class KVTransfers:
    def __init__(self, connector: KVConnectorScheduler, executor: Executor, kv: KVCacheManager,
                 scheduler: Scheduler, output: OutputProcessor) -> None:
        self.connector = connector
        self.worker = executor.kv               # every rank's worker side
        self.executor, self.kv, self.scheduler, self.output = executor, kv, scheduler, output
        self.aborted_leases: list[str] = []     # ended at the next poll
        self.num_prefix_leases = 0              # prefixes leased to peer replicas (lease_prefix)

    # --- a request ----------------------------------------------------------------------------------
    def holds(self, request_id: str) -> bool:
        """Whether a lease of that id is held here (its id is not free for a new request)."""
        return request_id in self.connector.leases

    def attach(self, request: Request, kv_transfer_params: dict[str, Any]) -> None:
        """Give a new request its transfer role from its `kv_transfer_params` (ValueError naming
        what is wrong with them)."""
        if not isinstance(kv_transfer_params, dict):
            raise ValueError("kv_transfer_params must be a dict")
        params = request.sampling_params
        if params.n != 1:
            raise ValueError(f"kv_transfer_params need n == 1; got n={params.n}")
        remote = self.connector.parse(kv_transfer_params, request.block_hashes, request.num_prompt_tokens,
                                      params.adapter_name)
        if remote is None:
            request.remote_decode = True
            request.max_tokens = 1
            peer = kv_transfer_params.get("peer_prefix")
            if peer is not None:       # its prefix pulled from a peer (a peer's lease_prefix)
                if not isinstance(peer, dict) or not peer.get("do_remote_prefill"):
                    raise ValueError("kv_transfer_params.peer_prefix must be the kv_transfer_params a peer's "
                                     "lease_prefix returned")
                request.remote_prefill = self.connector.parse(peer, request.block_hashes, request.num_prompt_tokens,
                                                              params.adapter_name)
        elif params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs must be None with do_remote_prefill (the prompt's KV "
                             "is pulled, not computed here)")
        else:
            request.remote_prefill = remote

    def abort(self, request_id: str) -> None:
        """An abort of a lease's id ends the lease at the next poll (its blocks are freed then)."""
        if request_id in self.connector.leases:
            self.aborted_leases.append(request_id)

    def renew(self, request_id: str, seconds: float) -> bool:
        """Keep a leased request's blocks at least `seconds` longer; False if it holds no lease."""
        return self.connector.renew_lease(request_id, seconds)

    # --- each step ----------------------------------------------------------------------------------
    def poll(self) -> list[RequestOutput]:
        """Collect finished transfers: end released, aborted and expired leases (the worker refuses
        their pulls before their blocks are freed), and re-queue or fail finished pulls."""
        report = self.executor.kv_poll()
        aborted, self.aborted_leases = self.aborted_leases, []
        ending = self.connector.leases_to_end(report.released, aborted)
        if ending:
            self.worker.end_leases([lease.slot for lease in ending])
            for lease in ending:
                self.kv.free(lease.request)
        outputs = []
        for request in self.scheduler.finish_loads(report.loaded, report.failed):
            output = self.output.finish_loaded(request)
            if output is not None:
                outputs.append(output)
        return outputs

    def dispatch(self) -> None:
        """The pulls the scheduler started and the releases of pulled leases, to the workers."""
        for spec in self.connector.take_new_loads():
            self.worker.start_load(spec)
        for remote in self.connector.take_new_releases():
            self.worker.release_remote(remote)

    def start_leases(self) -> None:
        """Lease the blocks of requests that finished their prefill for a remote decode."""
        for request in self.scheduler.take_new_leased():
            block_ids = self.kv.block_ids(request.request_id)
            taken = self.connector.lease_slots.take()
            if taken is None:        # lease table full: the decode side will compute the prompt
                self.kv.free(request)
                continue
            self.worker.hold_lease(*taken, block_ids)
            params = self.connector.add_lease(request, block_ids, *taken, self.worker.addresses,
                                              self.worker.engine_id)
            self.output.set_transfer_params(request.request_id, params)
        self.executor.kv_flush()     # every rank holds the new leases before their parameters leave

    # --- a peer's prefix ----------------------------------------------------------------------------
    def lease_prefix(self, block_hashes: list[bytes], adapter: str = "") -> dict[str, Any] | None:
        """Lease the leading run of `block_hashes` this engine holds, in its pool or (loaded back
        into the pool first, now) its offload tier, for a peer replica to pull instead of computing
        them (the router decides: router/routing/pool_router.py). Returns the kv_transfer_params to
        give the peer's request (as a prefill engine's, for `num_tokens` = the run's tokens), or
        None when there is nothing to lease (no such blocks, the lease table full). The blocks stay
        referenced until the peer releases the lease, or it expires. Runs between steps."""
        if not self.connector.lease_slots.num_free:
            return None
        kv, hashes = self.kv, list(block_hashes)
        holder, num_pool = kv.hold_prefix(f"{PEER_PREFIX}{uuid.uuid4().hex[:16]}", hashes)
        failed: set[int] = set()
        if kv.tier is not None and (kv.tier.saves or kv.tier.loads):    # the tier's blocks: load them now
            saves, loads = kv.tier.take_orders()
            out = self.executor.execute_model(SchedulerOutput([], 0, tier_saves=saves, tier_loads=loads))
            kv.tier.forget_failed(out.tier_failed)
            failed = {order[3] for order in out.tier_failed if order[0] == "load"}
        if kv.confirm_prefix(holder, hashes, failed) == 0:
            kv.free(holder)
            return None
        taken = self.connector.lease_slots.take()
        assert taken is not None
        blocks = kv.req_to_blocks[holder.request_id]
        block_ids = [b.block_id for b in blocks]
        self.worker.hold_lease(*taken, block_ids)
        params = self.connector.add_prefix_lease(
            holder, block_ids, list(block_hashes[:len(blocks) // kv.num_groups]),
            len(blocks) // kv.num_groups * kv.block_size, adapter, *taken,
            self.worker.addresses, self.worker.engine_id)
        self.executor.kv_flush()     # every rank holds the lease before its parameters leave
        self.num_prefix_leases += 1
        return params

    # --- reading ------------------------------------------------------------------------------------
    def stats(self) -> KVTransferStats:
        c, loads = self.connector, self.scheduler.loads
        assert loads is not None
        return KVTransferStats(loads=c.num_loads, load_failures=c.num_load_failures,
                               blocks_pulled=c.num_blocks_pulled, leases=c.num_leases,
                               leases_active=len(c.leases), leases_expired=c.num_leases_expired,
                               prefix_leases=self.num_prefix_leases, requests_waiting=len(loads.loading))

    def check_no_leaks(self) -> None:
        assert not self.connector.leases, f"leases held: {list(self.connector.leases)}"
