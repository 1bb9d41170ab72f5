"""A simulation profile: how long an engine step takes for its batch, on one kind of device with one
model, for the simulated model runner (engine/executor/simulated.py). Torch-free: the engine
config resolves it, and `pdserve simulate` reads it in a process that never loads a model.

A step's cost depends on its batch's `StepShape` (prompt tokens and the query-key pairs they
attend, decode rows and the context they read, rows sampled) and on the replica's TP x PP shape.
A profile says it in one of two ways:

- `roofline`: a device's rates (dense GEMM FLOP/s and the fraction of it reached, attention FLOP/s,
  memory bandwidth and the fraction reached, the links between ranks and between nodes) and a
  model's shape (`ModelShape`). A pipeline stage takes the longer of its compute and its memory
  traffic (every weight of its layers once, plus the K/V its rows read), plus two all-reduces
  per layer under TP. Built in: `h200-llama3-8b` (docs/performance.md says where its constants
  come from and how well they predict the measured steps).
- `linear`: fitted by least squares to an engine's measured steps on one machine (`pdserve profile`
  writes it: cluster/sim/calibrate.py), with the fit's error on those steps. The time of a step's
  tokens is piecewise linear between measured token counts (`knots`: a CPU's kernels change path
  with the batch, and a step of 8 rows took twice one of 4 here, not the line through 1 and 64),
  plus terms in the prompt's query-key pairs, the decode rows' context and the rows sampled.
  Measured at TP = PP = 1; another shape divides the step by TP x PP (unmeasured).

Either kind also carries what a step costs outside the forward pass (`engine_overhead`: the
scheduler and output processing, counted only in virtual time: a real-time simulated replica
spends it for real), the KV links (a P/D pull, the offload tier and swap), a replica's start-up
time (what a scale-up waits in a replay) and, for a GPU, its memory (the KV cache it leaves).

A profile is a small JSON file (`SimProfile.to_dict` / `from_dict`); `load_profile` takes a path or
a built-in's name (records/profiles/*.json).
"""
from __future__ import annotations

import bisect
import functools
import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
KINDS = ("roofline", "linear")
# A linear profile's coefficients: one per knot (the step's time at that many tokens), then these.
LINEAR_FEATURES = ("prefill_attention", "decode_context", "sampled_rows")


@dataclass(frozen=True)
class ModelShape:
    """The simulated model: what its weights and KV cost (an HF config's numbers)."""
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int              # the longest context a simulated request may have
    dtype_bytes: int = 2            # weights and KV (bf16); an fp8 KV cache halves the KV's

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer (attention and MLP projections)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    @property
    def num_params(self) -> int:
        """Every weight: the layers, the embedding and the LM head."""
        return self.num_layers * self.layer_params + 2 * self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, kv_dtype_bytes: int | None = None) -> int:
        """K and V of one token over every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * (kv_dtype_bytes or self.dtype_bytes)

    def check_parallel(self, tp: int, pp: int) -> None:
        """ValueError unless this shape splits into `tp` shards and `pp` stages (as a model's must)."""
        if self.num_heads % tp or (self.num_kv_heads % tp and tp % self.num_kv_heads) or self.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not split the simulated model {self.name!r} "
                             f"({self.num_heads} heads, {self.num_kv_heads} KV heads, intermediate size "
                             f"{self.intermediate_size})")
        if pp > self.num_layers:
            raise ValueError(f"pipeline_parallel_size must be <= the simulated model's {self.num_layers} layers; "
                             f"got {pp}")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step's cost depends on (engine/executor/simulated.py builds it from a SchedulerOutput)."""
    prefill_tokens: int = 0         # tokens of prompt segments (every row that is not a decode row)
    prefill_attention: float = 0.0  # query-key pairs of those rows: sum of tokens x (context before + (tokens + 1) / 2)
    decode_rows: int = 0            # one-token rows
    decode_context: int = 0         # the context those rows attend to, summed
    sampled_rows: int = 0           # rows whose logits are computed (the LM head runs on these)

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_rows

    def features(self, knots: tuple[int, ...]) -> list[float]:
        """A linear profile's features: the weights of the knots around the step's token count
        (piecewise linear; past the last knot, the last segment's line), then LINEAR_FEATURES."""
        weights = [0.0] * len(knots)
        n = self.num_tokens
        if n <= knots[0] or len(knots) == 1:
            weights[0] = n / knots[0] if len(knots) == 1 else 1.0
        else:
            i = min(bisect.bisect_left(knots, n), len(knots) - 1)
            lo, hi = knots[i - 1], knots[i]
            a = (n - lo) / (hi - lo)
            weights[i - 1], weights[i] = 1.0 - a, a
        return weights + [self.prefill_attention, self.decode_context, self.sampled_rows]


