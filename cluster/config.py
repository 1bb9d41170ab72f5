"""The cluster spec: model, pools, routing, serving limits (pydantic; loads from YAML).

    model: null                 # null = the embedded SmolLM2-135M-Instruct
    engine: {dtype: auto, max_model_len: 2048, max_num_seqs: 64}
    mode: disaggregated         # colocated (decode pool only) | disaggregated (prefill + decode pools)
    pools:
      prefill: {replicas: 1, num_cpus: 1}
      decode: {replicas: 1, num_cpus: 1}
    disaggregation: {connector: nixl, min_remote_prefill_tokens: 256, lease_s: 30}
    routing: {name: prefix_aware, load_weight: 0.5, imbalance_threshold: 8}
    serving: {host: 127.0.0.1, port: 8000, grpc_port: null, api_key: null, public_metrics: false,
              max_in_flight: 256}
    placement_timeout_s: 60     # wait this long for the cluster to fit the pools, then fail naming why

Every field is validated here, so a bad spec fails before any actor starts, naming the field.
"""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.config import KV_CONNECTORS, KV_LOAD_FAILURE_POLICIES, EngineArgs, EngineConfig
from engine.lora import LoRAConfig, read_adapter
from router.policy import POLICIES, PolicyConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PoolSpec(_Strict):
    replicas: int = Field(1, ge=1, le=64)
    num_cpus: float = Field(1.0, gt=0)          # per rank (the replica actor, or each worker actor
    num_gpus: float = Field(0.0, ge=0)          # with TP x PP > 1); torch uses this many threads
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    # Custom Ray resources per rank, to pin a pool to its nodes: a KubeRay worker group started with
    # `resources: {"pdserve_prefill": 1000}` takes the pool with `resources: {pdserve_prefill: 1}`.
    resources: dict[str, float] = Field(default_factory=dict)
    # Speculative decoding (LLM's speculative_config), for the pool that decodes: decode only.
    speculative_config: dict[str, Any] | None = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class RoutingSpec(_Strict):
    """The routing policy (router/policy.py: PolicyConfig holds the defaults and the checks)."""
    name: Literal[POLICIES] = PolicyConfig.name     # type: ignore[valid-type]
    load_weight: float = PolicyConfig.load_weight
    imbalance_threshold: int = PolicyConfig.imbalance_threshold
    adapter_weight: float = PolicyConfig.adapter_weight     # a LoRA request's pull to replicas that ran its adapter
    stats_interval_s: float = Field(0.5, gt=0)  # replica stats (KV usage) refresh period

    def model_post_init(self, _: Any) -> None:
        self.policy()

    def policy(self) -> PolicyConfig:
        return PolicyConfig(self.name, self.load_weight, self.imbalance_threshold, self.adapter_weight)


class DisaggregationSpec(_Strict):
    """The KV connector of both pools (engine/config.py: EngineArgs' kv_* fields hold the defaults
    and the checks)."""
    connector: Literal[KV_CONNECTORS] = "nixl"      # type: ignore[valid-type]
    # Prompts with fewer uncached tokens (on the chosen decode replica) are prefilled there.
    min_remote_prefill_tokens: int = Field(256, ge=1)
    lease_s: float = EngineArgs.kv_lease_s          # how long a prefill keeps its blocks for the decode side
    load_timeout_s: float = EngineArgs.kv_load_timeout_s
    load_failure_policy: Literal[KV_LOAD_FAILURE_POLICIES] = EngineArgs.kv_load_failure_policy  # type: ignore[valid-type]

    def model_post_init(self, _: Any) -> None:
        EngineArgs(**self.engine_args())

    def engine_args(self) -> dict[str, Any]:
        return {"kv_connector": self.connector, "kv_lease_s": self.lease_s,
                "kv_load_timeout_s": self.load_timeout_s, "kv_load_failure_policy": self.load_failure_policy}


