"""KV transfer between engines (prefill P -> decode D) through both connectors.

In-process tests run P and D as two engines stepped alternately (the transports still go through
their real channels: UCX for NIXL, a TCPStore and a gloo pair group for torch.distributed); the Ray
tests put them in separate actor processes. Every test ends with block accounting at zero on both
sides (the conftest fixture checks every engine made)."""
from __future__ import annotations

import time

import pytest
import torch
from transfer_helpers import (
    CONNECTORS,
    DEADLINE_S,
    GREEDY,
    kill_actor,
    make_engine,
    prefill,
    prompt,
    reference,
    run_one,
    settle,
)

from kv_transfer.base import KVConnectorScheduler
from kv_transfer.leases import LeaseSlots, LeaseTable
from kv_transfer.torch_dist import scatter_blocks
from records.config_resolution import engine_config
from records.engine_stats import KVTransferStats
from records.errors import KVLayoutMismatch, KVTransferError
from records.hashing import hash_block_tokens
from records.kv_layout import KVLayout
from records.sampling_params import SamplingParams


@pytest.fixture(params=CONNECTORS)
def connector(request) -> str:
    if request.param == "nixl":
        pytest.importorskip("nixl", reason="needs nixl: make setup installs it (pip install --no-deps "
                                           "nixl==1.5.1 nixl-cu13==1.5.1)")
    return request.param


# --- unit: records and the lease table -----------------------------------------------------------------
def test_layout_mismatch_names_the_field(tiny_llama):
    config = engine_config(tiny_llama, dtype="float32", max_model_len=512)
    layout = KVLayout.from_config(config)
    other = KVLayout.from_config(engine_config(tiny_llama, dtype="float32", block_size=8, max_model_len=512))
    with pytest.raises(KVLayoutMismatch, match="block_size is 8 but this engine's is 16"):
        layout.check_compatible(other)
    layout.check_compatible(KVLayout.from_config(config))


def test_lease_slots_and_table():
    """The engine's slots hand out unique tokens; a rank's table mirrors them and clears its word on
    release, so a reader holding an old token sees the lease gone."""
    slots, table = LeaseSlots(num_slots=2), LeaseTable(num_slots=2)
    slot_a, token_a = slots.take()
    slot_b, token_b = slots.take()
    assert slots.take() is None                          # full
    table.hold(slot_a, token_a, [1, 2])
    table.hold(slot_b, token_b, [3])
    assert token_a != token_b and table.is_live(slot_a, token_a)
    table.release(slot_a)
    slots.free(slot_a)
    assert not table.is_live(slot_a, token_a) and int(table.words[slot_a]) == 0
    slot_c, token_c = slots.take()
    table.hold(slot_c, token_c, [5])
    assert slot_c == slot_a and token_c != token_a and not table.is_live(slot_a, token_a)


