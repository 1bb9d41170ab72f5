"""What the tests share: the oracle (transformers' greedy generate, with or without a PEFT adapter),
tiny random models and adapters saved as their libraries save them, prompts of telling lengths, and
for the tests that start servers a free loopback port and waiting for /health."""
from __future__ import annotations

import contextlib
import os
import random
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import psutil

# (torch is imported in the functions that use it: tests/unit import this module and no torch)

# The repository's root (tests/ is one level down): what the tests run commands and read files in.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def benchmarks_on_path() -> None:
    """Make benchmarks/ importable (its scripts import their siblings by name) without its
    kernels.py shadowing the kernels package: that is bound first. Appending the folder is not
    enough alone: sys.path is searched before the editable install's finder, and a test that
    changed the directory takes the repository off the path's '' entry."""
    import sys

    import kernels  # noqa: F401 - bound before benchmarks/kernels.py can be found under its name

    path = os.path.join(REPO, "benchmarks")
    if path not in sys.path:
        sys.path.append(path)


# Where free_port looks: below Linux's ephemeral range (32768-60999), which every process binding
# port 0 draws from (Ray's agents and gRPC servers, NIXL, Serve replicas) and so may take a port the
# OS handed out a moment before, and above Ray's worker ports (10002-19999). A `pdserve serve` with
# direct ingress binds its port only after its pools start: a port from the ephemeral range was
# taken by then once, and Serve had no other to give its ingress (NoAvailablePortError). The two
# pytest processes of `make test` draw from halves of it (`use_ports`, from tests/conftest.py): a
# port one picked for a server that binds it seconds later (a `ray job`'s proxy) was once taken
# meanwhile by a test of the other, which had picked the same free port.
_PORTS = range(20000, 32000)
_RNG = random.SystemRandom()      # the OS's entropy: not a generator a test seeds


def use_ports(ports: range) -> None:
    """Draw free_port()'s ports from `ports` (a part of the range above) in this process."""
    global _PORTS
    _PORTS = ports


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, outside the ranges other processes draw ports from."""
    for _ in range(200):
        port = _RNG.choice(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS.start}-{_PORTS.stop - 1} on 127.0.0.1")


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[str]:
    """The processes among `procs` still running after up to `timeout_s` ('pid name' strings). A
    zombie counts as gone: it holds no port or memory, only its exit status until its parent reaps
    it. The Ray processes a dying raylet leaves behind are reparented to init, which on this machine
    reaps them seconds later; `psutil.wait_procs` (and `ray stop`) wait for that."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = [p for p in procs if _running(p)]
        if not running or time.monotonic() >= deadline:
            return [f"{p.pid} {_name(p)}" for p in running]
        time.sleep(0.1)


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "?"


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_ray_processes(timeout_s: float = 60.0) -> list[str]:
    """What `ray stop --force` does (this user's Ray processes killed at once, found as it finds
    them), without its wait for init to reap them: ~7 s of `ray stop` went to that. Returns those
    still running after `timeout_s` (`wait_gone`)."""
    from ray.autoscaler._private.constants import RAY_PROCESSES  # (the list `ray stop` kills)

    found = []
    for proc in psutil.process_iter(["name", "cmdline", "uids"]):
        if proc.info["uids"] is None or proc.info["uids"].real != os.getuid():
            continue
        name, args = proc.info["name"] or "", " ".join(proc.info["cmdline"] or [])
        if any(keyword in (name if by_name else args) for keyword, by_name in RAY_PROCESSES):
            found.append(proc)
    for proc in found:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return wait_gone(found, timeout_s)


def wait_healthy(base: str, timeout_s: float = 180.0, check: Callable[[], None] | None = None,
                 poll_s: float = 0.5) -> None:
    """Wait until GET {base}/health answers 200. `check` runs between polls and raises when waiting
    is pointless (the server process exited, its job failed); AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if check is not None:
            check()
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{base} never became healthy within {timeout_s:g} s"
        time.sleep(poll_s)


# A killed node is declared dead after about 3-5 s, not Ray's 15-30 (5 failed checks 3 s apart): the
# node-loss tests wait on that twice or three times each. A killed raylet's checks fail at once (its
# port is closed), so each check may wait Ray's 10 s for a live one, in case a node is only slow (the
# encode-pool failure this was first raised for turned out to be a raylet SIGKILLed at its start:
# tests/cluster/test_node_loss.py, docs/testing.md).
NODE_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_timeout_ms": 10000,
                      "health_check_failure_threshold": 3}


@contextlib.contextmanager
def simulated_cluster(num_nodes: int, cpus_per_node: float, namespace: str,
                      head_resources: dict[str, float] | None = None) -> Iterator[object]:
    """A Ray cluster of `num_nodes` simulated nodes on loopback (`ray.cluster_utils.Cluster`, each
    node its own raylet with its own resources; the head node has `head_resources` too), this
    process connected to it; shut down on exit. A Ray this process had joined before is left first."""
    import ray
    import ray._private.ray_constants as ray_constants
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus_per_node, "node_ip_address": "127.0.0.1",
                                                            "resources": dict(head_resources or {}),
                                                            "_system_config": NODE_HEALTH_CHECKS,
                                                            # (nine dashboard processes nothing here reads)
                                                            "include_dashboard": False})
    for _ in range(num_nodes - 1):
        cluster.add_node(num_cpus=cpus_per_node, node_ip_address="127.0.0.1")
    # ray.init rewrites a 127.0.0.1 address to this machine's outward IP, where the simulated nodes
    # do not listen; with "clusters" off it keeps loopback (the nodes all run here anyway).
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address=cluster.address, namespace=namespace)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
    try:
        cluster.wait_for_nodes()
        yield cluster
    finally:
        workers = _worker_processes(cluster)
        ray.shutdown()
        cluster.shutdown()
        _reap(workers)


def _worker_processes(cluster) -> list:
    """The processes the cluster's raylets started (workers, actors and their agents)."""
    import psutil
    import ray._private.ray_constants as ray_constants

    processes = []
    for node in cluster.list_all_nodes():
        for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
            try:
                processes += psutil.Process(info.process.pid).children(recursive=True)
            except psutil.Error:
                pass
    return processes


