"""Tensor and pipeline parallelism on Ray worker actors, on a simulated two-node cluster.

Greedy output must be token-identical to the single-rank engine and to transformers (fp32), with
chunked prefill and a prefix-cache hit; each stage's TP ranks share a node and the stages sit on
different nodes; a killed worker fails in-flight requests with EngineDeadError, not a hang."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch
from helpers import hf_greedy, make_adapter, peft_greedy, simulated_cluster

from engine.llm_engine import LLMEngine
from engine.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.model.parallel_state import ParallelState, pp_layer_range, reset_parallel_state, set_parallel_state
from records.config_resolution import engine_config
from records.errors import EngineDeadError
from records.model_source import resolve_layer_partition
from records.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[(i * 11 + 7 + 97 * n) % 2000 + 3 for i in range(n)] for n in (1, 17, 40, 75)]
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# --- unit: sharding without process groups -------------------------------------------------------------
def test_tp_shards_reassemble_the_full_weights():
    """Each rank's loader takes its slice; stacked over the ranks they give back the checkpoint
    (KV heads replicated when tp > num_kv_heads)."""
    torch.manual_seed(0)
    hidden, head_dim, heads, kv_heads, tp = 16, 4, 4, 1, 2
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    gate, up, down = torch.randn(24, hidden), torch.randn(24, hidden), torch.randn(hidden, 24)
    shards = []
    try:
        for rank in range(tp):
            set_parallel_state(ParallelState(tp_rank=rank, tp_size=tp))
            qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads)
            for name, t in zip("qkv", (q, k, v)):
                qkv.weight_loader(qkv.weight, t, name)
            mlp = MergedColumnParallelLinear(hidden, [24, 24])
            mlp.weight_loader(mlp.weight, gate, 0)
            mlp.weight_loader(mlp.weight, up, 1)
            row = RowParallelLinear(24, hidden)
            row.weight_loader(row.weight, down)
            shards.append((qkv.weight.clone(), mlp.weight.clone(), row.weight.clone()))
    finally:
        reset_parallel_state()
    q_rows = heads // tp * head_dim
    assert torch.equal(torch.cat([s[0][:q_rows] for s in shards]), q)
    for s in shards:                                   # the single KV head on both ranks
        assert torch.equal(s[0][q_rows:q_rows + head_dim], k) and torch.equal(s[0][q_rows + head_dim:], v)
    assert torch.equal(torch.cat([s[1][:12] for s in shards]), gate)
    assert torch.equal(torch.cat([s[1][12:] for s in shards]), up)
    assert torch.equal(torch.cat([s[2] for s in shards], dim=1), down)


def test_pp_layer_split_and_override(monkeypatch, tiny_llama):
    assert [pp_layer_range(30, r, 4) for r in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert pp_layer_range(30, 1, 2, (1, 29)) == (1, 30)
    assert resolve_layer_partition(30, 2, "1,29") == resolve_layer_partition(30, 2, [1, 29]) == (1, 29)
    monkeypatch.setenv("PDSERVE_PP_LAYER_PARTITION", "1,29")
    assert resolve_layer_partition(30, 2) == (1, 29)
    assert resolve_layer_partition(30, 2, [15, 15]) == (15, 15)       # the argument wins
    monkeypatch.setenv("PDSERVE_PP_LAYER_PARTITION", "1,2")
    with pytest.raises(ValueError, match="PDSERVE_PP_LAYER_PARTITION"):
        resolve_layer_partition(30, 2)
    monkeypatch.delenv("PDSERVE_PP_LAYER_PARTITION")
    for bad in ([2, 0], [1], "x,1"):
        with pytest.raises(ValueError, match="pp_layer_partition must list 2 positive layer counts"):
            engine_config(tiny_llama, pipeline_parallel_size=2, pp_layer_partition=bad)
    config = engine_config(tiny_llama, pipeline_parallel_size=2)
    assert config.parallel_config.layer_partition == (1, 1)


def test_parallel_sizes_are_validated(tiny_llama):
    with pytest.raises(ValueError, match="num_attention_heads"):
        engine_config(tiny_llama, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be <= num_hidden_layers"):
        engine_config(tiny_llama, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="max_concurrent_batches must be 1 with a kv_connector"):
        engine_config(tiny_llama, pipeline_parallel_size=2, kv_connector="nixl", max_concurrent_batches=2)
    config = engine_config(tiny_llama, pipeline_parallel_size=2, kv_connector="nixl")
    assert (config.parallel_config.max_concurrent_batches, config.parallel_config.pipeline_micro_batches) == (1, 2)
    engine_config(tiny_llama, tensor_parallel_size=2, kv_connector="nixl")


# --- on a simulated two-node cluster --------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_nodes():
    pytest.importorskip("ray", reason="needs ray (make setup installs it)")
    with simulated_cluster(2, 4, "pdserve-test-parallel") as cluster:
        yield cluster


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", None, ids, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.cluster
# Two by two (four workers) where the pipeline split matters (Gemma 3: local and global layers on
# each stage; Llama's pipelines are the micro-batch and in-flight tests below); the other families
# over TP alone (two workers: the Ray lane's time).
@pytest.mark.parametrize("kind,tp,pp", [("llama", 2, 1), ("qwen3", 2, 1), ("gemma2", 2, 1),
                                        ("gemma3", 2, 2), ("phi3", 2, 1)])
def test_parallel_greedy_matches_single_rank_and_hf(two_nodes, request, kind, tp, pp):
    """TP and PP over two simulated nodes give transformers' greedy tokens, as the single rank does
    (Qwen3: its per-head q/k norms, held whole on every TP rank; Gemma 2/3: local and global layers,
    soft-caps, on each stage; Phi-3: fused checkpoint projections cut per rank). Qwen2's QKV bias
    under TP is Qwen2-MoE's below."""
    path = request.getfixturevalue(f"tiny_{kind}")
    # A 24-token budget chunks the longer prompts; the repeat of prompt 3 hits the prefix cache.
    args = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=24)
    prompts = [*PROMPTS, PROMPTS[3]]
    want = hf_greedy(path, prompts, GREEDY.max_tokens)
    engine = LLMEngine(engine_config(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **args))
    try:
        assert run(engine, prompts) == want
        assert engine.stats().prefix_cache_hits > 0
        if kind in ("llama", "gemma3"):
            # Seeded sampling: the driver rank keeps each request's generator across steps (under
            # PP the last stage's, dropped when a later step names the request finished: the
            # constrained run reuses the seeded run's ids).
            seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
            single = LLMEngine(engine_config(path, **args))
            assert run(engine, PROMPTS[1:3], seeded) == run(single, PROMPTS[1:3], seeded)
            # A constraint: the driver rank (a worker actor) keeps the matcher and masks the logits.
            constrained = SamplingParams(max_tokens=12, temperature=0.9, seed=3,
                                         structured_outputs={"regex": "[a-z]+( [a-z]+)*"})
            assert run(engine, PROMPTS[1:3], constrained) == run(single, PROMPTS[1:3], constrained)
        placements = engine.executor.placements()
        by_stage: dict[int, set[str]] = {}
        for p in placements:
            by_stage.setdefault(p["pp_rank"], set()).add(p["node_id"])
        assert all(len(nodes) == 1 for nodes in by_stage.values()), placements   # TP ranks packed
        if pp == 2:
            assert by_stage[0] != by_stage[1], placements                           # stages spread
        engine.check_no_leaks()
    finally:
        engine.executor.shutdown()