@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 64), (torch.float32, 8), (torch.float16, 3)])
@pytest.mark.parametrize("heads", [None, slice(1, 3)])
def test_scatter_blocks_matches_index_copy(dtype, head_dim, heads):
    """The CPU scatter (NumPy over the cache's bytes) writes exactly what torch's indexing would."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 40, 4, 4, head_dim, generator=gen).to(dtype)
    index = torch.randperm(40, generator=gen)[:13]
    width = 4 if heads is None else heads.stop - heads.start
    received = torch.randn(2, 13, 4, width, head_dim, generator=gen).to(dtype)
    want = cache.clone()
    if heads is None:
        want.index_copy_(1, index, received)
    else:
        want[:, index, :, heads] = received
    scatter_blocks(cache, index, heads, received)
    assert torch.equal(cache, want)


def test_pair_threads_run_in_order_and_never_hold_up_exit():
    """A torch_dist pair's work runs in order on one daemon thread (a pair group that never forms
    must not keep a finished process from exiting); shutdown cancels what has not started."""
    import threading

    from kv_transfer.torch_dist import _PairThread

    worker = _PairThread()
    gate, order = threading.Event(), []
    first = worker.submit(gate.wait, 30)
    rest = [worker.submit(order.append, i) for i in range(3)]
    assert [t.daemon for t in threading.enumerate() if t.name == "pdserve-kv-pair"] and not first.done()
    gate.set()
    assert [f.result(timeout=30) for f in rest] == [None] * 3 and order == [0, 1, 2]
    assert isinstance(worker.submit(lambda: 1 / 0).exception(timeout=30), ZeroDivisionError)
    gate.clear()
    started = threading.Event()
    running = worker.submit(lambda: started.set() or gate.wait(30))
    queued = worker.submit(order.append, 3)
    assert started.wait(30)
    worker.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert running.result(timeout=30) and queued.cancelled() and order == [0, 1, 2]
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit(order.append, 4).result(timeout=30)


@pytest.mark.parametrize("heads,src_tp,dst_tp,want", [
    (2, 1, 1, [[(0, 0, 0, 2)]]),
    (2, 2, 2, [[(0, 0, 0, 1)], [(1, 0, 0, 1)]]),
    (2, 1, 2, [[(0, 0, 0, 1)], [(0, 1, 0, 1)]]),                  # each decode rank: half of P's heads
    (2, 2, 1, [[(0, 0, 0, 1), (1, 0, 1, 1)]]),                   # one decode rank: both prefill ranks
    (4, 4, 2, [[(0, 0, 0, 1), (1, 0, 1, 1)], [(2, 0, 0, 1), (3, 0, 1, 1)]]),
    (2, 4, 4, [[(0, 0, 0, 1)], [(1, 0, 0, 1)], [(2, 0, 0, 1)], [(3, 0, 0, 1)]]),   # replicated heads
    (2, 4, 1, [[(0, 0, 0, 1), (2, 0, 1, 1)]]),                    # a replicated head from its first holder
    (2, 1, 4, [[(0, 0, 0, 1)], [(0, 0, 0, 1)], [(0, 1, 0, 1)], [(0, 1, 0, 1)]]),
])
def test_head_slices(heads, src_tp, dst_tp, want):
    """Which prefill ranks hold each decode rank's KV heads, checked by hand and against a
    head-by-head reassembly."""
    from records.kv_layout import head_slices

    def layout(tp, rank=0):
        return KVLayout("m", 2, 16, heads, 8, "float32", rank, tp)

    got = [[(s.src_rank, s.src_start, s.dst_start, s.count) for s in head_slices(layout(src_tp), layout(dst_tp, r))]
           for r in range(dst_tp)]
    assert got == want
    for r in range(dst_tp):
        dst = layout(dst_tp, r)
        placed = {}
        for s in head_slices(layout(src_tp), dst):
            for i in range(s.count):
                placed[s.dst_start + i] = layout(src_tp, s.src_rank).rank_heads(s.src_rank)[s.src_start + i]
        assert [placed[i] for i in range(dst.local_kv_heads)] == list(dst.rank_heads(r))


def test_worker_group_waits_for_every_rank():
    """A pull is done only when every rank has finished it: one rank's failure is held back until
    the other rank stops writing, then reported as a failure naming the rank."""
    from kv_transfer.worker_group import KVWorkerGroup
    from records.transfer import LoadSpec, TransferReport

    group = KVWorkerGroup("e", [{}, {}])
    for rid in ("a", "b"):
        group.start_load(LoadSpec(rid, None, [1], [2], 0.0))
    group.hold_lease(3, 99, [4, 5])
    assert [op[0] for op in group.take_ops()] == ["load", "load", "hold"] and group.has_pending()
    group.collect([TransferReport(loaded=["a"]), TransferReport(failed=[("b", "boom")])])
    assert group.take_report() == TransferReport()              # rank 1 has not finished a, rank 0 b
    group.collect([TransferReport(loaded=["b"], released=[(3, 99)]), TransferReport(loaded=["a"])])
    report = group.take_report()
    assert report.loaded == ["a"] and report.failed == [("b", "rank 1: boom")]
    assert report.released == [(3, 99)] and not group.has_pending()


def test_bad_transfer_params_are_refused(tiny_llama):
    d = make_engine(tiny_llama, "torch_dist")
    plain = make_engine(tiny_llama, None)
    with pytest.raises(ValueError, match="need a KV connector"):
        plain.add_request("a", None, prompt(20), GREEDY, kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(ValueError, match="missing 'remote_engine_id'"):
        d.add_request("a", None, prompt(20), GREEDY, kv_transfer_params={"do_remote_prefill": True})
    with pytest.raises(ValueError, match="n == 1"):
        d.add_request("a", None, prompt(20), SamplingParams(n=2, max_tokens=3),
                      kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(ValueError, match="do_remote_decode .* or do_remote_prefill"):
        d.add_request("a", None, prompt(20), GREEDY, kv_transfer_params={"foo": 1})
    assert not d.has_unfinished_requests()


# --- P -> D through each connector ----------------------------------------------------------------------
def test_pd_output_matches_one_engine(tiny_llama, connector):
    """Prompts of 1, 16, 17 and 300 tokens: D's greedy output equals a single engine's; D pulls
    exactly the blocks holding the prompt but its last token."""
    sizes = [1, 16, 17, 300]
    ids_list = [prompt(n, salt=n) for n in sizes]
    want = reference(tiny_llama, ids_list)
    p, d = make_engine(tiny_llama, connector), make_engine(tiny_llama, connector)
    for n, ids, expected in zip(sizes, ids_list, want):
        before = d.stats().kv_transfer.blocks_pulled
        params = prefill(p, f"r{n}", ids)
        assert len(params["remote_block_ids"]) == -(-n // 16)
        out = run_one(d, f"r{n}", ids, GREEDY, params, others=(p,))
        assert out.outputs[0].token_ids == expected, n
        assert d.stats().kv_transfer.blocks_pulled - before == -(-(n - 1) // 16)
        settle(p, d)
    assert d.stats().kv_transfer.load_failures == 0
    assert p.stats().kv_transfer.leases == 4 and p.stats().kv_transfer.leases_expired == 0


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "phi3", "mistral_swa", "mixtral", "qwen3_moe"])
def test_pd_of_more_families_matches_transformers(family, request):
    """Gemma 2/3, Phi-3, a sliding-window Mistral, Mixtral and Qwen3-MoE across a transfer, with
    prompts past the windows: D's greedy tokens are transformers'. P keeps every block of a request
    it exports (the pull reads them whole); D releases the Mistral's and Gemma's local layers' behind
    the window once they have landed. One connector: either moves the blocks' bytes whatever the
    model (both are tested above)."""
    from helpers import hf_greedy

    connector = "torch_dist"

    path = request.getfixturevalue(f"tiny_{family}")
    ids_list = [prompt(17, salt=1), prompt(90, salt=2)]
    want = hf_greedy(path, ids_list, GREEDY.max_tokens)
    p, d = make_engine(path, connector), make_engine(path, connector)
    for i, (ids, expected) in enumerate(zip(ids_list, want)):
        params = prefill(p, f"r{i}", ids)
        # (Gemma's hybrid tables: each of its two layer groups' blocks, interleaved)
        assert len(params["remote_block_ids"]) == -(-len(ids) // 16) * p.config.kv_groups.num_groups
        assert run_one(d, f"r{i}", ids, GREEDY, params, others=(p,)).outputs[0].token_ids == expected
        settle(p, d)
    assert d.stats().kv_transfer.load_failures == 0


def test_decode_side_pulls_only_blocks_it_lacks(tiny_llama, connector):
    shared = prompt(64, salt=1)
    ids_a, ids_b = shared + prompt(40, salt=2), shared + prompt(70, salt=3)
    want = reference(tiny_llama, [ids_a, ids_b])
    p, d = make_engine(tiny_llama, connector), make_engine(tiny_llama, connector)
    # D computes ids_a itself, so it caches the 64-token shared prefix (4 blocks).
    assert run_one(d, "a", ids_a).outputs[0].token_ids == want[0]
    params = prefill(p, "b", ids_b)
    out = run_one(d, "b", ids_b, GREEDY, params, others=(p,))
    assert out.outputs[0].token_ids == want[1]
    total_blocks = -(-(len(ids_b) - 1) // 16)
    assert d.stats().kv_transfer.blocks_pulled == total_blocks - 4
    assert out.num_cached_tokens == 64
    settle(p, d)


def test_peer_prefix_pull_matches_one_engine(tiny_llama, connector):
    """A replica pulls the prefix another replica holds cached (`lease_prefix`) instead of computing
    it, and computes the rest: output identical to one engine's; the lease ends when the pull does.
    Nothing cached: nothing leased. A peer gone mid-pull, or a failed pull: the prompt is
    recomputed, same output."""
    shared = prompt(100, salt=4)
    ids = [shared + prompt(30, salt=5), shared + prompt(50, salt=6), shared + prompt(20, salt=7),
           shared + prompt(40, salt=8)]
    want = reference(tiny_llama, ids)
    a, b = make_engine(tiny_llama, connector), make_engine(tiny_llama, connector)
    assert run_one(a, "a", ids[0]).outputs[0].token_ids == want[0]
    assert a.lease_prefix(hash_block_tokens(prompt(40, salt=9), 16)) is None
    params = a.lease_prefix(hash_block_tokens(ids[1], 16))
    assert params["remote_num_tokens"] == 96 and len(params["remote_block_ids"]) == 6    # the shared blocks
    computed = b.stats().prompt_tokens_computed
    out = run_one(b, "b", ids[1], GREEDY, params, others=(a,))
    assert out.outputs[0].token_ids == want[1]
    assert b.stats().kv_transfer.blocks_pulled == 6 and b.stats().prompt_tokens_computed - computed == len(ids[1]) - 96
    settle(a, b)
    assert a.stats().kv_transfer.prefix_leases == 1 and a.stats().kv_transfer.leases_active == 0
    # A peer that lets go of the blocks before the pull (its lease ended: it restarted, or the
    # lease expired): the pull finds the lease gone and the prompt is computed.
    params = a.lease_prefix(hash_block_tokens(ids[2], 16))
    a.abort_request(params["remote_request_id"])
    a.step()
    assert a.stats().kv_transfer.leases_active == 0
    c = make_engine(tiny_llama, connector, kv_load_failure_policy="fail")    # a peer's pull recomputes anyway
    out = run_one(c, "c", ids[2], GREEDY, params, others=(a,))
    assert out.outputs[0].token_ids == want[2] and c.stats().kv_transfer.load_failures == 1
    settle(a, c)
    # Within a prefill pool: a prefill for a remote decode pulls its prefix from a peer first.
    d = make_engine(tiny_llama, connector)
    peer = a.lease_prefix(hash_block_tokens(ids[3], 16))
    leased = prefill_with(d, "d", ids[3], {"do_remote_decode": True, "peer_prefix": peer}, others=(a,))
    assert d.stats().kv_transfer.blocks_pulled == 6 and d.stats().kv_transfer.leases == 1
    out = run_one(c, "d", ids[3], GREEDY, leased, others=(d, a))
    assert out.outputs[0].token_ids == want[3]
    settle(a, c, d)
    with pytest.raises(ValueError, match="peer_prefix must be"):
        d.add_request("x", None, ids[3], GREEDY, kv_transfer_params={"do_remote_decode": True, "peer_prefix": 1})


def test_peer_prefix_from_the_peers_offload_tier(tiny_llama, connector):
    """A prefix the peer's pool has evicted into its offload tier: lease_prefix loads it back into
    the pool first, then leases it; the puller's output is one engine's."""
    shared = prompt(100, salt=4)
    ids = [shared + prompt(30, salt=5), prompt(300, salt=11), shared + prompt(50, salt=6)]
    want = reference(tiny_llama, [ids[2]])
    a = make_engine(tiny_llama, connector, num_kv_blocks=24, max_model_len=384,
                    kv_offloading_size=64 * 8192 / (1 << 30))
    b = make_engine(tiny_llama, connector)
    run_one(a, "a", ids[0])
    run_one(a, "evict", ids[1])      # 20 of the pool's 24 blocks: the prefix's last blocks (freed first) leave it
    hashes = hash_block_tokens(ids[2], 16)
    assert len(a.kv_cache_manager.cached_run(hashes)) == 4       # the shared prefix's other 2 are in the tier
    params = a.lease_prefix(hashes)
    assert len(params["remote_block_ids"]) == 6 and a.stats().kv_tier.host_hit_blocks == 2
    out = run_one(b, "b", ids[2], GREEDY, params, others=(a,))
    assert out.outputs[0].token_ids == want[0] and b.stats().kv_transfer.blocks_pulled == 6
    settle(a, b)


def prefill_with(engine, rid: str, ids: list[int], kv: dict, others=()) -> dict:
    out = run_one(engine, rid, ids, GREEDY, kv, others=others)
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params


def test_pulled_blocks_are_what_decode_uses(tiny_llama, connector):
    """The pulled bytes equal P's, and they are what D decodes from: noise written into P's leased
    blocks changes D's output (so a passing test cannot be D silently recomputing)."""
    ids = prompt(100, salt=4)
    [want] = reference(tiny_llama, [ids])
    p, d = make_engine(tiny_llama, connector), make_engine(tiny_llama, connector)
    params = prefill(p, "x", ids)
    num_full = len(ids) // 16
    p_blocks = params["remote_block_ids"][:num_full]
    sent = [cache[:, p_blocks].clone() for cache in p.executor.worker.runner.kv_caches]
    out = run_one(d, "x", ids, GREEDY, params, others=(p,))
    assert out.outputs[0].token_ids == want
    settle(p, d)
    # D registered the pulled full blocks in its prefix cache under the prompt's hashes.
    hashes = [bytes.fromhex(h) for h in params["remote_block_hashes"][:num_full]]
    d_blocks = [d.kv_cache_manager.block_pool.cached[h].block_id for h in hashes]
    for got, expected in zip(d.executor.worker.runner.kv_caches, sent, strict=True):
        assert torch.equal(got[:, d_blocks], expected)
    assert d.reset_prefix_cache() and p.reset_prefix_cache()

    params = prefill(p, "y", ids)
    leased = params["remote_block_ids"][:-1]
    for cache in p.executor.worker.runner.kv_caches:
        cache[:, leased] = torch.randn_like(cache[:, leased])
    out = run_one(d, "y", ids, GREEDY, params, others=(p,))
    assert out.outputs[0].token_ids != want, "noise in the pulled blocks did not change the output"
    assert d.stats().kv_transfer.load_failures == 0
    settle(p, d)


