"""How an engine's arguments become its config: the user's keyword arguments (`EngineArgs`, as
`LLM` and a cluster spec's `engine:` section take them, vLLM's names), checked, then resolved
against the model's own files (its config's context length and dtype, its quantization, fp8 KV
scales, generation defaults, a draft model's vocabulary) into the frozen records of
records/config.py, which everything downstream reads without checking again.
"""
from __future__ import annotations

import logging
import uuid
from typing import Any

from records.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SimulationConfig,
    SpeculativeConfig,
)
from records.cpu_flags import slow_half_dtype_warning
from records.dtypes import FP8_KV_DTYPE, resolve_dtype
from records.engine_args import GIB, SPEC_KEYS, SPEC_METHODS, EngineArgs
from records.frozen_config import resolve_frozen
from records.model_source import (
    check_parallel_fit,
    model_pooling,
    model_sampling_defaults,
    resolve_layer_partition,
    resolve_model,
)
from records.quantization import BLOCK_QUANTIZATIONS, kv_cache_scales, resolve_quantization
from records.sim_profile import load_profile

logger = logging.getLogger(__name__)


def engine_config(model: str | None = None, **engine_args: Any) -> EngineConfig:
    """Check the user's arguments (`EngineArgs`' fields, vLLM's names) and resolve them against
    the model's config."""
    return engine_config_from_args(model, EngineArgs(**engine_args))

def engine_config_from_args(model: str | None, args: EngineArgs, frozen: bool = False) -> EngineConfig:
    """Resolve checked arguments against the model's config (ValueError naming the field when
    the model does not allow them: max_model_len, the parallel split, a draft model). `frozen`:
    the config as a FrozenConfig, read from the cache of resolved configs where it can be
    (records/frozen_config.py: `resolve_frozen`), for a process that hands it on or only reads it."""
    block_size, max_num_seqs, max_model_len = args.block_size, args.max_num_seqs, args.max_model_len
    tensor_parallel_size, pipeline_parallel_size = args.tensor_parallel_size, args.pipeline_parallel_size
    max_num_batched_tokens, enable_chunked_prefill = args.max_num_batched_tokens, args.enable_chunked_prefill
    max_concurrent_batches = args.max_concurrent_batches or (1 if args.kv_connector else pipeline_parallel_size)
    pipeline_micro_batches = args.pipeline_micro_batches
    if pipeline_micro_batches is None:
        # Concurrent batches already keep every stage busy; splitting each of them again only
        # adds per-micro-batch weight reads (benchmarks/parallel.py).
        pipeline_micro_batches = 1 if max_concurrent_batches > 1 else pipeline_parallel_size
    # Sizes up to max_num_seqs, and the first one at or above it (a full batch replays too).
    sizes = sorted(set(args.cuda_graph_sizes))
    # LoRA steps run eagerly: a step's rows per adapter are not a shape a graph can replay.
    graph_sizes = () if args.enforce_eager or args.enable_lora else tuple(
        n for i, n in enumerate(sizes) if i == 0 or sizes[i - 1] < max_num_seqs)
    kv_transfer_config = None if args.kv_connector is None else KVTransferConfig(
        kv_connector=args.kv_connector, engine_id=args.kv_engine_id or uuid.uuid4().hex[:12],
        kv_host=args.kv_host, lease_s=args.kv_lease_s, load_timeout_s=args.kv_load_timeout_s,
        load_failure_policy=args.kv_load_failure_policy,
        extra=tuple(sorted((args.kv_connector_extra or {}).items())))
    dtype, seed, speculative_config = args.dtype, args.seed, args.speculative_config

    path, gguf_file, hf_config = (resolve_frozen if frozen else resolve_model)(model)
    simulation = None
    num_layers = hf_config.num_hidden_layers
    derived_len = getattr(hf_config, "max_position_embeddings", None) or 2048
    if args.simulate is not None:
        # The simulated model's shape splits and bounds the context; `model` gives the tokenizer
        # and the vocabulary the requests are checked against.
        simulation = SimulationConfig(load_profile(args.simulate), args.simulate_time_scale)
        shape = simulation.profile.model
        shape.check_parallel(tensor_parallel_size, pipeline_parallel_size)
        num_layers, derived_len = shape.num_layers, shape.max_model_len
    else:
        check_parallel_fit(hf_config, tensor_parallel_size, pipeline_parallel_size)
    layer_partition = resolve_layer_partition(num_layers, pipeline_parallel_size, args.pp_layer_partition)
    if max_model_len is None:
        max_model_len = derived_len
    elif not 1 <= max_model_len <= derived_len:
        raise ValueError(f"max_model_len must be in [1, {derived_len}] for this model; got {max_model_len}")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = 2048 if enable_chunked_prefill else max(2048, max_model_len)
    if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_model_len "
            f"({max_model_len}) when enable_chunked_prefill=False")
    raw = hf_config.to_dict()
    config_dtype = raw.get("dtype") or raw.get("torch_dtype")
    quantization = resolve_quantization(args.quantization, path, gguf_file, hf_config, args.worker_num_gpus > 0)
    if args.quantize_activations and (quantization not in BLOCK_QUANTIZATIONS or args.worker_num_gpus > 0):
        raise ValueError(f"quantize_activations multiplies weights kept in blocks on CPU (quantization one of "
                         f"{BLOCK_QUANTIZATIONS}, worker_num_gpus=0); this model resolved to "
                         f"quantization={quantization!r} with worker_num_gpus={args.worker_num_gpus}")
    model_config = ModelConfig(
        model=path, gguf_file=gguf_file, hf_config=hf_config,
        dtype=resolve_dtype(dtype, config_dtype), max_model_len=max_model_len, seed=seed,
        quantization=quantization, quantize_activations=args.quantize_activations, cuda_graph_sizes=graph_sizes,
        sampling_defaults=model_sampling_defaults(path, gguf_file) if args.generation_config == "auto" else (),
        pooling=model_pooling(path, gguf_file), media=args.media_access())
    warning = slow_half_dtype_warning(model_config.dtype) if args.worker_num_gpus == 0 else None
    if warning is not None:
        logger.warning(warning)
    fp8 = args.kv_cache_dtype != "auto"
    kv_scales = kv_cache_scales(path, gguf_file, hf_config) if fp8 and simulation is None else ()
    if (simulation is None and fp8 and args.calculate_kv_scales is not False and pipeline_parallel_size > 1
            and not kv_scales):
        raise ValueError("calculate_kv_scales calibrates on one pipeline stage only; with "
                         "pipeline_parallel_size > 1 and kv_cache_dtype='fp8' pass calculate_kv_scales=False "
                         "(scales 1.0) or a checkpoint with k_scale/v_scale tensors")
    spec_config = None
    if speculative_config is not None:
        spec_config = resolve_speculative_config(speculative_config, model_config)
    return EngineConfig(
        model_config=model_config,
        cache_config=CacheConfig(
            block_size=block_size, num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            enable_prefix_caching=args.enable_prefix_caching, swap_space_bytes=args.swap_space_bytes,
            offload_host_bytes=int((args.kv_offloading_size or 0) * GIB),
            offload_disk_bytes=int((args.kv_offloading_disk_size or 0) * GIB),
            offload_disk_path=args.kv_offloading_disk_path,
            hybrid_kv_cache=not args.disable_hybrid_kv_cache_manager,
            cache_dtype=FP8_KV_DTYPE if fp8 else None, kv_scales=kv_scales,
            # (a simulated engine has no K/V values to calibrate on)
            calculate_kv_scales=bool(fp8 and simulation is None and (
                args.calculate_kv_scales or (args.calculate_kv_scales is None and not kv_scales)))),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
            preemption_mode=args.preemption_mode, policy=args.scheduling_policy, batching=args.batching,
            max_loras=args.max_loras if args.enable_lora else None,
            max_num_encoder_input_tokens=args.max_num_encoder_input_tokens or max_num_batched_tokens,
            itl_target_s=args.itl_target_ms / 1e3 if args.itl_target_ms is not None else None),
        parallel_config=ParallelConfig(tensor_parallel_size, pipeline_parallel_size,
                                       args.worker_num_cpus, args.worker_num_gpus,
                                       args.distributed_executor_backend,
                                       tuple(sorted((args.worker_resources or {}).items())),
                                       pipeline_micro_batches, max_concurrent_batches, layer_partition,
                                       args.enable_expert_parallel, args.moe_dispatch),
        kv_transfer_config=kv_transfer_config,
        speculative_config=spec_config,
        lora_config=args.lora_config(), otlp_traces_endpoint=args.otlp_traces_endpoint,
        simulation=simulation, stream_interval=args.stream_interval,
    )


