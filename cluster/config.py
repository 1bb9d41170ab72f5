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
    drain_timeout_s: 60         # a replica leaving (scale-down, spec update) finishes its streams this long

A pool may autoscale between bounds (cluster/planner.py):

    pools:
      decode: {replicas: 1, autoscaling: {min_replicas: 1, max_replicas: 4, itl_slo_ms: 50,
                                          target_running_requests: 16}}

Several models behind one endpoint: a `models:` list, each entry one model's deployment keyed as
above (`model`, `engine`, `mode`, `pools`, `disaggregation`, `lora`) plus `name` (the id clients
send) and `aliases` (more ids), while `serving`, `routing` and the timeouts stay at the top, shared:

    models:
      - {name: chat, aliases: [smol], model: null, mode: disaggregated,
         pools: {prefill: {replicas: 1}, decode: {replicas: 1}}}
      - {name: qwen, model: /models/qwen2-0.5b, pools: {decode: {replicas: 2}}}

Each entry becomes a deployment of its own (`ClusterConfig.deployments`: its own manager, in the
namespace `<name>-<entry name>`, and its own pools, on the cluster's shared nodes); one ingress
routes each request by its `model` (router/ingress/served_models.py). A spec without `models:` is a
one-model deployment, as before.

Every field is validated here, so a bad spec fails before any actor starts, naming the field. The
sections the ingress reads (serving, routing, disaggregation, lora) are records/serving.py's; the
pools and the whole are here, with what each pool's engines and the ingress get
(`engine_config`, `ingress_spec`).
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from records.config import EngineConfig
from records.engine_args import EngineArgs
from records.model_source import is_vision_language
from records.serving import (
    DisaggregationSpec,
    IngressSpec,
    LoRASpec,
    RoutingSpec,
    ServingSpec,
    StrictSpec,
    resolve_engine_config,
)

# A pool's replicas at most (a simulated cluster replays hundreds: cluster/sim/).
MAX_REPLICAS = 1024


class AutoscalingSpec(StrictSpec):
    """A pool's planner (cluster/planner.py): the bounds it keeps the pool within and the targets it
    scales for (at least one). Load targets are per replica: the pool wants as many replicas as its
    load over the target; latency targets (the p90 over `window_s`, measured by the engines) add a
    replica while missed and allow one fewer once under `downscale_ratio` of the target. A pool
    grows when every plan of the last `upscale_delay_s` wanted more, shrinks when every plan of the
    last `downscale_delay_s` wanted fewer, and changes at most once per `cooldown_s`.

    `min_replicas: 0` (on every pool of a model) scales the model to zero: after `idle_timeout_s`
    without a request its replicas are drained and stopped, and the next request waits at the
    ingress while one replica per pool starts (up to `cold_start_timeout_s`, then 503 with
    Retry-After; cluster/scale_to_zero.py). The targets then size the pools from one replica up;
    none is needed for a pool that only scales to zero and back."""
    min_replicas: int = Field(1, ge=0, le=MAX_REPLICAS)
    max_replicas: int = Field(1, ge=1, le=MAX_REPLICAS)
    ttft_slo_ms: float | None = Field(None, gt=0)            # time to first token, p90
    itl_slo_ms: float | None = Field(None, gt=0)             # inter-token latency, p90
    target_queued_prompt_tokens: int | None = Field(None, ge=1)   # prompt tokens waiting to be run
    target_running_requests: float | None = Field(None, gt=0)     # requests running or waiting
    target_kv_usage: float | None = Field(None, gt=0, le=1)       # fraction of the KV blocks in use
    window_s: float = Field(30.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    cooldown_s: float = Field(30.0, ge=0)
    downscale_ratio: float = Field(0.5, gt=0, lt=1)
    idle_timeout_s: float = Field(300.0, gt=0)          # with min_replicas 0: idle this long, go to zero
    cold_start_timeout_s: float = Field(300.0, gt=0)    # with min_replicas 0: a held request waits this long

    def model_post_init(self, _: Any) -> None:
        if self.max_replicas < max(1, self.min_replicas):
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas}) "
                             f"and >= 1")
        if self.min_replicas == 0:
            return
        if not any(v is not None for v in (self.ttft_slo_ms, self.itl_slo_ms, self.target_queued_prompt_tokens,
                                           self.target_running_requests, self.target_kv_usage)):
            raise ValueError("autoscaling needs a target: one or more of ttft_slo_ms, itl_slo_ms, "
                             "target_queued_prompt_tokens, target_running_requests, target_kv_usage")