def test_pd_with_fp8_kv_matches_one_fp8_engine(tiny_llama, connector):
    """kv_cache_dtype="fp8" on both sides: D's greedy output equals a single fp8 engine's, and the
    blocks D decodes from hold P's fp8 bytes (scales calibrated at load agree on both sides)."""
    sizes = [17, 300]
    ids_list = [prompt(n, salt=20 + n) for n in sizes]
    single = make_engine(tiny_llama, None, kv_cache_dtype="fp8")
    want = [run_one(single, f"f{n}", ids).outputs[0].token_ids for n, ids in zip(sizes, ids_list)]
    p = make_engine(tiny_llama, connector, kv_cache_dtype="fp8")
    d = make_engine(tiny_llama, connector, kv_cache_dtype="fp8")
    assert p.config.cache_config.kv_scales == d.config.cache_config.kv_scales != ()
    assert p.executor.worker.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    for n, ids, expected in zip(sizes, ids_list, want):
        params = prefill(p, f"r{n}", ids)
        num_full = len(ids) // 16
        sent = [cache[:, params["remote_block_ids"][:num_full]].view(torch.uint8).clone()
                for cache in p.executor.worker.runner.kv_caches]
        out = run_one(d, f"r{n}", ids, GREEDY, params, others=(p,))
        assert out.outputs[0].token_ids == expected, n
        settle(p, d)
        hashes = [bytes.fromhex(h) for h in params["remote_block_hashes"][:num_full]]
        d_blocks = [d.kv_cache_manager.block_pool.cached[h].block_id for h in hashes]
        for got, expected_bytes in zip(d.executor.worker.runner.kv_caches, sent, strict=True):
            assert torch.equal(got[:, d_blocks].view(torch.uint8), expected_bytes)
    assert d.stats().kv_transfer.load_failures == 0


