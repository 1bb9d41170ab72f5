"""The models one ingress serves: each model's frontend and APIs (`ModelServer`), and the lookup
that sends a request to the model its `model` names (`ServedModels`).

A spec with several models (cluster/config.py, `models:`) gives the ingress one `IngressSpec` per
model. Each gets a `Frontend` of its own (its tokenizer, routers, admission and metrics over its own
pools, attached through its own manager); what the ingress shares among them is the API keys and
tenants (one `serving` section), the Files and Batch APIs' store, and the endpoints. A request goes
to the model whose name, alias or LoRA adapter its `model` is; an unknown one is a 404 naming every
id served, and a request without `model` is refused when there is more than one to choose from.
"""
from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from records.errors import InvalidRequestError, NotFoundError
from records.serving import IngressSpec
from router.ingress.frontend import Frontend
from router.ingress.grpc_api import GenerationService
from router.ingress.openai_api import OpenAIAPI
from router.ingress.replies import error_body
from router.ingress.responses_api import ResponsesAPI


@dataclass
class ModelServer:
    """One served model as the ingress holds it: its frontend and the APIs over it."""
    frontend: Frontend
    api: OpenAIAPI
    responses: ResponsesAPI
    grpc: GenerationService

    @classmethod
    def of(cls, spec: IngressSpec) -> ModelServer:
        frontend = Frontend(spec)
        return cls(frontend, OpenAIAPI(frontend), ResponsesAPI(frontend), GenerationService(frontend))

    @property
    def name(self) -> str:
        return self.frontend.preparer.model_name

    def serves(self, model: str) -> bool:
        preparer = self.frontend.preparer
        return model in preparer.model_names or model in preparer.adapters

    @property
    def state(self) -> str:
        """ready, sleeping, scaled_to_zero, starting or failed (what /v1/models says of it)."""
        frontend = self.frontend
        if frontend.not_ready is not None:
            return frontend.not_ready.partition(":")[0]
        if frontend.cold.scales_to_zero and not frontend.router.replicas:
            return "scaled_to_zero"
        return "sleeping" if frontend.cold.asleep else "ready"


