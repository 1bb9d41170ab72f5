"""The `pdserve serve` command line: its flags (vLLM's names where vLLM has the flag) and how they
override a cluster spec (`config_from_args`). cluster/launch.py runs what it describes."""
from __future__ import annotations

import argparse
import json
from typing import Any

from cluster.config import ClusterConfig
from engine.text.reasoning import PARSERS

# What `pdserve serve` runs without --config: the embedded model, 1 prefill + 1 decode replica, KV
# moved over NIXL.
DEFAULT_SPEC: dict = {"mode": "disaggregated", "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}}

# `pdserve serve` flags under vLLM's names for the spec's engine section (field -> (type, help)); a
# store_true flag has type bool, a --x / --no-x pair type None.
ENGINE_FLAGS: dict[str, tuple[Any, str]] = {
    "dtype": (str, "weights' and activations' dtype: auto, float32, bfloat16, float16"),
    "max_model_len": (int, "the longest prompt + output (default: the model's)"),
    "max_num_seqs": (int, "sequences in one batch"),
    "max_num_batched_tokens": (int, "tokens in one step (chunked prefill's budget)"),
    "itl_target_ms": (float, "while streams decode, cap a step's prompt tokens so that a step takes about this many "
                             "ms (their inter-token latency; default: none, the whole step budget)"),
    "max_num_encoder_input_tokens": (int, "image tokens encoded in one step (default: max_num_batched_tokens)"),
    "quantization": (str, "none, gguf, gguf+dense, int8, int8+dense, fp8 (default: auto)"),
    "kv_cache_dtype": (str, "auto or fp8 (e4m3)"),
    "kv_cache_memory_bytes": (int, "bytes of KV cache per replica (default: from free memory)"),
    "block_size": (int, "tokens per KV block"),
    "seed": (int, "the engine's sampling seed"),
    "stream_interval": (int, "a streamed request's chunks carry at least this many new tokens (its first and last "
                             "go out at once; default 1: every step's)"),
    "generation_config": (str, "auto (the model's sampling defaults) or vllm (none)"),
    "enable_prefix_caching": (None, "reuse cached prefixes' KV blocks (default on)"),
    "enable_chunked_prefill": (None, "split long prompts over steps (default on)"),
    "enforce_eager": (bool, "no CUDA graphs"),
    "disable_hybrid_kv_cache_manager": (bool, "local and global layers (Gemma 2, 3) share one block table: "
                                              "local layers keep a sequence's whole length"),
    "kv_offloading_size": (float, "GiB of host memory per replica for evicted prefix blocks (the offload tier)"),
    "kv_offloading_backend": (str, "the offload tier's backend: native"),
    "kv_offloading_disk_path": (str, "a local directory for the offload tier's disk store"),
    "kv_offloading_disk_size": (float, "GiB of the disk store (with --kv-offloading-disk-path)"),
    "allowed_local_media_path": (str, "a directory whose files file:// image URLs may read (default: none)"),
    "simulate": (str, "simulated replicas: the profile (a file, or a built-in such as h200-llama3-8b) whose cost "
                      "model replaces the forward pass (docs/simulation.md)"),
    "simulate_time_scale": (float, "simulated replicas: real seconds per simulated second (> 1 slows them down "
                                   "so that this machine keeps up)"),
}


def add_serve_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                    help="the model, as `vllm serve MODEL` takes it (same as --model)")
    ap.add_argument("--config", default=None, help="cluster spec YAML (see cluster/config.py)")
    ap.add_argument("--model", default=None, help="overrides the spec's model")
    ap.add_argument("--host", default=None)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--replicas", type=int, default=None, help="replicas of the decode pool")
    ap.add_argument("--prefill-replicas", type=int, default=None,
                    help="replicas of the prefill pool (> 0 serves disaggregated: prefill and decode "
                         "pools with KV transfer; 0 serves colocated)")
    ap.add_argument("--encode-replicas", type=int, default=None,
                    help="replicas of the encode pool: a vision-language model's images are encoded there "
                         "before the prompt is prefilled (0: none, encoded where prefilled)")
    ap.add_argument("--connector", choices=["nixl", "torch_dist"], default=None,
                    help="KV connector between the pools (disaggregated mode)")
    ap.add_argument("--tool-call-parser", choices=["hermes", "llama3_json", "mistral"], default=None,
                    help="how the model writes tool calls (default: read from its chat template)")
    ap.add_argument("--reasoning-parser", choices=PARSERS, default=None,
                    help="return a thinking model's <think>...</think> as the chat message's `reasoning` "
                         "(serving.reasoning_parser)")
    ap.add_argument("--structured-outputs-in-reasoning", action="store_true",
                    help="under a reasoning parser, constrain the thinking too (default: a structured output "
                         "starts after </think>; serving.structured_outputs_in_reasoning)")
    ap.add_argument("--chat-template", default=None,
                    help="a Jinja chat template, or a file holding one, in place of the tokenizer's "
                         "(serving.chat_template)")
    # vLLM command lines carry these; here they change nothing, and saying so beats refusing them.
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help="accepted as vLLM takes it: tool_choice 'auto' is always on here")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="accepted as vLLM takes it: pdserve runs no code from a checkpoint (its "
                         "architectures are built in)")
    ap.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-modules)")
    ap.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                    help="PEFT adapters to serve, each under its name (the request's `model`)")
    ap.add_argument("--max-loras", type=int, default=None, help="adapters in one batch (default 8)")
    ap.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank (default 16)")
    ap.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or a local Ray)")
    ap.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of a local Ray")
    ap.add_argument("--served-model-name", nargs="+", default=None,
                    help="the model's name in the API, or several: requests may use any, responses name "
                         "the first (serving.served_model_name)")
    ap.add_argument("--api-key", default=None, help="requests need `Authorization: Bearer <key>` (serving.api_key)")
    for flag, text in (("--allowed-origins", 'origins browsers may call from (default ["*"])'),
                       ("--allowed-methods", 'methods they may use (default ["*"])'),
                       ("--allowed-headers", 'headers they may send (default ["*"])')):
        ap.add_argument(flag, default=None, metavar="JSON_OR_CSV",
                        help=f"CORS: {text} (serving.{flag[2:].replace('-', '_')}; vLLM's flag)")
    ap.add_argument("--allow-credentials", action="store_const", const=True, default=None,
                    help="CORS: browsers may send cookies and credentials (serving.allow_credentials)")
    ap.add_argument("--tenants-file", default=None, metavar="PATH",
                    help="tenants, their keys and limits, as JSON: name -> serving.tenants' fields "
                         "(serving.tenants_file; docs/serving.md)")
    ap.add_argument("--ingress-replicas", type=int, default=None,
                    help="ingress replicas behind Serve's proxy; tenant limits hold over all of them "
                         "(serving.ingress_replicas)")
    ap.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                    help="export a span per hop of each request over OTLP to this collector, e.g. "
                         "http://127.0.0.1:4317 (serving.otlp_traces_endpoint; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL "
                         "grpc or http/protobuf)")
    ap.add_argument("--enable-weight-updates", action="store_true",
                    help="a trainer's endpoints: /pause, /resume, /update_weights_from_disk, ... "
                         "(serving.enable_weight_updates; docs/rl.md)")
    ap.add_argument("--enable-log-requests", action="store_true",
                    help="a JSON log line per request as it ends, without its text (serving.log_requests)")
    ap.add_argument("--log-request-prompts", action="store_true",
                    help="put the prompts' text in those lines too (serving.log_request_prompts)")
    engine = ap.add_argument_group("engine (vLLM's names; override the spec's engine section)")
    for field, (kind, text) in ENGINE_FLAGS.items():
        flag = "--" + field.replace("_", "-")
        if kind is bool:
            engine.add_argument(flag, action="store_const", const=True, default=None, help=text)
        elif kind is None:
            engine.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            engine.add_argument(flag, type=kind, default=None, help=text)
    engine.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                        help="hosts whose http(s) image URLs are fetched (default: none)")
    engine.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                        help='the most images one prompt may carry: {"image": n} (default 16)')
    engine.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                        help="TP ranks per replica, every pool")
    engine.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None,
                        help="PP stages per replica, every pool")
    engine.add_argument("--enable-expert-parallel", action="store_const", const=True, default=None,
                        help="a MoE model's experts split over each replica's TP ranks, every pool (vLLM's flag)")
    engine.add_argument("--moe-dispatch", choices=("allreduce", "all2all"), default=None,
                        help="how expert parallelism moves tokens to the experts (default allreduce)")
    engine.add_argument("--cpus-per-rank", type=float, default=None,
                        help="CPUs per rank (torch threads), every pool (default 1; e.g. 2 for one colocated "
                             "replica on a 2-core machine)")
    engine.add_argument("--num-gpus", type=float, default=None, help="GPUs per rank, every pool")
    engine.add_argument("--speculative-config", default=None,
                        help='speculative decoding of the decode pool, as JSON (e.g. \'{"method": "ngram", '
                             '"num_speculative_tokens": 4}\')')


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    """The spec file (or DEFAULT_SPEC) with the command line's overrides; ValueError names the field."""
    data = ClusterConfig.from_yaml(args.config).model_dump() if args.config else dict(DEFAULT_SPEC)
    if data.get("models") is not None:
        per_model = [flag for flag, given in (
            ("MODEL / --model", args.model_tag is not None or args.model is not None),
            ("--served-model-name", args.served_model_name is not None),
            ("--lora-modules / --enable-lora / --max-loras / --max-lora-rank",
             args.enable_lora or args.lora_modules or args.max_loras is not None or args.max_lora_rank is not None),
            ("--replicas / --prefill-replicas / --encode-replicas", args.replicas is not None
             or args.prefill_replicas is not None or args.encode_replicas is not None),
            ("--connector / --speculative-config", args.connector is not None or args.speculative_config is not None),
            ("the engine and parallelism flags", any(getattr(args, f, None) is not None for f in (
                *ENGINE_FLAGS, "tensor_parallel_size", "pipeline_parallel_size", "cpus_per_rank", "num_gpus",
                "enable_expert_parallel", "moe_dispatch", "allowed_media_domains", "limit_mm_per_prompt"))),
        ) if given]
        if per_model:
            raise ValueError(f"{', '.join(per_model)}: the spec serves several models (models:); set these "
                             f"in each models entry")
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
    model = args.model if args.model is not None else args.model_tag
    if model is not None:
        data["model"] = model
    serving = dict(data.get("serving", {}))
    if args.host is not None:
        serving["host"] = args.host
    if args.port is not None:
        serving["port"] = args.port
    for field in ("allowed_origins", "allowed_methods", "allowed_headers"):
        if getattr(args, field) is not None:
            serving[field] = _json_strings(getattr(args, field), "--" + field.replace("_", "-"))
    if args.allow_credentials:
        serving["allow_credentials"] = True
    if args.tool_call_parser is not None:
        serving["tool_call_parser"] = args.tool_call_parser
    if args.chat_template is not None:
        serving["chat_template"] = args.chat_template
    if args.reasoning_parser is not None:
        serving["reasoning_parser"] = args.reasoning_parser
    if args.structured_outputs_in_reasoning:
        serving["structured_outputs_in_reasoning"] = True
    if args.otlp_traces_endpoint is not None:
        serving["otlp_traces_endpoint"] = args.otlp_traces_endpoint
    if args.enable_log_requests:
        serving["log_requests"] = True
    if args.enable_weight_updates:
        serving["enable_weight_updates"] = True
    if args.log_request_prompts:
        serving.update(log_requests=True, log_request_prompts=True)
    data["serving"] = serving
    if args.enable_lora or args.lora_modules or args.max_loras is not None or args.max_lora_rank is not None:
        lora = dict(data.get("lora") or {})
        for item in args.lora_modules or []:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules takes name=path items; got {item!r}")
            lora["modules"] = {**dict(lora.get("modules", {})), name: path}
        if args.max_loras is not None:
            lora["max_loras"] = args.max_loras
        if args.max_lora_rank is not None:
            lora["max_lora_rank"] = args.max_lora_rank
        data["lora"] = lora
    engine = dict(data.get("engine", {}))
    engine.update((field, value) for field, value in vars(args).items()
                  if field in ENGINE_FLAGS and value is not None)
    if args.allowed_media_domains is not None:
        engine["allowed_media_domains"] = args.allowed_media_domains
    if args.limit_mm_per_prompt is not None:
        engine["limit_mm_per_prompt"] = _json_object(args.limit_mm_per_prompt, "--limit-mm-per-prompt")
    data["engine"] = engine
    if args.served_model_name is not None:
        names = args.served_model_name
        serving["served_model_name"] = names[0] if len(names) == 1 else names
    if args.api_key is not None:
        serving["api_key"] = args.api_key
    for flag in ("tenants_file", "ingress_replicas"):
        if getattr(args, flag) is not None:
            serving[flag] = getattr(args, flag)
    pools = {name: dict(spec) for name, spec in data.get("pools", {}).items()}
    for dest, field in (("tensor_parallel_size", "tensor_parallel_size"),
                        ("pipeline_parallel_size", "pipeline_parallel_size"),
                        ("cpus_per_rank", "num_cpus"), ("num_gpus", "num_gpus"),
                        ("enable_expert_parallel", "enable_expert_parallel"), ("moe_dispatch", "moe_dispatch")):
        if getattr(args, dest) is not None:
            for spec in pools.values():
                spec[field] = getattr(args, dest)
    if args.speculative_config is not None:
        pools.setdefault("decode", {})["speculative_config"] = _json_object(args.speculative_config,
                                                                             "--speculative-config")
    if args.replicas is not None:
        pools["decode"] = {**dict(pools.get("decode", {})), "replicas": args.replicas}
    if args.prefill_replicas == 0:
        pools.pop("prefill", None)
        data["mode"] = "colocated"
    elif args.prefill_replicas is not None:
        pools["prefill"] = {**dict(pools.get("prefill", {})), "replicas": args.prefill_replicas}
        data["mode"] = "disaggregated"
    if args.encode_replicas == 0:
        pools.pop("encode", None)
    elif args.encode_replicas is not None:
        pools["encode"] = {**dict(pools.get("encode", {})), "replicas": args.encode_replicas}
    if pools:
        data["pools"] = pools
    if args.connector is not None:
        data["disaggregation"] = {**dict(data.get("disaggregation", {})), "connector": args.connector}
    return ClusterConfig.model_validate(data)


def _json_object(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{flag} takes a JSON object; {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} takes a JSON object; got {text!r}")
    return value


def _json_strings(text: str, flag: str) -> list[str]:
    """A JSON list of strings, vLLM's form for its CORS flags (--allowed-origins '["*"]'), or the
    same without the JSON: comma-separated (--allowed-origins https://a.example,https://b.example)."""
    if not text.lstrip().startswith("["):
        return [item.strip() for item in text.split(",") if item.strip()]
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{flag} takes a JSON list of strings; {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{flag} takes a JSON list of strings; got {text!r}")
    return value