@pytest.mark.cluster
@pytest.mark.parametrize("kind,tp,pp,ep,dispatch", [("mixtral", 2, 2, True, "all2all"),
                                                    ("qwen3_moe", 2, 1, True, "allreduce"),
                                                    ("qwen2_moe", 2, 1, False, "allreduce")])
def test_moe_tensor_expert_and_pipeline_parallel_match_hf(two_nodes, request, kind, tp, pp, ep, dispatch):
    """MoE over two simulated nodes: experts split between the TP ranks (expert parallelism) with
    all-to-all dispatch (Mixtral, under PP too) or all-reduce (Qwen3-MoE), or sliced over them
    (Qwen2-MoE, its shared expert too, and its attention, Qwen2's, with QKV bias sharded):
    transformers' greedy tokens; with EP each rank runs only its own experts, and the load says so."""
    path = request.getfixturevalue(f"tiny_{kind}")
    args = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=24)
    engine = LLMEngine(engine_config(path, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                           enable_expert_parallel=ep, moe_dispatch=dispatch, **args))
    try:
        assert run(engine, PROMPTS) == hf_greedy(path, PROMPTS, GREEDY.max_tokens)
        load = engine.stats().moe_expert_tokens
        experts = {}
        for rank, expert, rows in load:
            experts.setdefault(rank, set()).add(expert)
            assert rows > 0
        num_experts = 8 if kind != "qwen2_moe" else 4
        for stage in range(pp):
            held = [experts[stage * tp + r] for r in range(tp)]
            if ep:          # disjoint halves that cover every expert
                assert set.union(*held) == set(range(num_experts)) and not set.intersection(*held)
            else:
                assert all(h == set(range(num_experts)) for h in held)
        engine.check_no_leaks()
    finally:
        engine.executor.shutdown()


