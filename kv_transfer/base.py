"""The KV connector: how a prompt's KV blocks move from a prefill engine to a decode engine.

Two roles, as in vLLM's v1 connector:
- scheduler side (`KVConnectorScheduler`, transport-independent, lives beside the scheduler): how many
  leading prompt tokens of a request come from a remote engine, which local blocks receive them,
  which pulls to start, and the prefill side's leases.
- worker side (`KVConnectorWorker`, one per rank; NIXL in `nixl.py`, torch.distributed in
  `torch_dist.py`): registers the KV tensors, moves blocks, reports finished sends and receives.

Beside them: `leases.py` (lease slots, tokens and the words remote readers check),
`worker_group.py` (the engine's view of its ranks' worker sides); the records they exchange live
below them: records/kv_layout.py (the KV layout both engines must share, and how their ranks map
by layer across pipeline stages and by head across TP ranks: `kv_sources`),
records/transfer.py (RemotePrefill, LoadSpec, TransferReport), and their wire form in
pdserve_proto/transfer.py.

The protocol (pull model):
1. Prefill engine P runs a request with `kv_transfer_params={"do_remote_decode": True}` and
   `max_tokens=1`. When it finishes, its blocks are not freed: P's worker takes a *lease* on them (a
   slot in its lease table holding a fresh token) and P returns its `RemotePrefill` as
   kv_transfer_params (pdserve_proto/transfer.py: `to_params`) with its output.
   Those parameters are a dict (the engine API) whose "pdserve_kv" entry is the protobuf
   `RemotePrefill` of pdserve_proto/pdserve.proto: schema version, handshake (connector, its
   protocol version, KV layout), blocks, lease and transport address. D refuses another schema
   version, connector, connector version or layout with a ValueError naming what differs.
2. Decode engine D gets the same prompt with those parameters. Its scheduler matches its own prefix
   cache, allocates blocks for the rest of the prompt but its last token (recomputed: its logits give
   the first output token), and queues a pull of just those blocks. The request waits in
   WAITING_FOR_REMOTE_KVS while other requests keep stepping.
3. Each of D's ranks (every TP rank of every pipeline stage) pulls its layers and heads of the
   blocks from the P ranks that hold them, then reads those ranks' lease words again: if the token
   is unchanged, P had not released the blocks during the pull (P clears the word before a released
   block can be rewritten), so the data is valid. Once every rank of D has finished (a failure on
   any fails the pull as a whole), D's engine tells P it is done (D's rank 0 to P's rank 0).
4. P frees the blocks on that notice, on abort, or when the lease expires. D falls back to computing
   the prompt itself (`load_failure_policy="recompute"`) or fails the request (`"fail"`) when the
   pull fails, times out or finds the lease gone. No step ever waits on the other engine, and every
   path ends with every block freed on both sides.
"""
from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import records.clock as clock
from kv_transfer.leases import Lease, LeaseSlots, LeaseTable
from pdserve_proto.transfer import from_params, to_params
from records.config import KVTransferConfig
from records.errors import KVLayoutMismatch
from records.kv_layout import KVLayout, KVSource, kv_sources
from records.request import BlockHolder, Request, RequestStatus
from records.transfer import CONNECTOR_VERSION, LoadSpec, RemotePrefill, TransferReport

if TYPE_CHECKING:
    import torch


def advertised_host(host: str) -> str:
    """The address other engines reach this one at: `host`, or for "auto" this Ray node's IP (a
    decode replica on another node must not be told 127.0.0.1), or 127.0.0.1 outside Ray."""
    if host != "auto":
        return host
    try:
        import ray  # noqa: PLC0415

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"



MAX_PULL_LOG = 4096       # finished pulls a rank keeps until taken (the oldest go first)


@dataclass(frozen=True, slots=True)
class PullRecord:
    """One rank's part of one pull, as that rank saw it: from the engine's order to the poll that
    saw it end (clock.wall(): comparable across the ranks of one machine)."""
    request_id: str
    rank: int
    start: float
    end: float
    num_bytes: int
    ok: bool


