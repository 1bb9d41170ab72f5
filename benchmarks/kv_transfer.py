"""KV transfer benchmark: what moving a prompt's KV blocks from a prefill engine to a decode engine costs.

    .venv/bin/python benchmarks/kv_transfer.py                                # full run, both connectors
    .venv/bin/python benchmarks/kv_transfer.py --blocks 100 --repeats 2 --prompt-len 200   # smoke test

1. Throughput. The real worker-side connectors (`kv_transfer/`) run in two spawned processes, a prefill
   side P and a decode side D, each with a KV cache shaped like SmolLM2-135M's (30 layers, block_size
   16, 3 KV heads, head_dim 64, bf16) of 4 x --blocks blocks. P leases --blocks randomly chosen
   (scattered) blocks and hands D the `RemotePrefill` record; D pulls them into its own random blocks
   and polls until loaded (start_load -> loaded is timed). The baseline moves the same bytes as ONE
   contiguous buffer over the same transport: a single-descriptor NIXL READ between two plain agents,
   or one gloo send/recv over a TCPStore-backed pair group. Bytes are checked with a SHA-256 of the
   gathered blocks on both sides. Reported: median GB/s of each, their ratio (target >= 0.8) and the
   untimed first pull (connection setup included).
2. TTFT on the embedded model (in-process, as tests/test_kv_transfer.py drives P and D): one engine
   prefilling a --prompt-len token prompt (max_tokens=1) against P's prefill with do_remote_decode,
   then D's add_request -> first token (pull + a one-token step; P is stepped alongside to serve it).
   The engines idle-poll like AsyncLLMEngine. Prefix caches are reset between runs.

Prints a plain-text table, then one JSON line with every figure.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.config import KVTransferConfig  # noqa: E402
from kv_transfer.base import KVConnectorWorker, KVLayout, LoadSpec, RemotePrefill  # noqa: E402
from kv_transfer.factory import create_connector_worker  # noqa: E402

LAYOUT = KVLayout(model="bench", num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="bfloat16")
TIMEOUT_S = 300.0
POLL_S = 1e-4           # sleep between polls in the transfer loops (both sides, both paths)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def wait(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError("the other side did not answer")
    time.sleep(POLL_S)


def ready(q: Any) -> bool:
    """True if a message waits in `q` (and takes it)."""
    try:
        q.get_nowait()
        return True
    except queue.Empty:
        return False


def make_worker(connector: str, role: str, num_blocks: int) -> KVConnectorWorker:
    config = KVTransferConfig(kv_connector=connector, engine_id=f"bench-{role}", load_timeout_s=TIMEOUT_S)
    worker = create_connector_worker(config, LAYOUT)
    shape = (2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    fill = torch.randn if role == "p" else torch.zeros
    worker.register_kv_caches([fill(shape, dtype=torch.bfloat16) for _ in range(LAYOUT.num_layers)])
    return worker


# --- prefill side --------------------------------------------------------------------------------------
def prefill_side(connector: str, blocks: int, repeats: int, to_p: Any, to_d: Any) -> None:
    worker = make_worker(connector, "p", 4 * blocks)
    rng = random.Random(1)
    for i in range(repeats + 1):                       # round 0: untimed, sets up the connection
        ids = rng.sample(range(worker.num_blocks), blocks)
        slot, token = worker.start_lease(ids)
        remote = RemotePrefill(worker.engine_id, f"req{i}", ids, [], blocks * LAYOUT.block_size, slot, token,
                               time.time() + 600, LAYOUT, worker.address())
        to_d.put((remote.to_dict(), digest(worker.gather_blocks(ids))))
        released = done = False
        deadline = time.monotonic() + TIMEOUT_S
        while not (released and done):                 # poll: torch_dist serves the pull in here
            if slot in [s for s, _ in worker.poll().released]:
                worker.end_leases([slot])
                released = True
            done = done or ready(to_p)
            wait(deadline)
    raw = worker.gather_blocks(ids).view(-1).view(torch.uint8)     # the same bytes, contiguous
    worker.shutdown()
    deadline = time.monotonic() + TIMEOUT_S
    if connector == "nixl":
        agent = nixl_agent("bench-raw-p")
        agent.register_memory(raw)
        to_d.put((agent.get_agent_metadata(), raw.data_ptr(), digest(raw)))
        while not ready(to_p):                         # D reads one-sidedly: just keep UCX going
            agent.get_new_notifs()
            wait(deadline)
    else:
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                           timeout=timedelta(seconds=TIMEOUT_S))
        to_d.put((store.port, digest(raw)))
        group = torch.distributed.ProcessGroupGloo(store, 0, 2, timedelta(seconds=TIMEOUT_S))
        for _ in range(repeats + 1):
            to_p.get(timeout=TIMEOUT_S)                # "go"
            group.send([raw], 1, 0).wait()
        to_p.get(timeout=TIMEOUT_S)


def nixl_agent(name: str) -> Any:
    from nixl._api import nixl_agent as agent, nixl_agent_config  # noqa: PLC0415 (optional install)

    return agent(f"{name}-{os.getpid()}", nixl_agent_config(backends=["UCX"]))


# --- decode side ---------------------------------------------------------------------------------------
def decode_side(connector: str, blocks: int, repeats: int, to_p: Any, to_d: Any) -> dict[str, Any]:
    worker = make_worker(connector, "d", 4 * blocks)
    rng = random.Random(2)
    scattered = []
    for i in range(repeats + 1):
        params, want = to_d.get(timeout=TIMEOUT_S)
        remote = RemotePrefill.from_dict(params)
        ids = rng.sample(range(worker.num_blocks), blocks)
        for cache in worker.kv_caches:
            cache[:, ids] = 0
        spec = LoadSpec(f"req{i}", remote, ids, remote.block_ids, time.monotonic() + 120)
        start = time.perf_counter()
        worker.start_load(spec)
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            report = worker.poll()
            if report.failed:
                raise RuntimeError(f"pull failed: {report.failed}")
            if spec.request_id in report.loaded:
                break
            wait(deadline)
        scattered.append(time.perf_counter() - start)
        if digest(worker.gather_blocks(ids)) != want:
            raise RuntimeError(f"{connector}: the pulled blocks differ from the prefill side's")
        to_p.put("done")
    worker.shutdown()
    raw = torch.zeros(blocks * LAYOUT.num_layers * 2 * LAYOUT.block_bytes, dtype=torch.uint8)
    contiguous = (raw_nixl if connector == "nixl" else raw_gloo)(raw, repeats, to_p, to_d)
    return {"connector": connector, "blocks": blocks, "bytes": raw.numel(), "first_s": scattered[0],
            "scattered_s": scattered[1:], "raw_s": contiguous[1:], "verified": True}


def raw_nixl(buf: torch.Tensor, repeats: int, to_p: Any, to_d: Any) -> list[float]:
    agent = nixl_agent("bench-raw-d")
    agent.register_memory(buf)
    metadata, remote_addr, want = to_d.get(timeout=TIMEOUT_S)
    peer = agent.add_remote_agent(metadata)
    peer = peer.decode() if isinstance(peer, bytes) else peer
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[buf.data_ptr(), buf.numel(), 0]]), "DRAM")
    remote = agent.prep_xfer_dlist(peer, np.array([[remote_addr, buf.numel(), 0]]), "DRAM")
    times = []
    for _ in range(repeats + 1):
        buf.zero_()
        handle = agent.make_prepped_xfer("READ", local, [0], remote, [0])
        start, deadline = time.perf_counter(), time.monotonic() + TIMEOUT_S
        state = agent.transfer(handle)
        while state == "PROC":
            wait(deadline)
            state = agent.check_xfer_state(handle)
        times.append(time.perf_counter() - start)
        agent.release_xfer_handle(handle)
        if state != "DONE" or digest(buf) != want:
            raise RuntimeError(f"raw NIXL READ failed ({state}) or its bytes differ")
    to_p.put("done")
    return times


def raw_gloo(buf: torch.Tensor, repeats: int, to_p: Any, to_d: Any) -> list[float]:
    port, want = to_d.get(timeout=TIMEOUT_S)
    timeout = timedelta(seconds=TIMEOUT_S)
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    group = torch.distributed.ProcessGroupGloo(store, 1, 2, timeout)
    times = []
    for _ in range(repeats + 1):
        buf.zero_()
        to_p.put("go")
        start = time.perf_counter()
        group.recv([buf], 0, 0).wait()
        times.append(time.perf_counter() - start)
        if digest(buf) != want:
            raise RuntimeError("raw gloo recv: bytes differ")
    to_p.put("done")
    return times


def child(role: str, results: Any, fn: Any, *args: Any) -> None:
    torch.set_num_threads(1)
    try:
        results.put((role, fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops both sides
        results.put((role, {"error": traceback.format_exc()}))


def bench_throughput(connector: str, blocks: int, repeats: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    to_p, to_d, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=child, args=("p", results, prefill_side, connector, blocks, repeats, to_p, to_d)),
             ctx.Process(target=child, args=("d", results, decode_side, connector, blocks, repeats, to_p, to_d))]
    for proc in procs:
        proc.start()
    try:
        got: dict[str, Any] = {}
        while len(got) < 2:
            role, value = results.get(timeout=2 * TIMEOUT_S)
            if isinstance(value, dict) and "error" in value:
                raise RuntimeError(f"{connector} {role} side failed:\n{value['error']}")
            got[role] = value
        return got["d"]
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()


# --- TTFT on the embedded model -------------------------------------------------------------------------
def bench_ttft(connector: str, prompt_len: int, repeats: int, dtype: str) -> dict[str, Any]:
    from engine.async_engine import IDLE_POLL_S  # noqa: PLC0415
    from engine.config import EngineConfig  # noqa: PLC0415
    from engine.llm_engine import LLMEngine  # noqa: PLC0415
    from engine.sampling_params import SamplingParams  # noqa: PLC0415

    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig.create(None, dtype=dtype, kv_connector=connector, max_model_len=4096,
                                             kv_load_timeout_s=TIMEOUT_S))

    p, d = engine(), engine()
    ids = [(i * 7 + 3) % 30000 + 5 for i in range(prompt_len)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(e: LLMEngine, rid: str, kv: dict[str, Any] | None = None) -> tuple[float, Any]:
        start, deadline = time.perf_counter(), time.monotonic() + TIMEOUT_S
        e.add_request(rid, None, ids, one, kv_transfer_params=kv)
        while time.monotonic() < deadline:
            for out in e.step():
                if out.request_id == rid and out.finished:
                    return time.perf_counter() - start, out
            if e is d:
                p.step()                               # P serves / releases while D waits
            if e.last_step_idle:
                time.sleep(IDLE_POLL_S)
        raise TimeoutError(f"request {rid} hung")

    def settle() -> None:
        while p.has_unfinished_requests() or d.has_unfinished_requests():
            p.step()
            d.step()
            time.sleep(IDLE_POLL_S)
        assert p.reset_prefix_cache() and d.reset_prefix_cache()

    rows: dict[str, list[float]] = {"colocated_s": [], "prefill_s": [], "decode_first_token_s": []}
    for i in range(repeats + 1):                       # round 0: warm-up (connections, allocator)
        colocated, _ = run(p, f"c{i}")
        settle()
        prefill, out = run(p, f"x{i}", {"do_remote_decode": True})
        decode, _ = run(d, f"x{i}", out.kv_transfer_params)
        settle()
        if i:
            for key, value in zip(rows, (colocated, prefill, decode)):
                rows[key].append(value)
    stats = d.stats()
    if stats["kv_load_failures"] or stats["kv_loads"] != repeats + 1:
        raise RuntimeError(f"{connector}: D did not pull every prompt: {stats}")
    return {"connector": connector, "prompt_len": prompt_len, "dtype": dtype,
            **{key: statistics.median(values) for key, values in rows.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--connectors", default="nixl,torch_dist")
    ap.add_argument("--blocks", type=int, default=1000, help="scattered blocks per transfer")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats (median reported)")
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--dtype", default="bfloat16", help="model dtype for the TTFT part")
    ap.add_argument("--skip-ttft", action="store_true")
    args = ap.parse_args()
    connectors = [c for c in args.connectors.split(",") if c]

    throughput = [bench_throughput(c, args.blocks, args.repeats) for c in connectors]
    print(f"\nThroughput: {args.blocks} scattered blocks vs one contiguous buffer (median of {args.repeats})")
    print(f"{'connector':<11}{'MB':>8}{'scattered GB/s':>16}{'raw GB/s':>10}{'ratio':>7}{'first pull s':>14}  ok")
    for r in throughput:
        r["scattered_gbps"] = r["bytes"] / statistics.median(r["scattered_s"]) / 1e9
        r["raw_gbps"] = r["bytes"] / statistics.median(r["raw_s"]) / 1e9
        r["ratio"] = r["scattered_gbps"] / r["raw_gbps"]
        print(f"{r['connector']:<11}{r['bytes'] / 1e6:>8.1f}{r['scattered_gbps']:>16.2f}{r['raw_gbps']:>10.2f}"
              f"{r['ratio']:>7.2f}{r['first_s']:>14.3f}  {'yes' if r['verified'] else 'NO'}")

    ttft = [] if args.skip_ttft else [bench_ttft(c, args.prompt_len, args.repeats, args.dtype) for c in connectors]
    if ttft:
        print(f"\nTTFT: {args.prompt_len}-token prompt, {args.dtype}, ms (median of {args.repeats})")
        print(f"{'connector':<11}{'colocated':>10}{'P prefill':>11}{'D 1st tok (split)':>19}{'P+D':>9}{'P+D/coloc':>11}")
        for r in ttft:
            total = r["prefill_s"] + r["decode_first_token_s"]
            r["split_total_s"], r["split_over_colocated"] = total, total / r["colocated_s"]
            print(f"{r['connector']:<11}{r['colocated_s'] * 1e3:>10.1f}{r['prefill_s'] * 1e3:>11.1f}"
                  f"{r['decode_first_token_s'] * 1e3:>19.1f}{total * 1e3:>9.1f}{r['split_over_colocated']:>11.2f}")
    print(json.dumps({"throughput": throughput, "ttft": ttft}))


if __name__ == "__main__":
    main()