def test_micro_batches_split_by_tokens():
    """Requests are dealt into micro-batches of about equal token counts, decodes first in each;
    with fewer tokens than MIN_MICRO_BATCH_TOKENS per micro-batch the step is not split."""
    from engine.worker.model_runner import MIN_MICRO_BATCH_TOKENS, ModelRunner
    from records.step import ScheduledRequest

    def req(rid: str, n: int) -> ScheduledRequest:
        return ScheduledRequest(request_id=rid, token_ids=[1] * n, start=0, block_ids=[0],
                                sampling_params=GREEDY, prompt_token_ids=[1] * n, output_token_ids=[],
                                do_sample=True)

    batch = [req("d1", 1), req("p300", 300), req("p200", 200), req("d2", 1), req("p90", 90)]
    groups = ModelRunner._micro_batches(batch, 2)
    assert [[r.request_id for r in g] for g in groups] == [["p300"], ["d1", "d2", "p200", "p90"]]
    assert ModelRunner._micro_batches(batch[:1], 2) == [batch[:1]]
    assert MIN_MICRO_BATCH_TOKENS >= 64


def test_concurrent_batches_take_disjoint_requests():
    """With two batches in the stages at once, each takes half of the running requests and none
    that is still in the other; a preemption never picks a request whose batch is still running."""
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.core.scheduler import Scheduler
    from records.config import SchedulerConfig
    from records.request import Request
    from records.step import ModelRunnerOutput, SampledToken

    scheduler = Scheduler(SchedulerConfig(), KVCacheManager(5, 4, False, 0), max_concurrent_batches=2)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i in range(4):
        scheduler.add_request(Request(f"r{i}", [i + 1, 2, 3], params, frozenset(), 4, 20))

    def ids(out):
        return [s.request_id for s in out.scheduled]

    def done(out):
        return scheduler.update_from_output(out, ModelRunnerOutput(
            sampled={s.request_id: SampledToken(7) for s in out.scheduled}))

    prefill = scheduler.schedule()
    assert ids(prefill) == ["r0", "r1", "r2", "r3"] and scheduler.schedule().is_empty   # all in flight
    done(prefill)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert ids(first) == ["r0", "r1"] and ids(second) == ["r2", "r3"] and scheduler.schedule().is_empty
    done(first)
    # r0 and r1 now need a second block each and one is free; r2 and r3 (newest) are in flight,
    # so r1 gives way, not r3.
    third = scheduler.schedule()
    assert ids(third) == ["r0"] and third.preempted_ids == ["r1"]
    assert {r.request_id for r in scheduler.running} == {"r0", "r2", "r3"}
    done(second)
    done(third)
    assert not scheduler.in_flight