class ServingSpec(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    served_model_name: str | None = None        # default: the model's directory or file name
    api_key: str | None = None                  # when set, requests need `Authorization: Bearer <key>`
    api_key_env: str | None = None              # or: the environment variable that holds the key (a
                                                # Kubernetes Secret), read by the ingress at startup
    # With a key, every path but /health needs it; this opens /metrics too (a scraper without
    # credentials; the series name replicas and pools, never requests).
    public_metrics: bool = False
    # True: the ingress replica finishes starting only once the pools serve, so Serve's app status
    # RUNNING means ready (what KubeRay's RayService waits for before it switches traffic in an
    # upgrade). False: it answers at once (/health 503 with the reason while the pools load); the
    # launcher (`pdserve serve`, `python -m cluster.launch`) deploys that way and watches the start.
    wait_for_pools: bool = True
    max_in_flight: int = Field(256, ge=1)       # beyond this, 429 (never an out-of-memory)
    max_body_bytes: int = Field(4 << 20, ge=1024)
    ingress_replicas: int = Field(1, ge=1)
    ingress_num_cpus: float = Field(0.1, gt=0)
    # The gRPC Generation service (pdserve_proto/pdserve.proto) through Serve's gRPC proxy on this
    # port; None serves HTTP only. Serve's gRPC proxy listens on every interface ([::]), which Ray
    # does not let us narrow: keep the port firewalled (or set api_key, which gRPC enforces too).
    grpc_port: int | None = Field(None, ge=1, le=65535)
    # The ingress replica serves HTTP on `port` itself (Ray Serve's direct ingress) instead of behind
    # Serve's HTTP proxy: one process fewer on every streamed token's path (docs/PERFORMANCE.md §7).
    # Ray reads it from the environment of the cluster's processes: `pdserve serve` sets that for
    # the Ray it starts; a cluster you start yourself needs `direct_ingress_env()` in its environment.
    # Serve's proxy still starts, on a free loopback port that nothing needs.
    direct_ingress: bool = False
    # How the model writes tool calls (engine/tool_calls.py FORMATS); None: read from its chat
    # template (Hermes/Qwen `<tool_call>` blocks unless the template is Llama 3's or Mistral's).
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = None
    # vLLM's --reasoning-parser: a thinking model's `<think>...</think>` returned apart from the
    # content, as the chat message's `reasoning` (engine/reasoning.py)
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None
    # Under a reasoning parser, a request's structured-output constraint (response_format, tool_choice
    # "required" or named, ...) starts after the thinking (`</think>`), as vLLM's does; true
    # constrains the thinking too (vLLM's structured_outputs_config.enable_in_reasoning).
    structured_outputs_in_reasoning: bool = False
    # The prefix of /metrics' names: "vllm" exports them as vLLM names them (vllm:num_requests_waiting,
    # vllm:kv_cache_usage_perc, ...), for dashboards, autoscalers and gateways built for vLLM.
    metrics_prefix: Literal["pdserve", "vllm"] = "pdserve"
    # vLLM's --chat-template: a Jinja chat template, or the path of a file holding one, used in place
    # of the tokenizer's (a base model has none). A path is read when the spec is built, so the
    # ingress replicas get the text wherever they run.
    chat_template: str | None = None

    @field_validator("chat_template")
    @classmethod
    def _chat_template_text(cls, value: str | None) -> str | None:
        if value is None or "{{" in value or "{%" in value:
            return value
        if not os.path.isfile(value):
            raise ValueError(f"chat_template must be a Jinja template or the path of a file holding one; "
                             f"{value!r} is neither")
        with open(value, encoding="utf-8") as f:
            return f.read()

    def model_post_init(self, _: Any) -> None:
        if self.direct_ingress and (self.ingress_replicas != 1 or self.grpc_port is not None):
            raise ValueError("serving.direct_ingress needs ingress_replicas = 1 and no grpc_port (the "
                             "ingress replica takes `port` itself; gRPC goes through Serve's proxy)")

    def direct_ingress_env(self) -> dict[str, str]:
        """The environment Ray's processes need for `direct_ingress` (empty without it)."""
        if not self.direct_ingress:
            return {}
        return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
                "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(self.port),
                "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(self.port + 1)}


class LoRASpec(_Strict):
    """LoRA adapters (engine/lora.py): `modules` are served from the start under their names (the
    `model` a request names; listed by /v1/models with the base model as parent); the rest set
    every engine's adapter pool. `allow_runtime_updates` opens vLLM's /v1/load_lora_adapter and
    /v1/unload_lora_adapter (behind the API key when one is set)."""
    modules: dict[str, str] = Field(default_factory=dict)      # name -> PEFT adapter directory
    max_loras: int = Field(LoRAConfig.max_loras, ge=1)
    max_lora_rank: int = Field(LoRAConfig.max_lora_rank, ge=1, le=512)
    max_cpu_loras: int | None = Field(None, ge=1)
    allow_runtime_updates: bool = False

    def engine_args(self) -> dict[str, Any]:
        return {"enable_lora": True, "max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank,
                "max_cpu_loras": self.max_cpu_loras}


class ClusterConfig(_Strict):
    model: str | None = None
    # LLM(...) keywords (engine/config.py: EngineArgs, where their defaults live), checked on load.
    engine: EngineArgs = Field(default_factory=EngineArgs)
    mode: Literal["colocated", "disaggregated"] = "colocated"
    pools: dict[Literal["prefill", "decode"], PoolSpec] = Field(
        default_factory=lambda: {"decode": PoolSpec()})
    disaggregation: DisaggregationSpec = DisaggregationSpec()
    routing: RoutingSpec = RoutingSpec()
    serving: ServingSpec = ServingSpec()
    lora: LoRASpec | None = None                # None: no adapters
    name: str = "pdserve"                       # namespace of the manager actor
    # How long to wait for the Ray cluster to have the resources the pools need (nodes joining,
    # an autoscaler adding them) before failing with a message naming what is missing. A local Ray
    # started by `pdserve serve` never grows, so there the check does not wait.
    placement_timeout_s: float = Field(60.0, ge=0)

    def model_post_init(self, _: Any) -> None:
        if "decode" not in self.pools:
            raise ValueError("pools must include 'decode' (the pool that streams tokens)")
        if self.mode == "disaggregated" and "prefill" not in self.pools:
            raise ValueError("mode 'disaggregated' needs a 'prefill' pool beside 'decode'")
        if self.mode == "colocated" and "prefill" in self.pools:
            raise ValueError("pools has 'prefill' but mode is 'colocated'; set mode: disaggregated")
        if self.mode == "disaggregated" and any(p.pipeline_parallel_size > 1 for p in self.pools.values()):
            raise ValueError("mode 'disaggregated' needs pipeline_parallel_size = 1 in every pool: KV "
                             "transfer moves each TP rank's heads (the pools' TP sizes may differ), not "
                             "pipeline stages")
        if self.pools.get("prefill") is not None and self.pools["prefill"].speculative_config is not None:
            raise ValueError("pools.prefill.speculative_config: only the decode pool decodes; set "
                             "pools.decode.speculative_config")

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_leaves_pools_their_fields(cls, engine: Any) -> Any:
        """The fields that other sections set, named with where they belong."""
        if not isinstance(engine, dict):
            return engine
        defaults = EngineArgs()     # a dumped spec (the JSON the actors get) holds every field
        engine_set = [k for k, v in engine.items() if not hasattr(defaults, k) or getattr(defaults, k) != v]
        parallel_keys = [k for k in engine_set if k in (
            "tensor_parallel_size", "pipeline_parallel_size", "worker_num_cpus", "worker_num_gpus",
            "worker_resources", "distributed_executor_backend")]
        if parallel_keys:
            raise ValueError(f"engine must not set {parallel_keys}: set them per pool (pools.<name>)")
        if "speculative_config" in engine_set:
            raise ValueError("engine must not set speculative_config: set it on the decode pool "
                             "(pools.decode.speculative_config); prefill replicas never decode")
        lora_keys = [k for k in engine_set if k in ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")]
        if lora_keys:
            raise ValueError(f"engine must not set {lora_keys}: the lora section configures adapters")
        kv_keys = [k for k in engine_set if k.startswith("kv_") and not k.startswith("kv_cache_")]
        if kv_keys:
            raise ValueError(f"engine must not set {kv_keys}: the disaggregation section configures "
                             f"the KV connector")
        return engine

    def engine_config(self, pool: str = "decode") -> EngineConfig:
        """The engine config of one pool's replicas: the engine section, the pool's parallelism and
        speculative decoding, and in disaggregated mode the KV connector (every engine can play
        either role of a transfer). Resolves the model's config (ValueError naming the field when
        the model does not allow a setting)."""
        spec = self.pools[pool]
        kv_args = self.disaggregation.engine_args() if self.mode == "disaggregated" else {}
        # With one rank the replica actor is the rank (it holds the pool's CPUs/GPUs and runs on CUDA
        # when it has a GPU); with more, the engine places worker actors with these per rank.
        parallel: dict[str, Any] = {"worker_num_cpus": spec.num_cpus, "worker_num_gpus": spec.num_gpus}
        if spec.world_size > 1:
            parallel.update(tensor_parallel_size=spec.tensor_parallel_size,
                            pipeline_parallel_size=spec.pipeline_parallel_size,
                            worker_resources=dict(spec.resources))
        spec_args = {"speculative_config": spec.speculative_config} if spec.speculative_config else {}
        lora_args = self.lora.engine_args() if self.lora is not None else {}
        config = EngineConfig.from_args(self.model, replace(self.engine, **kv_args, **parallel, **spec_args,
                                                            **lora_args))
        if self.lora is not None:
            for name, path in self.lora.modules.items():
                try:
                    read_adapter(path, config.model_config.hf_config, self.lora.max_lora_rank)
                except ValueError as e:
                    raise ValueError(f"lora.modules.{name}: {e}") from None
        return config

    @classmethod
    def from_yaml(cls, path: str) -> ClusterConfig:
        with open(path) as f:
            return cls.model_validate(yaml.safe_load(f) or {})
