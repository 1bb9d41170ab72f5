"""KV transfer benchmark: what moving a prompt's KV from a prefill engine to a decode engine costs.

    .venv/bin/python benchmarks/transfer.py                                      # full run
    .venv/bin/python benchmarks/transfer.py --blocks 100 --repeats 2 --prompt-len 200   # smoke

1. Throughput: the real worker-side connectors in two spawned processes, prefill P and decode D, with
   KV caches shaped like SmolLM2-135M's (30 layers, 16-token blocks, 3 KV heads of 64, bf16), 4 x
   --blocks blocks each. D pulls --blocks random (scattered) blocks leased by P into its own random
   blocks (start_load -> loaded). Baseline: the same bytes as ONE contiguous buffer over the same
   transport (a one-descriptor NIXL READ between plain agents; one gloo send/recv). Every copy is
   checked by SHA-256. Reported: median GB/s, scattered/raw (target >= 0.8), the untimed first pull.
2. TTFT on the embedded model, in-process as in tests/kv_transfer/test_kv_transfer.py: a plain engine's (no
   connector) prefill of a --prompt-len prompt (max_tokens=1) vs P's prefill (do_remote_decode) then D's
   add_request -> first token (pull + one-token step; P is stepped alongside). Engines idle-poll like
   AsyncLLMEngine; prefix caches are reset between runs; round 0 of every loop is an untimed warm-up.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")     # NIXL's INFO lines and the GGUF loader's
os.environ.setdefault("TQDM_DISABLE", "1")          # progress bars would bury the table

import numpy as np
import torch
import torch.distributed as dist

from kv_transfer.base import KVConnectorWorker
from kv_transfer.factory import create_connector_worker
from kv_transfer.leases import LeaseSlots
from pdserve_proto.transfer import from_params, to_params
from records.config import KVTransferConfig
from records.config_resolution import engine_config
from records.kv_layout import KVLayout
from records.transfer import LoadSpec, RemotePrefill

LAYOUT = KVLayout(model="bench", num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="bfloat16")
TIMEOUT_S = 300.0
TIMEOUT = timedelta(seconds=TIMEOUT_S)
POLL_S = 1e-4           # sleep between polls in every transfer loop (both sides, both paths)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def wait(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError("the other side did not answer")
    time.sleep(POLL_S)


def nixl_agent(name: str) -> Any:
    from nixl._api import nixl_agent as agent
    from nixl._api import nixl_agent_config

    return agent(f"{name}-{os.getpid()}", nixl_agent_config(backends=["UCX"]))


def make_worker(connector: str, role: str, num_blocks: int) -> KVConnectorWorker:
    extra = tuple(sorted(json.loads(os.environ.get("PDSERVE_BENCH_KV_EXTRA", "{}")).items()))
    config = KVTransferConfig(kv_connector=connector, engine_id=f"bench-{role}", load_timeout_s=TIMEOUT_S,
                              extra=extra)
    worker = create_connector_worker(config, LAYOUT)
    shape = (2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    fill = torch.randn if role == "p" else torch.zeros
    worker.register_kv_caches([fill(shape, dtype=torch.bfloat16) for _ in range(LAYOUT.num_layers)])
    return worker


def prefill_side(connector: str, blocks: int, repeats: int, to_p: Any, to_d: Any) -> None:
    worker = make_worker(connector, "p", 4 * blocks)
    rng = random.Random(1)
    slots = LeaseSlots()
    for i in range(repeats + 1):                       # round 0: untimed, sets up the connection
        ids = rng.sample(range(worker.num_blocks), blocks)
        slot, token = slots.take()
        worker.leases.hold(slot, token, ids)
        remote = RemotePrefill(worker.engine_id, f"req{i}", ids, [], blocks * LAYOUT.block_size, slot, token,
                               time.time() + 600, LAYOUT, [worker.address()])
        to_d.put((to_params(remote), digest(worker.gather_blocks(ids))))
        released = done = False
        deadline = time.monotonic() + TIMEOUT_S
        while not (released and done):                 # torch_dist serves the pull inside poll()
            if slot in [s for s, _ in worker.poll().released]:
                worker.end_leases([slot])
                slots.free(slot)
                released = True
            done = done or (not to_p.empty() and to_p.get() == "done")
            wait(deadline)
    raw = worker.gather_blocks(ids).view(-1).view(torch.uint8)     # the same bytes, contiguous
    worker.shutdown()
    del worker                     # a NIXL agent's progress thread spins a core until it is freed
    if connector == "nixl":
        agent = nixl_agent("bench-raw-p")
        agent.register_memory(raw)
        to_d.put((agent.get_agent_metadata(), raw.data_ptr(), digest(raw)))
        deadline = time.monotonic() + TIMEOUT_S
        while to_p.empty():                            # D reads one-sidedly; keep UCX progressing
            agent.get_new_notifs()
            wait(deadline)
        to_p.get()
    else:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        to_d.put((store.port, digest(raw)))
        group = dist.ProcessGroupGloo(store, 0, 2, TIMEOUT)
        while to_p.get(timeout=TIMEOUT_S) == "go":
            group.send([raw], 1, 0).wait()


def decode_side(connector: str, blocks: int, repeats: int, to_p: Any, to_d: Any) -> dict[str, Any]:
    worker = make_worker(connector, "d", 4 * blocks)
    rng = random.Random(2)
    scattered = []
    for i in range(repeats + 1):
        params, want = to_d.get(timeout=TIMEOUT_S)
        remote = from_params(params)
        ids = rng.sample(range(worker.num_blocks), blocks)
        for cache in worker.kv_caches:
            cache[:, ids] = 0
        spec = LoadSpec(f"req{i}", remote, ids, remote.block_ids, time.monotonic() + 120)
        start, deadline = time.perf_counter(), time.monotonic() + TIMEOUT_S
        worker.start_load(spec)
        while spec.request_id not in (report := worker.poll()).loaded:
            if report.failed:
                raise RuntimeError(f"pull failed: {report.failed}")
            wait(deadline)
        scattered.append(time.perf_counter() - start)
        worker.release_remote(remote)                  # as the decode engine does once all ranks pulled
        if digest(worker.gather_blocks(ids)) != want:
            raise RuntimeError(f"{connector}: the pulled blocks differ from the prefill side's")
        to_p.put("done")
    worker.shutdown()
    del worker
    buf = torch.zeros(blocks * LAYOUT.num_layers * 2 * LAYOUT.block_bytes, dtype=torch.uint8)
    contiguous = (raw_nixl if connector == "nixl" else raw_gloo)(buf, repeats, to_p, to_d)
    to_p.put("done")
    scattered_s, raw_s = statistics.median(scattered[1:]), statistics.median(contiguous[1:])
    return {"connector": connector, "bytes": buf.numel(), "first_s": scattered[0],
            "scattered_gbps": buf.numel() / scattered_s / 1e9, "raw_gbps": buf.numel() / raw_s / 1e9,
            "ratio": raw_s / scattered_s, "scattered_s": scattered[1:], "raw_s": contiguous[1:]}


def timed_copies(buf: torch.Tensor, want: str, repeats: int, copy: Callable[[], None]) -> list[float]:
    times = []
    for _ in range(repeats + 1):
        buf.zero_()
        start = time.perf_counter()
        copy()
        times.append(time.perf_counter() - start)
        if digest(buf) != want:
            raise RuntimeError("raw copy: the bytes differ from the prefill side's")
    return times


def raw_nixl(buf: torch.Tensor, repeats: int, to_p: Any, to_d: Any) -> list[float]:
    agent = nixl_agent("bench-raw-d")
    agent.register_memory(buf)
    metadata, remote_addr, want = to_d.get(timeout=TIMEOUT_S)
    peer = agent.add_remote_agent(metadata)
    peer = peer.decode() if isinstance(peer, bytes) else peer
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[buf.data_ptr(), buf.numel(), 0]]), "DRAM")
    remote = agent.prep_xfer_dlist(peer, np.array([[remote_addr, buf.numel(), 0]]), "DRAM")

    def read() -> None:
        handle = agent.make_prepped_xfer("READ", local, [0], remote, [0])
        state, deadline = agent.transfer(handle), time.monotonic() + TIMEOUT_S
        while state == "PROC":
            wait(deadline)
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ failed ({state})")

    return timed_copies(buf, want, repeats, read)


def raw_gloo(buf: torch.Tensor, repeats: int, to_p: Any, to_d: Any) -> list[float]:
    port, want = to_d.get(timeout=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    group = dist.ProcessGroupGloo(store, 1, 2, TIMEOUT)

    def recv() -> None:
        to_p.put("go")
        group.recv([buf], 0, 0).wait()

    return timed_copies(buf, want, repeats, recv)


def child(role: str, results: Any, fn: Callable[..., Any], *args: Any) -> None:
    torch.set_num_threads(1)
    try:
        results.put((role, fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops both sides
        results.put((role, {"error": traceback.format_exc()}))


def bench_throughput(connector: str, blocks: int, repeats: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    to_p, to_d, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=child, args=(role, results, fn, connector, blocks, repeats, to_p, to_d))
             for role, fn in (("p", prefill_side), ("d", decode_side))]
    for proc in procs:
        proc.start()
    try:
        got: dict[str, Any] = {}
        while len(got) < 2:
            role, value = results.get(timeout=2 * TIMEOUT_S)
            if isinstance(value, dict) and "error" in value:
                raise RuntimeError(f"{connector}: the {role} side failed:\n{value['error']}")
            got[role] = value
        return got["d"]
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()


def bench_ttft(connectors: list[str], prompt_len: int, repeats: int, dtype: str) -> list[dict[str, Any]]:
    from engine.async_engine import IDLE_POLL_S
    from engine.llm_engine import LLMEngine
    from records.sampling_params import SamplingParams

    ids = [(i * 7 + 3) % 30000 + 5 for i in range(prompt_len)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def engine(connector: str | None) -> LLMEngine:
        return LLMEngine(engine_config(None, dtype=dtype, kv_connector=connector, max_model_len=4096,
                                             kv_load_timeout_s=TIMEOUT_S))

    def run(e: LLMEngine, rid: str, kv: dict[str, Any] | None = None, peer: LLMEngine | None = None
            ) -> tuple[float, Any]:
        start, deadline = time.perf_counter(), time.monotonic() + TIMEOUT_S
        e.add_request(rid, None, ids, one, kv_transfer_params=kv)
        while time.monotonic() < deadline:
            for out in e.step():
                if out.request_id == rid and out.finished:
                    return time.perf_counter() - start, out
            if peer is not None:
                peer.step()                            # P serves the pull / ends the lease
            if e.last_step_idle:
                time.sleep(IDLE_POLL_S)
        raise TimeoutError(f"request {rid} hung")

    def settle(*engines: LLMEngine) -> None:
        while any(e.has_unfinished_requests() for e in engines):
            for e in engines:
                e.step()
            time.sleep(IDLE_POLL_S)
        assert all(e.reset_prefix_cache() for e in engines)

    alone, colocated = engine(None), []                # no connector: nothing runs beside the model
    for i in range(repeats + 1):                       # round 0 of every loop: untimed warm-up
        colocated.append(run(alone, f"c{i}")[0])
        settle(alone)
    del alone
    results = []
    for connector in connectors:
        p, d = engine(connector), engine(connector)
        prefill, decode = [], []
        for i in range(repeats + 1):
            prefill_s, out = run(p, f"x{i}", {"do_remote_decode": True})
            decode.append(run(d, f"x{i}", out.kv_transfer_params, peer=p)[0])
            prefill.append(prefill_s)
            settle(p, d)
        if d.stats().kv_transfer.load_failures or d.stats().kv_transfer.loads != repeats + 1:
            raise RuntimeError(f"{connector}: D computed a prompt instead of pulling it: {d.stats()}")
        del p, d                                       # frees the NIXL agents (and their threads)
        gc.collect()
        row = {key: statistics.median(values[1:]) for key, values in
               (("colocated_s", colocated), ("prefill_s", prefill), ("decode_first_token_s", decode))}
        total = row["prefill_s"] + row["decode_first_token_s"]
        results.append({"connector": connector, "prompt_len": prompt_len, "dtype": dtype, **row,
                        "split_total_s": total, "split_over_colocated": total / row["colocated_s"]})
    return results


def table(title: str, rows: list[dict[str, Any]], columns: list[tuple[str, str, float]]) -> None:
    """Print one row per connector; columns are (header, key, scale)."""
    cols = [(h, key, scale, max(len(h), 8) + 2) for h, key, scale in columns]
    print(f"\n{title}\n{'connector':<11}" + "".join(f"{h:>{w}}" for h, _, _, w in cols))
    for r in rows:
        print(f"{r['connector']:<11}" + "".join(f"{r[key] * scale:>{w}.2f}" for _, key, scale, w in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--connectors", default="nixl,torch_dist")
    ap.add_argument("--blocks", type=int, default=1000, help="scattered blocks per transfer")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats (medians are reported)")
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--dtype", default="bfloat16", help="model dtype for the TTFT part")
    ap.add_argument("--skip-ttft", action="store_true")
    args = ap.parse_args()
    connectors = [c for c in args.connectors.split(",") if c]

    throughput = [bench_throughput(c, args.blocks, args.repeats) for c in connectors]
    table(f"Throughput: {args.blocks} scattered blocks vs one contiguous buffer, bytes verified "
          f"(median of {args.repeats})", throughput,
          [("MB", "bytes", 1e-6), ("scattered GB/s", "scattered_gbps", 1), ("raw GB/s", "raw_gbps", 1),
           ("ratio", "ratio", 1), ("first pull ms", "first_s", 1e3)])
    ttft = [] if args.skip_ttft else bench_ttft(connectors, args.prompt_len, args.repeats, args.dtype)
    if ttft:
        table(f"TTFT, ms: {args.prompt_len}-token prompt, {args.dtype} (median of {args.repeats})", ttft,
              [("colocated", "colocated_s", 1e3), ("P prefill", "prefill_s", 1e3),
               ("D first token (split)", "decode_first_token_s", 1e3), ("P+D", "split_total_s", 1e3),
               ("P+D / colocated", "split_over_colocated", 1)])
    print(json.dumps({"throughput": throughput, "ttft": ttft}))


if __name__ == "__main__":
    main()