def test_pd_seeded_sampling_matches_one_engine(tiny_llama, connector):
    """A seeded request decoded after a pull draws what one engine draws from its seed, from the
    first token on (the prefill's own draw is not part of the stream), prompts of one block and
    of several; a second request of the same id with another seed draws its own."""
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=13, ignore_eos=True)
    single = make_engine(tiny_llama, None)
    p, d = make_engine(tiny_llama, connector), make_engine(tiny_llama, connector)
    for n, seed in ((5, 13), (40, 13), (40, 14)):
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=seed, ignore_eos=True)
        ids = prompt(n, salt=60 + n)
        want = run_one(single, f"s{n}", ids, params).outputs[0].token_ids
        kv = prefill(p, f"r{n}", ids, params)
        assert run_one(d, f"r{n}", ids, params, kv, others=(p,)).outputs[0].token_ids == want
        settle(p, d)
    assert want != run_one(single, "t", ids, seeded).outputs[0].token_ids
    assert d.stats().kv_transfer.load_failures == 0
    p.check_no_leaks()
    d.check_no_leaks()


def test_pd_with_lora_matches_one_engine_and_refuses_a_mismatch(tiny_llama, connector, tmp_path):
    """A prompt prefilled under an adapter decodes on D, under that adapter, to a single engine's
    tokens; parameters from a prefill under another adapter (or none) are refused, naming
    lora_request, even for a prompt shorter than one block (no block hash to tell them apart)."""
    from dataclasses import replace

    from helpers import make_adapter

    from records.lora import LoRARequest

    lora = LoRARequest("a", 1, make_adapter(tiny_llama, str(tmp_path / "a"), 8, ["q_proj", "v_proj", "down_proj"],
                                            seed=11))
    under = replace(GREEDY, lora_request=lora)
    lora_args = dict(enable_lora=True, max_lora_rank=8)
    single = make_engine(tiny_llama, None, **lora_args)
    p, d = make_engine(tiny_llama, connector, **lora_args), make_engine(tiny_llama, connector, **lora_args)
    for n in (5, 40):
        ids = prompt(n, salt=40 + n)
        want = run_one(single, f"s{n}", ids, under).outputs[0].token_ids
        assert want != run_one(single, f"b{n}", ids).outputs[0].token_ids
        params = prefill(p, f"r{n}", ids, under)
        assert params["remote_adapter"] == "a"
        with pytest.raises(ValueError, match="lora_request.*prefilled under 'a'.*the base model"):
            d.add_request(f"x{n}", None, ids, GREEDY, kv_transfer_params=params)
        assert run_one(d, f"r{n}", ids, under, params, others=(p,)).outputs[0].token_ids == want
        settle(p, d)
        base = prefill(p, f"q{n}", ids)
        with pytest.raises(ValueError, match="lora_request.*the base model.*under 'a'"):
            d.add_request(f"y{n}", None, ids, under, kv_transfer_params=base)
        p.abort_request(f"q{n}")            # its lease: no decode engine will pull it
        settle(p, d)
    assert d.stats().kv_transfer.load_failures == 0