class ServedModels:
    """Every model of the ingress, in the spec's order; `pick` finds the one a request names."""

    def __init__(self, specs: list[IngressSpec]) -> None:
        if not specs:
            raise ValueError("an ingress serves at least one model")
        self.servers = [ModelServer.of(spec) for spec in specs]
        self.first = self.servers[0]

    @property
    def several(self) -> bool:
        return len(self.servers) > 1

    def ids(self) -> list[str]:
        """Every id a request may send: each model's names and aliases, then its adapters."""
        return [i for s in self.servers for i in (*s.frontend.preparer.model_names, *s.frontend.preparer.adapters)]

    def pick(self, model: Any) -> ModelServer:
        """The model a request's `model` names (absent: the only one); NotFoundError naming every id
        served when none is, InvalidRequestError when it is absent and several are served."""
        if model is None:
            if self.several:
                raise InvalidRequestError(f"model is required: this server serves {self.ids()}", param="model")
            return self.first
        if isinstance(model, str):
            for server in self.servers:
                if server.serves(model):
                    return server
        raise NotFoundError(f"model {model!r} does not exist; this server serves {self.ids()}", "model")

    # --- what spans every model --------------------------------------------------------------------
    def models(self, versions: dict[str, str | None] | None = None) -> dict[str, Any]:
        """GET /v1/models: every model's cards (a card per name and alias, one per adapter), each
        with its model's state and weight version (`versions`: weight_versions')."""
        versions = versions or {}
        return {"object": "list", "data": [{**card, "state": s.state, "weight_version": versions.get(s.name)}
                                           for s in self.servers for card in s.frontend.preparer.models()["data"]]}

    async def weight_versions(self) -> dict[str, str | None]:
        """Each model's weight version, from its manager (None where it cannot say now)."""
        async def one(server: ModelServer) -> str | None:
            try:
                return (await server.frontend.cold.manager().weights.remote("state"))["weight_version"]
            except Exception:  # noqa: BLE001 - a manager not attached or gone: the listing goes on
                return None
        return dict(zip([s.name for s in self.servers], await asyncio.gather(*[one(s) for s in self.servers]),
                        strict=True))

    def model(self, name: str) -> dict[str, Any]:
        """GET /v1/models/{model}: its card; NotFoundError naming every id served otherwise."""
        server = self.pick(name)
        return {**server.frontend.preparer.model(name), "state": server.state}

    def load_adapter(self, body: dict[str, Any]) -> str:
        """vLLM's /v1/load_lora_adapter, onto the model `body["model"]` names (absent: the only one);
        the adapter's name may not be an id another model serves."""
        body = dict(body)
        server = self.pick(body.pop("model", None))
        name = body.get("lora_name")
        other = next((s for s in self.servers if s is not server and isinstance(name, str) and s.serves(name)), None)
        if other is not None:
            raise InvalidRequestError(f"lora_name {name!r} is already served by the model {other.name!r}",
                                      param="lora_name")
        return server.frontend.preparer.load_adapter(body)

    def unload_adapter(self, body: dict[str, Any]) -> str:
        """vLLM's /v1/unload_lora_adapter: from the model that serves it."""
        name = body.get("lora_name")
        owner = next((s for s in self.servers if isinstance(name, str) and name in s.frontend.preparer.adapters),
                     self.first)
        return owner.frontend.preparer.unload_adapter(body)

    def not_ready(self) -> str | None:
        """Why not every model serves yet (None once all do, or all but those waiting for room
        while others serve), naming the models when several."""
        waiting = [(s.name, s.frontend.not_ready) for s in self.servers if s.frontend.not_ready is not None]
        if len(waiting) < len(self.servers):
            waiting = [(name, why) for name, why in waiting if not why.startswith("waiting")]
        if not waiting:
            return None
        if not self.several:
            return waiting[0][1]
        failed = [w for w in waiting if w[1].startswith("failed")]
        status = "failed" if failed else "starting"
        return f"{status}: " + "; ".join(f"model {name}: {why}" for name, why in (failed or waiting))

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """Ready when every model's pools are (Frontend.health); with one model its pools, with
        several each model's {"healthy", "pools"}."""
        results = await asyncio.gather(*(s.frontend.health() for s in self.servers))
        if not self.several:
            return results[0]
        detail = {s.name: {"healthy": ok, "pools": pools} for s, (ok, pools) in zip(self.servers, results)}
        for s in self.servers:              # a model waiting for room: said, not held against the rest
            if s.frontend.not_ready is not None:
                detail[s.name].update(healthy=False, reason=s.frontend.not_ready)
        counted = [ok for s, (ok, _) in zip(self.servers, results) if s.frontend.not_ready is None]
        return bool(counted) and all(counted), {"models": detail}

    async def render_metrics(self) -> str:
        """Every model's series in one Prometheus exposition, each family's HELP and TYPE once; with
        several models each sample is labelled with its model's `model_name` (as vLLM's are; one
        model's series keep the labels they always had)."""
        texts = await asyncio.gather(*(s.frontend.render_metrics() for s in self.servers))
        if not self.several:
            return texts[0]
        return merge_expositions([label_samples(text, {"model_name": s.name}) for s, text in zip(self.servers, texts)])

    async def execute(self, url: str, body: dict[str, Any], owner: str) -> tuple[int, dict[str, Any]]:
        """One request of a batch (router/ingress/batches.py), run by the model its line names: a
        batch may mix models. (HTTP status, response or error body)."""
        try:
            server = self.pick(body.get("model"))
        except (InvalidRequestError, NotFoundError) as e:
            return e.status, error_body(e.message, e.err_type, e.status, e.param)
        return await server.api.execute(url, body, owner)

    def dispatch_limit(self) -> int:
        """Requests every model's decode pool is given at once (the Batch API's concurrency)."""
        return sum(s.frontend.admission.dispatch_limit() for s in self.servers)

    async def admin_status(self) -> dict[str, Any]:
        """`pdserve status --json`: the model's (with several, each model's under `models`)."""
        if not self.several:
            return await self.first.frontend.admin_status()
        statuses = await asyncio.gather(*(s.frontend.admin_status() for s in self.servers))
        return {"models": {s.name: status for s, status in zip(self.servers, statuses)}}

    async def admin_scale(self, body: dict[str, Any]) -> dict[str, Any]:
        """`pdserve scale`: the pool of the model `body["model"]` names (absent: the only one)."""
        body = dict(body)
        return await self.pick(body.pop("model", None)).frontend.admin_scale(body)

    def observability(self) -> dict[str, Any]:
        if not self.several:
            return self.first.frontend.observability()
        return {"models": {s.name: s.frontend.observability() for s in self.servers}}

    # --- gRPC's answers that span every model -----------------------------------------------------
    def grpc_models(self, metadata: Any) -> Any:
        """The Models RPC: every model's cards."""
        answers = [s.grpc.models(metadata) for s in self.servers]
        for other in answers[1:]:
            answers[0].models.extend(other.models)
        return answers[0]

    async def grpc_health(self) -> Any:
        """The Health RPC: healthy when every model is; with several, pools named `<model>/<pool>`."""
        answers = await asyncio.gather(*(s.grpc.health() for s in self.servers))
        if not self.several:
            return answers[0]
        merged = type(answers[0])(healthy=all(a.healthy for a in answers))
        for server, answer in zip(self.servers, answers):
            for pool, replicas in answer.pools.items():
                merged.pools[f"{server.name}/{pool}"].CopyFrom(replicas)
        return merged


# A sample line: its metric name, then its labels if any, then the rest.
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?( .*)$")


def label_samples(text: str, labels: Mapping[str, str]) -> str:
    """A Prometheus exposition with `labels` added first to every sample's labels."""
    extra = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line) if line and not line.startswith("#") else None
        if m is None:
            out.append(line)
            continue
        name, own, rest = m.groups()
        out.append(f"{name}{{{extra}{',' + own[1:-1] if own and own != '{}' else ''}}}{rest}")
    return "\n".join(out) + "\n"


def merge_expositions(texts: list[str]) -> str:
    """Several expositions as one: each family's HELP and TYPE once, its samples from every text
    together, families in the order first seen."""
    if len(texts) == 1:
        return texts[0]
    families: dict[str, tuple[list[str], list[str]]] = {}
    current = ""
    for text in texts:
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split(" ", 3)[2]
                header, _ = families.setdefault(current, ([], []))
                if line not in header:
                    header.append(line)
                continue
            families.setdefault(current, ([], []))[1].append(line)
    return "\n".join(line for header, samples in families.values() for line in (*header, *samples)) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