# --- worker side ------------------------------------------------------------------------------------
class KVConnectorWorker:
    """Worker side of a connector, one per rank (every TP rank of every pipeline stage). All methods
    run on the rank's step thread, between steps; transports may use their own threads for the
    bytes, never for engine state.

    Subclasses implement `address`, `_start_load`, `release_remote`, `_poll` and `shutdown`."""

    name = "base"

    def __init__(self, config: KVTransferConfig, layout: KVLayout) -> None:
        self.config = config
        self.layout = layout
        self.rank = layout.rank              # in its engine, stage-major
        # Unique per worker incarnation (replicas of a pool share one config and its engine_id).
        self.engine_id = f"{config.engine_id}-{uuid.uuid4().hex[:8]}"
        self.leases = LeaseTable()
        self.kv_caches: list[torch.Tensor] = []    # per layer [2, num_blocks, block_size, kvh, d]
        self._injected_failures: list[tuple[str, str]] = []
        self._delayed: list[tuple[float, LoadSpec]] = []
        self._pulls_started: dict[str, tuple[float, int]] = {}    # rid -> (clock.wall(), bytes)
        # A deque: appended on the step thread, taken from another (a Ray worker's control thread).
        self.pull_log: deque[PullRecord] = deque(maxlen=MAX_PULL_LOG)

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Make these tensors readable by remote engines (called once, after allocation)."""
        self.kv_caches = kv_caches

    @property
    def num_blocks(self) -> int:
        return self.kv_caches[0].shape[1]

    def address(self) -> dict[str, Any]:
        """How a remote worker reaches this one (one entry of RemotePrefill.addresses)."""
        raise NotImplementedError

    def apply(self, ops: list[tuple[Any, ...]]) -> None:
        """Carry out the engine's orders, in order (see KVWorkerGroup)."""
        for op, *args in ops:
            if op == "hold":
                self.leases.hold(*args)
            elif op == "end":
                self.end_leases(args[0])
            elif op == "load":
                self.start_load(args[0])
            elif op == "release":
                if self.rank == 0:           # the release goes rank 0 -> the prefill engine's rank 0
                    self.release_remote(args[0])
            else:
                raise ValueError(f"unknown KV connector order {op!r}")

    # P side.
    def end_leases(self, slots: list[int]) -> None:
        """The engine is about to free these leases' blocks: refuse every later pull of them."""
        for slot in slots:
            self.leases.release(slot)

    # D side.
    def pull_sources(self, remote: RemotePrefill) -> list[KVSource]:
        """The prefill ranks this rank pulls from, with which of its layers and heads each holds;
        KVLayoutMismatch if the remote engine's parameters name no address for one of them."""
        parts = kv_sources(remote.layout, self.layout)
        if len(remote.addresses) != remote.layout.world_size:
            raise KVLayoutMismatch(
                f"kv_transfer_params carry {len(remote.addresses)} rank addresses for a prefill engine of "
                f"tensor_parallel_size {remote.layout.tp_size} x pipeline_parallel_size {remote.layout.pp_size}")
        return parts

    def start_load(self, spec: LoadSpec) -> None:
        """Begin pulling `spec.remote_block_ids` into `spec.local_block_ids` (returns at once; the
        outcome arrives through `poll`). The local blocks must stay allocated until then."""
        self._pulls_started[spec.request_id] = (clock.wall(), self._pull_bytes(spec))
        if self.config.extra_value("fail_loads"):
            self._injected_failures.append((spec.request_id, "injected failure"))
        elif self.config.extra_value("load_delay_s"):
            start_at = clock.monotonic() + float(self.config.extra_value("load_delay_s"))
            self._delayed.append((start_at, spec))
        else:
            self._start_load(spec)

    def _start_load(self, spec: LoadSpec) -> None:
        raise NotImplementedError

    def _pull_bytes(self, spec: LoadSpec) -> int:
        """Bytes this rank pulls for `spec`: K and V of its blocks in its layers, its heads."""
        return 2 * len(spec.local_block_ids) * len(self.layout.layers) * self.layout.block_bytes

    def take_pull_log(self) -> list[PullRecord]:
        """This rank's pulls finished since the last call (for benchmarks and metrics); safe from
        another thread than the step thread."""
        return [self.pull_log.popleft() for _ in range(len(self.pull_log))]

    def release_remote(self, remote: RemotePrefill) -> None:
        """Tell the prefill engine (its rank 0) that this engine is done with the leased blocks."""
        raise NotImplementedError

    def poll(self) -> TransferReport:
        """Advance transfers; report what finished since the last poll."""
        now = clock.monotonic()
        for start_at, spec in [d for d in self._delayed if d[0] <= now]:
            self._delayed.remove((start_at, spec))
            if now > spec.deadline:
                self._injected_failures.append((spec.request_id, "timed out (injected delay)"))
            else:
                self._start_load(spec)
        report = self._poll()
        if self._injected_failures:
            report.failed.extend(self._injected_failures)
            self._injected_failures = []
        end = clock.wall()
        for rid, ok in [(rid, True) for rid in report.loaded] + [(rid, False) for rid, _ in report.failed]:
            started = self._pulls_started.pop(rid, None)
            if started is not None:
                self.pull_log.append(PullRecord(rid, self.rank, started[0], end, started[1], ok))
        return report

    def _poll(self) -> TransferReport:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass

    # Shared helpers for the transports.
    def gather_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' K and V in each of this rank's layers, contiguous: [layers, 2, n, block_size, kvh, d]
        (for checks and benchmarks; the transports move blocks without this copy)."""
        import torch  # noqa: PLC0415 - the scheduler side (this module's import) needs no torch

        first = self.kv_caches[0]
        index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
        out = torch.empty(self.gathered_shape(len(block_ids)), dtype=first.dtype, device=first.device)
        for layer, cache in enumerate(self.kv_caches):
            torch.index_select(cache, 1, index, out=out[layer])
        return out

    def gathered_shape(self, num_blocks: int) -> tuple[int, ...]:
        lay = self.layout
        return (len(lay.layers), 2, num_blocks, lay.block_size, lay.local_kv_heads, lay.head_dim)


# --- scheduler side ---------------------------------------------------------------------------------
class KVConnectorScheduler:
    """Scheduler side: which tokens come from a remote engine, the pulls to start, and the leases.

    Owns no blocks: the KVCacheManager does. The scheduler calls it when it admits a remotely
    prefilled request (`plan_load`) and when a request to be decoded remotely finishes
    (`wants_lease`); the engine moves its queues to and from the worker side."""

    def __init__(self, config: KVTransferConfig, layout: KVLayout) -> None:
        self.config = config
        self.layout = layout
        self.leases: dict[str, Lease] = {}            # local request id -> its lease (P side)
        self.lease_slots = LeaseSlots()
        self.new_loads: list[LoadSpec] = []
        self.new_releases: list[RemotePrefill] = []
        self.num_loads = 0
        self.num_load_failures = 0
        self.num_blocks_pulled = 0
        self.num_leases = 0
        self.num_leases_expired = 0

    def parse(self, params: dict[str, Any], prompt_block_hashes: list[bytes], num_prompt_tokens: int,
              adapter: str = "") -> RemotePrefill | None:
        """Validate a request's kv_transfer_params at intake (ValueError naming the field).

        Returns the RemotePrefill of a remotely prefilled request, None for one to be decoded
        remotely (`do_remote_decode`)."""
        if params.get("do_remote_decode"):
            if params.get("do_remote_prefill"):
                raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive")
            return None
        if not params.get("do_remote_prefill"):
            raise ValueError("kv_transfer_params must set do_remote_decode (prefill here, decode "
                             "elsewhere) or do_remote_prefill (with the prefill engine's parameters)")
        remote = from_params(params)
        self.check_handshake(remote)
        if remote.adapter != adapter:
            # The KV of a prompt depends on the adapter from its first token: never reuse another's.
            raise ValueError(f"lora_request: the prompt was prefilled under "
                             f"{repr(remote.adapter) if remote.adapter else 'the base model'} but this request runs "
                             f"under {repr(adapter) if adapter else 'the base model'}; both must name the same adapter")
        num_full = min(len(remote.block_hashes), len(prompt_block_hashes))
        if remote.block_hashes[:num_full] != prompt_block_hashes[:num_full]:
            raise ValueError("kv_transfer_params.remote_block_hashes do not match this prompt's blocks "
                             "(the parameters belong to another prompt)")
        if remote.num_tokens > num_prompt_tokens:
            raise ValueError(f"kv_transfer_params.remote_num_tokens ({remote.num_tokens}) exceeds the "
                             f"prompt's {num_prompt_tokens} tokens")
        return remote

    def check_handshake(self, remote: RemotePrefill) -> None:
        """KVLayoutMismatch unless the prefill engine's connector, its protocol version and its KV
        layout are this engine's (a hand-built RemotePrefill without a connector skips that check)."""
        mine = self.config.kv_connector
        if remote.connector and remote.connector != mine:
            raise KVLayoutMismatch(f"kv_transfer_params: the prefill engine's connector is {remote.connector!r} "
                                   f"but this engine's is {mine!r}; both must use the same connector")
        if remote.connector_version != CONNECTOR_VERSION:
            raise KVLayoutMismatch(
                f"kv_transfer_params: the prefill engine's {remote.connector or 'connector'} protocol is "
                f"version {remote.connector_version} but this engine's is {CONNECTOR_VERSION}; prefill and "
                f"decode engines must run the same pdserve version")
        self.layout.check_compatible(remote.layout)

    # --- D side ---------------------------------------------------------------------------------
    def num_external_tokens(self, request: Request, num_local_tokens: int) -> int:
        """Prompt tokens past the local prefix-cache hit whose KV to pull. The last prompt token is
        always recomputed (its logits give the first token); partial remote blocks are never used
        beyond the tokens the remote engine computed."""
        remote = request.remote_prefill
        assert remote is not None
        end = min(remote.num_tokens, request.num_prompt_tokens - 1)
        end = min(end, len(remote.block_ids) // self.layout.num_groups * self.layout.block_size)
        return max(0, end - num_local_tokens)

    def plan_load(self, request: Request, block_ids: list[int], num_local_tokens: int,
                  num_external_tokens: int) -> None:
        """Queue the pull of the blocks covering [num_local_tokens, + num_external_tokens).
        `num_local_tokens` is a whole number of blocks (prefix hits are full blocks)."""
        remote = request.remote_prefill
        assert remote is not None and num_local_tokens % self.layout.block_size == 0
        bs, g = self.layout.block_size, self.layout.num_groups      # (a table interleaves g groups')
        first, end = num_local_tokens // bs * g, -(-(num_local_tokens + num_external_tokens) // bs) * g
        deadline = clock.monotonic() + self.config.load_timeout_s
        self.new_loads.append(LoadSpec(request.request_id, remote, block_ids[first:end],
                                       remote.block_ids[first:end], deadline))
        self.num_loads += 1
        self.num_blocks_pulled += end - first

    def plan_release(self, request: Request) -> None:
        """Nothing to pull (all local, or a one-token prompt): just release P's lease."""
        assert request.remote_prefill is not None
        self.new_releases.append(request.remote_prefill)

    def take_new_loads(self) -> list[LoadSpec]:
        loads, self.new_loads = self.new_loads, []
        return loads

    def take_new_releases(self) -> list[RemotePrefill]:
        releases, self.new_releases = self.new_releases, []
        return releases

    # --- P side ---------------------------------------------------------------------------------
    def wants_lease(self, request: Request) -> bool:
        """A finished request keeps its blocks for a remote decode only if it was asked to and it
        ended by its one-token cap (a stop on the first token leaves nothing to decode)."""
        return request.remote_decode and request.status == RequestStatus.FINISHED_LENGTH_CAPPED

    def add_lease(self, request: Request, block_ids: list[int], slot: int, token: int,
                  addresses: list[dict[str, Any]], engine_id: str) -> dict[str, Any]:
        """Record the lease (a slot from `lease_slots`) and return the transfer parameters for the
        decode side."""
        hashes = list(request.block_hashes[:request.num_prompt_tokens // self.layout.block_size])
        return self.add_prefix_lease(request, block_ids, hashes, request.num_prompt_tokens,
                                     request.sampling_params.adapter_name, slot, token, addresses, engine_id)

    def add_prefix_lease(self, holder: Request | BlockHolder, block_ids: list[int], block_hashes: list[bytes],
                         num_tokens: int, adapter: str, slot: int, token: int, addresses: list[dict[str, Any]],
                         engine_id: str) -> dict[str, Any]:
        """`add_lease` for blocks held by `holder` (a finished prefill, or cached prefix blocks a
        peer replica pulls): `num_tokens` of KV, `block_hashes` its full blocks' hashes."""
        expires = clock.wall() + self.config.lease_s
        self.leases[holder.request_id] = Lease(holder, slot, token, expires)
        self.num_leases += 1
        remote = RemotePrefill(
            engine_id=engine_id, request_id=holder.request_id, block_ids=block_ids, block_hashes=block_hashes,
            num_tokens=num_tokens, lease_slot=slot, lease_token=token, lease_expires_at=expires,
            layout=self.layout, addresses=addresses, connector=self.config.kv_connector, adapter=adapter)
        return to_params(remote)

    def renew_lease(self, request_id: str, seconds: float) -> bool:
        lease = self.leases.get(request_id)
        if lease is None:
            return False
        lease.expires_at = max(lease.expires_at, clock.wall() + seconds)
        return True

    def leases_to_end(self, released: list[tuple[int, int]], aborted: list[str]) -> list[Lease]:
        """Take out the leases that end now: released by the decode side, aborted, or expired. Their
        slots are free for new leases (the engine orders the ranks to end them first)."""
        ending = []
        if released:
            by_slot = {(lease.slot, lease.token): rid for rid, lease in self.leases.items()}
            ending = [by_slot[key] for key in released if key in by_slot]
        ending += [rid for rid in aborted if rid in self.leases]
        now = clock.wall()
        expired = [rid for rid, lease in self.leases.items() if lease.expires_at <= now]
        self.num_leases_expired += len(set(expired) - set(ending))
        taken = [self.leases.pop(rid) for rid in dict.fromkeys(ending + expired) if rid in self.leases]
        for lease in taken:
            self.lease_slots.free(lease.slot)
        return taken