# --- faults: each ends with zero blocks held on both sides ---------------------------------------------
def test_abort_on_prefill_before_pull_falls_back_to_recompute(tiny_llama, connector):
    ids = prompt(80, salt=5)
    [want] = reference(tiny_llama, [ids])
    p, d = make_engine(tiny_llama, connector), make_engine(tiny_llama, connector)
    params = prefill(p, "x", ids)
    p.abort_request("x")
    # Reuse P's freed blocks for another prompt before D pulls: stale bytes would be wrong bytes.
    run_one(p, "other", prompt(200, salt=6))
    settle(p)
    out = run_one(d, "x", ids, GREEDY, params, others=(p,))
    assert out.outputs[0].token_ids == want
    assert d.stats().kv_transfer.load_failures == 1
    settle(p, d)


def test_abort_on_decode_during_pull(tiny_llama, connector):
    p = make_engine(tiny_llama, connector)
    d = make_engine(tiny_llama, connector, kv_connector_extra={"load_delay_s": 0.3})
    ids = prompt(90, salt=7)
    params = prefill(p, "x", ids)
    d.add_request("x", None, ids, GREEDY, kv_transfer_params=params)
    d.step()
    assert d.stats().kv_transfer.requests_waiting == 1
    d.abort_request("x")
    assert d.has_unfinished_requests()           # blocks stay until the pull ends
    settle(p, d)
    assert p.stats().kv_transfer.leases_active == 0 and d.stats().num_free_kv_blocks == 64


