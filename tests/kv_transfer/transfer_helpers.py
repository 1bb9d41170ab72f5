"""What the KV-transfer tests share: prompts, engines made with a connector, stepping a prefill
engine and a decode engine together until a request ends or every transfer settles, the single
engine they must agree with, and an engine's KV blocks reassembled from its ranks."""
from __future__ import annotations

import time

import torch

from engine.llm_engine import LLMEngine
from records.config_resolution import engine_config
from records.outputs import RequestOutput
from records.sampling_params import SamplingParams

CONNECTORS = ["torch_dist", "nixl"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# A hang guard, not a deadline: make test runs these files at nice 19 beside the Ray tests, where
# a process can wait tens of seconds for a core.
DEADLINE_S = 300.0


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + 3 + salt * 131) % 1000 + 5 for i in range(n)]


def make_engine(model: str, connector: str | None, **kwargs) -> LLMEngine:
    args = dict(dtype="float32", num_kv_blocks=64, max_model_len=512)
    if connector is not None:
        # A pull's deadline covers its first connect (a gloo pair group between two engine threads).
        # In make test this file runs at nice 19 beside the Ray tests: there a first connect took
        # past the default 10 s, and later past 30 s, and the pull recomputed (right tokens, one
        # kv_load_failure). The fault tests set their own.
        args.update(kv_connector=connector, kv_load_timeout_s=DEADLINE_S)
    return LLMEngine(engine_config(model, **{**args, **kwargs}))


def run_one(engine: LLMEngine, rid: str, ids: list[int], params: SamplingParams = GREEDY,
            kv_transfer_params: dict | None = None, others: tuple[LLMEngine, ...] = (),
            trace_context: dict | None = None) -> RequestOutput:
    """Step `engine` (and `others`, so their transfers progress) until request `rid` finishes."""
    engine.add_request(rid, None, ids, params, kv_transfer_params=kv_transfer_params, trace_context=trace_context)
    deadline = time.monotonic() + DEADLINE_S
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out
        for other in others:
            other.step()
        assert time.monotonic() < deadline, "request hung"


def settle(*engines: LLMEngine) -> None:
    """Step every engine until none has work left (leases released, pulls ended)."""
    deadline = time.monotonic() + DEADLINE_S
    while any(e.has_unfinished_requests() for e in engines):
        for e in engines:
            e.step()
        time.sleep(0.001)
        assert time.monotonic() < deadline, "transfers never settled"


def prefill(p: LLMEngine, rid: str, ids: list[int], params: SamplingParams = GREEDY,
            trace_context: dict | None = None) -> dict:
    out = run_one(p, rid, ids, params, {"do_remote_decode": True}, trace_context=trace_context)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 1
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params


def reference(model: str, ids_list: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    engine = make_engine(model, None)
    return [run_one(engine, f"ref{i}", ids, params).outputs[0].token_ids for i, ids in enumerate(ids_list)]


def global_blocks(engine: LLMEngine, block_ids: list[int]) -> torch.Tensor:
    """Every layer's and every KV head's K and V of these blocks, [layers, 2, n, block_size, heads,
    d], reassembled from the engine's ranks (stage-major: a stage's TP ranks hold its layers' heads
    in order; tp <= num_kv_heads)."""
    ranks = engine.executor.kv_blocks(block_ids)
    tp = engine.config.parallel_config.tensor_parallel_size
    stages = [torch.cat(ranks[s:s + tp], dim=-2) for s in range(0, len(ranks), tp)]
    return torch.cat(stages, dim=0)


def kill_actor(actor, probe: str) -> None:
    """`ray.kill` the actor and wait until a call of its method `probe` fails with RayActorError
    (ray.kill returns before the process is gone)."""
    import ray

    ray.kill(actor)
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            ray.get(getattr(actor, probe).remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        assert time.monotonic() < deadline, "the actor would not die"
        time.sleep(0.05)

