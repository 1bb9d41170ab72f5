"""The KV connector: how a prompt's KV blocks move from a prefill engine to a decode engine.

Two roles, as in vLLM's v1 connector:
- scheduler side (`KVConnectorScheduler`, transport-independent, lives beside the scheduler): how many
  leading prompt tokens of a request come from a remote engine, which local blocks receive them,
  which pulls to start, and the prefill side's leases.
- worker side (`KVConnectorWorker`, one per rank; NIXL in `nixl.py`, torch.distributed in
  `torch_dist.py`): registers the KV tensors, moves blocks, reports finished sends and receives.

The protocol (pull model):
1. Prefill engine P runs a request with `kv_transfer_params={"do_remote_decode": True}` and
   `max_tokens=1`. When it finishes, its blocks are not freed: P's worker takes a *lease* on them (a
   slot in its lease table holding a fresh token) and P returns `RemotePrefill.to_dict()` with its
   output.
   Those parameters are a dict (the engine API) whose "pdserve_kv" entry is the protobuf
   `RemotePrefill` of pdserve_proto/pdserve.proto: schema version, handshake (connector, its
   protocol version, KV layout), blocks, lease and transport address. D refuses another schema
   version, connector, connector version or layout with a ValueError naming what differs.
2. Decode engine D gets the same prompt with those parameters. Its scheduler matches its own prefix
   cache, allocates blocks for the rest of the prompt but its last token (recomputed: its logits give
   the first output token), and queues a pull of just those blocks. The request waits in
   WAITING_FOR_REMOTE_KVS while other requests keep stepping.
3. D's worker pulls the blocks, then reads P's lease word again: if the token is unchanged, P had not
   released the blocks during the pull (P clears the word before a released block can be rewritten),
   so the data is valid. Once every rank of D has finished, D's engine tells P it is done (D's rank 0
   to P's rank 0).
4. P frees the blocks on that notice, on abort, or when the lease expires. D falls back to computing
   the prompt itself (`load_failure_policy="recompute"`) or fails the request (`"fail"`) when the
   pull fails, times out or finds the lease gone. No step ever waits on the other engine, and every
   path ends with every block freed on both sides.
"""
from __future__ import annotations

import hashlib
import json
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.config import EngineConfig, KVTransferConfig
    from engine.request import Request

# Leases one prefill worker can hold at once (one slot each); beyond that a finished prefill frees
# its blocks at once and returns no transfer parameters (the decode side then computes the prompt).
MAX_LEASES = 4096


# Version of the connectors' own protocol (lease words, notifications, staging layout): both ends
# of a transfer must run the same one. Checked with the layout in the handshake.
CONNECTOR_VERSION = 2     # 2: the decode engine releases the lease once all its ranks pulled


class KVLayoutMismatch(ValueError):
    """The two engines' KV layouts (or connectors) differ: their blocks cannot be exchanged."""


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