def test_lease_expiry_frees_prefill_blocks(tiny_llama, connector):
    p = make_engine(tiny_llama, connector, kv_lease_s=0.3)
    prefill(p, "x", prompt(50, salt=8))
    assert p.stats().kv_transfer.leases_active == 1 and p.stats().num_free_kv_blocks < 64
    settle(p)                                     # D never pulls
    assert p.stats().kv_transfer.leases_expired == 1 and p.stats().num_free_kv_blocks == 64


@pytest.mark.parametrize("fault", [{"fail_loads": True}, {"load_delay_s": 1.0}])
def test_failed_or_timed_out_pull_recomputes(tiny_llama, connector, fault):
    ids = prompt(120, salt=9)
    [want] = reference(tiny_llama, [ids])
    p = make_engine(tiny_llama, connector)
    d = make_engine(tiny_llama, connector, kv_load_timeout_s=0.3, kv_connector_extra=fault)
    params = prefill(p, "x", ids)
    out = run_one(d, "x", ids, GREEDY, params, others=(p,))
    assert out.outputs[0].token_ids == want
    assert d.stats().kv_transfer.load_failures == 1
    p.abort_request("x")                          # the router's job when D gave up
    settle(p, d)


def test_failure_policy_fail_ends_the_request_with_an_error(tiny_llama, connector):
    p = make_engine(tiny_llama, connector)
    d = make_engine(tiny_llama, connector, kv_load_failure_policy="fail",
                    kv_connector_extra={"fail_loads": True})
    ids = prompt(40, salt=10)
    params = prefill(p, "x", ids)
    out = run_one(d, "x", ids, GREEDY, params, others=(p,))
    assert out.outputs[0].finish_reason == "error" and "injected" in out.outputs[0].stop_reason
    # Another request on D is unaffected.
    assert run_one(d, "y", prompt(30, salt=11)).outputs[0].finish_reason == "length"
    p.abort_request("x")
    settle(p, d)


def test_layout_mismatch_refused_at_handshake(tiny_llama, tiny_qwen2, connector):
    p = make_engine(tiny_llama, connector)
    ids = prompt(40, salt=12)
    params = prefill(p, "x", ids)
    cases = [(make_engine(tiny_llama, connector, block_size=8), "block_size"),
             (make_engine(tiny_llama, connector, dtype="bfloat16"), "dtype"),
             (make_engine(tiny_llama, connector, kv_cache_dtype="fp8"), "dtype"),
             (make_engine(tiny_qwen2, connector), "model")]
    for d, field in cases:
        with pytest.raises(KVLayoutMismatch, match=f"prefill engine's {field} is"):
            d.add_request("x", None, ids, GREEDY, kv_transfer_params=params)
        assert not d.has_unfinished_requests()
    p.abort_request("x")
    settle(p)


