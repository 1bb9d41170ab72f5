"""Frozen configuration records for one engine replica.

records/config_resolution.py makes them from the user's arguments (as `LLM` takes them), resolved
against the model's own config (max_model_len, dtype); everything downstream reads these records
and never re-validates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from records.dtypes import FP8_KV_DTYPE, KV_DTYPE_SIZES
from records.engine_args import EngineArgs
from records.frozen_config import FrozenConfig
from records.kv_groups import KVGroups
from records.lora import LoRAConfig
from records.model_source import (
    architecture_of,
    attention_windows,
)
from records.multimodal import MediaAccess
from records.sim_profile import SimProfile

# A rank's KV budget when neither num_kv_blocks nor kv_cache_memory_bytes is given.
DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class ModelConfig:
    model: str                  # directory, .gguf file, or the embedded default's path
    gguf_file: str | None       # file name inside `model` when loading GGUF
    hf_config: Any              # transformers PretrainedConfig
    dtype: str                  # float32 | bfloat16 | float16 (`torch_dtype` for the torch object)
    max_model_len: int
    seed: int = 0
    quantization: str = "none"  # one of model_source.QUANTIZATIONS (resolve_quantization)
    quantize_activations: bool = False    # blocks times int8 activations (EngineArgs.quantize_activations)
    # CUDA graphs of the decode step, one per batch size here (empty: eager); see engine/worker/cuda_graph.py.
    cuda_graph_sizes: tuple[int, ...] = ()
    # What requests that leave them unset sample with (EngineArgs.generation_config).
    sampling_defaults: tuple[tuple[str, Any], ...] = ()
    pooling: tuple[str, bool] = ("last", True)     # an embedding's pooling and normalization (model_pooling)
    media: MediaAccess = MediaAccess()      # a prompt's images: how many, from where (EngineArgs.media_access)

    def __getstate__(self) -> dict[str, Any]:
        # The model's config travels as plain values: a process that receives it (a replica, a TP /
        # PP rank) need not import transformers to read it (records/frozen_config.py).
        return {**self.__dict__, "hf_config": FrozenConfig.of(self.hf_config)}

    @property
    def torch_dtype(self) -> Any:
        import torch  # noqa: PLC0415 - configs are records that import without torch; the model side asks

        return getattr(torch, self.dtype)

    @property
    def architecture(self) -> str:
        return architecture_of(self.hf_config)

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads

    @property
    def head_dim(self) -> int:
        hd = getattr(self.hf_config, "head_dim", None)
        return hd or self.hf_config.hidden_size // self.hf_config.num_attention_heads


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = EngineArgs.block_size
    num_kv_blocks: int | None = None         # resolved by the worker from kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = EngineArgs.enable_prefix_caching
    swap_space_bytes: int = EngineArgs.swap_space_bytes     # CPU block pool for swap preemption
    cache_dtype: str | None = None           # None: the model's dtype; or FP8_KV_DTYPE (EngineConfig.kv_dtype)
    # fp8: each layer's (K scale, V scale) from the checkpoint (or, with calculate_kv_scales, as
    # the worker calibrated them at load); () for all 1.0
    kv_scales: tuple[tuple[float, float], ...] = ()
    calculate_kv_scales: bool = False        # fp8: calibrate the scales at load (engine/worker/kv_scales.py)
    # The offload tier (engine/core/kv_tier.py): bytes of host memory and of local disk for evicted
    # prefix blocks, summed over the engine's ranks; 0 host bytes: no tier.
    offload_host_bytes: int = 0
    offload_disk_bytes: int = 0
    offload_disk_path: str | None = None
    # Local and global layers with tables of their own (records/kv_groups.py: KVGroups), where the
    # model mixes them; False: one table, every layer keeps a sequence's whole length.
    hybrid_kv_cache: bool = True

    @property
    def is_fp8(self) -> bool:
        return self.cache_dtype == FP8_KV_DTYPE


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = EngineArgs.max_num_seqs
    max_num_batched_tokens: int = 2048       # resolved by engine_config_from_args
    max_model_len: int = 2048                # resolved from the model
    enable_chunked_prefill: bool = EngineArgs.enable_chunked_prefill
    preemption_mode: str = EngineArgs.preemption_mode      # "recompute" | "swap"
    policy: str = EngineArgs.scheduling_policy             # "fcfs" | "priority"
    batching: str = EngineArgs.batching      # "continuous" | "static" (a batch barrier: the baseline)
    max_loras: int | None = None             # distinct adapters among running requests (None: no LoRA)
    max_num_encoder_input_tokens: int = 2048  # image tokens encoded per step (resolved by engine_config_from_args)
    itl_target_s: float | None = None        # steps that carry decodes paced to it (engine/core/step_budget.py)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    worker_num_cpus: float = EngineArgs.worker_num_cpus   # per rank actor (torch gets that many threads)
    worker_num_gpus: float = EngineArgs.worker_num_gpus   # per rank actor; > 0 runs the ranks on CUDA
    distributed_executor_backend: str | None = None   # "ray" forces worker actors even for one rank
    worker_resources: tuple[tuple[str, float], ...] = ()   # custom Ray resources per rank actor
    pipeline_micro_batches: int = 1          # micro-batches per step (the stages overlap on them)
    max_concurrent_batches: int = 1          # batches of disjoint requests in the stages at once
    layer_partition: tuple[int, ...] = ()    # layers per stage (resolved: always set by engine_config_from_args)
    enable_expert_parallel: bool = False     # MoE experts split over the TP ranks rather than sliced
    moe_dispatch: str = "allreduce"          # "allreduce" | "all2all" (engine/model/layers/moe.py)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class KVTransferConfig:
    """How this engine moves KV blocks to and from other engines (prefill/decode disaggregation).

    Every engine with a connector plays both roles: it can prefill for a remote decode (its blocks
    then wait under a lease) and decode a remotely prefilled request (it pulls the blocks)."""
    kv_connector: str                        # one of KV_CONNECTORS
    engine_id: str                           # unique per engine; names its NIXL agent / store peer
    kv_host: str = EngineArgs.kv_host        # address other engines reach this one at ("auto": this
                                             # Ray node's IP, or 127.0.0.1 outside Ray)
    lease_s: float = EngineArgs.kv_lease_s   # how long a prefill keeps its blocks for the decode side
    load_timeout_s: float = EngineArgs.kv_load_timeout_s    # a pull not done by then fails (then: policy)
    # "recompute": prefill locally; "fail": finish with an error
    load_failure_policy: str = EngineArgs.kv_load_failure_policy
    # Test-only fault injection: {"fail_loads": True} or {"load_delay_s": float}.
    extra: tuple[tuple[str, Any], ...] = ()

    def extra_value(self, key: str, default: Any = None) -> Any:
        return dict(self.extra).get(key, default)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec_decode/): each decode step verifies up to
    `num_speculative_tokens` proposed tokens in one target forward pass.

    "ngram" proposes the tokens that followed the latest earlier occurrence of the sequence's last
    n tokens (n from prompt_lookup_max down to prompt_lookup_min); "draft_model" runs `model` (same
    vocabulary) greedily for k steps over its own paged KV cache."""
    method: str                                  # one of SPEC_METHODS
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model_config: ModelConfig | None = None   # method == "draft_model" only
    disable_by_batch_size: int | None = None     # no proposals while this many requests run (vLLM's)


