"""The layer contract (docs/architecture.md, "Layers"): every import, at module level or inside a
function, points down the stack or within its layer, and no import cycle exists between modules.

Read from the sources with `ast`, so nothing is imported here. A new module must be given a layer
below (the test names it otherwise). Function-level imports count like any other: a lazy import
may keep an optional or heavy dependency off a path (Ray, NIXL, Triton), never hide a cycle.
"""
from __future__ import annotations

import ast
import fnmatch
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("records", "engine", "kernels", "kv_transfer", "router", "cluster", "pdserve_proto")

# Bottom to top. A module may import modules of its own layer or of layers below. Exact names are
# matched before wildcards.
LAYERS: list[tuple[str, list[str]]] = [
    # plain records and checks, no torch: configs, requests, params, outputs, hashing, errors, the
    # model source, the serving spec, the wire schema; and every package's __init__ (a docstring)
    ("records", ["records", "records.*", "records.transfer", "records.kv_layout", "pdserve_proto",
                 "pdserve_proto.kv_events",
                 "kernels", "kv_transfer", "router", "router.ingress", "router.routing", "cluster",
                 "engine.text", "engine.core", "engine.executor", "engine.worker", "engine.model",
                 "engine.model.layers", "engine.model.models", "engine.sample", "engine.loading"]),
    # the wire schema: protobuf stubs and the control-plane messages' codecs (KV events, transfers)
    ("wire", ["pdserve_proto", "pdserve_proto.kv_events", "pdserve_proto.transfer"]),
    # text the ingress and LLM.chat share, no torch: tokenizer, chat template, tool calls, reasoning
    ("text", ["engine.text.*"]),
    # pure functions over tensors; this process's rank and collectives; weights; grammar masks
    ("kernels", ["kernels.*", "engine.model.parallel_state", "engine.loading.*", "engine.sample.structured_output"]),
    ("kv_transfer", ["kv_transfer.*"]),
    # one rank: the model, sampling, the runner, the worker and its per-step transport
    ("model", ["engine.model.*", "engine.sample.*", "engine.worker.*"]),
    ("distributed", ["engine.executor.*"]),
    # one replica: blocks, scheduling, speculative decoding, outputs, the step loop and its fronts,
    # beam search over it (torch-free: the ingress runs it over the router too)
    ("engine", ["engine.core.*", "engine.spec_decode", "engine.spec_decode.*", "engine.output_processor",
                "engine.tracing", "engine.telemetry", "engine.llm_engine", "engine.kv_transfers",
                "engine.async_engine", "engine.llm", "engine.beam_search", "engine.weight_updates",
                "engine"]),
    # routing: prefix index, policy, P/D orchestration, output channels, metrics
    ("routing", ["router.routing.*"]),
    # the ingress: HTTP, gRPC, OpenAI protocol, request preparation, admission, the Serve app
    ("ingress", ["router.ingress.*", "pdserve_proto.serve_proxy"]),
    # the composition root: replicas, pools, manager, placement, the cluster spec, launch, CLI
    ("cluster", ["cluster.*"]),
]
# The `engine` package's public names load on first use (engine/__init__.py, PEP 562) for users'
# `from engine import LLM`; its edges are exempt, and no module of pdserve may import through it.
FACADES = {"engine"}


def _modules() -> dict[str, str]:
    found = {}
    for package in PACKAGES:
        for root, dirs, files in os.walk(os.path.join(ROOT, package)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "csrc")]
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                    found[module] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int:
    """Index of the first layer whose patterns match (exact names before wildcards)."""
    for i, (_, patterns) in enumerate(LAYERS):
        if module in patterns:
            return i
    for i, (_, patterns) in enumerate(LAYERS):
        if any("*" in p and fnmatch.fnmatchcase(module, p) for p in patterns):
            return i
    raise AssertionError(f"{module} has no layer: add it to LAYERS in tests/unit/test_layers.py")


def _resolve(name: str) -> str | None:
    """The project module an import name lands in (a name imported from a module is that module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported project module, line, inside a function) for every import statement in `module`."""
    path = MODULES[module]
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                names = [f"{base}.{a.name}" for a in child.names]
            elif isinstance(child, ast.Call) and getattr(child.func, "attr", None) == "import_module" \
                    and child.args and isinstance(child.args[0], ast.Constant):
                names = [child.args[0].value]
            for name in names:
                target = _resolve(name)
                if target is not None and target != module:
                    found.append((target, child.lineno, inner))
            visit(child, inner)

    visit(tree, False)
    return found


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_imports_point_down_the_stack():
    wrong = []
    for module in sorted(MODULES):
        if module in FACADES:
            continue
        for target, line, in_function in sorted(set(_imports(module))):
            if target in FACADES:
                wrong.append(f"{MODULES[module]}:{line} imports through the `{target}` facade; import "
                             f"the module that defines the name")
            elif _layer(target) > _layer(module):
                wrong.append(f"{MODULES[module]}:{line} ({LAYERS[_layer(module)][0]}) imports {target} "
                             f"({LAYERS[_layer(target)][0]}){' inside a function' if in_function else ''}")
    assert not wrong, "imports pointing up the layer stack:\n" + "\n".join(wrong)