def test_async_engine_raises_kv_transfer_error(tiny_llama):
    import asyncio

    from engine.async_engine import AsyncLLMEngine

    async def main() -> None:
        d = AsyncLLMEngine(engine_config(
            tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=512, kv_connector="torch_dist",
            kv_load_failure_policy="fail", kv_connector_extra={"fail_loads": True}))
        p = AsyncLLMEngine(engine_config(tiny_llama, dtype="float32", num_kv_blocks=64,
                                               max_model_len=512, kv_connector="torch_dist"))
        ids = prompt(40, salt=13)
        outs = [o async for o in p.generate("x", ids, SamplingParams(max_tokens=1, temperature=0.0),
                                            {"do_remote_decode": True})]
        params = outs[-1].kv_transfer_params
        with pytest.raises(KVTransferError, match="injected failure"):
            async for _ in d.generate("x", ids, GREEDY, params):
                pass
        p.abort("x")
        for engine in (p, d):
            while engine.engine.has_unfinished_requests():
                await asyncio.sleep(0.01)
            await engine.shutdown()

    asyncio.run(main())


def test_stats_expose_transfer_counters(tiny_llama):
    engine = make_engine(tiny_llama, "torch_dist")
    assert engine.stats().kv_transfer == KVTransferStats()      # present, every counter at zero
    assert isinstance(engine.kv_connector, KVConnectorScheduler)