class KVOffloadingSpec(StrictSpec):
    """A pool's offload tier for evicted prefix blocks (engine/core/kv_tier.py), over the engine
    section's kv_offloading_* for this pool's replicas."""
    enabled: bool = True
    size_gib: float | None = Field(None, gt=0)        # host memory (None: engine.kv_offloading_size)
    disk_path: str | None = None                      # a local directory for the disk tier
    disk_size_gib: float | None = Field(None, gt=0)

    def engine_args(self, engine: EngineArgs) -> dict[str, Any]:
        if not self.enabled:
            return {"kv_offloading_size": None, "kv_offloading_backend": None, "kv_offloading_disk_path": None,
                    "kv_offloading_disk_size": None}
        out: dict[str, Any] = {"kv_offloading_size": self.size_gib or engine.kv_offloading_size}
        if self.disk_path is not None or self.disk_size_gib is not None:
            out.update(kv_offloading_disk_path=self.disk_path, kv_offloading_disk_size=self.disk_size_gib)
        return out


class PoolSpec(StrictSpec):
    # The replicas it starts with (and keeps, without autoscaling); `pdserve scale` changes that.
    # 0 only where autoscaling's min_replicas is 0: the model starts scaled to zero.
    replicas: int = Field(1, ge=0, le=MAX_REPLICAS)
    num_cpus: float = Field(1.0, gt=0)          # per rank (the replica actor, or each worker actor
    num_gpus: float = Field(0.0, ge=0)          # with TP x PP > 1); torch uses this many threads
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    # Layers per pipeline stage (default: an even split); the pools of a disaggregated deployment may
    # split differently: each decode stage pulls its layers from the prefill stages that hold them.
    pp_layer_partition: list[int] | None = None
    # A MoE model's experts split over the pool's TP ranks (vLLM's enable_expert_parallel), and how
    # tokens reach them (engine/model/layers/moe.py)
    enable_expert_parallel: bool = False
    moe_dispatch: Literal["allreduce", "all2all"] = "allreduce"
    # Custom Ray resources per rank, to pin a pool to its nodes: a KubeRay worker group started with
    # `resources: {"pdserve_prefill": 1000}` takes the pool with `resources: {pdserve_prefill: 1}`.
    resources: dict[str, float] = Field(default_factory=dict)
    # Speculative decoding (LLM's speculative_config), for the pool that decodes: decode only.
    speculative_config: dict[str, Any] | None = None
    autoscaling: AutoscalingSpec | None = None      # None: a fixed size
    kv_offloading: KVOffloadingSpec | None = None   # None: the engine section's kv_offloading_*
    # Simulated replicas (engine.simulate) share host processes, this many to one (cluster/replica_host.py;
    # 1: a process each, as real replicas, e.g. to lose one at a time); real replicas ignore it.
    replicas_per_process: int = Field(8, ge=1)
    # The nice value of its engine processes (the replica actor and its rank workers; None: Ray's
    # worker niceness, 15 unless the cluster says otherwise, as Serve's proxy and the ingress have).
    # At 0 on a node the engine shares with the serving processes, their bursts wait for the step's
    # single-threaded gaps rather than stall a parallel region: decode-heavy traffic gains a little,
    # a new request's first token comes later (docs/perf/journal.md §72).
    niceness: int | None = Field(None, ge=0, le=19)

    def model_post_init(self, _: Any) -> None:
        a = self.autoscaling
        if a is None and self.replicas < 1:
            raise ValueError("replicas must be >= 1 (0 only with autoscaling's min_replicas 0: scale to zero)")
        if a is not None and not a.min_replicas <= self.replicas <= a.max_replicas:
            raise ValueError(f"replicas ({self.replicas}) must lie within autoscaling's min_replicas "
                             f"({a.min_replicas}) and max_replicas ({a.max_replicas})")

    def process_env(self) -> dict[str, str]:
        """The environment of the pool's engine processes (the replica actor's runtime_env, which
        the rank workers it starts inherit), and the spec's niceness where it sets one. OpenMP's idle
        threads asleep hands the kernels' parallel regions to their own threads
        (kernels/csrc/work_split.h): a region ends when its items are done, and a thread between
        regions leaves its core to the serving processes (served decode +8% on two cores, §72)."""
        env = {"OMP_WAIT_POLICY": "passive"}
        if self.niceness is not None:
            env["RAY_worker_niceness"] = str(self.niceness)
        return env

    def bounds(self) -> tuple[int, int]:
        """The replica counts this pool may have (`pdserve scale`, the planner; 0 only for a pool
        that scales to zero)."""
        a = self.autoscaling
        return (a.min_replicas, a.max_replicas) if a is not None else (1, MAX_REPLICAS)

    def identity(self) -> str:
        """What its replicas are made of: the spec less its size and autoscaling (a change of
        those resizes the pool; any other change replaces its replicas)."""
        return self.model_dump_json(exclude={"replicas", "autoscaling"})

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def scales_to_zero(self) -> bool:
        return self.autoscaling is not None and self.autoscaling.min_replicas == 0