def test_packages_import_nothing_above_their_modules():
    """Importing any module runs its packages' __init__ first: a package may only import modules
    of layers at or below every module it holds (so that `import records.config` stays a record)."""
    wrong = []
    for package in MODULES:
        if not MODULES[package].endswith("__init__.py") or package in FACADES:
            continue
        floor = min(_layer(m) for m in MODULES if m.startswith(package + ".")) if any(
            m.startswith(package + ".") for m in MODULES) else _layer(package)
        for target, line, in_function in _imports(package):
            if not in_function and _layer(target) > floor:
                wrong.append(f"{MODULES[package]}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    """No cycle between modules, with function-level imports counted: none hides one."""
    graph = {m: sorted({t for t, _, _ in _imports(m)}) for m in MODULES if m not in FACADES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def strongconnect(v: str) -> None:          # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, []):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            strongconnect(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_http_ingress_does_not_load_the_model_code():
    """The ingress process reads configs and records; the executor, workers and model stay out."""
    code = ("import sys, router.ingress.app\n"
            "heavy = [m for m in ('engine.executor.executor', 'engine.worker.model_runner', 'engine.worker.worker',\n"
            "                     'engine.llm_engine')\n"
            "         if m in sys.modules]\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_cluster_manager_starts_replicas_without_the_engine():
    """A manager names the replica class to start its actors (cluster/pool.py): that import leaves
    torch and transformers to the replicas that build an engine (each manager would spend ~1 s of
    CPU importing them, a dozen managers at a time in the Ray test lane)."""
    code = ("import sys, cluster.manager, cluster.pool, cluster.replica, cluster.replica_host\n"
            "print(','.join(m for m in ('torch', 'transformers', 'engine.async_engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_records_import_without_torch():
    """The record, wire and text layers (configs, requests, params, outputs, errors, the wire
    schema, the serving spec, tokenizer and tool-call text) and the cluster spec load in a process without torch
    or transformers: a frontend or a tool reading specs needs neither."""
    records = [m for m in MODULES if _layer(m) <= 2] + ["cluster.config"]
    code = (f"import importlib, sys\nfor m in {records!r}:\n    importlib.import_module(m)\n"
            "print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# Run in a fresh interpreter where importing torch fails: any unit test (or the suite's conftest,
# or a plugin) that imports torch, itself or through transformers, fails there.
NO_TORCH_RUN = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("tests/unit imports torch (" + name + ")")
sys.meta_path.insert(0, NoTorch())
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def test_the_unit_tests_import_no_torch(tmp_path):
    """tests/unit runs without torch (nor transformers, which imports it): its tests need no model,
    and the suite's shared code (tests/conftest.py, tests/helpers.py) loads none. Every other unit
    test runs again, in a process where torch cannot be imported."""
    out = subprocess.run([sys.executable, "-c", NO_TORCH_RUN, "-q", "-p", "no:cacheprovider", "--basetemp",
                          str(tmp_path), "-k", "not test_the_unit_tests_import_no_torch", "tests/unit"],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-4000:] + out.stderr[-2000:]
    assert "imports torch" not in out.stdout, out.stdout[-4000:]


def test_the_layer_checker_sees_violations(tmp_path, monkeypatch):
    """The checks above can fail: a record importing the scheduler, and a two-module cycle."""
    monkeypatch.setitem(MODULES, "records.config", str(tmp_path / "config.py"))
    (tmp_path / "config.py").write_text("def f():\n    from engine.core.scheduler import Scheduler\n")
    assert ("engine.core.scheduler", 2, True) in _imports("records.config")
    assert _layer("engine.core.scheduler") > _layer("records.config")
    monkeypatch.setitem(MODULES, "records.hashing", str(tmp_path / "hashing.py"))
    (tmp_path / "hashing.py").write_text("import records.config\n")
    (tmp_path / "config.py").write_text("from records import hashing\n")
    try:
        test_no_import_cycles()
    except AssertionError as e:
        assert "records.config" in str(e) and "records.hashing" in str(e)
    else:
        raise AssertionError("the cycle records.config <-> records.hashing went unseen")