# --- separate processes (Ray actors) -------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.parametrize("conn", CONNECTORS)
def test_pd_across_ray_actors(tiny_llama, conn):
    """P and D in separate actor processes: identical greedy output; then P is killed after handing
    out its parameters, and a decode engine that never reached P before falls back to computing the
    prompt (identical output again). (One that has pulled from P before may still succeed over NIXL:
    UCX's shared-memory mapping of P's registered memory outlives P's process, with the data and the
    lease word as P left them, which is why the test uses a fresh one.)"""
    ray = pytest.importorskip("ray", reason="needs ray (make setup installs it)")
    if conn == "nixl":
        pytest.importorskip("nixl", reason="needs nixl: make setup installs it")
    from cluster.launch import init_ray
    from cluster.replica import EngineReplica

    init_ray(num_cpus=8)
    sizes = [1, 16, 17, 300]
    ids_list = [prompt(n, salt=20 + n) for n in sizes]
    last = prompt(150, salt=99)
    want = reference(tiny_llama, [*ids_list, last])
    config = engine_config(tiny_llama, dtype="float32", num_kv_blocks=64, max_model_len=512,
                                 kv_connector=conn, kv_load_timeout_s=5.0)
    actor = ray.remote(EngineReplica).options(num_cpus=1, max_concurrency=100)
    p, d, fresh = actor.remote(config, "p", 1), actor.remote(config, "d", 1), actor.remote(config, "d2", 1)

    def generate(handle, rid, ids, params, kv):
        return [delta for delta in ray.get(list(handle.generate.options(num_returns="streaming")
                                                .remote(rid, ids, params, kv)), timeout=DEADLINE_S)]

    try:
        # All three started (an actor left pending for CPUs would hang the first stream below).
        ray.get([h.info.remote() for h in (p, d, fresh)], timeout=DEADLINE_S)
        for n, ids, expected in zip(sizes, ids_list, want):
            [first] = generate(p, f"r{n}", ids, SamplingParams(max_tokens=1, temperature=0.0),
                               {"do_remote_decode": True})
            deltas = generate(d, f"r{n}", ids, GREEDY, first.kv_transfer_params)
            assert [t for x in deltas for c in x.choices for t in c.token_ids] == expected, n
        stats = ray.get(d.stats.remote()).engine
        assert stats.kv_transfer.load_failures == 0
        assert stats.kv_transfer.blocks_pulled == sum(-(-(n - 1) // 16) for n in sizes)

        [first] = generate(p, "last", last, SamplingParams(max_tokens=1, temperature=0.0),
                           {"do_remote_decode": True})
        kill_actor(p, "info")
        deltas = generate(fresh, "last", last, GREEDY, first.kv_transfer_params)
        assert [t for x in deltas for c in x.choices for t in c.token_ids] == want[-1]
        assert ray.get(fresh.stats.remote()).engine.kv_transfer.load_failures == 1
        deadline = time.monotonic() + DEADLINE_S
        while not (ray.get(d.check_no_leaks.remote()) and ray.get(fresh.check_no_leaks.remote())):
            assert time.monotonic() < deadline, "decode side kept blocks"
            time.sleep(0.05)
    finally:
        for handle in (p, d, fresh):
            ray.kill(handle)



def test_pd_hops_join_one_trace_with_the_pull_measured(tiny_llama):
    """A prefill engine and a decode engine given the same trace context (as the ingress gives its
    request span's): P records its hop (queue, prefill), D its hop with the KV pull (its blocks and
    bytes as the engine counts them), the one-token prefill after it, and decode; the decode side's
    pull histograms count it."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import engine.tracing as tracing

    ids = prompt(100, salt=9)
    want = reference(tiny_llama, [ids])[0]          # before tracing: an engine that traces traces everything
    exporter = InMemorySpanExporter()
    tracing.use_exporter(exporter)
    try:
        carrier = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
        p, d = make_engine(tiny_llama, "torch_dist"), make_engine(tiny_llama, "torch_dist")
        params = prefill(p, "r", ids, trace_context=carrier)
        out = run_one(d, "r", ids, GREEDY, params, others=(p,), trace_context=carrier)
        assert out.outputs[0].token_ids == want
        settle(p, d)
        spans = exporter.get_finished_spans()
    finally:
        tracing.shutdown()
    hops = [s for s in spans if s.name == "pdserve.engine"]
    assert len(hops) == 2 and {format(h.parent.span_id, "016x") for h in hops} == {"00f067aa0ba902b7"}
    assert {format(s.context.trace_id, "032x") for s in spans} == {"4bf92f3577b34da6a3ce929d0e0e4736"}
    roles = {h.attributes["pdserve.kv_role"]: h for h in hops}
    p_hop, d_hop = roles["prefill_for_remote_decode"], roles["decode_after_pull"]
    under = {h.context.span_id: sorted(s.name for s in spans if s.parent and s.parent.span_id == h.context.span_id)
             for h in hops}
    assert under[p_hop.context.span_id] == ["pdserve.detokenize", "pdserve.prefill", "pdserve.queue"]
    assert under[d_hop.context.span_id] == ["pdserve.decode", "pdserve.detokenize", "pdserve.kv_pull",
                                            "pdserve.prefill", "pdserve.queue"]
    pull = next(s for s in spans if s.name == "pdserve.kv_pull")
    blocks = -(-(len(ids) - 1) // 16)
    assert pull.attributes["pdserve.kv.blocks"] == blocks == d.stats().kv_transfer.blocks_pulled
    assert pull.attributes["pdserve.kv.bytes"] == blocks * d.config.kv_block_bytes()
    d_prefill = next(s for s in spans if s.name == "pdserve.prefill" and s.parent.span_id == d_hop.context.span_id)
    assert d_prefill.attributes["pdserve.computed_prompt_tokens"] == 1      # the last token: the rest pulled
    assert pull.end_time == d_prefill.start_time
    hist = d.stats().histograms
    assert sum(hist["kv_pull_seconds"][0]) == 1 and hist["kv_pull_bytes"][1] == blocks * d.config.kv_block_bytes()


def test_a_weight_update_voids_a_lease_and_the_decode_side_computes_afresh(tiny_llama, tmp_path):
    """A prompt prefilled for a decode engine before a weight update: P ends the lease (its KV is
    the old weights'), D's pull fails and D computes the prompt under the new weights: D's output is
    an engine's of the new weights, wholly version 1 (engine/weight_updates.py)."""
    import glob
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    trained = tmp_path / "trained"
    trained.mkdir()
    for name in os.listdir(tiny_llama):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_llama, name), trained / name)
    g = torch.Generator().manual_seed(9)
    weights = {n: t + 0.05 * torch.randn(t.shape, generator=g) for f in glob.glob(f"{tiny_llama}/*.safetensors")
               for n, t in load_file(f).items()}
    save_file(weights, str(trained / "model.safetensors"))
    ids = prompt(300, salt=4)
    [want] = reference(str(trained), [ids])
    p, d = make_engine(tiny_llama, "torch_dist"), make_engine(tiny_llama, "torch_dist")
    params = prefill(p, "r", ids)
    for engine in (p, d):
        engine.weights.from_disk(str(trained))
    out = run_one(d, "r", ids, GREEDY, params, others=(p,))
    assert out.outputs[0].token_ids == want and out.outputs[0].weight_versions == [(0, "1")]
    settle(p, d)
    assert d.stats().kv_transfer.load_failures == 1
    p.check_no_leaks()
    d.check_no_leaks()