@dataclass(frozen=True)
class Device:
    """A roofline profile's device: its rates and the fractions of them a step reaches."""
    name: str
    gemm_flops: float               # dense FLOP/s of the model's dtype (the datasheet's)
    gemm_efficiency: float          # the fraction of it the GEMMs reach
    attention_flops: float          # FLOP/s the attention kernel reaches (measured)
    memory_bandwidth: float         # bytes/s (a device-to-device copy's rate)
    memory_efficiency: float        # the fraction of it a step's weight and K/V reads reach
    memory_bytes: float             # device memory per rank
    memory_utilization: float = 0.9     # vLLM's gpu_memory_utilization: the rest is left alone
    activation_bytes: float = 2 << 30   # per rank, kept from the KV cache (activations, graphs)
    interconnect_bandwidth: float = 0.0     # bytes/s of an all-reduce between TP ranks (bus rate)
    interconnect_latency_s: float = 0.0     # per all-reduce


@dataclass(frozen=True)
class SimProfile:
    name: str
    kind: str                       # one of KINDS
    model: ModelShape
    description: str = ""
    device: Device | None = None    # roofline
    knots: tuple[int, ...] = ()              # linear: the token counts the step time was measured at
    coefficients: tuple[float, ...] = ()     # linear: seconds at each knot, then per unit of LINEAR_FEATURES
    # The engine's work per step outside the forward pass: (seconds, seconds per scheduled request).
    engine_overhead: tuple[float, float] = (0.0, 0.0)
    network_bandwidth: float = 40e9     # bytes/s between nodes: pipeline activations
    network_latency_s: float = 20e-6
    kv_transfer_bandwidth: float = 40e9     # bytes/s of a P/D pull (NIXL over RDMA)
    kv_transfer_latency_s: float = 1e-3     # its fixed cost (the notification round trip)
    host_bandwidth: float = 40e9        # bytes/s device <-> host: swap and the offload tier
    startup_s: float = 60.0             # a new replica's start (load, warm-up), for a replay's scale-ups
    kv_cache_bytes: float | None = None     # per replica over its ranks; None: the device's, or the engine's default
    fit: dict[str, Any] = field(default_factory=dict)    # how it was fitted and its error (JSON)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"profile {self.name!r}: kind must be one of {KINDS}; got {self.kind!r}")
        if self.kind == "roofline" and self.device is None:
            raise ValueError(f"profile {self.name!r}: a roofline profile needs a device")
        if self.kind == "linear" and (not self.knots or list(self.knots) != sorted(set(self.knots))
                                      or self.knots[0] < 1):
            raise ValueError(f"profile {self.name!r}: a linear profile needs knots, increasing token counts >= 1; "
                             f"got {list(self.knots)}")
        if self.kind == "linear" and len(self.coefficients) != len(self.knots) + len(LINEAR_FEATURES):
            raise ValueError(f"profile {self.name!r}: a linear profile needs {len(self.knots) + len(LINEAR_FEATURES)} "
                             f"coefficients (one per knot, then {', '.join(LINEAR_FEATURES)}); got "
                             f"{len(self.coefficients)}")

    # --- the cost model ---------------------------------------------------------------------------
    def stage_time(self, shape: StepShape, tp: int = 1, pp: int = 1, kv_dtype_bytes: int | None = None) -> float:
        """Seconds one pipeline stage takes for the batch (the whole forward when pp = 1)."""
        ranks = tp * pp
        if self.kind == "linear":
            return sum(c * f for c, f in zip(self.coefficients, shape.features(self.knots))) / ranks
        d, m = self.device, self.model
        assert d is not None
        lm_head = m.vocab_size * m.hidden_size
        gemm = 2 * (m.num_layers * m.layer_params * shape.num_tokens + lm_head * shape.sampled_rows)
        attention = 4 * m.num_layers * m.num_heads * m.head_dim * (shape.prefill_attention + shape.decode_context)
        compute_s = (gemm / (d.gemm_flops * d.gemm_efficiency) + attention / d.attention_flops) / ranks
        kv_read = m.kv_bytes_per_token(kv_dtype_bytes) * (shape.decode_context + shape.prefill_tokens)
        memory_s = (m.num_params * m.dtype_bytes + kv_read) / ranks / (d.memory_bandwidth * d.memory_efficiency)
        stage = max(compute_s, memory_s)
        if tp > 1 and d.interconnect_bandwidth > 0:
            message = shape.num_tokens * m.hidden_size * m.dtype_bytes
            per_reduce = d.interconnect_latency_s + 2 * (tp - 1) / tp * message / d.interconnect_bandwidth
            stage += 2 * (m.num_layers / pp) * per_reduce
        return stage

    def hop_time(self, shape: StepShape) -> float:
        """Seconds a batch's activations take from one pipeline stage to the next."""
        return self.network_latency_s + shape.num_tokens * self.model.hidden_size * 2 * self.model.dtype_bytes \
            / self.network_bandwidth

    def step_time(self, shape: StepShape, tp: int = 1, pp: int = 1, kv_dtype_bytes: int | None = None) -> float:
        """Seconds the batch takes through every stage (a step's latency)."""
        return pp * self.stage_time(shape, tp, pp, kv_dtype_bytes) + (pp - 1) * self.hop_time(shape)

    def overhead_time(self, num_scheduled: int) -> float:
        """The engine's own work around a step of this many requests (virtual time only)."""
        return self.engine_overhead[0] + self.engine_overhead[1] * num_scheduled

    def transfer_time(self, num_bytes: float, bandwidth: float | None = None) -> float:
        """Seconds to move KV bytes over the KV link (or `bandwidth`: the host link)."""
        return self.kv_transfer_latency_s + num_bytes / (bandwidth or self.kv_transfer_bandwidth)

    def kv_capacity_bytes(self, tp: int, pp: int) -> float | None:
        """KV cache bytes of one replica of this shape: the profile's, or what the device's memory
        leaves after the weights (a roofline profile), or None (the engine's default)."""
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        d = self.device
        if d is None:
            return None
        ranks = tp * pp
        weights = self.model.num_params * self.model.dtype_bytes / ranks
        per_rank = d.memory_bytes * d.memory_utilization - weights - d.activation_bytes
        if per_rank <= 0:
            raise ValueError(f"profile {self.name!r}: the model's weights ({weights / 2**30:.1f} GiB per rank) "
                             f"leave no KV cache on {d.name} at TP={tp} x PP={pp}; use more ranks")
        return per_rank * ranks

    # --- files ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["coefficients"] = list(self.coefficients)
        out["knots"] = list(self.knots)
        out["engine_overhead"] = list(self.engine_overhead)
        if self.device is None:
            del out["device"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "profile") -> SimProfile:
        """A profile from its JSON object; ValueError naming the field that is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: a profile is a JSON object")
        data = dict(data)
        try:
            model = _record(ModelShape, data.pop("model", None), f"{source}: model")
            device = data.pop("device", None)
            device = None if device is None else _record(Device, device, f"{source}: device")
            data["coefficients"] = tuple(data.get("coefficients", ()))
            data["knots"] = tuple(data.get("knots", ()))
            data["engine_overhead"] = tuple(data.get("engine_overhead", (0.0, 0.0)))
            return _record(cls, {**data, "model": model, "device": device}, source)
        except TypeError as e:
            raise ValueError(f"{source}: {e}") from None


def _record(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object with fields {[f.name for f in fields(cls)]}")
    unknown = sorted(set(data) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}; the fields are {[f.name for f in fields(cls)]}")
    return cls(**data)


def builtin_profiles() -> list[str]:
    """The names of the profiles that ship with pdserve."""
    if not os.path.isdir(PROFILE_DIR):
        return []
    return sorted(n[:-5] for n in os.listdir(PROFILE_DIR) if n.endswith(".json"))


def load_profile(name_or_path: str) -> SimProfile:
    """A profile file's path, or a built-in's name; ValueError listing the built-ins otherwise."""
    path = os.path.expanduser(name_or_path)
    if not os.path.isfile(path):
        if name_or_path not in builtin_profiles():
            raise ValueError(f"simulate: {name_or_path!r} is neither a profile file nor a built-in profile; the "
                             f"built-ins are {builtin_profiles()} (pdserve profile writes one for a model on "
                             f"this machine)")
        path = os.path.join(PROFILE_DIR, f"{name_or_path}.json")
    try:
        return _read_profile(os.path.abspath(path), os.path.getmtime(path))
    except OSError as e:
        raise ValueError(f"simulate: cannot read the profile {path}: {e}") from None


@functools.lru_cache(maxsize=32)
def _read_profile(path: str, mtime: float) -> SimProfile:
    """A profile file, read once per version of it (engine arguments are checked often)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except ValueError as e:
        raise ValueError(f"simulate: the profile {path} is not JSON: {e}") from None
    return SimProfile.from_dict(data, path)


def save_profile(profile: SimProfile, path: str) -> None:
    with open(path, "w") as f:
        json.dump(profile.to_dict(), f, indent=2)
        f.write("\n")