class ModelDeployment(StrictSpec):
    """One model's deployment: what a `models:` entry and a one-model spec have in common."""
    model: str | None = None
    # LLM(...) keywords (records/engine_args.py: EngineArgs, where their defaults live), checked on load.
    engine: EngineArgs = Field(default_factory=EngineArgs)
    mode: Literal["colocated", "disaggregated"] = "colocated"
    # "encode" (a vision-language model's, either mode): replicas that encode a request's images
    # before it is prefilled (E/P/D: router/routing/encode.py)
    pools: dict[Literal["prefill", "decode", "encode"], PoolSpec] = Field(
        default_factory=lambda: {"decode": PoolSpec()})
    disaggregation: DisaggregationSpec = DisaggregationSpec()
    lora: LoRASpec | None = None                # None: no adapters

    def model_post_init(self, _: Any) -> None:
        if "decode" not in self.pools:
            raise ValueError("pools must include 'decode' (the pool that streams tokens)")
        if self.mode == "disaggregated" and "prefill" not in self.pools:
            raise ValueError("mode 'disaggregated' needs a 'prefill' pool beside 'decode'")
        if self.mode == "colocated" and "prefill" in self.pools:
            raise ValueError("pools has 'prefill' but mode is 'colocated'; set mode: disaggregated")
        to_zero = [name for name, pool in self.pools.items() if pool.bounds()[0] == 0]
        if to_zero and len(to_zero) != len(self.pools):
            others = sorted(set(self.pools) - set(to_zero))
            raise ValueError(f"pools {to_zero} have autoscaling min_replicas 0 but {others} not: a model "
                             f"scales to zero as a whole (set it on every pool)")
        for name, pool in self.pools.items():
            if pool.kv_offloading is not None and pool.kv_offloading.enabled:
                if pool.kv_offloading.size_gib is None and self.engine.kv_offloading_size is None:
                    raise ValueError(f"pools.{name}.kv_offloading: size_gib (or the engine section's "
                                     f"kv_offloading_size) is needed")
                EngineArgs(**{**vars(self.engine), **pool.kv_offloading.engine_args(self.engine)})
        for name in ("prefill", "encode"):
            if self.pools.get(name) is not None and self.pools[name].speculative_config is not None:
                raise ValueError(f"pools.{name}.speculative_config: only the decode pool decodes; set "
                                 f"pools.decode.speculative_config")

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_leaves_pools_their_fields(cls, engine: Any) -> Any:
        """The fields that other sections set, named with where they belong."""
        if not isinstance(engine, dict):
            return engine
        defaults = EngineArgs()     # a dumped spec (the JSON the actors get) holds every field
        engine_set = [k for k, v in engine.items() if not hasattr(defaults, k) or getattr(defaults, k) != v]
        parallel_keys = [k for k in engine_set if k in (
            "tensor_parallel_size", "pipeline_parallel_size", "pp_layer_partition", "worker_num_cpus",
            "worker_num_gpus", "worker_resources", "distributed_executor_backend", "enable_expert_parallel",
            "moe_dispatch")]
        if parallel_keys:
            raise ValueError(f"engine must not set {parallel_keys}: set them per pool (pools.<name>)")
        if "speculative_config" in engine_set:
            raise ValueError("engine must not set speculative_config: set it on the decode pool "
                             "(pools.decode.speculative_config); prefill replicas never decode")
        lora_keys = [k for k in engine_set if k in ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")]
        if lora_keys:
            raise ValueError(f"engine must not set {lora_keys}: the lora section configures adapters")
        kv_keys = [k for k in engine_set if k.startswith("kv_") and not k.startswith(("kv_cache_", "kv_offloading_"))]
        if kv_keys:
            raise ValueError(f"engine must not set {kv_keys}: the disaggregation section configures "
                             f"the KV connector")
        return engine


# The serving fields a models entry may set for itself (how its chat template and outputs are
# read differ by model family); the rest of `serving` is the models' shared one.
PER_MODEL_SERVING = ("chat_template", "tool_call_parser", "reasoning_parser", "structured_outputs_in_reasoning")


class ModelEntry(ModelDeployment):
    """One entry of `models:`: a model's deployment and the ids clients send for it."""
    name: str = Field(min_length=1)             # the id responses name
    aliases: list[str] = Field(default_factory=list)
    serving: dict[str, Any] = Field(default_factory=dict)    # its own PER_MODEL_SERVING values

    @field_validator("serving")
    @classmethod
    def _own_serving(cls, serving: dict[str, Any]) -> dict[str, Any]:
        shared = sorted(set(serving) - set(PER_MODEL_SERVING))
        if shared:
            raise ValueError(f"serving {shared}: a model may set only {list(PER_MODEL_SERVING)}; "
                             f"the rest of serving is shared at the top of the spec")
        ServingSpec.model_validate(serving)     # (each value checked as the shared section's is)
        return serving

    @model_validator(mode="before")
    @classmethod
    def _source_given(cls, data: Any) -> Any:
        if isinstance(data, dict) and "model" not in data:
            raise ValueError(f"models entry {data.get('name')!r} has no model: the source (an HF "
                             f"directory, a .gguf file, or null for the embedded model) must be given")
        return data

    @property
    def ids(self) -> list[str]:
        return [self.name, *self.aliases]


_MODEL_FIELDS = tuple(ModelDeployment.model_fields)


def model_namespace(app: str, model: str) -> str:
    """The namespace of the manager of the model `model` (its entry's name) of the spec `app`."""
    return f"{app}-{_slug(model)}"


def _slug(name: str) -> str:
    """A model id as a Ray namespace's suffix (ids hold slashes: "meta-llama/Llama-3.1-8B")."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "model"


class ClusterConfig(ModelDeployment):
    """The whole spec: one model's deployment (the fields above), or several under `models`, with
    the serving, routing and timing sections they share."""
    routing: RoutingSpec = RoutingSpec()
    serving: ServingSpec = ServingSpec()
    name: str = "pdserve"                       # namespace of the manager actor (of each model's: `deployments`)
    # How long to wait for the Ray cluster to have the resources the pools need (nodes joining,
    # an autoscaler adding them) before failing with a message naming what is missing. A local Ray
    # started by `pdserve serve` never grows, so there the check does not wait.
    placement_timeout_s: float = Field(60.0, ge=0)
    # How long a replica leaving its pool (scaled down by hand or by the planner, or replaced by a
    # spec update) may finish its streams; those still running then migrate to another replica.
    drain_timeout_s: float = Field(60.0, ge=0)
    # Several models behind one endpoint (None: this spec's own model is the one).
    models: list[ModelEntry] | None = None
    # Set by `deployments` on each model's own spec: the name of the spec (and Serve app) it is one
    # model of (None: a one-model spec, its own app).
    app: str | None = None

    @model_validator(mode="after")
    def _models_each_their_own(self) -> ClusterConfig:
        if self.models is None:
            return self
        if not self.models:
            raise ValueError("models must list at least one model (or be left out)")
        default = ModelDeployment()     # (a dumped spec holds every field: compare, not `model_fields_set`)
        set_here = [f for f in _MODEL_FIELDS if getattr(self, f) != getattr(default, f)]
        if set_here:
            raise ValueError(f"with models, {set_here} belong to each models entry, not the top of the spec")
        if self.serving.served_model_name is not None:
            raise ValueError("with models, each entry's name and aliases are the ids it is served under; "
                             "serving.served_model_name is not used")
        owners: dict[str, list[str]] = {}
        for entry in self.models:
            for served in entry.ids:
                owners.setdefault(served, []).append(f"{entry.name} (name/aliases)")
            for adapter in (entry.lora.modules if entry.lora is not None else {}):
                owners.setdefault(adapter, []).append(f"{entry.name} (lora.modules)")
        for tenant, spec in self.serving.tenants.items():
            unknown = [m for m in spec.models or [] if m not in owners or "(lora.modules)" in owners[m][0]]
            if unknown:
                raise ValueError(f"serving.tenants.{tenant}.models: {unknown} name no model of models "
                                 f"(their names and aliases: {[i for e in self.models for i in e.ids]})")
        taken = {served: where for served, where in owners.items() if len(where) > 1}
        if taken:
            raise ValueError("models: each id must name one model or adapter; "
                             + "; ".join(f"{served!r} is claimed by {', '.join(w)}" for served, w in taken.items()))
        slugs: dict[str, str] = {}
        for entry in self.models:
            other = slugs.setdefault(_slug(entry.name), entry.name)
            if other != entry.name:
                raise ValueError(f"models {other!r} and {entry.name!r} would share the manager namespace "
                                 f"{model_namespace(self.name, entry.name)}; rename one")
        return self

    def deployments(self) -> list[ClusterConfig]:
        """One one-model spec per model: the spec itself without `models`; else each entry with the
        shared sections, served under its name and aliases, its manager in its own namespace."""
        if self.models is None:
            return [self]
        shared = self.model_dump(exclude={"models", "name", *_MODEL_FIELDS})
        out = []
        for entry in self.models:
            own = entry.model_dump(include=set(_MODEL_FIELDS), exclude_unset=True)
            serving = {**shared["serving"], **entry.serving, "served_model_name": entry.ids}
            out.append(ClusterConfig.model_validate({**shared, **own, "serving": serving, "app": self.name,
                                                     "name": model_namespace(self.name, entry.name)}))
        return out

    @model_validator(mode="after")
    def _adapters_not_under_model_names(self) -> ClusterConfig:
        adapters = self.lora.modules if self.lora is not None else {}
        taken = [n for n in adapters if n in self.serving.served_model_names]
        if taken:
            raise ValueError(f"lora.modules {taken}: the base model is served under that name "
                             f"(serving.served_model_name: {self.serving.served_model_names})")
        return self

    def engine_args(self, pool: str = "decode") -> EngineArgs:
        """The engine arguments of one pool's replicas: the engine section, the pool's parallelism
        and speculative decoding, its offload tier, and in disaggregated mode (or with peer prefix
        pulls) the KV connector (every engine can play either role of a transfer)."""
        spec = self.pools[pool]
        # An encode replica runs no request: no KV moves, one sequence's KV pool (the least an engine has).
        connector = (self.mode == "disaggregated" or self.routing.peer_prefix_pulls) and pool != "encode"
        kv_args = self.disaggregation.engine_args() if connector else {}
        # With one rank the replica actor is the rank (it holds the pool's CPUs/GPUs and runs on CUDA
        # when it has a GPU); with more, the engine places worker actors with these per rank.
        parallel: dict[str, Any] = {"worker_num_cpus": spec.num_cpus, "worker_num_gpus": spec.num_gpus}
        if spec.world_size > 1:
            parallel.update(tensor_parallel_size=spec.tensor_parallel_size,
                            pipeline_parallel_size=spec.pipeline_parallel_size,
                            pp_layer_partition=spec.pp_layer_partition,
                            worker_resources=dict(spec.resources),
                            enable_expert_parallel=spec.enable_expert_parallel, moe_dispatch=spec.moe_dispatch)
        spec_args = {"speculative_config": spec.speculative_config} if spec.speculative_config else {}
        lora_args = self.lora.engine_args() if self.lora is not None else {}
        tier_args = spec.kv_offloading.engine_args(self.engine) if spec.kv_offloading is not None else {}
        endpoint = self.serving.otlp_traces_endpoint
        trace_args = {"otlp_traces_endpoint": endpoint} if endpoint else {}
        encode_args = {"max_num_seqs": 1, "enable_prefix_caching": False} if pool == "encode" else {}
        return replace(self.engine, **kv_args, **parallel, **spec_args, **lora_args, **tier_args, **trace_args,
                       **encode_args)

    def engine_config(self, pool: str = "decode") -> EngineConfig:
        """The engine config of one pool's replicas (`engine_args`), resolved against the model's
        own config and the spec's adapters (records/serving.py: `resolve_engine_config`)."""
        config = resolve_engine_config(self.model, self.engine_args(pool), self.lora)
        if pool == "encode" and not is_vision_language(config.model_config.hf_config):
            raise ValueError(f"pools.encode: model {self.model!r} takes no images (an encode pool serves a "
                             f"vision-language model's)")
        return config

    def ingress_spec(self) -> IngressSpec:
        """What the ingress reads of this spec (records/serving.py), handed to it by the launcher."""
        cold = [p.autoscaling.cold_start_timeout_s for p in self.pools.values() if p.scales_to_zero]
        return IngressSpec(name=self.name, model=self.model, engine=self.engine_args("decode"), mode=self.mode,
                           serving=self.serving, routing=self.routing,
                           disaggregation=self.disaggregation, lora=self.lora,
                           cold_start_timeout_s=max(cold) if cold else None, encode="encode" in self.pools)

    @classmethod
    def from_yaml(cls, path: str) -> ClusterConfig:
        with open(path) as f:
            return cls.model_validate(yaml.safe_load(f) or {})
