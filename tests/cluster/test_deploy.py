"""deploy/ checked offline (no Kubernetes, no Ray cluster): the Helm chart rendered and linted by
Helm's own Go engine (helm-python-sdk), core Kubernetes objects and every Ray pod template validated
against Kubernetes' schemas (kubernetes-validate, strict), the KubeRay objects against the KubeRay
CRDs' OpenAPI schemas plus a check that rejects fields the schema does not declare (the API server
would prune them silently), the Serve config built the way Serve builds it (the args validated
into ClusterConfig by `cluster.app:build_app`'s annotation), and the pinning of each pool to its
worker group (custom Ray resources, GPUs, CPUs), the API key wiring, the model volume.

The KubeRay CRDs are data outside the repository: `../shared/kuberay-crds/` next to it, or the
folder named by PDSERVE_KUBERAY_CRDS; the CRD tests skip when neither exists.
"""
from __future__ import annotations

import argparse
import base64
import copy
import json
import math
import os
import re
import shlex
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from helpers import REPO

from cluster.config import ClusterConfig, PoolSpec, ServingSpec

ROOT = Path(REPO)
CHART = ROOT / "deploy" / "helm" / "pdserve"
KUBERAY = ROOT / "deploy" / "kuberay"
VALUES_FILES = ["values.yaml"] + sorted(p.name for p in CHART.glob("values-*.yaml"))
PLAIN_MANIFESTS = ["rayservice.yaml", "raycluster.yaml", "rayjob.yaml", "rayservice-two-models.yaml"]
K8S_VERSION = "1.33.0"          # a version kubernetes-validate ships schemas for (and a supported one)
RAY_KINDS = {"RayService": "rayservices", "RayCluster": "rayclusters", "RayJob": "rayjobs"}
CORE_KINDS = {"Service", "Secret", "ConfigMap"}
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# --- rendering -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


def _values(name: str) -> dict | None:
    """The values of `helm install -f <name>` (values.yaml alone: none; Helm merges the defaults)."""
    return None if name == "values.yaml" else yaml.safe_load((CHART / name).read_text())


