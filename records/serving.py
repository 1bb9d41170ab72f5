"""The serving spec: what the ingress and the routers read of the cluster spec (pydantic; the
`serving`, `routing`, `disaggregation` and `lora` sections of cluster/config.py's `ClusterConfig`),
and `IngressSpec`, the record the launcher hands the ingress. Torch-free, validated on construction:
a bad field fails before any actor starts, naming the field.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from records.config import EngineConfig
from records.config_resolution import engine_config_from_args
from records.engine_args import KV_CONNECTORS, KV_LOAD_FAILURE_POLICIES, EngineArgs, check_otlp_endpoint
from records.errors import StartupError
from records.lora import LoRAConfig, read_adapter

POLICIES = ("prefix_aware", "round_robin", "least_load")
# The variables Serve reads from Ray's processes for `proxy_channel` and `direct_ingress` (ray_env).
PROXY_GRPC_ENV, DIRECT_INGRESS_ENV = "RAY_SERVE_PROXY_USE_GRPC", "RAY_SERVE_ENABLE_DIRECT_INGRESS"
# How an ingress and its replicas exchange requests and step messages (router/routing/channel.py).
CHANNEL_TRANSPORTS = ("tcp", "ray")


@dataclass(frozen=True)
class PolicyConfig:
    """How router/routing/policy.py's RoutingPolicy weighs prefix overlap against load."""
    name: str = "prefix_aware"
    load_weight: float = 0.5
    imbalance_threshold: int = 8
    adapter_weight: float = 0.25
    seed: int | None = None
    tier_weight: float = 0.5        # a block in a replica's offload tier, against one in its pool

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}; got {self.name!r}")
        if self.load_weight < 0:
            raise ValueError(f"load_weight must be >= 0; got {self.load_weight}")
        if self.adapter_weight < 0:
            raise ValueError(f"adapter_weight must be >= 0; got {self.adapter_weight}")
        if not 0 <= self.tier_weight <= 1:
            raise ValueError(f"tier_weight must be in [0, 1]; got {self.tier_weight}")
        if self.imbalance_threshold < 1:
            raise ValueError(f"imbalance_threshold must be >= 1; got {self.imbalance_threshold}")


class StrictSpec(BaseModel):
    """A section of the spec: unknown fields refused, frozen once built."""
    model_config = ConfigDict(extra="forbid", frozen=True)


class RoutingSpec(StrictSpec):
    """The routing policy (router/routing/policy.py; PolicyConfig above holds the defaults and the
    checks)."""
    name: Literal[POLICIES] = PolicyConfig.name     # type: ignore[valid-type]
    load_weight: float = PolicyConfig.load_weight
    imbalance_threshold: int = PolicyConfig.imbalance_threshold
    adapter_weight: float = PolicyConfig.adapter_weight     # a LoRA request's pull to replicas that ran its adapter
    tier_weight: float = PolicyConfig.tier_weight     # a block in the offload tier, against one in the pool
    stats_interval_s: float = Field(0.5, gt=0)  # replica stats (KV usage) refresh period
    # How many times one stream may move to another replica of its pool when its own is lost (node
    # loss, actor or engine death): the new replica resumes after the tokens already streamed. 0
    # ends such a stream with an error at once (as Dynamo's migration_limit 0).
    max_migrations: int = Field(3, ge=0)
    # Peer prefix pulls: a replica sent a prompt whose prefix another replica of the (decode or
    # colocated) pool holds cached pulls those blocks over the KV connector instead of computing
    # them, when the peer holds at least min_peer_pull_tokens more of it (the replicas then get the
    # disaggregation section's connector in colocated mode too).
    peer_prefix_pulls: bool = False
    min_peer_pull_tokens: int = Field(128, ge=1)
    # How the ingress and its replicas exchange requests and step messages (router/routing/channel.py):
    # "tcp", a connection per (ingress, replica) pair; "ray", an actor call per request and a Ray
    # streaming generator per pair.
    channel: Literal[CHANNEL_TRANSPORTS] = "tcp"     # type: ignore[valid-type]

    def model_post_init(self, _: Any) -> None:
        self.policy()

    def policy(self) -> PolicyConfig:
        return PolicyConfig(self.name, self.load_weight, self.imbalance_threshold, self.adapter_weight,
                            tier_weight=self.tier_weight)