@pytest.mark.cluster
def test_pipeline_micro_batches_match_single_rank(two_nodes, tiny_llama):
    """PP=2 with two micro-batches per step (long prompts: the prefill steps split) gives the single
    rank's greedy tokens, and its seeded draws (the request ids of the greedy run again)."""
    args = dict(dtype="float32", max_model_len=512, num_kv_blocks=96, max_num_batched_tokens=512)
    prompts = [[(i * 37 + j * 11) % 900 + 5 for j in range(130 + 20 * i)] for i in range(4)]
    single = LLMEngine(engine_config(tiny_llama, **args))
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    want = run(single, prompts)
    engine = LLMEngine(engine_config(tiny_llama, pipeline_parallel_size=2, pipeline_micro_batches=2,
                                           **args))
    try:
        assert run(engine, prompts) == want
        assert run(engine, prompts, seeded) == run(single, prompts, seeded)
        engine.check_no_leaks()
    finally:
        engine.executor.shutdown()


@pytest.mark.cluster
def test_concurrent_pipeline_batches_match_single_rank_and_survive_abort(two_nodes, tiny_llama, tmp_path):
    """PP=2 keeps two batches of disjoint requests in the stages (the default); greedy output is the
    single rank's, and aborting a request whose batch is still in the stages loses nothing else
    and frees every block. With a host + disk offload tier: each stage saves, demotes and loads its
    own layers of each block (the orders ride on the steps), and tenants' second turns loaded from
    the tier give the single rank's tokens."""
    args = dict(dtype="float32", max_model_len=256, num_kv_blocks=64)
    prompts = [*PROMPTS, *PROMPTS[1:]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    single = LLMEngine(engine_config(tiny_llama, **args))
    want = run(single, prompts, params)
    slot = 8192 / (1 << 30)          # a block's bytes over the ranks (2 layers x 2 KV heads of 16, fp32)
    engine = LLMEngine(engine_config(tiny_llama, pipeline_parallel_size=2, kv_offloading_size=8 * slot,
                                           kv_offloading_disk_path=str(tmp_path), kv_offloading_disk_size=64 * slot,
                                           **args))
    assert engine.config.parallel_config.max_concurrent_batches == 2
    assert engine.config.parallel_config.pipeline_micro_batches == 1
    try:
        assert run(engine, prompts, params) == want
        for i, ids in enumerate(prompts):
            engine.add_request(f"a{i}", None, ids, params)
        done: dict[str, list[int]] = {}
        overlapped = aborted = False
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            overlapped = overlapped or bool(engine.in_flight)      # a second batch still in the stages
            a2 = engine.scheduler.requests.get("a2")
            if not aborted and "a2" in engine.scheduler.in_flight and len(a2.output_token_ids) >= 3:
                engine.abort_request("a2")
                aborted = True
        assert overlapped and aborted
        assert done == {f"a{i}": w for i, w in enumerate(want) if i != 2}
        # Ten tenants of 13 blocks each, twice over, one at a time: the 64-block pool has long
        # evicted a tenant's prompt by its second turn; the 8-slot host store passes it to disk.
        tenants = [[(i * 13 + 5 + 211 * t) % 2000 + 3 for i in range(200)] for t in range(10)]
        turns = [run(single, [p]) for p in tenants]
        assert engine.executor.tier_slots == (8, 64)
        assert [run(engine, [p]) for p in tenants * 2] == turns * 2
        stats = engine.stats()
        assert stats.kv_tier.disk_hit_blocks > 0 and stats.kv_tier.load_failures == 0
        engine.check_no_leaks()
    finally:
        engine.executor.shutdown()


@pytest.mark.cluster
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_lora_across_ranks_matches_peft(two_nodes, tiny_llama, tmp_path_factory, tp, pp):
    """Adapters sharded like the weights (B's rows on column-parallel layers, A's columns on
    row-parallel ones) and split by stage: a mixed batch (two adapters, base rows, chunked prefill)
    gives transformers + PEFT's greedy tokens on every path."""
    from records.lora import LoRARequest

    root = tmp_path_factory.mktemp(f"lora-tp{tp}-pp{pp}")
    adapters = {"all16": make_adapter(tiny_llama, str(root / "all16"), 16, LORA_TARGETS, seed=7),
                "attn8": make_adapter(tiny_llama, str(root / "attn8"), 8, LORA_TARGETS[:4], seed=8)}
    names = [None, "all16", "attn8"]
    cases = [(p, names[i % 3]) for i, p in enumerate(PROMPTS + PROMPTS[1:])]
    expected = {name: peft_greedy(tiny_llama, adapters.get(name), PROMPTS, 8) for name in names}
    config = engine_config(tiny_llama, dtype="float32", max_model_len=256, num_kv_blocks=64,
                                 max_num_batched_tokens=24, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                 enable_lora=True, max_lora_rank=16)
    engine = LLMEngine(config)
    try:
        loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}
        for i, (ids, name) in enumerate(cases):
            engine.add_request(f"r{i}", None, ids, replace(GREEDY, lora_request=loras.get(name)))
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        for i, (ids, name) in enumerate(cases):
            assert done[f"r{i}"] == expected[name][PROMPTS.index(ids)], (name, len(ids))
    finally:
        engine.executor.shutdown()