@dataclass(frozen=True)
class SimulationConfig:
    """A simulated engine (EngineArgs.simulate): its forward pass is `profile`'s cost model
    (engine/executor/simulated.py); `time_scale` real seconds pass per simulated second."""
    profile: SimProfile
    time_scale: float = 1.0


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    kv_transfer_config: KVTransferConfig | None = None
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None
    otlp_traces_endpoint: str | None = None     # engine/tracing.py: None traces nothing
    simulation: SimulationConfig | None = None  # None: the model runs (else engine/executor/simulated.py)
    stream_interval: int = 1                    # a streamed delta's fewest new tokens (EngineArgs)

    @property
    def kv_dtype(self) -> str:
        """The KV cache tensors' dtype name (torch's): the model's, or fp8 (kv_cache_dtype)."""
        return self.cache_config.cache_dtype or self.model_config.dtype

    def kv_block_bytes(self) -> int:
        """One KV block's bytes over every layer and rank of the engine (what a pull of it moves): the
        model's, or the simulated model's."""
        cc = self.cache_config
        kv_bytes = KV_DTYPE_SIZES[self.kv_dtype]
        if self.simulation is not None:
            shape = self.simulation.profile.model
            return cc.block_size * shape.kv_bytes_per_token(kv_bytes if cc.is_fp8 else None)
        mc, groups = self.model_config, self.kv_groups
        layers = groups.num_slots if groups.hybrid else mc.num_layers     # a hybrid block: a group's pages
        return 2 * cc.block_size * mc.num_kv_heads * mc.head_dim * kv_bytes * layers

    @property
    def kv_groups(self) -> KVGroups:
        """How the layers share the KV cache's blocks (KVGroups): hybrid where the model mixes local
        and global layers, unless turned off (disable_hybrid_kv_cache_manager), the engine is
        pipelined (a stage's layers would need their own grouping) or simulated."""
        hybrid = (self.cache_config.hybrid_kv_cache and self.parallel_config.pipeline_parallel_size == 1
                  and self.simulation is None)
        return KVGroups.of(attention_windows(self.model_config.hf_config), hybrid)

    def kv_blocks_per_seq(self) -> int:
        """The most blocks one sequence holds at once, over its groups' tables: a global group's
        blocks cover its whole length; where prefill is chunked, a local group's only its window and
        one step's chunk (the KV cache releases the rest)."""
        cc, sc = self.cache_config, self.scheduler_config
        total = 0
        for window in self.kv_groups.windows:
            tokens = sc.max_model_len
            if window and sc.enable_chunked_prefill:
                tokens = min(tokens, window + sc.max_num_batched_tokens + cc.block_size)
            total += -(-tokens // cc.block_size)
        return total

    def kv_cache_blocks(self, bytes_per_block: int, default_bytes: float) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) of one rank whose block is `bytes_per_block`: num_kv_blocks,
        or kv_cache_memory_bytes over the block's bytes, or enough for max_num_seqs full sequences
        within `default_bytes`. ValueError unless one sequence fits."""
        cc, sc = self.cache_config, self.scheduler_config
        per_seq = self.kv_blocks_per_seq() if self.simulation is None else -(-sc.max_model_len // cc.block_size)
        if cc.num_kv_blocks is not None:
            num_blocks = cc.num_kv_blocks
        elif cc.kv_cache_memory_bytes is not None:
            num_blocks = cc.kv_cache_memory_bytes // bytes_per_block
        else:
            num_blocks = min(sc.max_num_seqs * per_seq, int(default_bytes // bytes_per_block))
        if num_blocks < per_seq:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {cc.block_size} tokens, less than the {per_seq} "
                f"one sequence of max_model_len={sc.max_model_len} tokens holds; raise num_kv_blocks / "
                f"kv_cache_memory_bytes or lower max_model_len")
        num_cpu_blocks = cc.swap_space_bytes // bytes_per_block if sc.preemption_mode == "swap" else 0
        return num_blocks, num_cpu_blocks

    def tier_slots(self, block_bytes: int) -> tuple[int, int]:
        """(host, disk) slots of the offload tier for blocks of `block_bytes` over every rank: its
        sizes are the engine's, summed over its ranks (vLLM's kv_offloading_size), and a slot holds
        one block on every rank."""
        cc = self.cache_config
        slots = cc.offload_host_bytes // block_bytes, cc.offload_disk_bytes // block_bytes
        for name, size, n in (("kv_offloading_size", cc.offload_host_bytes, slots[0]),
                              ("kv_offloading_disk_size", cc.offload_disk_bytes, slots[1])):
            if size and not n:
                raise ValueError(f"{name} ({size / (1 << 30):.6g} GiB) holds no KV block of this model "
                                 f"({block_bytes} bytes over its ranks); raise it")
        return slots

    def model_info(self) -> ModelInfo:
        """What a frontend needs to know of the model this engine serves."""
        mc = self.model_config
        return ModelInfo(mc.model, mc.gguf_file, mc.vocab_size, mc.max_model_len, self.cache_config.block_size,
                         self.scheduler_config.max_num_seqs, mc.sampling_defaults, mc.pooling, mc.media)


@dataclass(frozen=True)
class ModelInfo:
    """The model as the HTTP/gRPC frontend sees it: enough to tokenize and validate requests and
    to route them by prefix blocks, with no engine internals."""
    model: str                  # directory or the GGUF file's directory (the tokenizer's path)
    gguf_file: str | None
    vocab_size: int
    max_model_len: int
    block_size: int
    max_num_seqs: int
    sampling_defaults: tuple[tuple[str, Any], ...] = ()      # ModelConfig's
    pooling: tuple[str, bool] = ("last", True)                # ModelConfig's
    media: MediaAccess = MediaAccess()                        # ModelConfig's