def _reap(processes: list, grace_s: float = 30.0) -> None:
    """Wait for a torn-down cluster's workers to exit, then kill what is left. Ray kills a removed
    node's raylet and leaves its workers to notice it. The next package's local Ray failed to start
    three times in ~12 lane runs, each right after the 3-node cluster's teardown (see init_ray); on
    a quiet machine every worker is gone by the time the nodes are, so this only guarantees that
    none is left to a busy one's next package."""
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=10)


def save_random_model(tmp_path_factory, config, name: str, seed: int, std: float = 0.15) -> str:
    """A transformers model of this config with random fp32 weights, saved as safetensors; matrices
    drawn with a larger std than HF's 0.02 init, so logits are peaked and well separated."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    out = tmp_path_factory.mktemp(name)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


_hf_cache: dict[str, object] = {}


def hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    if path not in _hf_cache:
        _hf_cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _hf_cache[path]


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int, **kwargs) -> list[list[int]]:
    """The oracle: transformers' greedy generate, one prompt at a time (no padding), EOS ignored."""
    import torch

    model = hf_model(path)
    outs = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def mixed_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompt lengths: 1 token, block boundaries (15, 16, 17, 32, 33) and > 100 tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 15, 16, 17, 32, 33, 130)]


def make_adapter(base_path: str, out_dir: str, rank: int, targets: list[str], seed: int,
                 alpha: float | None = None, rslora: bool = False) -> str:
    """A PEFT LoRA adapter of the model at `base_path` with random A and B (PEFT starts B at zero,
    which would make every adapter the base model), saved as PEFT saves one."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=targets,
                        lora_dropout=0.0, use_rslora=rslora)
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(base_path: str, adapter: str | None, prompts: list[list[int]], max_new_tokens: int):
    """The oracle: transformers + PEFT greedy generate on `adapter` (None: the base model)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = hf_model(base_path)
    if adapter is not None:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32),
                                          adapter).eval()
    outs = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(gen[0, len(ids):].tolist())
    return outs


# The profile of the tests' simulated replicas (engine.simulate): the cluster is their subject, not
# the engine's numerics. Their tokens are the sequence's (engine/executor/simulated.py), so a
# simulated engine in this process is their oracle (`simulated_outputs`).
SIM_PROFILE = "h200-llama3-8b"


def simulated_outputs(prompts: list[str], max_tokens: int, **engine_args) -> list[str]:
    """One simulated engine's text for each prompt (the embedded model's tokenizer), in virtual
    time (no step sleeps)."""
    import records.clock as clock
    from engine.llm import LLM
    from records.sampling_params import SamplingParams

    with clock.virtual(clock.VirtualClock()), LLM(None, simulate=SIM_PROFILE, **engine_args) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def kill_replica(handle) -> None:
    """Kill a replica's process: its actor's, or a simulated replica's host's (with
    `replicas_per_process: 1` it holds that replica alone)."""
    import ray

    ray.kill(getattr(handle, "host", handle), no_restart=True)


class InProcessHandle:
    """An engine replica (cluster/replica.py: EngineReplica) in this process behind an actor handle's
    surface (`handle.method.remote(...)`, `.options(num_returns="streaming")` for its output channel),
    so that the ingress's routers and channels drive it without Ray. Call `.remote` on the event loop."""

    def __init__(self, replica, streaming: bool = False, name: str | None = None) -> None:
        self._replica, self._streaming, self._name = replica, streaming, name

    def __getattr__(self, name: str) -> InProcessHandle:
        if name.startswith("_"):
            raise AttributeError(name)
        return InProcessHandle(self._replica, False, name)

    def options(self, **options) -> InProcessHandle:
        return InProcessHandle(self._replica, options.get("num_returns") == "streaming", self._name)

    def remote(self, *args, **kwargs):
        import asyncio
        import inspect

        result = getattr(self._replica, self._name)(*args, **kwargs)
        if self._streaming:
            async def refs():           # a Ray streaming generator's items: awaitables of the values
                async for item in result:
                    done = asyncio.get_running_loop().create_future()
                    done.set_result(item)
                    yield done
            return refs()
        if inspect.isawaitable(result):
            return asyncio.ensure_future(result)
        done = asyncio.get_running_loop().create_future()
        done.set_result(result)
        return done
