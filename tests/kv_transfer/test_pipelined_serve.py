"""The card's shape served end to end: `cluster.launch` (what `pdserve serve` runs) deploys a
disaggregated spec whose decode pool runs two pipeline stages on different nodes of the simulated
three-node cluster, and the official `openai` client gets the same tokens and text as one colocated
engine of the embedded model, with the prompt's KV pulled stage by stage."""
from __future__ import annotations

import re

import httpx
import openai
import pytest
from helpers import free_port

from records.sampling_params import SamplingParams

PROMPTS = ["The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
           "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
           "Within fifty years presses were running in more than two hundred cities, and",
           "A short list of reasons to learn a second language: it trains memory, it opens other "
           "literatures, it helps when travelling, and"]


@pytest.mark.ray
@pytest.mark.parametrize("connector", ["nixl"])    # the default (torch_dist: test_pipelined_pd.py)
def test_serve_disaggregated_with_a_pipelined_decode_pool(ray_nodes, connector):
    if connector == "nixl":
        pytest.importorskip("nixl", reason="needs nixl: make setup installs it")
    from cluster.config import ClusterConfig
    from cluster.launch import serve_cluster, shutdown
    from engine.llm import LLM

    engine = dict(max_model_len=512, max_num_seqs=8, kv_cache_memory_bytes=48 << 20)
    port = free_port()
    config = ClusterConfig(
        engine=engine, mode="disaggregated",
        # 30 layers split 12 + 18 on the decode side (the prefill replica holds all 30)
        pools={"prefill": {"replicas": 1}, "decode": {"pipeline_parallel_size": 2, "pp_layer_partition": [12, 18]}},
        disaggregation={"connector": connector, "min_remote_prefill_tokens": 16, "load_timeout_s": 300},
        serving={"port": port, "wait_for_pools": False}, placement_timeout_s=120, name="pdserve-pp-serve")
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    with LLM(None, **engine) as llm:                        # one colocated engine: the reference
        want = [(o.outputs[0].text, o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy)]
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
        # The decode replica's two stages sit on two different nodes.
        from ray.util import placement_group_table

        spread = [g for g in placement_group_table().values()
                  if g["state"] == "CREATED" and g["strategy"] == "STRICT_SPREAD"]
        assert [len(set(g["bundles_to_node_id"].values())) for g in spread] == [2], spread
    finally:
        shutdown(config)