@pytest.mark.cluster
def test_killed_worker_fails_requests_with_engine_dead(two_nodes, tiny_llama):
    import ray

    from engine.async_engine import AsyncLLMEngine

    async def main() -> None:
        engine = AsyncLLMEngine(engine_config(tiny_llama, dtype="float32", max_model_len=256,
                                                    num_kv_blocks=64, tensor_parallel_size=2))
        executor = engine.engine.executor
        try:
            stream = engine.generate("x", PROMPTS[2], SamplingParams(max_tokens=200, temperature=0.0,
                                                                      ignore_eos=True))
            await stream.__anext__()                        # running
            ray.kill(executor.workers[1])
            start = time.monotonic()
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            assert time.monotonic() - start < 30
            assert not engine.is_healthy
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate("y", PROMPTS[1], GREEDY):
                    pass
        finally:
            executor.shutdown()

    asyncio.run(main())


@pytest.mark.cluster
def test_llm_shutdown_lets_go_of_workers_and_placement_group(two_nodes, tiny_llama):
    """`with LLM(...)` (whose exit is `LLM.shutdown()`) and garbage collection each stop the engine's
    worker actors and remove its placement group, so the next TP engine in the process gets their
    CPUs (two TP=2 engines in turn, each let go one way; the placement groups counted after each)."""
    import gc

    import ray
    from ray.util import placement_group_table

    from engine import LLM

    def live_groups() -> int:
        return sum(pg["state"] != "REMOVED" for pg in placement_group_table().values())

    args = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, tensor_parallel_size=2)
    before = live_groups()
    with LLM(tiny_llama, **args) as llm:
        workers = list(llm.llm_engine.executor.workers)
        out = llm.generate({"prompt_token_ids": PROMPTS[2]}, GREEDY, use_tqdm=False)[0]
        assert live_groups() == before + 1
    assert live_groups() == before
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(workers[0].placement.remote(), timeout=60)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate({"prompt_token_ids": PROMPTS[2]}, GREEDY, use_tqdm=False)
    llm.shutdown()                                 # again: nothing happens
    llm = LLM(tiny_llama, **args)
    assert llm.generate({"prompt_token_ids": PROMPTS[2]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids \
        == out.outputs[0].token_ids
    del llm                                        # let go by garbage collection
    gc.collect()
    assert live_groups() == before


@pytest.mark.cluster
def test_pool_of_tensor_parallel_replicas(two_nodes, tiny_llama):
    """A pool spec with tensor_parallel_size=2: its replica actor drives two worker actors and
    streams the single-rank engine's greedy output."""
    import ray

    from cluster.config import ClusterConfig
    from cluster.pool import EnginePool

    config = ClusterConfig(model=tiny_llama, engine={"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64},
                           pools={"decode": {"replicas": 1, "num_cpus": 1, "tensor_parallel_size": 2}})
    [want] = run(LLMEngine(engine_config(tiny_llama, dtype="float32", max_model_len=256, num_kv_blocks=64)),
                 [PROMPTS[2]])
    pool = EnginePool("decode", config.pools["decode"], config.engine_config("decode"), "pdserve-test")
    pool.start()
    try:
        asyncio.run(pool.wait_ready())
        [handle] = pool.replicas.values()
        deltas = ray.get(list(handle.generate.options(num_returns="streaming").remote("a", PROMPTS[2], GREEDY)))
        assert [t for d in deltas for c in d.choices for t in c.token_ids] == want
        _push_weights_over_gloo(pool.replicas, tiny_llama)
        assert ray.get(handle.check_no_leaks.remote())
    finally:
        pool.shutdown()


def _push_weights_over_gloo(replicas: dict, path: str) -> None:
    """A trainer (a thread here: rank 0) broadcasts perturbed weights over a gloo group to both TP
    ranks of the replica (cluster/weights.py: ranks 1 and 2); the replica then streams what an engine
    given the same weights does, and says it is version 1."""
    import glob
    import os
    import socket
    import threading

    import ray
    from safetensors.torch import load_file

    from cluster.weights import ModelWeights
    from engine.worker.weight_sync import WeightUpdateGroup

    g = torch.Generator().manual_seed(5)
    weights = {n: t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype)
               for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))) for n, t in load_file(file).items()}
    single = LLMEngine(engine_config(path, dtype="float32", max_model_len=256, num_kv_blocks=64))
    single.weights.from_tensors(list(weights.items()))
    [want] = run(single, [PROMPTS[2]])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    joined, failures = threading.Event(), []

    def trainer() -> None:
        try:
            group = WeightUpdateGroup("127.0.0.1", port, 0, 3)
            joined.wait(timeout=300)
            for tensor in weights.values():
                group.broadcast(tensor.clone())
        except BaseException as e:  # noqa: BLE001
            failures.append(e)

    state = ModelWeights()
    thread = threading.Thread(target=trainer)
    thread.start()
    assert asyncio.run(state.call(replicas, "group_size")) == 3
    assert asyncio.run(state.call(replicas, "join_group", "127.0.0.1", port)) == 3
    joined.set()
    names = list(weights)
    out = asyncio.run(state.call(replicas, "update_from_group", names, ["float32"] * len(names),
                                 [list(weights[n].shape) for n in names], None))
    thread.join(timeout=300)
    assert not failures and out == {"weight_version": "1", "paused": None}
    [handle] = replicas.values()
    deltas = ray.get(list(handle.generate.options(num_returns="streaming").remote("b", PROMPTS[2], GREEDY)))
    assert [t for d in deltas for c in d.choices for t in c.token_ids] == want
    assert {d.weight_version for d in deltas} == {"1"} and ray.get(handle.info.remote())["weight_version"] == "1"


