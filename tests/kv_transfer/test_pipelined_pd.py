"""P/D between pipelined engines: each decode rank pulls its own layers from the prefill stage(s)
that hold them, and within those its own heads, over both connectors, on a simulated three-node
cluster (each stage's TP ranks on one node, the stages on different nodes).

The shapes are the card's (TP inside a node, PP across nodes, both sides, sized differently), and
TP 2 on both sides; the model has four layers so that two pipelined engines can split them
differently (2+2 against 1+3).
Greedy output (fp32) must equal one colocated engine's with chunked prefill on P, prefix hits on D
and a LoRA adapter; D's blocks must hold exactly P's bytes in every layer and head; a killed
prefill stage fails the pull as a whole (recompute or error, per policy); nothing leaks. And the
card's shape served end to end: `cluster.launch` (what `pdserve serve` runs) deploys a
disaggregated spec of the embedded model whose pools run pipeline stages on different nodes, and
the official `openai` client gets one colocated engine's tokens and text.

The simulated cluster is this module's (`ray_nodes`): the folder's other Ray test needs one node,
and a cluster fixture shared by the folder would outlive it (a folder without __init__.py is no
pytest package, and package scope then means the session)."""
from __future__ import annotations

import re
import time
from dataclasses import replace

import httpx
import openai
import pytest
import torch
from helpers import free_port, make_adapter, simulated_cluster
from transfer_helpers import (
    CONNECTORS,
    DEADLINE_S,
    GREEDY,
    global_blocks,
    kill_actor,
    make_engine,
    prefill,
    prompt,
    run_one,
    settle,
)

from engine.llm_engine import LLMEngine
from records.errors import KVLayoutMismatch
from records.kv_layout import KVLayout, kv_sources
from records.lora import LoRARequest
from records.sampling_params import SamplingParams

# (P tp, P pp), (D tp, D pp): the five pairs, and equal TP > 1 (whole blocks of the peer rank).
SHAPES = [((1, 2), (1, 1)), ((1, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 1), (1, 2)), ((1, 2), (1, 2)), ((2, 1), (2, 1))]
# Each shape over one connector: the layout's map is the connectors' shared code, and each
# connector meets a pair where both the stages and the TP sizes differ (each decode rank reads a
# strided part of the peer's blocks, from a stage that splits its layers unlike its own). NIXL
# takes the TP-2 prefill's pairs, whose engines it then builds once (the Ray lane's time is kept).
NIXL_SHAPES = (((2, 1), (1, 2)), ((2, 1), (2, 1)))
CASES = [("nixl" if (p, d) in NIXL_SHAPES else "torch_dist", p, d) for p, d in SHAPES]
D_SPLIT = [1, 3]          # a pipelined decode engine splits the 4 layers unlike P's even 2+2
LORA = dict(enable_lora=True, max_lora_rank=8)


# --- unit: the stage and head map ---------------------------------------------------------------------
def _layout(tp: int, pp: int, tp_rank: int = 0, pp_rank: int = 0, split: tuple[int, ...] = (),
            layers: int = 4, heads: int = 2) -> KVLayout:
    return KVLayout("m", layers, 16, heads, 8, "float32", tp_rank, tp, pp_rank, pp, split)


