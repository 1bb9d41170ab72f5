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
   so the data is valid. D then tells P it is done.
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
CONNECTOR_VERSION = 1


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

    def check_compatible(self, remote: KVLayout) -> None:
        """Raise KVLayoutMismatch naming the first field on which the remote engine differs."""
        for name in ("model", "num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "tp_size"):
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
        """Bytes of one block's K (or V) in one layer."""
        elem = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.block_size * self.num_kv_heads * self.head_dim * elem


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
    layout: KVLayout
    address: dict[str, Any]         # transport-specific: how D's worker reaches P's
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
                "layout": asdict(self.layout), "address": self.address}

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
        a = self.address
        if "agent_metadata" in a:
            msg.nixl.CopyFrom(pb2.NixlAddress(
                agent_metadata=a["agent_metadata"], kv_addrs=a["kv_addrs"], num_blocks=a["num_blocks"],
                lease_addr=a["lease_addr"], num_lease_slots=a["num_lease_slots"], mem=a["mem"],
                device_id=a["device_id"]))
        elif "host" in a:
            msg.torch_dist.CopyFrom(pb2.TorchDistAddress(host=a["host"], port=a["port"]))
        elif a:
            raise ValueError(f"RemotePrefill.address has no wire form: {sorted(a)}")
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
        which = msg.WhichOneof("address")
        if which == "nixl":
            n = msg.nixl
            address: dict[str, Any] = {
                "agent_metadata": n.agent_metadata, "kv_addrs": list(n.kv_addrs), "num_blocks": n.num_blocks,
                "lease_addr": n.lease_addr, "num_lease_slots": n.num_lease_slots, "mem": n.mem,
                "device_id": n.device_id}
        elif which == "torch_dist":
            address = {"host": msg.torch_dist.host, "port": msg.torch_dist.port}
        else:
            address = {}
        hs = msg.handshake
        return cls(engine_id=msg.engine_id, request_id=msg.request_id, block_ids=list(msg.block_ids),
                   block_hashes=list(msg.block_hashes), num_tokens=msg.num_tokens, lease_slot=msg.lease_slot,
                   lease_token=msg.lease_token, lease_expires_at=msg.lease_expires_at,
                   layout=KVLayout.from_proto(hs.layout), address=address, connector=hs.connector,
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
                       layout=KVLayout(**params["layout"]), address=dict(params["address"]))
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
class LeaseTable:
    """The prefill worker's lease words: slot -> token of the live lease, 0 when free.

    The words live in a tensor so a remote reader (NIXL) can read a lease's token after pulling its
    blocks. Tokens start at a random base so that a restarted engine never reissues an old token."""

    def __init__(self, num_slots: int = MAX_LEASES) -> None:
        self.words = torch.zeros(num_slots, dtype=torch.int64)
        self.block_ids: dict[int, list[int]] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._next_token = random.getrandbits(40) << 20 | 1

    def take(self, block_ids: list[int]) -> tuple[int, int] | None:
        if not self._free:
            return None
        slot = self._free.pop()
        token, self._next_token = self._next_token, self._next_token + 1
        self.words[slot] = token
        self.block_ids[slot] = list(block_ids)
        return slot, token

    def is_live(self, slot: int, token: int) -> bool:
        return 0 <= slot < len(self.words) and token != 0 and int(self.words[slot]) == token

    def release(self, slot: int) -> None:
        """Clear the word first: from here on a reader sees the lease gone."""
        if slot in self.block_ids:
            self.words[slot] = 0
            del self.block_ids[slot]
            self._free.append(slot)


class KVConnectorWorker:
    """Worker side of a connector. All methods run on the engine's thread, between steps; transports
    may use their own threads for the bytes, never for engine state.

    Subclasses implement `address`, `_start_load`, `release_remote`, `_poll` and `shutdown`."""

    name = "base"

    def __init__(self, config: KVTransferConfig, layout: KVLayout) -> None:
        self.config = config
        self.layout = layout
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
        """How a remote worker reaches this one (goes into RemotePrefill.address)."""
        raise NotImplementedError

    # P side.
    def start_lease(self, block_ids: list[int]) -> tuple[int, int] | None:
        """Protect `block_ids` for a remote pull; (slot, token), or None if the table is full."""
        return self.leases.take(block_ids)

    def end_leases(self, slots: list[int]) -> None:
        """The scheduler is about to free these leases' blocks: refuse every later pull of them."""
        for slot in slots:
            self.leases.release(slot)

    # D side.
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
        """Tell the prefill engine its blocks are not needed (this engine will not pull them)."""
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
        return (lay.num_layers, 2, num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)


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
                  address: dict[str, Any], engine_id: str) -> dict[str, Any]:
        """Record the lease and return the transfer parameters for the decode side."""
        expires = time.time() + self.config.lease_s
        self.leases[request.request_id] = Lease(request, slot, token, expires)
        self.num_leases += 1
        remote = RemotePrefill(
            engine_id=engine_id, request_id=request.request_id, block_ids=block_ids,
            block_hashes=list(request.block_hashes[:request.num_prompt_tokens // self.layout.block_size]),
            num_tokens=request.num_prompt_tokens, lease_slot=slot, lease_token=token,
            lease_expires_at=expires, layout=self.layout, address=address, connector=self.config.kv_connector)
        return remote.to_dict()

    def renew_lease(self, request_id: str, seconds: float) -> bool:
        lease = self.leases.get(request_id)
        if lease is None:
            return False
        lease.expires_at = max(lease.expires_at, time.time() + seconds)
        return True

    def leases_to_end(self, released: list[tuple[int, int]], aborted: list[str]) -> list[Lease]:
        """Take out the leases that end now: released by the decode side, aborted, or expired."""
        ending = []
        if released:
            by_slot = {(lease.slot, lease.token): rid for rid, lease in self.leases.items()}
            ending = [by_slot[key] for key in released if key in by_slot]
        ending += [rid for rid in aborted if rid in self.leases]
        now = time.time()
        expired = [rid for rid, lease in self.leases.items() if lease.expires_at <= now]
        self.num_leases_expired += len(set(expired) - set(ending))
        return [self.leases.pop(rid) for rid in dict.fromkeys(ending + expired) if rid in self.leases]