class DisaggregationSpec(StrictSpec):
    """The KV connector of both pools (records/engine_args.py: EngineArgs' kv_* fields hold the defaults
    and the checks)."""
    connector: Literal[KV_CONNECTORS] = "nixl"      # type: ignore[valid-type]
    # Prompts with fewer uncached tokens (on the chosen decode replica) are prefilled there.
    min_remote_prefill_tokens: int = Field(256, ge=1)
    # Load-aware: a longer prompt is prefilled on the decode replica too when the prefill replica's
    # backlog of prompt tokens exceeds this factor times the decode replica's own (null: never).
    prefill_backlog_factor: float | None = Field(1.0, ge=0)
    lease_s: float = EngineArgs.kv_lease_s          # how long a prefill keeps its blocks for the decode side
    load_timeout_s: float = EngineArgs.kv_load_timeout_s
    load_failure_policy: Literal[KV_LOAD_FAILURE_POLICIES] = EngineArgs.kv_load_failure_policy  # type: ignore[valid-type]

    def model_post_init(self, _: Any) -> None:
        EngineArgs(**self.engine_args())

    def engine_args(self) -> dict[str, Any]:
        return {"kv_connector": self.connector, "kv_lease_s": self.lease_s,
                "kv_load_timeout_s": self.load_timeout_s, "kv_load_failure_policy": self.load_failure_policy}


# Priority bands a tenant may be given (0 is served first); the Batch API runs below them all.
TENANT_BANDS = 10
BATCH_BAND = TENANT_BANDS


class TenantSpec(StrictSpec):
    """One tenant of a shared server (router/ingress/tenants.py): the keys that name it and its
    limits, each None for none. A request over a limit is answered 429 with `Retry-After`."""
    api_keys: list[str] = Field(default_factory=list)
    api_key_env: str | None = None              # or a key read from this environment variable at startup
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)   # prompt tokens at admission, generated ones as they stream
    max_concurrent: int | None = Field(None, ge=1)      # its requests admitted at once (queued or running)
    # Its band: every queued request of band 0 is dispatched before any of band 1, and so on.
    priority: int = Field(0, ge=0, lt=TENANT_BANDS)
    # Within a band, tenants with queued requests are served in proportion to their weights.
    weight: float = Field(1.0, gt=0)
    # The models it may use (their names or aliases; each one's adapters with it), None: every one.
    models: list[str] | None = None

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        if any(not k or k != k.strip() for k in keys):
            raise ValueError("api_keys must be non-empty strings without surrounding spaces")
        return keys


def _as_names(value: str | list[str] | None) -> list[str]:
    """A `served_model_name` (one name, several, or none) as a list."""
    return [value] if isinstance(value, str) else list(value or [])