def render(chart, values: dict | None = None, name: str = "pdserve") -> list[dict]:
    out = chart.render(values, name=name, namespace="serving", is_install=True)
    assert any(k.endswith("NOTES.txt") for k in out)
    return [doc for path, text in sorted(out.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(scope="module", params=VALUES_FILES)
def rendered(request, chart) -> tuple[str, list[dict]]:
    return request.param, render(chart, _values(request.param))


def load_manifest(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((KUBERAY / name).read_text()) if d]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[d['kind'] for d in docs]}"
    return found[0]


def test_chart_renders_every_values_file_and_lints_clean():
    assert {"values-small.yaml", "values-single-node.yaml", "values-multi-node.yaml"} <= set(VALUES_FILES)
    with helm.Chart.load(CHART) as c:
        assert c.metadata["apiVersion"] == "v2"
        for name in VALUES_FILES:
            kinds = sorted(d["kind"] for d in render(c, _values(name)))
            assert kinds.count("RayService") == 1 and "Service" in kinds and "ConfigMap" in kinds, (name, kinds)
            c.validate_schema(_values(name))
            report = helm.lint(CHART, _values(name), strict=True, kube_version=f"v{K8S_VERSION}")
            problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
            assert not problems, (name, problems)


@pytest.mark.parametrize("values, message", [
    ({"pools": {"decode": {"num_gpus": 1, "replicas": 3, "worker": {"gpus": 2, "pods": 1}}}},
     "needs 3 GPUs"),
    ({"mode": "colocated", "pools": {"decode": {"num_gpus": 1, "tensor_parallel_size": 4,
                                                "worker": {"gpus": 2}}}}, "must share a pod"),
    ({"apiKey": {"enabled": True, "create": False, "existingSecret": ""}}, "apiKey.existingSecret"),
    ({"serving": {"api_key": "sk-plain"}}, "clear text"),
    ({"serving": {"tenants": {"team-a": {"api_keys": ["sk-plain"]}}}}, "serving.tenants.team-a.api_keys"),
    ({"model": {"source": "pvc"}}, "model.pvc.claimName"),
    ({"pools": {"prefill": {"worker": {"rayStartParams": {"resources": "x"}}}}}, "set by the chart"),
    ({"pools": {"decode": {"replica": 2}}}, "replica"),                   # values.schema.json
    ({"modle": {"source": "embedded"}}, "modle"),
    ({"disaggregation": {"connector": "rdma"}}, "connector"),
    ({"pools": {"decode": {"worker": {"maxPods": 3}}}}, "minPods/maxPods need autoscaler.enabled"),
    ({"autoscaler": {"enabled": True}, "pools": {"decode": {"worker": {"pods": 4, "maxPods": 3}}}},
     "pods (4) must lie within minPods (4) and maxPods (3)"),
    ({"autoscaler": {"enabled": True}, "pools": {"decode": {
        "num_gpus": 1, "autoscaling": {"max_replicas": 4, "itl_slo_ms": 50},
        "worker": {"gpus": 1, "pods": 1, "maxPods": 3}}}}, "needs 4 GPUs"),
    ({"autoscaler": {"upscalingMode": "Fast"}}, "upscalingMode"),
    ({"models": [{"name": "qwen", "path": "Qwen2.5-0.5B"}]}, "models[qwen].path is read from the model volume"),
    ({"models": [{"name": "a", "pools": {"decode": {"worker": {"pods": 1}}}}]},
     "models[a].pools.decode.worker: worker groups are shared"),
    ({"models": [{"name": "a", "pools": {"encode": {}}}]}, "encode"),             # values.schema.json
    ({"models": [{"path": None}]}, "name"),
])
def test_chart_refuses_bad_values(chart, values, message):
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        chart.render(values, name="pdserve")


def test_values_schema_pools_mirror_poolspec(chart):
    """values.schema.json closes pools.<name> (typos fail at install): its fields must follow
    PoolSpec's, and the chart must not shadow a ServingSpec field it sets itself."""
    pool = chart.schema["definitions"]["pool"]["properties"]
    assert set(pool) - {"worker"} == set(PoolSpec.model_fields)
    assert {"host", "port", "api_key_env"} <= set(ServingSpec.model_fields)


# --- core Kubernetes objects and pod templates (kubernetes-validate, strict) ---------------------
def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(group name, pod template) of a RayService / RayCluster / RayJob."""
    spec = doc["spec"]
    cluster = {"RayService": lambda: spec["rayClusterConfig"], "RayCluster": lambda: spec,
               "RayJob": lambda: spec["rayClusterSpec"]}[doc["kind"]]()
    return [("head", cluster["headGroupSpec"]["template"])] + [
        (g["groupName"], g["template"]) for g in cluster.get("workerGroupSpecs", [])]


def k8s_validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def check_core_objects(docs: list[dict]) -> None:
    for doc in docs:
        if doc["kind"] in CORE_KINDS:
            k8s_validate(doc)
        elif doc["kind"] in RAY_KINDS:
            # the custom resource's metadata (the CRD schema leaves it to the API server) ...
            k8s_validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]})
            # ... and each group's pod template as the Pod KubeRay makes of it
            for _, template in pod_templates(doc):
                k8s_validate({"apiVersion": "v1", "kind": "Pod", "metadata": template.get("metadata", {}),
                              "spec": template["spec"]})
        else:
            raise AssertionError(f"unexpected kind {doc['kind']}")


def test_chart_core_objects_are_valid_kubernetes(rendered):
    check_core_objects(rendered[1])


@pytest.mark.parametrize("name", PLAIN_MANIFESTS)
def test_plain_manifests_core_objects_are_valid_kubernetes(name):
    check_core_objects(load_manifest(name))


def test_kubernetes_validate_rejects_a_misspelled_field(chart):
    service = copy.deepcopy(one(render(chart), "Service"))
    service["spec"]["selecter"] = service["spec"].pop("selector")
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(service)


# --- KubeRay objects against the CRDs ------------------------------------------------------------
def crd_dir() -> Path:
    return Path(os.environ.get("PDSERVE_KUBERAY_CRDS") or ROOT.parent / "shared" / "kuberay-crds")


def openapi_to_jsonschema(schema: Any) -> Any:
    """An OpenAPI v3 (Kubernetes structural) schema as JSON Schema: `nullable` becomes a null
    alternative, int-or-string an anyOf; the x-kubernetes-* annotations are left for the checks
    below (jsonschema ignores unknown keywords)."""
    if isinstance(schema, list):
        return [openapi_to_jsonschema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "default", "required", "x-kubernetes-list-map-keys")
               else {p: openapi_to_jsonschema(s) for p, s in v.items()} if k == "properties"
               else openapi_to_jsonschema(v)) for k, v in schema.items()}
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


@pytest.fixture(scope="session")
def crd_schemas() -> dict[str, dict]:
    folder = crd_dir()
    if not folder.is_dir():
        pytest.skip(f"KubeRay CRDs not found at {folder}: set PDSERVE_KUBERAY_CRDS")
    schemas = {}
    for kind, plural in RAY_KINDS.items():
        crd = yaml.load((folder / f"ray.io_{plural}.yaml").read_text(), Loader=Loader)
        assert crd["spec"]["names"]["kind"] == kind
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        schemas[kind] = version["schema"]["openAPIV3Schema"]
    return schemas


def undeclared_fields(instance: Any, schema: dict, path: str = "") -> list[str]:
    """Fields the structural schema does not declare (the API server would drop them without a
    word: a misspelled field is then silently ignored), and duplicate keys in list-type=map lists
    (the API server rejects those)."""
    problems: list[str] = []
    if isinstance(instance, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in instance.items():
            where = f"{path}.{key}"
            if props is not None and key in props:
                problems += undeclared_fields(value, props[key], where)
            elif isinstance(extra, dict):
                problems += undeclared_fields(value, extra, where)
            elif props is not None and not extra and not schema.get("x-kubernetes-preserve-unknown-fields"):
                problems.append(f"{where}: not in the schema")
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        if schema.get("x-kubernetes-list-type") == "map":
            keys = schema.get("x-kubernetes-list-map-keys", [])
            seen = [tuple(item.get(k) for k in keys) for item in instance if isinstance(item, dict)]
            problems += [f"{path}: duplicate {dict(zip(keys, k))}" for k in {k for k in seen if seen.count(k) > 1}]
        for i, item in enumerate(instance):
            problems += undeclared_fields(item, schema["items"], f"{path}[{i}]")
    return problems


def crd_validate(doc: dict, schemas: dict[str, dict]) -> None:
    schema = schemas[doc["kind"]]
    assert doc["apiVersion"] == "ray.io/v1"
    jsonschema.Draft7Validator(openapi_to_jsonschema(schema)).validate(doc)
    problems = undeclared_fields(doc, schema)
    if problems:
        raise jsonschema.ValidationError("; ".join(problems))


def test_chart_ray_objects_match_the_crds(rendered, crd_schemas):
    for doc in rendered[1]:
        if doc["kind"] in RAY_KINDS:
            crd_validate(doc, crd_schemas)


@pytest.mark.parametrize("name", PLAIN_MANIFESTS)
def test_plain_manifests_match_the_crds(name, crd_schemas):
    docs = load_manifest(name)
    kinds = [d["kind"] for d in docs if d["kind"] in RAY_KINDS]
    assert kinds == [{"rayservice.yaml": "RayService", "raycluster.yaml": "RayCluster",
                      "rayjob.yaml": "RayJob", "rayservice-two-models.yaml": "RayService"}[name]]
    for doc in docs:
        if doc["kind"] in RAY_KINDS:
            crd_validate(doc, crd_schemas)


@pytest.mark.parametrize("mutate, message", [
    # misspelled fields at several depths: the CRD schema alone (structural, pruning) accepts them
    (lambda s: s["spec"]["rayClusterConfig"].__setitem__(
        "workerGroupSpec", s["spec"]["rayClusterConfig"].pop("workerGroupSpecs")), "workerGroupSpec"),
    (lambda s: s["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].__setitem__(
        "rayStartParam", s["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].pop("rayStartParams")),
     "rayStartParam"),
    (lambda s: s["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
     .__setitem__("resource", {}), "resource"),
    (lambda s: s["spec"].__setitem__("serveConfig", "x"), "serveConfig"),
    # wrong types and values the schema itself rejects
    (lambda s: s["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"].__setitem__("num-cpus", 4),
     "is not of type 'string'"),
    (lambda s: s["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].__setitem__("replicas", "one"),
     "is not of type 'integer'"),
    (lambda s: s["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
     ["resources"]["limits"].__setitem__("memory", "6 GB"), "does not match"),
    (lambda s: s["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
     ["env"].append({"name": "RAY_USAGE_STATS_ENABLED", "value": "1"}), "duplicate"),
])
def test_crd_validation_catches_mistakes(chart, crd_schemas, mutate, message):
    service = copy.deepcopy(one(render(chart, _values("values-small.yaml")), "RayService"))
    crd_validate(service, crd_schemas)             # valid as rendered
    mutate(service)
    with pytest.raises(jsonschema.ValidationError, match=re.escape(message)):
        crd_validate(service, crd_schemas)


def test_openapi_nullable_and_int_or_string():
    schema = openapi_to_jsonschema({"type": "object", "properties": {
        "a": {"type": "string", "nullable": True}, "b": {"x-kubernetes-int-or-string": True}}})
    jsonschema.Draft7Validator(schema).validate({"a": None, "b": "50%"})
    jsonschema.Draft7Validator(schema).validate({"a": "x", "b": 3})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate({"b": 1.5})


# --- the Serve config and the cluster spec ---------------------------------------------------------
def serve_config(doc: dict) -> dict:
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    assert set(config) <= set(ServeDeploySchema.model_fields), set(config) - set(ServeDeploySchema.model_fields)
    for app in config["applications"]:
        assert set(app) <= set(ServeApplicationSchema.model_fields), app.keys()
    return config


def build_serve_app(import_path: str, args: dict) -> Any:
    """What Serve does with an application of serveConfigV2 (ray.serve._private.api)."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.deployment import Application

    app = call_user_app_builder_with_args_if_necessary(import_attr(import_path), args)
    assert isinstance(app, Application)
    return app


def check_serve_config(doc: dict) -> list[ClusterConfig]:
    config = serve_config(doc)
    assert config["http_options"]["host"] == "0.0.0.0" and config["http_options"]["port"] == 8000
    specs = []
    for app in config["applications"]:
        assert app["import_path"] == "cluster.app:build_app"
        build_serve_app(app["import_path"], app["args"])
        spec = ClusterConfig.model_validate(app["args"])
        assert spec.serving.host == "0.0.0.0" and spec.serving.port == 8000
        assert spec.serving.api_key is None                 # never a key in clear text
        assert spec.placement_timeout_s >= 300              # pods join after the head
        specs.append(spec)
    assert len(specs) == 1
    return specs


def test_chart_serve_config_builds_the_app(rendered):
    name, docs = rendered
    (spec,) = check_serve_config(one(docs, "RayService"))
    # the ConfigMap carries the same spec
    assert ClusterConfig.model_validate(yaml.safe_load(one(docs, "ConfigMap")["data"]["spec.yaml"])) == spec
    values = _values(name) or {}
    if name != "values-two-models.yaml":
        assert spec.mode == values.get("mode", "disaggregated")
        assert set(spec.pools) == ({"prefill", "decode"} if spec.mode == "disaggregated" else {"decode"})
    else:                                        # each model its own pools, pinned to the shared groups
        smol, qwen = spec.deployments()
        assert (smol.serving.served_model_names, smol.model, smol.mode) == (["smol", "chat"], None, "disaggregated")
        assert (qwen.serving.served_model_names, qwen.model) == (["qwen"], "/models/Qwen2.5-0.5B-Instruct")
        assert qwen.pools["decode"].scales_to_zero and set(qwen.pools) == {"decode"}
        assert {p: s.resources for p, s in smol.pools.items()} == {"prefill": {"pdserve_prefill": 1},
                                                                    "decode": {"pdserve_decode": 1}}
    if name == "values-pipelined.yaml":          # the card's shape: both pools TP inside, PP across nodes
        assert spec.mode == "disaggregated"
        assert all((p.tensor_parallel_size, p.pipeline_parallel_size) == (8, 2) for p in spec.pools.values())


def test_plain_rayservice_serve_config_builds_the_app():
    check_serve_config(one(load_manifest("rayservice.yaml"), "RayService"))
    (two,) = check_serve_config(one(load_manifest("rayservice-two-models.yaml"), "RayService"))
    smol, qwen = two.deployments()
    assert (smol.serving.served_model_names, smol.mode, qwen.serving.served_model_names, qwen.mode) == (
        ["smol", "chat"], "disaggregated", ["qwen"], "colocated")


def launcher_spec(docs: list[dict], entrypoint: str, head_template: dict) -> ClusterConfig:
    """The spec a `python -m cluster.launch --config FILE` entrypoint reads: FILE must be on a
    ConfigMap volume of the head (where a Ray job's driver runs) whose ConfigMap is in `docs`."""
    from cluster.serve_args import add_serve_args

    argv = shlex.split(entrypoint)
    assert argv[:3] == ["python", "-m", "cluster.launch"], argv
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(argv[3:])
    assert args.config, "the entrypoint names no --config"
    container = head_template["spec"]["containers"][0]
    (mount,) = [m for m in container.get("volumeMounts", [])
                if args.config.startswith(m["mountPath"].rstrip("/") + "/")]
    (volume,) = [v for v in head_template["spec"]["volumes"] if v["name"] == mount["name"]]
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"
                     and d["metadata"]["name"] == volume["configMap"]["name"]]
    key = os.path.relpath(args.config, mount["mountPath"])
    spec = ClusterConfig.model_validate(yaml.safe_load(config_map["data"][key]))
    assert (args.host or spec.serving.host) == "0.0.0.0"
    assert spec.placement_timeout_s >= 300
    return spec