@pytest.mark.parametrize("src,dst", [
    ((1, 2, ()), (1, 1, ())), ((1, 1, ()), (1, 2, (1, 3))), ((1, 2, ()), (2, 1, ())),
    ((2, 1, ()), (1, 2, (1, 3))), ((1, 2, (2, 2)), (1, 2, (1, 3))), ((2, 2, (3, 1)), (2, 2, (1, 3))),
    ((1, 4, ()), (2, 2, ())), ((1, 2, ()), (4, 1, ())),            # 4 TP ranks over 2 heads: replicated
])
def test_kv_sources_cover_every_layer_and_head_once(src, dst):
    """Each decode rank's (layer, head) cells come from exactly one prefill rank that holds them,
    land where the decode rank keeps them, and the parts of one rank are distinct source ranks."""
    (stp, spp, ssplit), (dtp, dpp, dsplit) = src, dst
    for d_rank in range(dtp * dpp):
        d = _layout(dtp, dpp, d_rank % dtp, d_rank // dtp, dsplit)
        parts = kv_sources(_layout(stp, spp, split=ssplit), d)
        assert len({p.src_rank for p in parts}) == len(parts)
        placed: dict[tuple[int, int], tuple[int, int]] = {}
        for part in parts:
            s = _layout(stp, spp, part.src_rank % stp, part.src_rank // stp, ssplit)
            assert set(part.layers) <= set(s.layers) and set(part.layers) <= set(d.layers)
            assert list(part.src_layers) == [s.layers.index(n) for n in part.layers]
            assert list(part.dst_layers) == [d.layers.index(n) for n in part.layers]
            for layer in part.layers:
                for i in range(part.heads.count):
                    cell = (layer, d.rank_heads(d.tp_rank)[part.heads.dst_start + i])
                    assert cell not in placed
                    placed[cell] = (layer, s.rank_heads(s.tp_rank)[part.heads.src_start + i])
        assert sorted(placed) == sorted((n, h) for n in d.layers for h in d.rank_heads(d.tp_rank))
        assert all(k == v for k, v in placed.items())


def test_handshake_names_what_cannot_be_mapped():
    mine = _layout(1, 2, split=(1, 3))
    for bad, field in [(_layout(1, 2, split=(1, 2)), "layer_partition"),
                       (_layout(1, 3, split=(2, 2)), "layer_partition"),
                       (_layout(1, 2, layers=6), "num_layers"), (_layout(3, 1), "tensor_parallel_size 3")]:
        with pytest.raises(KVLayoutMismatch, match=field):
            mine.check_compatible(bad)
    mine.check_compatible(_layout(2, 2, split=(3, 1)))


# --- P -> D between pipelined engines on the simulated cluster ----------------------------------------
@pytest.fixture(scope="module")
def ray_nodes():
    """Three simulated nodes of 4 CPUs on loopback, each its own raylet: a stage's ranks share a
    node, a replica's stages go to different nodes."""
    pytest.importorskip("ray", reason="needs ray (make setup installs it)")
    with simulated_cluster(3, 4, "pdserve-test-pipelined-pd") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def pp_engines(request, tiny_llama4, ray_nodes):
    """Engines built on first use and shared by the tests of one connector: engines(role, tp, pp).
    One rank runs in this process; more run on Ray worker actors (half a CPU each: eight ranks in
    all). Every engine can take a LoRA adapter; P chunks prompts into 32-token steps."""
    if request.param == "nixl":
        pytest.importorskip("nixl", reason="needs nixl: make setup installs it")
    built: dict[tuple[str, int, int], LLMEngine] = {}

    def engines(role: str, tp: int, pp: int) -> LLMEngine:
        if (role, tp, pp) not in built:
            args: dict = dict(LORA)
            if tp * pp > 1:
                args.update(tensor_parallel_size=tp, pipeline_parallel_size=pp, worker_num_cpus=0.5)
            if role == "p":
                args.update(max_num_batched_tokens=32)
            elif pp > 1:
                args.update(pp_layer_partition=D_SPLIT)
            built[role, tp, pp] = make_engine(tiny_llama4, request.param, **args)
        return built[role, tp, pp]

    yield engines
    for engine in built.values():
        if engine.config.parallel_config.world_size > 1:
            engine.executor.shutdown()


@pytest.fixture(scope="module")
def lora_a(tiny_llama4, tmp_path_factory) -> LoRARequest:
    path = make_adapter(tiny_llama4, str(tmp_path_factory.mktemp("lora") / "a"), 8,
                        ["q_proj", "k_proj", "v_proj", "down_proj"], seed=21)
    return LoRARequest("a", 1, path)


@pytest.fixture(scope="module")
def single_pd_reference(tiny_llama4, lora_a):
    """One colocated engine's greedy tokens (fp32), memoised: reference(ids, lora)."""
    engine = make_engine(tiny_llama4, None, **LORA)
    seen: dict[tuple, list[int]] = {}

    def reference(ids: list[int], lora: LoRARequest | None = None) -> list[int]:
        key = (tuple(ids), lora is not None)
        if key not in seen:
            params = GREEDY if lora is None else replace(GREEDY, lora_request=lora)
            seen[key] = run_one(engine, f"ref{len(seen)}", ids, params).outputs[0].token_ids
        return seen[key]

    return reference


@pytest.mark.ray
@pytest.mark.parametrize("pp_engines,p_shape,d_shape", CASES, indirect=["pp_engines"],
                         ids=[f"{c}-P{p[0]}x{p[1]}-D{d[0]}x{d[1]}" for c, p, d in CASES])
def test_pd_between_pipelined_engines(pp_engines, single_pd_reference, lora_a, p_shape, d_shape):
    """Token-identical to one engine for prompts of one token, one block and a chunked 300, a
    prompt under a LoRA adapter, and one sharing 4 blocks with an earlier prompt (D pulls only the
    rest); D's blocks hold P's bytes in every layer and head; every block free on both sides."""
    p, d = pp_engines("p", *p_shape), pp_engines("d", *d_shape)
    assert p.reset_prefix_cache() and d.reset_prefix_cache()
    if p_shape[1] > 1:
        assert len({pl["node_id"] for pl in p.executor.placements()}) == p_shape[1]      # stages spread
    under = replace(GREEDY, lora_request=lora_a)
    base = prompt(300, salt=3)
    cases = [(prompt(1, salt=1), GREEDY), (prompt(16, salt=2), GREEDY), (base, GREEDY),
             (prompt(50, salt=4), under), ([*base[:64], *prompt(40, salt=5)], GREEDY)]
    failures = d.stats().kv_transfer.load_failures
    for i, (ids, params) in enumerate(cases):
        before = d.stats().kv_transfer.blocks_pulled
        kv = prefill(p, f"r{i}", ids, params)
        num_full = len(ids) // 16
        sent = global_blocks(p, kv["remote_block_ids"][:num_full])
        out = run_one(d, f"r{i}", ids, params, kv, others=(p,))
        assert out.outputs[0].token_ids == single_pd_reference(ids, params.lora_request), i
        cached = 4 if i == len(cases) - 1 else 0            # the last shares base's first 4 blocks
        num_pulled = -(-(len(ids) - 1) // 16) - cached
        assert d.stats().kv_transfer.blocks_pulled - before == num_pulled, i
        # Every decode rank pulled its part; the parts add up to the blocks' every layer and head.
        log = [r for r in d.executor.kv_pull_log() if r.request_id == f"r{i}"]
        assert sorted(r.rank for r in log) == (list(range(d_shape[0] * d_shape[1])) if num_pulled else [])
        assert all(r.ok for r in log)
        # K/V x tokens x layers x heads x head_dim x fp32
        assert sum(r.num_bytes for r in log) == num_pulled * 2 * 16 * 4 * 2 * 16 * 4
        hashes = [bytes.fromhex(h) for h in kv["remote_block_hashes"][:num_full]]
        d_blocks = [d.kv_cache_manager.block_pool.cached[h].block_id for h in hashes]
        pulled = min(num_full * 16, len(ids) - 1)          # D computes the prompt's last token itself
        got = global_blocks(d, d_blocks)
        assert got.shape == sent.shape and got.shape[0] == 4
        assert torch.equal(got.flatten(2, 3)[:, :, :pulled], sent.flatten(2, 3)[:, :, :pulled]), i
        settle(p, d)
    assert d.stats().kv_transfer.load_failures == failures and p.stats().kv_transfer.leases_expired == 0
    p.check_no_leaks()
    d.check_no_leaks()


@pytest.mark.ray
@pytest.mark.parametrize("conn", CONNECTORS)
def test_pd_with_fp8_cache_between_pipelined_engines(tiny_llama4, ray_nodes, conn):
    """kv_cache_dtype="fp8" (scales 1.0 on both sides: calibration runs on one stage only): P split
    2+2 over two nodes, D TP 2 on one; D's greedy output equals one fp8 engine's and its blocks
    hold P's fp8 bytes."""
    if conn == "nixl":
        pytest.importorskip("nixl", reason="needs nixl: make setup installs it")
    fp8 = dict(kv_cache_dtype="fp8", calculate_kv_scales=False)
    ids = prompt(100, salt=7)
    want = run_one(make_engine(tiny_llama4, None, **fp8), "ref", ids).outputs[0].token_ids
    p = make_engine(tiny_llama4, conn, pipeline_parallel_size=2, worker_num_cpus=0.5, **fp8)
    d = make_engine(tiny_llama4, conn, tensor_parallel_size=2, worker_num_cpus=0.5, **fp8)
    try:
        kv = prefill(p, "x", ids)
        sent = global_blocks(p, kv["remote_block_ids"][:6])
        assert sent.dtype == torch.float8_e4m3fn
        assert run_one(d, "x", ids, GREEDY, kv, others=(p,)).outputs[0].token_ids == want
        settle(p, d)
        hashes = [bytes.fromhex(h) for h in kv["remote_block_hashes"][:6]]
        got = global_blocks(d, [d.kv_cache_manager.block_pool.cached[h].block_id for h in hashes])
        assert torch.equal(got.view(torch.uint8), sent.view(torch.uint8))
        assert d.stats().kv_transfer.load_failures == 0
    finally:
        for engine in (p, d):
            engine.executor.shutdown()


@pytest.mark.ray
@pytest.mark.parametrize("conn", ["nixl"])      # the failure's path is the engine's; its transport, NIXL's
def test_killed_prefill_stage_mid_pull(tiny_llama4, ray_nodes, block_accounting, conn):
    """P's second stage dies while D's pull waits to start: the pull fails as a whole (the first
    stage's part may have landed, the request never decodes over it), and D recomputes the prompt
    (policy recompute: the single engine's tokens) or ends the request with an error naming the
    pull (policy fail). D keeps serving and holds no block afterwards."""
    if conn == "nixl":
        pytest.importorskip("nixl", reason="needs nixl: make setup installs it")
    ids = prompt(100, salt=9)
    want = run_one(make_engine(tiny_llama4, None), "ref", ids).outputs[0].token_ids
    p = make_engine(tiny_llama4, conn, pipeline_parallel_size=2, worker_num_cpus=0.5)
    # Fresh decode engines that never reached P (see test_pd_across_ray_actors on UCX's mappings),
    # their pulls started 2 s late so that the kill lands between their plan and their reads.
    late = dict(kv_load_timeout_s=6.0, kv_connector_extra={"load_delay_s": 2.0})
    recompute = make_engine(tiny_llama4, conn, **late)
    fail = make_engine(tiny_llama4, conn, kv_load_failure_policy="fail", **late)
    try:
        kv = [prefill(p, f"x{i}", ids) for i in range(2)]
        for i, d in enumerate((recompute, fail)):
            d.add_request(f"x{i}", None, ids, GREEDY, kv_transfer_params=kv[i])
            d.step()                                   # plans the pull
            assert d.stats().kv_transfer.requests_waiting == 1
        kill_actor(p.executor.workers[1], "placement")          # stage 1's only rank
        deadline = time.monotonic() + DEADLINE_S
        outs = {}
        for i, d in enumerate((recompute, fail)):
            while f"x{i}" not in outs:
                outs.update((o.request_id, o) for o in d.step() if o.finished)
                assert time.monotonic() < deadline, "request hung"
        assert outs["x0"].outputs[0].token_ids == want
        assert recompute.stats().kv_transfer.load_failures == 1
        failed = outs["x1"].outputs[0]
        assert failed.finish_reason == "error" and "KV" in failed.stop_reason, failed.stop_reason
        assert run_one(fail, "after", prompt(30, salt=8)).outputs[0].finish_reason == "length"
        settle(recompute, fail)
    finally:
        p.executor.shutdown()
    # The dead engine is discarded whole, as its replica would be: its blocks went with its workers.
    block_accounting.remove(p)


# --- the card's shape served -----------------------------------------------------------------------
PROMPTS = ["The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
           "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
           "Within fifty years presses were running in more than two hundred cities, and",
           "A short list of reasons to learn a second language: it trains memory, it opens other "
           "literatures, it helps when travelling, and"]


@pytest.mark.ray
@pytest.mark.parametrize("connector", ["nixl"])    # the default (torch_dist: the tests above)
def test_serve_disaggregated_with_pipelined_pools(ray_nodes, connector):
    """Both pools run two stages, split differently (15+15 and 12+18): each replica's stages on two
    nodes, the same tokens and text as one engine, the KV moved stage by stage."""
    if connector == "nixl":
        pytest.importorskip("nixl", reason="needs nixl: make setup installs it")
    from cluster.config import ClusterConfig
    from cluster.launch import serve_cluster, shutdown
    from engine.llm import LLM

    engine = dict(max_model_len=512, max_num_seqs=8, kv_cache_memory_bytes=48 << 20)
    port = free_port()
    config = ClusterConfig(
        engine=engine, mode="disaggregated",
        # 30 layers: 15 + 15 on the prefill side, 12 + 18 on the decode side
        pools={"prefill": {"pipeline_parallel_size": 2},
               "decode": {"pipeline_parallel_size": 2, "pp_layer_partition": [12, 18]}},
        disaggregation={"connector": connector, "min_remote_prefill_tokens": 16, "load_timeout_s": 300},
        serving={"port": port, "wait_for_pools": False}, placement_timeout_s=120, name="pdserve-pp-serve")
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    with LLM(None, **engine) as llm:                        # one colocated engine: the reference
        want = [(o.outputs[0].text, o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy)]
    from ray.util import placement_group_table

    earlier = set(placement_group_table())           # the other tests' engines may still be up
    try:
        serve_cluster(config, blocking=False)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        for prompt, (text, token_ids) in zip(PROMPTS, want):
            out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.0,
                                            extra_body={"return_token_ids": True})
            assert out.choices[0].text == text
            assert out.choices[0].model_extra["token_ids"] == token_ids
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=60).text

        def total(name: str) -> float:
            return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", metrics, re.M))

        assert total("pdserve:kv_blocks_transferred_total") > 0, metrics      # the KV moved stage by stage
        assert total("pdserve:kv_load_failures_total") == 0
        # Each replica's two stages sit on two different nodes.
        spread = [g for pg, g in placement_group_table().items()
                  if pg not in earlier and g["state"] == "CREATED" and g["strategy"] == "STRICT_SPREAD"]
        assert [len(set(g["bundles_to_node_id"].values())) for g in spread] == [2, 2], spread
    finally:
        shutdown(config)
