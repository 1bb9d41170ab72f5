"""The engine's user arguments (`EngineArgs`): `LLM(...)`'s keywords and the cluster spec's `engine`
section, with vLLM's names and their defaults stated once; records/config.py resolves them against
the model into the frozen configs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from records.dtypes import KV_CACHE_DTYPES, resolve_dtype
from records.lora import LoRAConfig
from records.multimodal import MediaAccess
from records.quantization import QUANTIZATIONS
from records.sim_profile import load_profile

PREEMPTION_MODES = ("recompute", "swap")
KV_CONNECTORS = ("nixl", "torch_dist")
KV_OFFLOADING_BACKENDS = ("native",)         # vLLM's other one, "lmcache", is LMCache's own engine
GIB = 1 << 30
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
SPEC_METHODS = ("ngram", "draft_model")
BATCHING_MODES = ("continuous", "static")
SPEC_KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
             "disable_by_batch_size")


@dataclass(frozen=True)
class EngineArgs:
    """The engine's user arguments: `LLM(...)`'s keywords and the cluster spec's `engine` section
    (vLLM's names), with their defaults stated once, here. Everything that needs no model is
    checked on construction (ValueError naming the field), so a cluster spec with a bad engine
    field is refused when it is loaded; records/config_resolution.py (`engine_config_from_args`)
    resolves the rest against the model (max_model_len, the parallel split, a draft model)."""
    # Pydantic validates the spec's `engine` section into this (field types; no unknown fields).
    __pydantic_config__ = {"extra": "forbid", "arbitrary_types_allowed": True}

    dtype: Any = "auto"                               # "auto", a name, or a torch.dtype
    quantization: str | None = None                  # None (auto) or one of QUANTIZATIONS: resolve_quantization
    # Block-quantized weights (GGUF, int8 checkpoints) on CPU: multiply decode-sized batches by x
    # quantized to int8 per block of 32 features, llama.cpp's arithmetic (lossy; docs/kernels.md)
    quantize_activations: bool = False
    block_size: int = 16
    max_model_len: int | None = None                 # None: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None        # None: 2048 (with chunked prefill)
    enable_chunked_prefill: bool = True
    # pdserve's: while decodes run, a step's prompt tokens are capped so that a step stays near this
    # many ms (a stream's inter-token latency; engine/core/step_budget.py); None: the whole budget
    itl_target_ms: float | None = None
    enable_prefix_caching: bool = True
    # vLLM's: local (sliding-window) and global layers share one block table, every layer keeping a
    # sequence's whole length (records/kv_groups.py: KVGroups)
    disable_hybrid_kv_cache_manager: bool = False
    num_kv_blocks: int | None = None                 # None: from kv_cache_memory_bytes / free memory
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"                     # one of KV_CACHE_DTYPES
    # vLLM's: "auto" takes the model's generation_config.json sampling fields as the defaults of
    # requests that leave them unset (records/model_source.py: model_sampling_defaults); "vllm": none
    generation_config: str = "auto"
    # fp8: calibrate per-layer K/V scales at load on a fixed text (engine/worker/kv_scales.py); None (auto):
    # where the checkpoint has no scales of its own
    calculate_kv_scales: bool | None = None
    preemption_mode: str = "recompute"               # one of PREEMPTION_MODES
    swap_space_bytes: int = 256 << 20                # CPU block pool for swap preemption
    # vLLM's KV offloading: GiB of host memory for evicted prefix blocks (summed over the ranks) and
    # its backend (only "native"); pdserve's disk tier below it: a directory and GiB.
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None         # one of KV_OFFLOADING_BACKENDS (None: native)
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: float | None = None
    scheduling_policy: str = "fcfs"                  # "fcfs" | "priority"
    batching: str = "continuous"                     # one of BATCHING_MODES
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Layers per pipeline stage (a list, or "10,20"); None: $PDSERVE_PP_LAYER_PARTITION, else even
    pp_layer_partition: list[int] | str | None = None
    # vLLM's: a MoE model's experts split over the TP ranks (expert parallelism) instead of each
    # expert's intermediate size; moe_dispatch: how tokens reach them ("allreduce" | "all2all")
    enable_expert_parallel: bool = False
    moe_dispatch: str = "allreduce"
    kv_connector: str | None = None                  # one of KV_CONNECTORS: P/D disaggregation
    kv_engine_id: str | None = None
    kv_host: str = "auto"
    kv_lease_s: float = 30.0
    kv_load_timeout_s: float = 10.0
    kv_load_failure_policy: str = "recompute"        # one of KV_LOAD_FAILURE_POLICIES
    kv_connector_extra: dict[str, Any] | None = None  # test-only fault injection
    worker_num_cpus: float = 1.0
    worker_num_gpus: float = 0.0
    distributed_executor_backend: str | None = None  # "ray" forces worker actors even for one rank
    worker_resources: dict[str, float] | None = None
    speculative_config: dict[str, Any] | None = None  # see config_resolution.resolve_speculative_config
    pipeline_micro_batches: int | None = None        # None: 1 with concurrent batches, else PP
    # vLLM's: export each request's spans over OTLP to this collector (engine/tracing.py)
    otlp_traces_endpoint: str | None = None
    # vLLM's --stream-interval: a streamed request's deltas carry at least this many new tokens
    # (its first and its last go out at once); fewer messages and chunks per token on the way out
    stream_interval: int = 1
    max_concurrent_batches: int | None = None        # None: pipeline_parallel_size (1 with a kv_connector)
    enforce_eager: bool = False                      # no CUDA graphs
    cuda_graph_sizes: list[int] = field(default_factory=lambda: [1, 2, 4] + list(range(8, 257, 8)))
    # vLLM's: the most images one prompt may carry (a vision-language model; records/multimodal.py)
    limit_mm_per_prompt: dict[str, int] | None = None
    # vLLM's: image tokens encoded in one step at most (engine/core/encoder_budget.py; None:
    # max_num_batched_tokens)
    max_num_encoder_input_tokens: int | None = None
    # vLLM's: hosts image URLs may be fetched from, and a directory file:// images may be read
    # under (none by default: images come in the request)
    allowed_media_domains: list[str] | None = None
    allowed_local_media_path: str | None = None
    enable_lora: bool = False                        # serve PEFT LoRA adapters (records/lora.py)
    max_loras: int = LoRAConfig.max_loras            # adapters in one batch (device slots)
    max_lora_rank: int = LoRAConfig.max_lora_rank
    max_cpu_loras: int | None = None                 # adapters kept in host memory; None: 4 x max_loras
    # pdserve's simulated model runner (engine/executor/simulated.py): a profile's name or file
    # (records/sim_profile.py). The whole engine runs but the forward pass: a step takes the time
    # the profile gives its batch and emits deterministic tokens.
    simulate: str | None = None
    simulate_time_scale: float = 1.0                 # real seconds per simulated second (> 1: slower)

    def __post_init__(self) -> None:
        block_size, max_num_seqs = self.block_size, self.max_num_seqs
        if block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two in [1, 128]; got {block_size}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1; got {max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1; got {self.max_model_len}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}; got {self.preemption_mode!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority'; got {self.scheduling_policy!r}")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {BATCHING_MODES}; got {self.batching!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1; got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0; got {self.kv_cache_memory_bytes}")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' (the model's sampling defaults) or 'vllm' (none); "
                             f"got {self.generation_config!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}; got {self.kv_cache_dtype!r}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0; got {self.swap_space_bytes}")
        self._check_offloading()
        self._check_tracing()
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if tp < 1 or pp < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if self.moe_dispatch not in ("allreduce", "all2all"):
            raise ValueError(f"moe_dispatch must be one of ('allreduce', 'all2all'); got {self.moe_dispatch!r}")
        concurrent = self.max_concurrent_batches
        if concurrent is not None and not 1 <= concurrent <= max(1, pp):
            raise ValueError(f"max_concurrent_batches must be in [1, pipeline_parallel_size={pp}] (default: "
                             f"pipeline_parallel_size); got {concurrent}")
        if self.pipeline_micro_batches is not None and self.pipeline_micro_batches < 1:
            raise ValueError(f"pipeline_micro_batches must be >= 1 (default: 1 with concurrent batches, "
                             f"else pipeline_parallel_size); got {self.pipeline_micro_batches}")
        if self.distributed_executor_backend not in (None, "ray"):
            raise ValueError(f"distributed_executor_backend must be None or 'ray'; got "
                             f"{self.distributed_executor_backend!r}")
        if self.worker_num_cpus <= 0 or self.worker_num_gpus < 0:
            raise ValueError(f"worker_num_cpus must be > 0 and worker_num_gpus >= 0; got "
                             f"{self.worker_num_cpus}, {self.worker_num_gpus}")
        if isinstance(self.stream_interval, bool) or not isinstance(self.stream_interval, int) \
                or self.stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1; got {self.stream_interval!r}")
        sizes = self.cuda_graph_sizes
        if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
            raise ValueError(f"cuda_graph_sizes must be positive integers; got {sizes!r}")
        itl = self.itl_target_ms
        if itl is not None and (isinstance(itl, bool) or not isinstance(itl, (int, float)) or not itl > 0
                                or not self.enable_chunked_prefill):
            raise ValueError(f"itl_target_ms must be a number > 0, with enable_chunked_prefill (a prompt is then "
                             f"prefilled in chunks between decodes); got {self.itl_target_ms!r}")
        for name in ("max_num_batched_tokens", "max_num_encoder_input_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.kv_connector is not None:
            if concurrent is not None and concurrent > 1:
                # A lease must be live on every rank before its parameters leave, and a pull's
                # outcome comes back with a step's replies: both need the stages' replies in order
                # with the engine's own messages, which batches still in the stages would delay.
                raise ValueError(f"max_concurrent_batches must be 1 with a kv_connector (pipeline stages "
                                 f"still overlap on micro-batches: pipeline_micro_batches); got {concurrent}")
            if self.kv_connector not in KV_CONNECTORS:
                raise ValueError(f"kv_connector must be one of {KV_CONNECTORS} or None; got {self.kv_connector!r}")
            if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
                raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}; "
                                 f"got {self.kv_load_failure_policy!r}")
            if self.kv_lease_s <= 0 or self.kv_load_timeout_s <= 0:
                raise ValueError(f"kv_lease_s and kv_load_timeout_s must be > 0; got {self.kv_lease_s}, "
                                 f"{self.kv_load_timeout_s}")
        if isinstance(self.dtype, str):
            resolve_dtype(self.dtype, None)         # ValueError naming the allowed names
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None (auto); got {self.quantization!r}")
        if self.enable_lora:
            self.lora_config()           # ValueError naming the field
        self._check_simulation()
        self.media_access()                                     # ValueError naming the field

    def _check_simulation(self) -> None:
        if not self.simulate_time_scale > 0:
            raise ValueError(f"simulate_time_scale must be > 0 (real seconds per simulated second); got "
                             f"{self.simulate_time_scale!r}")
        if self.simulate is None:
            return
        if not isinstance(self.simulate, str) or not self.simulate:
            raise ValueError(f"simulate must name a profile (a file, or one of the built-ins); got {self.simulate!r}")
        load_profile(self.simulate)                 # ValueError listing the built-ins
        if self.speculative_config is not None:
            raise ValueError("speculative_config: a simulated engine (simulate) does not model speculative "
                             "decoding; leave it unset")

    def _check_tracing(self) -> None:
        if self.otlp_traces_endpoint is not None:
            check_otlp_endpoint(self.otlp_traces_endpoint)

    def _check_offloading(self) -> None:
        size, backend = self.kv_offloading_size, self.kv_offloading_backend
        disk_path, disk_size = self.kv_offloading_disk_path, self.kv_offloading_disk_size
        if backend is not None and backend not in KV_OFFLOADING_BACKENDS:
            raise ValueError(f"kv_offloading_backend must be one of {KV_OFFLOADING_BACKENDS}; got {backend!r}")
        if size is None:
            if backend is not None or disk_path is not None or disk_size is not None:
                raise ValueError("kv_offloading_size (GiB of host memory) is needed with kv_offloading_backend "
                                 "and with the disk tier (kv_offloading_disk_path, kv_offloading_disk_size)")
            return
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
            raise ValueError(f"kv_offloading_size must be a number of GiB > 0; got {size!r}")
        if (disk_path is None) != (disk_size is None):
            raise ValueError("kv_offloading_disk_path and kv_offloading_disk_size go together (the disk tier's "
                             "directory and GiB)")
        if disk_size is not None and (isinstance(disk_size, bool) or not isinstance(disk_size, (int, float))
                                      or not disk_size > 0):
            raise ValueError(f"kv_offloading_disk_size must be a number of GiB > 0; got {disk_size!r}")
        if not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size keeps evicted prefix-cache blocks: it needs "
                             "enable_prefix_caching=True")

    def media_access(self) -> MediaAccess:
        """Where a prompt's images may come from, and how many (records/multimodal.py)."""
        return MediaAccess.of(self.limit_mm_per_prompt, self.allowed_media_domains, self.allowed_local_media_path)

    def lora_config(self) -> LoRAConfig | None:
        """The adapter pool's configuration, None without enable_lora."""
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)


def check_otlp_endpoint(endpoint: str) -> str:
    """An OTLP collector's address as vLLM's --otlp-traces-endpoint takes it (`host:port` or an
    http(s) URL); ValueError naming the field otherwise."""
    if not isinstance(endpoint, str) or not endpoint.strip() or any(c.isspace() for c in endpoint):
        raise ValueError(f"otlp_traces_endpoint must be an OTLP collector's address such as "
                         f"http://127.0.0.1:4317 or 127.0.0.1:4317; got {endpoint!r}")
    url = urlparse(endpoint if "://" in endpoint else f"//{endpoint}")
    try:
        url.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        url = None
    if url is None or url.scheme not in ("", "http", "https") or not url.hostname:
        raise ValueError(f"otlp_traces_endpoint must be host:port or an http(s) URL; got {endpoint!r}")
    return endpoint