def test_rayjob_entrypoint_reads_a_valid_spec_from_its_configmap():
    docs = load_manifest("rayjob.yaml")
    job = one(docs, "RayJob")
    head = dict(pod_templates(job))["head"]
    spec = launcher_spec(docs, job["spec"]["entrypoint"], head)
    assert spec.mode == "disaggregated" and spec.pools["prefill"].resources == {"pdserve_prefill": 1}
    # the job's Service reaches the head pod, where the launcher's Serve proxy listens
    service = one(docs, "Service")
    labels = head["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items() if not k.startswith("ray.io/"))
    assert service["spec"]["selector"].get("ray.io/node-type") == "head"


def test_raycluster_spec_for_ray_job_submit_is_valid():
    docs = load_manifest("raycluster.yaml")
    cluster = one(docs, "RayCluster")
    launcher_spec(docs, "python -m cluster.launch --config /etc/pdserve/spec.yaml",
                  dict(pod_templates(cluster))["head"])


def test_serve_builder_rejects_bad_args():
    build_serve_app("cluster.app:build_app", {"mode": "colocated"})
    with pytest.raises(ValueError, match="replicaz"):           # pydantic's ValidationError
        build_serve_app("cluster.app:build_app", {"pools": {"decode": {"replicaz": 2}}})
    with pytest.raises(ValueError, match="pp_layer_partition"):
        build_serve_app("cluster.app:build_app", {"mode": "disaggregated", "pools": {
            "prefill": {}, "decode": {"pipeline_parallel_size": 2, "pp_layer_partition": "1,1"}}})
    build_serve_app("cluster.app:build_app", {"mode": "disaggregated", "pools": {
        "prefill": {}, "decode": {"pipeline_parallel_size": 2}}})


# --- pools pinned to worker groups, GPUs, CPUs, API key, model, shm --------------------------------
def ray_resources(params: dict[str, str]) -> dict[str, float]:
    """rayStartParams.resources in KubeRay's form: a JSON object inside a quoted string,
    '"{\\"pdserve_prefill\\": 1000}"'."""
    raw = params.get("resources")
    if raw is None:
        return {}
    assert raw.startswith('"') and raw.endswith('"'), f"resources must be a quoted JSON string: {raw!r}"
    return json.loads(json.loads(raw))


def cpu_quantity(value: Any) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def cluster_of(doc: dict) -> dict:
    spec = doc["spec"]
    return spec.get("rayClusterConfig") or spec.get("rayClusterSpec") or spec


def check_shared_pinning(spec: ClusterConfig, cluster: dict) -> None:
    """Several models on shared engine groups: every pool of every model asks for a custom resource
    that only worker groups (never the head) advertise, a stage fits one pod, and the groups that
    advertise it have the CPUs for every rank asking for it."""
    groups = {g["groupName"]: g for g in cluster.get("workerGroupSpecs", [])}
    provided = {name: ray_resources(g["rayStartParams"]) for name, g in groups.items()}
    head = ray_resources(cluster["headGroupSpec"].get("rayStartParams", {}))
    wanted: dict[str, float] = {}
    for d in spec.deployments():
        for pool_name, pool in d.pools.items():
            where = f"{d.serving.served_model_names[0]}/{pool_name}"
            assert pool.resources, f"{where} asks for no custom resource: nothing pins it"
            for key, per_rank in pool.resources.items():
                assert head.get(key, 0) == 0, f"{key} ({where}) is advertised by the head"
                assert any(res.get(key, 0) >= per_rank * pool.tensor_parallel_size for res in provided.values()), (
                    f"{where}: no pod holds a stage's {key}")
                wanted[key] = wanted.get(key, 0.0) + pool.replicas * pool.world_size * pool.num_cpus
    for key, cpus in wanted.items():
        have = sum(g["replicas"] * cpu_quantity(g["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
                   for name, g in groups.items() if provided[name].get(key, 0) > 0)
        assert cpus <= have, f"the ranks asking for {key} need {cpus:g} CPUs; its pods have {have:g}"


def check_pinning(spec: ClusterConfig, cluster: dict) -> None:
    if spec.models is not None:
        check_shared_pinning(spec, cluster)
        return
    head = cluster["headGroupSpec"]
    groups = {g["groupName"]: g for g in cluster.get("workerGroupSpecs", [])}
    provided = {name: ray_resources(g["rayStartParams"]) for name, g in groups.items()}
    provided["head"] = ray_resources(head.get("rayStartParams", {}))
    # a worker group per pool, named after it, and none for a pool that does not exist
    assert set(groups) == set(spec.pools), (set(groups), set(spec.pools))
    for pool_name, pool in spec.pools.items():
        assert pool.resources, f"pool {pool_name} asks for no custom resource: nothing pins it"
        for key, per_rank in pool.resources.items():
            holders = [g for g, res in provided.items() if res.get(key, 0) > 0]
            assert holders == [pool_name], f"{key} (pool {pool_name}) is advertised by {holders}"
            # one pipeline stage (TP ranks) must fit one pod
            assert provided[pool_name][key] >= per_rank * pool.tensor_parallel_size
        group = groups[pool_name]
        pods = group["replicas"]
        assert group.get("minReplicas", pods) <= pods <= group.get("maxReplicas", pods)
        container = group["template"]["spec"]["containers"][0]
        limits = container["resources"]["limits"]
        requests = container["resources"].get("requests", {})
        gpus = int(limits.get("nvidia.com/gpu", 0))
        assert int(requests.get("nvidia.com/gpu", gpus)) == gpus
        ranks = pool.replicas * pool.world_size
        if pool.num_gpus > 0:
            stage = pool.tensor_parallel_size * pool.num_gpus
            assert gpus >= stage, f"{pool_name}: a stage takes {stage} GPUs, a pod has {gpus}"
            needed, have = ranks * pool.num_gpus, pods * gpus
            assert needed <= have, f"{pool_name}: needs {needed} GPUs, the group has {have}"
            assert have - needed < gpus, f"{pool_name}: a whole pod's GPUs idle ({have} for {needed})"
            ranks_per_pod = math.floor(gpus / pool.num_gpus)
        else:
            assert gpus == 0, f"{pool_name}: a CPU pool's pods request {gpus} GPUs"
            ranks_per_pod = math.ceil(ranks / pods)
        cpus = cpu_quantity(limits["cpu"])
        assert cpus >= ranks_per_pod * pool.num_cpus, (
            f"{pool_name}: {ranks_per_pod} ranks x {pool.num_cpus} CPUs on a {cpus}-CPU pod")
    assert not any(k.startswith("pdserve_") for k in provided["head"]), "the head would take engine ranks"


def containers(doc: dict) -> list[tuple[str, dict, dict]]:
    return [(group, template["spec"], c) for group, template in pod_templates(doc)
            for c in template["spec"]["containers"]]


def check_pods(doc: dict, spec: ClusterConfig, docs: list[dict], values: dict | None = None) -> None:
    for group, pod, container in containers(doc):
        env = {e["name"]: e for e in container.get("env", [])}
        assert env["RAY_USAGE_STATS_ENABLED"]["value"] == "0"
        # what Serve reads from Ray's processes (the proxies' channel), as the spec asks
        assert {k: env[k]["value"] for k in spec.serving.ray_env()} == spec.serving.ray_env(), group
        mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        shm = volumes[mounts["/dev/shm"]["name"]]
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"].get("sizeLimit"), group
        # the API key: from a Secret when the spec names the variable, absent otherwise
        key_env = spec.serving.api_key_env
        if key_env is None:
            assert "PDSERVE_API_KEY" not in env, group
        else:
            ref = env[key_env]["valueFrom"]["secretKeyRef"]
            secrets = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == ref["name"]]
            if secrets:
                assert base64.b64decode(secrets[0]["data"][ref["key"]]), "empty API key"
            else:                      # a Secret the user manages
                assert values is not None and ref["name"] == values["apiKey"]["existingSecret"]
                assert ref["key"] == values["apiKey"]["secretKey"]
        # each model: a read-only volume under which the spec's path lies
        for model in [d.model for d in spec.deployments() if d.model is not None]:
            (mount,) = [m for p, m in mounts.items() if model.startswith(p.rstrip("/") + "/")
                        or model == p]
            assert mount.get("readOnly") is True
            volume = volumes[mount["name"]]
            assert "persistentVolumeClaim" in volume or "hostPath" in volume
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"].get("readOnly") is True
        # the transport's settings: UCX for NIXL, NCCL for torch_dist, each only with its connector
        if values is not None:
            connector = (values.get("disaggregation") or {}).get("connector", "nixl")
            nixl = spec.mode == "disaggregated" and spec.disaggregation.connector == "nixl" or (
                spec.mode == "colocated" and connector == "nixl")
            for var, section, key in (("UCX_TLS", "ucx", "tls"), ("UCX_NET_DEVICES", "ucx", "netDevices"),
                                      ("NCCL_SOCKET_IFNAME", "nccl", "socketIfname")):
                want = (values.get(section) or {}).get(key) if nixl == (section == "ucx") else None
                if want:
                    assert env[var]["value"] == want, (group, var)
                else:
                    assert var not in env, (group, var)


def test_chart_pins_pools_gpus_cpus_and_wires_the_key(rendered):
    name, docs = rendered
    service = one(docs, "RayService")
    spec = ClusterConfig.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"])
    check_pinning(spec, cluster_of(service))
    values = _values(name) or yaml.safe_load((CHART / "values.yaml").read_text())
    check_pods(service, spec, docs, values)
    if name == "values-small.yaml":
        assert spec.serving.api_key_env is None and not [d for d in docs if d["kind"] == "Secret"]
    else:
        assert spec.serving.api_key_env == "PDSERVE_API_KEY"
    # the chart's Service reaches the release's Ray pods with a healthy Serve proxy
    selector = one(docs, "Service")["spec"]["selector"]
    assert selector.pop("ray.io/serve") == "true"
    for _, template in pod_templates(service):
        assert selector.items() <= template["metadata"]["labels"].items()


@pytest.mark.parametrize("name", PLAIN_MANIFESTS)
def test_plain_manifests_pin_pools(name):
    docs = load_manifest(name)
    (doc,) = [d for d in docs if d["kind"] in RAY_KINDS]
    if doc["kind"] == "RayService":
        spec = ClusterConfig.model_validate(yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]["args"])
    else:
        entrypoint = doc["spec"].get("entrypoint", "python -m cluster.launch --config /etc/pdserve/spec.yaml")
        spec = launcher_spec(docs, entrypoint, dict(pod_templates(doc))["head"])
    check_pinning(spec, cluster_of(doc))
    check_pods(doc, spec, docs)


def test_pinning_check_catches_a_crossed_group(chart):
    """The checks above can fail: decode's resource advertised by the prefill group."""
    service = one(render(chart, _values("values-small.yaml")), "RayService")
    spec = ClusterConfig.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"])
    cluster = copy.deepcopy(cluster_of(service))
    check_pinning(spec, cluster)
    cluster["workerGroupSpecs"][0]["rayStartParams"]["resources"] = '"{\\"pdserve_decode\\": 1000}"'
    with pytest.raises(AssertionError, match="pdserve_decode"):
        check_pinning(spec, cluster)
    cluster = copy.deepcopy(cluster_of(service))
    cluster["workerGroupSpecs"][1]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "500m"
    with pytest.raises(AssertionError, match="CPUs on a 0.5-CPU pod"):
        check_pinning(spec, cluster)
    # Two models on a shared group: one more qwen replica than the engine pods have CPUs for.
    service = one(load_manifest("rayservice-two-models.yaml"), "RayService")
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    check_pinning(ClusterConfig.model_validate(args), cluster_of(service))
    args["models"][1]["pools"]["decode"]["replicas"] = 3
    with pytest.raises(AssertionError, match="need 5 CPUs; its pods have 4"):
        check_pinning(ClusterConfig.model_validate(args), cluster_of(service))


def test_chart_colocated_tp_renders_only_the_decode_group(chart, crd_schemas):
    values = {"mode": "colocated", "pools": {"decode": {
        "replicas": 2, "num_gpus": 1, "tensor_parallel_size": 4,
        "worker": {"pods": 1, "gpus": 8, "cpu": "40", "memory": "200Gi"}}},
        "model": {"source": "pvc", "path": "llama-70b", "pvc": {"claimName": "models"}}}
    docs = render(chart, values)
    service = one(docs, "RayService")
    crd_validate(service, crd_schemas)
    (spec,) = check_serve_config(service)
    assert spec.mode == "colocated" and set(spec.pools) == {"decode"} and spec.model == "/models/llama-70b"
    assert [g["groupName"] for g in cluster_of(service)["workerGroupSpecs"]] == ["decode"]
    check_pinning(spec, cluster_of(service))
    check_pods(service, spec, docs, values={**yaml.safe_load((CHART / "values.yaml").read_text()), **values})


def test_chart_turns_on_gcs_fault_tolerance_with_an_external_redis(chart, crd_schemas):
    values = {"gcsFaultTolerance": {"redisAddress": "redis.default.svc:6379", "redisPasswordSecret": "redis-auth"}}
    service = one(render(chart, values), "RayService")
    crd_validate(service, crd_schemas)
    assert cluster_of(service)["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis.default.svc:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis-auth", "key": "password"}}}}
    assert "gcsFaultToleranceOptions" not in cluster_of(one(render(chart, {}), "RayService"))