class ServingSpec(StrictSpec):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    # The model's name in the API, or several (vLLM's --served-model-name a b): requests may name
    # any, responses name the first. Default: the model's directory or file name.
    served_model_name: str | list[str] | None = None
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
    max_in_flight: int = Field(256, ge=1)       # requests admitted (queued or running); beyond, 429
    # How many admitted requests each replica of the decode (or colocated) pool is given at once;
    # the rest wait at the ingress in its fair queue (bands, then tenants by weight, then each
    # request's `priority`). None: the engine's max_num_seqs, so that few wait in an engine's own
    # first-come queue, where no tenant's share is kept.
    dispatch_per_replica: int | None = Field(None, ge=1)
    # With several tenants, the share of those dispatch slots that no one tenant may hold, kept for
    # the others: a tenant that arrives while another floods starts at once (dispatch never
    # preempts, so without it the newcomer waits for one of the flood's requests to end).
    tenant_reserve: float = Field(0.25, ge=0, lt=1)
    # The OpenAI Files and Batch APIs (router/ingress/files.py, batches.py): uploaded files, batches'
    # state and their output files live under this directory (None: ~/.cache/pdserve/files/<app
    # name>, or $PDSERVE_FILES_DIR/<app name>); several ingress replicas must share it. A batch's
    # requests run in the lowest band of the fair queue, on at most `batch_share` of the dispatch
    # slots (those no one else wants: dispatch never preempts, so this bounds what interactive
    # traffic can find taken).
    files_dir: str | None = None
    max_file_bytes: int = Field(100 << 20, ge=1024)
    batch_share: float = Field(0.5, gt=0, le=1)
    # Tenants, by name (router/ingress/tenants.py). With tenants every request needs one of their
    # keys; `api_key` / `api_key_env`, when set too, is the tenant "default" without limits.
    tenants: dict[str, TenantSpec] = Field(default_factory=dict)
    # Or a JSON file of the same mapping, read by each ingress replica when it starts (a mounted
    # Secret: the keys never enter the spec).
    tenants_file: str | None = None
    max_body_bytes: int = Field(4 << 20, ge=1024)
    # Browsers on other origins (a web chat page calling the API itself): the CORS answers, with
    # vLLM's names and defaults (--allowed-origins ["*"], --allow-credentials false, --allowed-methods
    # and --allowed-headers ["*"]). The preflight (OPTIONS) is answered before the API key is asked
    # for, since browsers send it without one; [] origins answers no origin (no CORS headers).
    allowed_origins: list[str] = Field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    allowed_methods: list[str] = Field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = Field(default_factory=lambda: ["*"])
    ingress_replicas: int = Field(1, ge=1)
    ingress_num_cpus: float = Field(0.1, gt=0)
    # How long an ingress replica Serve stops (an update of the spec rolls them, a scale-down) may
    # finish the streams passing through it (Serve's graceful_shutdown_timeout_s; it ends sooner
    # once they are done).
    ingress_drain_timeout_s: float = Field(60.0, ge=0)
    # Custom resources an ingress replica needs (Ray's `resources`): what pins it to some nodes. A
    # stream passes through its ingress replica, and one whose node is lost ends there (the engine
    # side migrates, the client's connection cannot): keep ingresses off the nodes you expect to lose.
    ingress_resources: dict[str, float] = Field(default_factory=dict)
    # The gRPC Generation service (pdserve_proto/pdserve.proto) through Serve's gRPC proxy on this
    # port, on `host` (Ray's proxy would take every interface: cluster/launch.py grpc_start_options
    # narrows it); None serves HTTP only.
    grpc_port: int | None = Field(None, ge=1, le=65535)
    # The ingress replica serves HTTP on `port` itself (Ray Serve's direct ingress) instead of behind
    # Serve's HTTP proxy: one process fewer on every streamed token's path (docs/perf/journal.md §7).
    # Ray reads it from the environment of the cluster's processes: `pdserve serve` sets that for
    # the Ray it starts; a cluster you start yourself needs `ray_env()` in its environment.
    # Serve's proxy still starts, on a free loopback port that nothing needs.
    direct_ingress: bool = False
    # How Serve's proxies (HTTP and gRPC) reach the ingress replicas: "grpc", Serve's gRPC channel
    # to each replica's inter-deployment server (one stream per request, its messages unpickled
    # once), or "ray", Serve's default, a Ray actor call and streaming generator per request (every
    # chunk an object the proxy resolves). gRPC took ~20% more tok/s through the proxy where the
    # engine shares the node's cores (docs/perf/journal.md §33). Ray reads it from its processes'
    # environment, as `direct_ingress`: see `ray_env()`.
    proxy_channel: Literal["grpc", "ray"] = "grpc"
    # How the model writes tool calls (engine/text/tool_parser.py FORMATS); None: read from its chat
    # template (Hermes/Qwen `<tool_call>` blocks unless the template is Llama 3's or Mistral's).
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = None
    # vLLM's --reasoning-parser: a thinking model's `<think>...</think>` returned apart from the
    # content, as the chat message's `reasoning` (engine/text/reasoning.py)
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None
    # Under a reasoning parser, a request's structured-output constraint (response_format, tool_choice
    # "required" or named, ...) starts after the thinking (`</think>`), as vLLM's does; true
    # constrains the thinking too (vLLM's structured_outputs_config.enable_in_reasoning).
    structured_outputs_in_reasoning: bool = False
    # The prefix of /metrics' names: "vllm" exports them as vLLM names them (vllm:num_requests_waiting,
    # vllm:kv_cache_usage_perc, ...), for dashboards, autoscalers and gateways built for vLLM.
    metrics_prefix: Literal["pdserve", "vllm"] = "pdserve"
    # vLLM's --otlp-traces-endpoint: every process (ingress and engine replicas) exports a span per
    # hop of each request over OTLP to this collector (engine/tracing.py; the protocol and the rest
    # from the standard OTEL_EXPORTER_OTLP_* variables); None traces nothing.
    otlp_traces_endpoint: str | None = None
    # One structured log line (JSON, logger `pdserve.requests`) per request as it ends: id, model and
    # adapter, tokens, cached tokens, TTFT, end-to-end time, replicas, P/D or colocated, finish
    # reason. Never the prompt's text, unless `log_request_prompts`.
    log_requests: bool = False
    log_request_prompts: bool = False
    # A trainer's endpoints (RL: /pause, /resume, /update_weights_*, ...; docs/rl.md): they change what
    # every client is served, so they answer 404 unless turned on (vLLM keeps its own behind a dev mode).
    enable_weight_updates: bool = False
    # vLLM's --chat-template: a Jinja chat template, or the path of a file holding one, used in place
    # of the tokenizer's (a base model has none). A path is read when the spec is built, so the
    # ingress replicas get the text wherever they run.
    chat_template: str | None = None

    @field_validator("served_model_name")
    @classmethod
    def _served_names(cls, value: str | list[str] | None) -> str | list[str] | None:
        names = _as_names(value)
        if isinstance(value, list) and not value:
            raise ValueError("served_model_name must name at least one model (or be left out)")
        if any(not n or n != n.strip() for n in names):
            raise ValueError(f"served_model_name must be non-empty names without surrounding spaces; got {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"served_model_name names a model twice: {names}")
        return value

    @property
    def served_model_names(self) -> list[str]:
        """`served_model_name` as a list (empty: the default name)."""
        return _as_names(self.served_model_name)

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _otlp_endpoint(cls, value: str | None) -> str | None:
        return value if value is None else check_otlp_endpoint(value)

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

    @field_validator("tenants")
    @classmethod
    def _tenants(cls, tenants: dict[str, TenantSpec]) -> dict[str, TenantSpec]:
        check_tenants(tenants)
        return tenants

    def model_post_init(self, _: Any) -> None:
        if "default" in self.tenants and (self.api_key is not None or self.api_key_env is not None):
            raise ValueError("serving.tenants.default: api_key names the tenant 'default' already")
        if self.direct_ingress and (self.ingress_replicas != 1 or self.grpc_port is not None):
            raise ValueError("serving.direct_ingress needs ingress_replicas = 1 and no grpc_port (the "
                             "ingress replica takes `port` itself; gRPC goes through Serve's proxy)")

    def ray_env(self) -> dict[str, str]:
        """The environment Ray's processes read this serving spec's `direct_ingress` and
        `proxy_channel` from (Serve reads them in its proxies and replicas, not from the app)."""
        env = {PROXY_GRPC_ENV: "1" if self.proxy_channel == "grpc" else "0"}
        if self.direct_ingress:
            env |= {DIRECT_INGRESS_ENV: "1",
                    "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(self.port),
                    "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(self.port + 1)}
        return env

    def check_ray_env(self, environ: Mapping[str, str]) -> str | None:
        """Check a Ray cluster's environment (a job's driver inherits it) against `ray_env()`:
        StartupError where `direct_ingress` cannot work; a warning to print where Serve's proxies
        will use the other `proxy_channel` (it serves, with more CPU a token); None where all agree."""
        if self.direct_ingress and environ.get(DIRECT_INGRESS_ENV) != "1":
            raise StartupError(f"serving.direct_ingress: this Ray cluster was not started with "
                               f"{self.ray_env()} in its environment (set them for `ray start`, or use "
                               "`pdserve serve` without --address, which sets them for the Ray it starts)")
        have = "grpc" if environ.get(PROXY_GRPC_ENV) == "1" else "ray"
        if have == self.proxy_channel:
            return None
        want = self.ray_env()[PROXY_GRPC_ENV]
        return (f"serving.proxy_channel is {self.proxy_channel!r}, but this Ray cluster's processes were "
                f"started without {PROXY_GRPC_ENV}={want}: Serve's proxies will use {have!r} (set "
                "it for `ray start`, or use `pdserve serve` without --address, which sets it)")


def check_tenants(tenants: dict[str, TenantSpec]) -> None:
    """ValueError naming the tenant that has no key, or a key two tenants share (its names only)."""
    owner: dict[str, str] = {}
    for name, tenant in tenants.items():
        if not name or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ValueError(f"serving.tenants: a tenant's name is letters, digits, '-', '_' and '.'; got {name!r}")
        if not tenant.api_keys and tenant.api_key_env is None:
            raise ValueError(f"serving.tenants.{name}: give it api_keys or api_key_env")
        for key in tenant.api_keys:
            if key in owner:
                raise ValueError(f"serving.tenants: {owner[key]} and {name} share an API key")
            owner[key] = name


class LoRASpec(StrictSpec):
    """LoRA adapters (records/lora.py): `modules` are served from the start under their names (the
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


class IngressSpec(StrictSpec):
    """What an ingress replica needs of the cluster spec, handed to it by the launcher
    (cluster/config.py: `ClusterConfig.ingress_spec`): the model and the decode pool's engine
    arguments (each ingress resolves them where it runs: the tokenizer, limits and defaults), the
    mode, and the serving, routing and LoRA sections."""
    name: str
    model: str | None
    engine: EngineArgs
    mode: Literal["colocated", "disaggregated"]
    serving: ServingSpec
    routing: RoutingSpec
    disaggregation: DisaggregationSpec
    lora: LoRASpec | None
    # How long a request waits for the model to come back from zero (None: it never goes to zero).
    cold_start_timeout_s: float | None = None
    encode: bool = False            # an encode pool encodes requests' images first (router/routing/encode.py)

    def engine_config(self) -> EngineConfig:
        """The decode pool's engine config, resolved here (see `resolve_engine_config`), its model
        config frozen (an ingress reads its values only)."""
        return resolve_engine_config(self.model, self.engine, self.lora)


def resolve_engine_config(model: str | None, args: EngineArgs, lora: LoRASpec | None) -> EngineConfig:
    """The engine config of `args`, resolved against the model's own config (ValueError naming the
    field when the model does not allow a setting), with the spec's adapters checked against it:
    ValueError naming `lora.modules.<name>` when one does not fit the model or the rank limit (read
    from its config and safetensors header). The model's config comes frozen, from the cache of
    resolved configs where it can (records/frozen_config.py: `resolve_frozen`): a deployment's
    configs go to its replicas and ingress, which read it as that view anyway."""
    config = engine_config_from_args(model, args, frozen=True)
    for name, path in (lora.modules if lora is not None else {}).items():
        try:
            read_adapter(path, config.model_config.hf_config, lora.max_lora_rank)
        except ValueError as e:
            raise ValueError(f"lora.modules.{name}: {e}") from None
    return config