def resolve_speculative_config(spec: dict[str, Any], target: ModelConfig) -> SpeculativeConfig:
    """Validate the user's `speculative_config` dict (ValueError naming the field)."""
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict or None; got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"speculative_config keys must be among {SPEC_KEYS}; got {unknown}")
    method = spec.get("method")
    if method not in SPEC_METHODS:
        raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}; got {method!r}")
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
        raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, 16]; got {k!r}")
    lo = spec.get("prompt_lookup_min", SpeculativeConfig.prompt_lookup_min)
    if not isinstance(lo, int) or lo < 1:
        raise ValueError(f"speculative_config.prompt_lookup_min must be an integer >= 1; got {lo!r}")
    hi = spec.get("prompt_lookup_max", max(lo, SpeculativeConfig.prompt_lookup_max))
    if not isinstance(hi, int) or hi < lo:
        raise ValueError(f"speculative_config.prompt_lookup_max must be an integer >= prompt_lookup_min "
                         f"({lo}); got {hi!r}")
    off = spec.get("disable_by_batch_size")
    if off is not None and (not isinstance(off, int) or isinstance(off, bool) or off < 1):
        raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 1 or None; got {off!r}")
    draft = None
    if method == "draft_model":
        if not spec.get("model"):
            raise ValueError("speculative_config.model must name the draft model when method is 'draft_model'")
        path, gguf_file, hf_config = resolve_model(spec["model"])
        if hf_config.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model must share the target's vocabulary "
                             f"({target.vocab_size} tokens); it has {hf_config.vocab_size}")
        draft = ModelConfig(model=path, gguf_file=gguf_file, hf_config=hf_config, dtype=target.dtype,
                            max_model_len=target.max_model_len, seed=target.seed)
    elif spec.get("model") is not None:
        raise ValueError("speculative_config.model must be None when method is 'ngram'")
    return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi,
                             draft_model_config=draft, disable_by_batch_size=off)