def test_cluster_spec_parallel_fields():
    from pydantic import ValidationError

    from cluster.config import ClusterConfig

    with pytest.raises(ValidationError, match="set them per pool"):
        ClusterConfig(engine={"tensor_parallel_size": 2})
    with pytest.raises(ValidationError, match="set them per pool"):
        ClusterConfig(engine={"pp_layer_partition": [1, 1]})
    spec = ClusterConfig(mode="disaggregated", pools={"prefill": {"tensor_parallel_size": 2}, "decode": {}})
    assert spec.pools["prefill"].world_size == 2
    # The card's shape: both pools pipelined (split differently), KV moving stage by stage.
    spec = ClusterConfig(mode="disaggregated", pools={
        "prefill": {"pipeline_parallel_size": 2},
        "decode": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "pp_layer_partition": [1, 3]}})
    args = spec.engine_args("decode")
    assert (args.pipeline_parallel_size, args.pp_layer_partition, args.kv_connector) == (2, [1, 3], "nixl")
    assert spec.engine_args("prefill").pp_layer_partition is None
    assert ClusterConfig(pools={"decode": {"pipeline_parallel_size": 2}}).pools["decode"].world_size == 2


# --- step deltas (unit: the Ray executor's step messages, checked in-process) -----------------------
def _fields(req) -> tuple:
    return (req.request_id, req.token_ids, req.start, req.block_ids, req.do_sample, req.spec_token_ids,
            req.prompt_logprobs_from, req.sampling_params, req.output_token_ids, req.prompt_token_ids,
            req.eos_token_ids)