def test_chart_enables_kuberays_autoscaler_with_pods_per_pool(chart, crd_schemas):
    """values-autoscaling.yaml: the in-tree autoscaler on, each worker group between its minPods and
    maxPods, the pools' planners (autoscaling) and the drain timeout in the spec; valid against
    the CRD. By default the autoscaler is off and every group is fixed at `pods`."""
    service = one(render(chart, _values("values-autoscaling.yaml")), "RayService")
    crd_validate(service, crd_schemas)
    cluster = cluster_of(service)
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["upscalingMode"] == "Default"
    assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] == 300
    groups = {g["groupName"]: (g["replicas"], g["minReplicas"], g["maxReplicas"]) for g in cluster["workerGroupSpecs"]}
    assert groups == {"prefill": (1, 1, 4), "decode": (2, 2, 8)}
    (spec,) = check_serve_config(service)
    assert spec.pools["decode"].autoscaling.itl_slo_ms == 40 and spec.pools["decode"].bounds() == (2, 8)
    assert spec.pools["prefill"].autoscaling.ttft_slo_ms == 500 and spec.drain_timeout_s == 120
    fixed = cluster_of(one(render(chart, {}), "RayService"))
    assert fixed["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in fixed
    assert all(g["minReplicas"] == g["maxReplicas"] == g["replicas"] for g in fixed["workerGroupSpecs"])


def test_chart_passes_speculative_config_to_the_decode_pool(chart):
    docs = render(chart, {"pools": {"decode": {"speculative_config": {
        "method": "ngram", "num_speculative_tokens": 3}}}})
    (spec,) = check_serve_config(one(docs, "RayService"))
    assert spec.pools["decode"].speculative_config == {"method": "ngram", "num_speculative_tokens": 3}


def test_chart_torch_dist_gets_nccl_settings_not_ucx(chart):
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    values = {"disaggregation": {"connector": "torch_dist"}, "ucx": {"tls": "tcp"},
              "nccl": {"socketIfname": "eth0"}}
    docs = render(chart, values)
    service = one(docs, "RayService")
    (spec,) = check_serve_config(service)
    assert spec.disaggregation.connector == "torch_dist"
    check_pods(service, spec, docs, values={**defaults, **values})
    env = {e["name"]: e.get("value") for e in containers(service)[0][2]["env"]}
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and "UCX_TLS" not in env


def test_chart_generated_key_and_existing_secret(chart):
    docs = render(chart, {"apiKey": {"enabled": True, "create": True, "value": "sk-test"}})
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    assert base64.b64decode(secret["data"]["api-key"]) == b"sk-test"
    docs = render(chart, {"apiKey": {"enabled": True, "existingSecret": "mine", "secretKey": "token"}})
    assert not [d for d in docs if d["kind"] == "Secret"]
    for _, _, container in containers(one(docs, "RayService")):
        (ref,) = [e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == "PDSERVE_API_KEY"]
        assert ref == {"name": "mine", "key": "token"}


def test_chart_mounts_the_tenants_file_from_a_secret(chart, crd_schemas):
    """`tenants.existingSecret`: every Ray pod mounts its file read-only, and the spec reads it as
    serving.tenants_file (with two ingress replicas, their limits hold over both); without it,
    nothing is mounted."""
    values = {"tenants": {"existingSecret": "team-keys", "secretKey": "t.json"}, "serving": {"ingress_replicas": 2}}
    service = one(render(chart, values), "RayService")
    crd_validate(service, crd_schemas)
    (spec,) = check_serve_config(service)
    assert (spec.serving.tenants_file, spec.serving.ingress_replicas) == ("/etc/pdserve/tenants/t.json", 2)
    for _, pod, container in containers(service):
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tenants"]
        assert mount == {"name": "tenants", "mountPath": "/etc/pdserve/tenants", "readOnly": True}
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tenants"]
        assert volume["secret"] == {"secretName": "team-keys", "items": [{"key": "t.json", "path": "t.json"}]}
    plain = one(render(chart, {}), "RayService")
    assert check_serve_config(plain)[0].serving.tenants_file is None
    assert all("tenants" not in {v["name"] for v in pod["volumes"]} for _, pod, _ in containers(plain))


def test_chart_serves_grpc_beside_http_when_asked(chart, crd_schemas):
    """`grpc.enabled`: Serve's gRPC proxies serve pdserve's Generation service on `grpc.port` of
    every Ray pod (a container port named grpc; the servicer function imports), listening as the
    HTTP proxies do; off by default; a port the pods already use is refused."""
    import importlib

    service = one(render(chart, {"grpc": {"enabled": True, "port": 9100}}), "RayService")
    crd_validate(service, crd_schemas)
    check_serve_config(service)
    options = serve_config(service)["grpc_options"]
    assert options["port"] == 9100
    (function,) = options["grpc_servicer_functions"]
    module, name = function.rsplit(".", 1)
    assert callable(getattr(importlib.import_module(module), name))
    for _, _, container in containers(service):
        assert {"name": "grpc", "containerPort": 9100} in container["ports"]
    plain = one(render(chart, {}), "RayService")
    assert "grpc_options" not in serve_config(plain)
    assert all(p["name"] != "grpc" for _, _, c in containers(plain) for p in c["ports"])
    with pytest.raises(Exception, match="grpc"):
        render(chart, {"grpc": {"enabled": True, "port": 8265}})


# --- one image, one Ray version ----------------------------------------------------------------------
def test_image_and_ray_version_agree_across_deploy():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    (base,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", dockerfile, re.M)
    assert base.split(":")[1].startswith(values["rayVersion"] + "-")
    default_image = f"{values['image']['repository']}:{values['image']['tag']}"
    assert f"-t {default_image} " in dockerfile
    for name in PLAIN_MANIFESTS:
        (doc,) = [d for d in load_manifest(name) if d["kind"] in RAY_KINDS]
        assert cluster_of(doc)["rayVersion"] == values["rayVersion"]
        assert {c["image"] for _, _, c in containers(doc)} == {default_image}


def test_dockerfile_copies_every_package_the_project_installs():
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY \S+ (\w+) \./\1$", (ROOT / "deploy" / "Dockerfile").read_text(), re.M))
    assert packages <= copied, f"deploy/Dockerfile does not COPY {sorted(packages - copied)}"


# --- monitoring: ServiceMonitor, PodMonitor, the Grafana dashboard --------------------------------
DASHBOARD = CHART / "dashboards" / "pdserve.json"


def test_chart_monitoring_objects_select_what_serves_metrics_with_the_key(chart):
    on = {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                      "podMonitor": {"enabled": True}, "dashboard": {"enabled": True}}}
    docs = render(chart, on)
    assert not [d for d in render(chart) if d["kind"] in ("ServiceMonitor", "PodMonitor")]      # off by default
    service, rayservice = one(docs, "Service"), one(docs, "RayService")
    secret = one(docs, "Secret")["metadata"]["name"]
    sm, pm = one(docs, "ServiceMonitor"), one(docs, "PodMonitor")
    assert sm["apiVersion"] == pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kps"
    # The ServiceMonitor selects the chart's Service and scrapes its named port.
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]} and endpoint["path"] == "/metrics"
    # The PodMonitor selects Ray pods of this release that serve (the head's template carries the
    # release's labels; KubeRay adds ray.io/serve=true to those whose proxy is healthy).
    selector = pm["spec"]["podMetricsEndpoints"][0], pm["spec"]["selector"]["matchLabels"]
    head_labels = dict(pod_templates(rayservice)[0][1]["metadata"]["labels"])
    assert {k: v for k, v in selector[1].items() if k != "ray.io/serve"}.items() <= head_labels.items()
    assert selector[1]["ray.io/serve"] == "true" and selector[0]["portNumber"] == 8000
    # With the API key on, both send it (the Secret the ingress reads); serving.public_metrics drops it.
    for ep in (endpoint, selector[0]):
        assert ep["authorization"]["credentials"] == {"name": secret, "key": "api-key"}
    open_docs = render(chart, {**on, "serving": {"public_metrics": True}})
    assert "authorization" not in one(open_docs, "ServiceMonitor")["spec"]["endpoints"][0]
    # The dashboard's ConfigMap holds the shipped JSON, for Grafana's sidecar.
    (board,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]
    k8s_validate(board)
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(board["data"]["pdserve.json"]) == json.loads(DASHBOARD.read_text())
    with pytest.raises(Exception, match="metrics.serviceMonitor needs service.enabled"):
        render(chart, {**on, "service": {"enabled": False}})
    with pytest.raises(Exception, match="serviceMonitr"):
        chart.validate_schema({"metrics": {"serviceMonitr": {"enabled": True}}})


def test_dashboard_reads_only_series_the_server_exports():
    """Every metric name in the dashboard's expressions is one ServingMetrics exports (the real
    Prometheus check of tests/serving/test_observability.py runs them against a live server)."""
    from router.routing.metrics import ServingMetrics

    exported = set()
    for metric in ServingMetrics().registry.metrics.values():
        base = metric.name.removeprefix("pdserve:")
        exported.add(base)
        if metric.kind == "histogram":
            exported.update({f"{base}_bucket", f"{base}_sum", f"{base}_count"})
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\$\{prefix\}:(\w+)", e)}
    assert len(used) >= 25 and used <= exported, sorted(used - exported)
    # The JSON is what deploy/dashboard.py writes (edited there, not by hand).
    import importlib.util

    spec = importlib.util.spec_from_file_location("dashboard", ROOT / "deploy" / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.build() == board, "run `python deploy/dashboard.py` after editing it"
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "prefix", "pool"} <= variables
    assert all(set(re.findall(r"\$\{?(\w+)", e)) <= variables | {"__rate_interval"} for e in exprs)