class KVTransferError(RuntimeError):
    """A request's KV could not be pulled and its failure policy is "fail"."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What must agree between two engines for their blocks to be interchangeable."""
    model: str            # architecture and a digest of the model config (not of the weights)
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def from_config(cls, config: EngineConfig, tp_rank: int = 0) -> KVLayout:
        mc = config.model_config
        raw = {k: v for k, v in mc.hf_config.to_dict().items()
               if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")}
        digest = hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return cls(model=f"{mc.architecture}:{digest}", num_layers=mc.num_layers,
                   block_size=config.cache_config.block_size, num_kv_heads=mc.num_kv_heads,
                   head_dim=mc.head_dim, dtype=str(mc.dtype).removeprefix("torch."), tp_rank=tp_rank,
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

    def to_proto(self) -> Any:
        from pdserve_proto import pb2  # noqa: PLC0415

        return pb2.KVLayout(model=self.model, num_layers=self.num_layers, block_size=self.block_size,
                            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype,
                            tp_rank=self.tp_rank, tp_size=self.tp_size)

    @classmethod
    def from_proto(cls, msg: Any) -> KVLayout:
        return cls(model=msg.model, num_layers=msg.num_layers, block_size=msg.block_size,
                   num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim, dtype=msg.dtype,
                   tp_rank=msg.tp_rank, tp_size=msg.tp_size)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's K (or V) in one layer, on one rank."""
        return self.block_size * self.local_kv_heads * self.head_bytes

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token's K (or V)."""
        return self.head_dim * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


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


@dataclass(slots=True)
class RemotePrefill:
    """Where a prefilled prompt's KV waits: what P returns and D receives as kv_transfer_params."""
    engine_id: str
    request_id: str                 # the request's id on P
    block_ids: list[int]            # P's block table for the prompt
    block_hashes: list[bytes]       # hashes of the prompt's full blocks (as D computes them too)
    num_tokens: int                 # prompt tokens whose KV P holds
    lease_slot: int
    lease_token: int
    lease_expires_at: float         # time.time() on P (nodes' clocks agree within LEASE_MARGIN_S)
    layout: KVLayout                # P's layout (tp_rank 0 of P's TP group)
    addresses: list[dict[str, Any]]  # per P TP rank, transport-specific: how D's workers reach P's
    connector: str = ""             # P's connector ("" when built by hand without one)
    connector_version: int = CONNECTOR_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The kv_transfer_params dict (engine API): the protobuf `RemotePrefill` (versioned, what D
        parses) under "pdserve_kv", beside a readable view of the same fields for logs and tests."""
        return {"do_remote_prefill": True, "pdserve_kv": self.to_proto_bytes(),
                "remote_engine_id": self.engine_id,
                "remote_request_id": self.request_id, "remote_block_ids": list(self.block_ids),
                "remote_block_hashes": [h.hex() for h in self.block_hashes],
                "remote_num_tokens": self.num_tokens, "lease_slot": self.lease_slot,
                "lease_token": self.lease_token, "lease_expires_at": self.lease_expires_at,
                "layout": asdict(self.layout), "addresses": self.addresses}

    def handshake(self) -> Any:
        from pdserve_proto import CONTROL_SCHEMA_VERSION, pb2  # noqa: PLC0415

        return pb2.KVHandshake(schema_version=CONTROL_SCHEMA_VERSION, connector=self.connector,
                               connector_version=self.connector_version, layout=self.layout.to_proto())

    def to_proto_bytes(self) -> bytes:
        from pdserve_proto import CONTROL_SCHEMA_VERSION, pb2  # noqa: PLC0415

        msg = pb2.RemotePrefill(
            schema_version=CONTROL_SCHEMA_VERSION, handshake=self.handshake(), engine_id=self.engine_id,
            request_id=self.request_id, block_ids=self.block_ids, block_hashes=self.block_hashes,
            num_tokens=self.num_tokens, lease_slot=self.lease_slot, lease_token=self.lease_token,
            lease_expires_at=self.lease_expires_at)
        for a in self.addresses:
            rank = msg.ranks.add()
            if "agent_metadata" in a:
                rank.nixl.CopyFrom(pb2.NixlAddress(
                    agent_metadata=a["agent_metadata"], kv_addrs=a["kv_addrs"], num_blocks=a["num_blocks"],
                    lease_addr=a["lease_addr"], num_lease_slots=a["num_lease_slots"], mem=a["mem"],
                    device_id=a["device_id"]))
            elif "host" in a:
                rank.torch_dist.CopyFrom(pb2.TorchDistAddress(host=a["host"], port=a["port"]))
            elif a:
                raise ValueError(f"RemotePrefill.addresses has no wire form: {sorted(a)}")
        return msg.SerializeToString()

    @classmethod
    def from_proto_bytes(cls, data: bytes) -> RemotePrefill:
        """Decode `to_proto_bytes()`; SchemaVersionMismatch (a ValueError) for another schema
        version, ValueError for bytes that are not a RemotePrefill."""
        from google.protobuf.message import DecodeError  # noqa: PLC0415

        from pdserve_proto import check_version, pb2  # noqa: PLC0415

        msg = pb2.RemotePrefill()
        try:
            msg.ParseFromString(bytes(data))
        except DecodeError as e:
            raise ValueError(f"kv_transfer_params.pdserve_kv is not a RemotePrefill message: {e}") from None
        check_version("kv_transfer_params.pdserve_kv (RemotePrefill)", msg.schema_version)
        check_version("kv_transfer_params.pdserve_kv (KVHandshake)", msg.handshake.schema_version)
        addresses: list[dict[str, Any]] = []
        for rank in msg.ranks:
            which = rank.WhichOneof("kind")
            if which == "nixl":
                n = rank.nixl
                addresses.append({
                    "agent_metadata": n.agent_metadata, "kv_addrs": list(n.kv_addrs), "num_blocks": n.num_blocks,
                    "lease_addr": n.lease_addr, "num_lease_slots": n.num_lease_slots, "mem": n.mem,
                    "device_id": n.device_id})
            elif which == "torch_dist":
                addresses.append({"host": rank.torch_dist.host, "port": rank.torch_dist.port})
            else:
                addresses.append({})
        hs = msg.handshake
        if addresses and len(addresses) != hs.layout.tp_size:
            raise ValueError(f"kv_transfer_params.pdserve_kv carries {len(addresses)} rank addresses for a "
                             f"prefill engine of tensor_parallel_size {hs.layout.tp_size}")
        return cls(engine_id=msg.engine_id, request_id=msg.request_id, block_ids=list(msg.block_ids),
                   block_hashes=list(msg.block_hashes), num_tokens=msg.num_tokens, lease_slot=msg.lease_slot,
                   lease_token=msg.lease_token, lease_expires_at=msg.lease_expires_at,
                   layout=KVLayout.from_proto(hs.layout), addresses=addresses, connector=hs.connector,
                   connector_version=hs.connector_version)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> RemotePrefill:
        """Parse kv_transfer_params; ValueError naming the missing or malformed field. The protobuf
        form ("pdserve_kv", what a prefill engine returns) is authoritative when present; a
        hand-built dict without it is read from its readable keys."""
        if "pdserve_kv" in params:
            return cls.from_proto_bytes(params["pdserve_kv"])
        try:
            return cls(engine_id=str(params["remote_engine_id"]),
                       request_id=str(params["remote_request_id"]),
                       block_ids=[int(b) for b in params["remote_block_ids"]],
                       block_hashes=[bytes.fromhex(h) for h in params["remote_block_hashes"]],
                       num_tokens=int(params["remote_num_tokens"]),
                       lease_slot=int(params["lease_slot"]), lease_token=int(params["lease_token"]),
                       lease_expires_at=float(params["lease_expires_at"]),
                       layout=KVLayout(**params["layout"]),
                       addresses=[dict(a) for a in params["addresses"]])
        except KeyError as e:
            raise ValueError(f"kv_transfer_params is missing {e.args[0]!r} (pass the parameters the "
                             f"prefill engine returned)") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"kv_transfer_params is malformed: {e}") from None


@dataclass(slots=True)
class LoadSpec:
    """One pull: remote blocks -> local blocks, both in prompt order."""
    request_id: str                 # the request's id on this (decode) engine
    remote: RemotePrefill
    local_block_ids: list[int]
    remote_block_ids: list[int]
    deadline: float                 # time.monotonic() by which it must be done


@dataclass(slots=True)
class TransferReport:
    """What a worker's `poll()` saw finish since the last poll."""
    released: list[tuple[int, int]] = field(default_factory=list)   # P: (lease slot, token) done with
    loaded: list[str] = field(default_factory=list)                  # D: request ids whose pull is done
    failed: list[tuple[str, str]] = field(default_factory=list)      # D: (request id, reason)


@dataclass(slots=True)
class Lease:
    request: Request
    slot: int
    token: int
    expires_at: float               # time.time()


# --- worker side ------------------------------------------------------------------------------------
class LeaseSlots:
    """The engine's lease slots and tokens (every rank's worker mirrors them in its LeaseTable).
    Tokens start at a random base so that a restarted engine never reissues an old token."""

    def __init__(self, num_slots: int = MAX_LEASES) -> None:
        self._free = list(range(num_slots - 1, -1, -1))
        self._next_token = random.getrandbits(40) << 20 | 1

    def take(self) -> tuple[int, int] | None:
        if not self._free:
            return None
        token, self._next_token = self._next_token, self._next_token + 1
        return self._free.pop(), token

    def free(self, slot: int) -> None:
        self._free.append(slot)


class LeaseTable:
    """A prefill worker's lease words: slot -> token of the live lease, 0 when free.

    The words live in a tensor so a remote reader (NIXL) can read a lease's token after pulling its
    blocks."""

    def __init__(self, num_slots: int = MAX_LEASES) -> None:
        self.words = torch.zeros(num_slots, dtype=torch.int64)
        self.block_ids: dict[int, list[int]] = {}

    def hold(self, slot: int, token: int, block_ids: list[int]) -> None:
        self.words[slot] = token
        self.block_ids[slot] = list(block_ids)

    def is_live(self, slot: int, token: int) -> bool:
        return 0 <= slot < len(self.words) and token != 0 and int(self.words[slot]) == token

    def release(self, slot: int) -> None:
        """Clear the word first: from here on a reader sees the lease gone."""
        if slot in self.block_ids:
            self.words[slot] = 0
            del self.block_ids[slot]


class KVConnectorWorker:
    """Worker side of a connector, one per TP rank. All methods run on the rank's step thread, between
    steps; transports may use their own threads for the bytes, never for engine state.

    Subclasses implement `address`, `_start_load`, `release_remote`, `_poll` and `shutdown`."""

    name = "base"

    def __init__(self, config: KVTransferConfig, layout: KVLayout) -> None:
        self.config = config
        self.layout = layout
        self.rank = layout.tp_rank
        # Unique per worker incarnation (replicas of a pool share one config and its engine_id).
        self.engine_id = f"{config.engine_id}-{uuid.uuid4().hex[:8]}"
        self.leases = LeaseTable()
        self.kv_caches: list[torch.Tensor] = []    # per layer [2, num_blocks, block_size, kvh, d]
        self._injected_failures: list[tuple[str, str]] = []
        self._delayed: list[tuple[float, LoadSpec]] = []

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
    def source_heads(self, remote: RemotePrefill) -> list[HeadSlice]:
        """The prefill ranks this rank pulls from, and which heads; KVLayoutMismatch if the remote
        engine's parameters name no address for one of them."""
        slices = head_slices(remote.layout, self.layout)
        if any(s.src_rank >= len(remote.addresses) for s in slices):
            raise KVLayoutMismatch(f"kv_transfer_params carry {len(remote.addresses)} rank addresses for a "
                                   f"prefill engine of tensor_parallel_size {remote.layout.tp_size}")
        return slices

    def start_load(self, spec: LoadSpec) -> None:
        """Begin pulling `spec.remote_block_ids` into `spec.local_block_ids` (returns at once; the
        outcome arrives through `poll`). The local blocks must stay allocated until then."""
        if self.config.extra_value("fail_loads"):
            self._injected_failures.append((spec.request_id, "injected failure"))
        elif self.config.extra_value("load_delay_s"):
            start_at = time.monotonic() + float(self.config.extra_value("load_delay_s"))
            self._delayed.append((start_at, spec))
        else:
            self._start_load(spec)

    def _start_load(self, spec: LoadSpec) -> None:
        raise NotImplementedError

    def release_remote(self, remote: RemotePrefill) -> None:
        """Tell the prefill engine (its rank 0) that this engine is done with the leased blocks."""
        raise NotImplementedError

    def poll(self) -> TransferReport:
        """Advance transfers; report what finished since the last poll."""
        now = time.monotonic()
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
        return report

    def _poll(self) -> TransferReport:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass

    # Shared helpers for the transports.
    def gather_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' K and V in every layer, contiguous: [num_layers, 2, n, block_size, kvh, d]
        (for checks and benchmarks; the transports move blocks without this copy)."""
        first = self.kv_caches[0]
        index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
        out = torch.empty(self.gathered_shape(len(block_ids)), dtype=first.dtype, device=first.device)
        for layer, cache in enumerate(self.kv_caches):
            torch.index_select(cache, 1, index, out=out[layer])
        return out

    def gathered_shape(self, num_blocks: int) -> tuple[int, ...]:
        lay = self.layout
        return (lay.num_layers, 2, num_blocks, lay.block_size, lay.local_kv_heads, lay.head_dim)


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

    def parse(self, params: dict[str, Any], prompt_block_hashes: list[bytes], num_prompt_tokens: int
              ) -> RemotePrefill | None:
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
        remote = RemotePrefill.from_dict(params)
        self.check_handshake(remote)
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
        end = min(end, len(remote.block_ids) * self.layout.block_size)
        return max(0, end - num_local_tokens)

    def plan_load(self, request: Request, block_ids: list[int], num_local_tokens: int,
                  num_external_tokens: int) -> None:
        """Queue the pull of the blocks covering [num_local_tokens, + num_external_tokens).
        `num_local_tokens` is a whole number of blocks (prefix hits are full blocks)."""
        remote = request.remote_prefill
        assert remote is not None and num_local_tokens % self.layout.block_size == 0
        bs = self.layout.block_size
        first, end = num_local_tokens // bs, -(-(num_local_tokens + num_external_tokens) // bs)
        deadline = time.monotonic() + self.config.load_timeout_s
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
        from engine.request import RequestStatus  # noqa: PLC0415 (engine imports this module)

        return request.remote_decode and request.status == RequestStatus.FINISHED_LENGTH_CAPPED

    def add_lease(self, request: Request, block_ids: list[int], slot: int, token: int,
                  addresses: list[dict[str, Any]], engine_id: str) -> dict[str, Any]:
        """Record the lease (a slot from `lease_slots`) and return the transfer parameters for the
        decode side."""
        expires = time.time() + self.config.lease_s
        self.leases[request.request_id] = Lease(request, slot, token, expires)
        self.num_leases += 1
        remote = RemotePrefill(
            engine_id=engine_id, request_id=request.request_id, block_ids=block_ids,
            block_hashes=list(request.block_hashes[:request.num_prompt_tokens // self.layout.block_size]),
            num_tokens=request.num_prompt_tokens, lease_slot=slot, lease_token=token,
            lease_expires_at=expires, layout=self.layout, addresses=addresses, connector=self.config.kv_connector)
        return remote.to_dict()

    def renew_lease(self, request_id: str, seconds: float) -> bool:
        lease = self.leases.get(request_id)
        if lease is None:
            return False
        lease.expires_at = max(lease.expires_at, time.time() + seconds)
        return True

    def leases_to_end(self, released: list[tuple[int, int]], aborted: list[str]) -> list[Lease]:
        """Take out the leases that end now: released by the decode side, aborted, or expired. Their
        slots are free for new leases (the engine orders the ranks to end them first)."""
        ending = []
        if released:
            by_slot = {(lease.slot, lease.token): rid for rid, lease in self.leases.items()}
            ending = [by_slot[key] for key in released if key in by_slot]
        ending += [rid for rid in aborted if rid in self.leases]
        now = time.time()
        expired = [rid for rid, lease in self.leases.items() if lease.expires_at <= now]
        self.num_leases_expired += len(set(expired) - set(ending))
        taken = [self.leases.pop(rid) for rid in dict.fromkeys(ending + expired) if rid in self.leases]
        for lease in taken:
            self.lease_slots.free(lease.slot)
        return taken