def _through_deltas(llm, sizes: list[tuple[int, int]]) -> None:
    """Make `llm`'s in-process executor run every step from a pickled step delta, as a Ray worker
    does, after checking that the rebuilt SchedulerOutput equals the scheduler's own. `sizes` gets
    (number of requests, message bytes) per model step."""
    import pickle

    from engine.worker.step_codec import StepDecoder, StepEncoder

    executor = llm.llm_engine.executor
    encoder, decoder, exchange = StepEncoder(), StepDecoder(), executor._exchange

    def via_delta(sched, kv_ops):
        if sched is not None:
            payload = pickle.dumps(encoder.encode(sched), protocol=pickle.HIGHEST_PROTOCOL)
            sizes.append((len(sched.scheduled), len(payload)))
            rebuilt = decoder.decode(pickle.loads(payload))
            assert [_fields(r) for r in rebuilt.scheduled] == [_fields(r) for r in sched.scheduled]
            assert (rebuilt.swap_out, rebuilt.swap_in, rebuilt.copy_blocks, rebuilt.finished_ids,
                    rebuilt.preempted_ids) == (sched.swap_out, sched.swap_in, sched.copy_blocks,
                                               sched.finished_ids, sched.preempted_ids)
            sched = rebuilt
        return exchange(sched, kv_ops)

    executor._exchange = via_delta
    return encoder, decoder


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_step_deltas_rebuild_every_step_and_keep_output(tiny_qwen2, mode):
    """Preemption (both kinds), prefix hits with copy-on-write, n > 1, seeded sampling, penalties
    and prompt logprobs: every step rebuilt from its delta equals the scheduler's own, the outputs
    equal the in-process executor's, and both tables are empty at the end."""
    from helpers import mixed_prompts

    from engine import LLM, SamplingParams

    prompts = [p for p in mixed_prompts(1000, seed=7) if len(p) > 10]
    prompts += [prompts[0][:40], prompts[0][:40]]          # shared prefixes: hits, copy-on-write
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.9, seed=5, n=2, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, seed=9, repetition_penalty=1.3,
                             frequency_penalty=0.5, logprobs=2, prompt_logprobs=1, ignore_eos=True)]
    params = [params[i % 3] for i in range(len(prompts))]

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]

    kwargs = dict(dtype="float32", num_kv_blocks=14, max_model_len=200, preemption_mode=mode,
                  max_num_batched_tokens=64)
    expected = run(LLM(tiny_qwen2, **kwargs))
    llm = LLM(tiny_qwen2, **kwargs)
    sizes: list[tuple[int, int]] = []
    encoder, decoder = _through_deltas(llm, sizes)
    assert run(llm) == expected
    assert llm.llm_engine.stats().num_preemptions > 0 and len(sizes) > 20
    # What is left is what the next step's message frees: the requests that finished in the last.
    left = set(llm.llm_engine.scheduler.finished_ids)
    assert set(encoder._sent) <= left and set(decoder._held) <= left


def test_decode_step_delta_does_not_grow_with_context(tiny_llama):
    """Bytes of a decode step's message at batch 16: the same at a context of 48 and of 700 tokens
    (the whole SchedulerOutput grew with both context and output length)."""
    from engine import LLM, SamplingParams

    per_context = {}
    for context in (48, 700):
        llm = LLM(tiny_llama, dtype="float32", max_model_len=1024)
        sizes: list[tuple[int, int]] = []
        _through_deltas(llm, sizes)
        prompts = [[(7 * i + j) % 900 + 20 for j in range(context)] for i in range(16)]
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
        decode = [b for n, b in sizes[-30:-2] if n == 16]
        assert len(decode) > 10
        per_context[context] = max(decode)
    assert per_context[700] <= per_context[48] * 1.1, per_context
