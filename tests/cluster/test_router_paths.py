"""The router's request paths on a real model's config and tokenizer, without Ray (fake replicas
and channels): tier hits and peer prefix pulls, a backlogged prefill pool, a client gone between
prefill and decode, and a stream whose replica is lost. (tests/unit holds the routing logic that
needs no model.)"""
from __future__ import annotations

import pytest

from records.hashing import hash_block_tokens
from records.kv_events import AllCleared, BlockRemoved, BlockStored
from records.serving import PolicyConfig
from router.routing.policy import Loads, RoutingPolicy
from router.routing.prefix_index import PrefixIndex


def test_tier_hits_score_between_a_pool_hit_and_a_miss_and_peers_lend_their_prefix(tiny_llama):
    """The index follows each medium's events; the policy weighs a tier block at tier_weight of a
    pool block; with peer pulls on, a replica chosen for load that lacks the prefix another holds
    is sent with that peer's lease (its kv_transfer_params), which the router asks for."""
    import asyncio

    from cluster.config import ClusterConfig
    from records.deltas import ChoiceDelta, StepDelta
    from records.sampling_params import SamplingParams
    from router.ingress.frontend import Frontend

    h = hash_block_tokens(list(range(96)), 16)
    index = PrefixIndex()
    index.apply("a", [BlockStored(h[:2]), BlockStored(h[2:5], "host"), BlockStored(h[5:], "disk")])
    index.apply("b", [BlockStored(h[:1]), BlockStored(h[3:], "host")])        # a gap at block 1
    pool = index.match(h)
    assert pool == {"a": 2, "b": 1} and index.match_tiers(h, pool) == {"a": 4, "b": 0}
    index.apply("a", [BlockRemoved(h[2:3], "host"), AllCleared()])
    assert index.match_tiers(h, index.match(h)) == {"a": 0, "b": 0} and index.num_tier_blocks("a") == 0
    policy = RoutingPolicy(PolicyConfig(seed=0), max_num_seqs=8)
    idle = Loads(["a", "b"], max_num_seqs=8)
    d = policy.choose({"a": 0, "b": 2}, 6, idle, tier_matched={"a": 5, "b": 0})   # 2.5 against 2
    assert (d.replica_id, d.reason, d.tier_blocks) == ("a", "tier_hit", 5)
    assert policy.choose({"a": 0, "b": 3}, 6, idle, tier_matched={"a": 5, "b": 0}).replica_id == "b"
    with pytest.raises(ValueError, match="tier_weight"):
        PolicyConfig(tier_weight=2)

    config = ClusterConfig(model=tiny_llama, routing={"peer_prefix_pulls": True, "min_peer_pull_tokens": 32})
    assert config.engine_args("decode").kv_connector == "nixl"           # peers pull over the connector
    router = Frontend(config.ingress_spec(), {"decode-0": None, "decode-1": None}).router
    ids = list(range(5, 105))
    hashes = hash_block_tokens(ids, 16)
    router.index.apply("decode-0", [BlockStored(hashes)])
    params = SamplingParams(max_tokens=2)
    router.loads["decode-0"].in_flight = 9                                # busy: decode-1 wins on load
    d = router.route(ids, params)
    assert d.replica_id == "decode-1" and d.peer == ("decode-0", hashes)
    router.index.apply("decode-1", [BlockStored(hashes[:5])])             # 1 block short: < 32 tokens
    assert router.route(ids, params).peer is None
    sent = {}

    class Remote:
        def __init__(self, fn):
            self.remote = fn

    class Peer:                                                           # decode-0's lease_prefix
        lease_prefix = Remote(lambda hs, adapter: _done({"do_remote_prefill": True, "remote_block_ids": [1] * len(hs)}))

    class Channel:
        async def stream(self, rid, prompt, p, kv_params, continuation, trace_context=None, block_hashes=None,
                         images=()):
            sent["kv"] = kv_params
            yield StepDelta(rid, [ChoiceDelta(0, [7], "x")], True, len(ids))

    async def run() -> None:
        router.replicas["decode-0"] = Peer()
        router.channels.by_replica["decode-1"] = Channel()
        [_ async for _ in router.generate("r", ids, params, d)]

    asyncio.run(run())
    assert sent["kv"]["remote_block_ids"] == [1] * 6
    assert router.metrics.routing.peer_pulls.get(pool="decode", outcome="leased") == 1


async def _result(value):
    return value


def _done(value):
    return _result(value)


def test_a_backlogged_prefill_pool_leaves_prompts_to_the_decode_replica(tiny_llama):
    """Load-aware conditional disaggregation: a long prompt goes to the prefill pool unless the
    prefill replica's backlog of prompt tokens (this prompt's included) exceeds the decode replica's
    own by `prefill_backlog_factor`; the backlogs count a prompt from routing to its first token."""
    import asyncio

    from cluster.config import ClusterConfig
    from records.deltas import ChoiceDelta, StepDelta
    from records.sampling_params import SamplingParams
    from router.ingress.frontend import Frontend

    config = ClusterConfig(model=tiny_llama, mode="disaggregated", pools={"prefill": {}, "decode": {}},
                           disaggregation={"min_remote_prefill_tokens": 64})
    pd = Frontend(config.ingress_spec(), {"decode-0": None}, {"prefill-0": None}).router
    assert pd.prefill_backlog_factor == 1.0
    params = SamplingParams(max_tokens=4)
    ids = list(range(5, 389))                                  # 384 tokens, 24 blocks, none cached
    d, p = pd.decode.route(ids, params), pd.prefill.route(ids, params)
    p_load, d_load = pd.prefill.loads["prefill-0"], pd.decode.loads["decode-0"]
    assert pd.wants_remote_prefill(len(ids), params, d) and not pd.wants_remote_prefill(40, params, d)
    assert not pd.prefill_is_backlogged(len(ids), p, d)        # both idle: 384 vs 384, remote
    p_load.prefill_tokens = 384                                # one prompt queued on P
    assert pd.prefill_is_backlogged(len(ids), p, d)            # 768 > 384: D takes it
    d_load.prefill_tokens = 384                                # and one on D
    assert not pd.prefill_is_backlogged(len(ids), p, d)        # 768 vs 768: remote again
    pd.prefill_backlog_factor = 3.0
    p_load.prefill_tokens, d_load.prefill_tokens = 700, 0
    assert not pd.prefill_is_backlogged(len(ids), p, d)        # 1084 <= 3 x 384
    pd.prefill_backlog_factor = None
    p_load.prefill_tokens = 10 ** 6
    assert not pd.prefill_is_backlogged(len(ids), p, d)        # the check off
    p_load.prefill_tokens = 0

    class Channel:                                             # a replica streaming 3 tokens, one per step
        async def stream(self, *args):
            assert d_load.prefill_tokens == 384 and d_load.in_flight == 1
            for i in range(3):
                yield StepDelta("r", [ChoiceDelta(0, [7], "x")], i == 2, len(ids))
                assert d_load.prefill_tokens == 0               # the first token ended the prompt's part

    async def run() -> int:
        pd.decode.channels.by_replica["decode-0"] = Channel()
        return len([delta async for delta in pd.decode.generate("r", ids, params, d)])

    assert asyncio.run(run()) == 3
    assert (d_load.prefill_tokens, d_load.in_flight) == (0, 0)


def test_a_client_gone_between_prefill_and_decode_ends_the_prefill_lease(tiny_llama):
    """P/D: the prefill replica leased its blocks and the client went away before the decode
    replica took the request (or while it streamed): the router tells P to end that lease (an
    abort of the lease's id), so that its blocks are not held until `kv_lease_s` runs out. A
    stream that finishes leaves the release to D."""
    import asyncio

    from cluster.config import ClusterConfig
    from records.deltas import ChoiceDelta, StepDelta
    from records.sampling_params import SamplingParams
    from router.ingress.frontend import Frontend

    aborts = []

    class Handle:
        class abort:                                           # noqa: N801 - a Ray method's shape
            @staticmethod
            def remote(request_id):
                aborts.append(request_id)

    config = ClusterConfig(model=tiny_llama, mode="disaggregated", pools={"prefill": {}, "decode": {}},
                           disaggregation={"min_remote_prefill_tokens": 64})
    pd = Frontend(config.ingress_spec(), {"decode-0": Handle()}, {"prefill-0": Handle()}).router
    ids, params = list(range(5, 389)), SamplingParams(max_tokens=4)
    lease = {"do_remote_prefill": True, "remote_request_id": "r"}
    taken = asyncio.Event()

    class Prefill:                                             # leases after one step
        async def stream(self, *args):
            yield StepDelta("r", [ChoiceDelta(0, [7], "x")], True, len(ids), kv_transfer_params=lease)

    class Decode:
        def __init__(self, hangs: bool) -> None:
            self.hangs = hangs

        async def stream(self, *args):
            taken.set()
            if self.hangs:                                     # the submit never returns
                await asyncio.Event().wait()
            for i in range(3):
                yield StepDelta("r", [ChoiceDelta(0, [7], "x")], i == 2, len(ids))

    async def run(hangs: bool) -> None:
        pd.prefill.channels.by_replica["prefill-0"] = Prefill()
        pd.decode.channels.by_replica["decode-0"] = Decode(hangs)
        taken.clear()

        async def consume() -> int:
            return len([d async for d in pd.generate("r", ids, params)])

        task = asyncio.create_task(consume())
        if hangs:
            await taken.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            assert await task == 3

    asyncio.run(run(hangs=False))
    assert aborts == []                                        # D released it
    asyncio.run(run(hangs=True))
    assert aborts == ["r"]
    assert pd.metrics.routing.decisions.get(reason="remote_prefill", pool="pd") == 2


def test_a_stream_whose_replica_is_lost_migrates_and_fails_clearly_past_the_limit(tiny_llama):
    """RequestRouter.generate: a replica lost mid-stream (its channel broke, its engine stopped) has
    the stream resumed on another replica after the tokens already sent (their text's length too);
    the consumer reads one stream. With no replica left, past routing.max_migrations, or with
    n > 1 it ends with ReplicaDiedError saying why, and each outcome is counted."""
    import asyncio
    import dataclasses

    from cluster.config import ClusterConfig
    from records.deltas import ChoiceDelta, StepDelta
    from records.errors import EngineDeadError, ReplicaDiedError
    from records.request import Continuation
    from records.sampling_params import SamplingParams
    from router.ingress.frontend import Frontend

    config = ClusterConfig(model=tiny_llama, pools={"decode": {"replicas": 2}}, routing={"max_migrations": 2})
    router = Frontend(config.ingress_spec(), {"decode-0": None, "decode-1": None}).router
    ids, params = list(range(5, 40)), SamplingParams(max_tokens=6)
    resumed = []

    class Channel:
        """Streams tokens 100, 101, ... from where the continuation leaves off; dies after `dies_after`."""
        def __init__(self, dies_after: int | None, error: BaseException) -> None:
            self.dies_after, self.error = dies_after, error

        async def stream(self, rid, prompt, p, kv, continuation=None, trace_context=None, block_hashes=None,
                         images=()):
            resumed.append(continuation)
            done = len(continuation.token_ids) if continuation else 0
            for n, i in enumerate(range(done, 6)):
                if n == self.dies_after:
                    raise self.error
                yield StepDelta(rid, [ChoiceDelta(0, [100 + i], f"t{i} ")], i == 5, len(prompt))

    async def run(channels: dict, p: SamplingParams = params) -> list[int]:
        router.down.clear()
        router.channels.by_replica = dict(channels)
        first = sorted(channels)[0]
        decision = dataclasses.replace(router.route(ids, p), replica_id=first)
        return [t async for d in router.generate("r", ids, p, decision) for t in d.choices[0].token_ids]

    chans = {"decode-0": Channel(2, ConnectionError("the replica closed its output channel")),
             "decode-1": Channel(None, RuntimeError())}
    assert asyncio.run(run(chans)) == [100, 101, 102, 103, 104, 105]
    assert resumed == [None, Continuation((100, 101), 6)]
    assert router.down == {"decode-0"} and router.metrics.routing.migrations.get(pool="decode") == 1
    # Both replicas die in turn: none is left for a second migration.
    def dying() -> dict:
        return {"decode-0": Channel(1, EngineDeadError("engine is dead")), "decode-1": Channel(1, ConnectionError())}

    resumed.clear()
    with pytest.raises(ReplicaDiedError, match="replica decode-1 died while running request r and no other "
                                               "replica is available"):
        asyncio.run(run(dying()))
    assert resumed == [None, Continuation((100,), 3)]
    assert router.metrics.routing.migration_failures.get(pool="decode", reason="no_replica") == 1
    router.max_migrations = 0                                  # past the limit at once
    with pytest.raises(ReplicaDiedError, match=r"replica decode-0 died while running request r after 0 "
                                               r"migrations \(routing.max_migrations\)"):
        asyncio.run(run(dying()))
    router.max_migrations = 2
    with pytest.raises(ReplicaDiedError, match=r"n > 1 .* cannot move"):
        asyncio.run(run(dying(), dataclasses.replace(params, n=2)))
    assert router.metrics.routing.migration_failures.get(pool="decode", reason="not_migratable") == 1
    assert router.metrics.routing.migrations.get(pool="decode") == 2
    assert all(load.in_flight == 0 and load.prefill_tokens == 0 for load in router.loads.values())


@pytest.mark.parametrize("channel", ["tcp", "ray"])
@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_a_request_is_validated_tokenized_compiled_and_hashed_once(mode, channel, monkeypatch):
    """One pass per request (issue 70), counted on the ingress's whole path (its preparer, admission,
    routers and channels, with simulated engine replicas in this process behind actor-handle
    surfaces): a chat request with an output constraint is validated once (the engines check only
    their own limits, one check each), tokenized once, its constraint compiled once by the ingress
    and once by each engine it reaches (each in its own process when deployed), and its prompt's
    block hash chain computed once: the router's, which the engines take. On the P/D path the
    prefill and the decode engine both get it. Each delta a replica makes crosses one queue in the
    ingress. The same over either channel transport (a TCP connection, or Ray's calls)."""
    import asyncio
    import json
    import sys

    from helpers import SIM_PROFILE, InProcessHandle

    import engine.text.tokenizer as text
    import records.hashing as hashing
    import records.sampling_params as sp
    from cluster.config import ClusterConfig
    from cluster.replica import EngineReplica
    from engine.llm_engine import LLMEngine
    from records.deltas import StepDelta
    from router.ingress.frontend import Frontend
    from router.ingress.openai_api import OpenAIAPI

    counts = {"validate": 0, "limits": 0, "tokenize": 0, "chains": 0, "engine_compiles": 0}

    def counted(module, name, key, only=lambda *a, **k: True):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            counts[key] += bool(only(*args, **kwargs))
            return original(*args, **kwargs)
        for mod in list(sys.modules.values()):          # every module that imported it by name
            if getattr(mod, name, None) is original:
                monkeypatch.setattr(mod, name, wrapper)

    counted(sp, "validate_request", "validate")
    counted(sp, "check_limits", "limits",      # (validate_request's own use of it is the validation)
            lambda *a, **k: sys._getframe(2).f_globals["__name__"] != sp.__name__)
    counted(text, "apply_chat_template", "tokenize")
    # A chain from the prompt's start (an engine's decode extends its own from where it stands).
    counted(hashing, "hash_block_tokens", "chains",
            lambda tokens, block_size, extra=(), parent=None, start=0, items=(): parent is None and start == 0
            and len(tokens) >= block_size)
    compile_constraint = LLMEngine.compile_constraint

    def engine_compile(self, spec):
        counts["engine_compiles"] += 1
        return compile_constraint(self, spec)
    monkeypatch.setattr(LLMEngine, "compile_constraint", engine_compile)
    # Per delta, one queue hop in the ingress: the deltas the replicas made, and the puts onto
    # asyncio queues by the ingress's modules (router/).
    hops = {"deltas": 0, "puts": 0}
    of_output, put_nowait = StepDelta.of_output.__func__, asyncio.Queue.put_nowait

    def made(cls, *args, **kwargs):
        hops["deltas"] += 1
        return of_output(cls, *args, **kwargs)

    def put(self, item):
        hops["puts"] += sys._getframe(1).f_globals["__name__"].startswith("router.")
        return put_nowait(self, item)
    monkeypatch.setattr(StepDelta, "of_output", classmethod(made))
    monkeypatch.setattr(asyncio.Queue, "put_nowait", put)

    engine = {"simulate": SIM_PROFILE, "max_model_len": 2048}
    pools = {"decode": {"replicas": 1}} if mode == "colocated" else {"prefill": {"replicas": 1},
                                                                    "decode": {"replicas": 1}}
    config = ClusterConfig(engine=engine, mode=mode, pools=pools, routing={"channel": channel},
                           disaggregation={"connector": "nixl", "min_remote_prefill_tokens": 8})
    body = {"model": "m", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "Count the colours of a rainbow, one by one, in a list. " * 4}],
            "response_format": {"type": "json_object"}}

    async def run() -> dict:
        replicas = {pool: {f"{pool}-0": InProcessHandle(EngineReplica(config.engine_config(pool), f"{pool}-0"))}
                    for pool in pools}
        frontend = Frontend(config.ingress_spec(), replicas["decode"], replicas.get("prefill"))
        frontend.router.start()
        try:
            body["model"] = frontend.preparer.model_name
            response = await OpenAIAPI(frontend).chat(dict(body))
            return json.loads(response.body)
        finally:
            frontend.router.stop()
            for pool in replicas.values():
                for handle in pool.values():
                    await handle._replica.close()

    reply = asyncio.run(run())
    assert reply["usage"]["completion_tokens"] == 6
    engines = len(pools)
    assert counts == {"validate": 1, "limits": engines, "tokenize": 1, "chains": 1, "engine_compiles": engines}
    # (on the P/D path the prefill replica's delta, its first token, too: it ends at the router)
    assert hops["deltas"] >= 2 and hops["puts"] == hops["deltas"], hops


def test_the_tcp_channel_checks_its_token_returns_refused_submits_and_aborts_what_a_closed_one_ran():
    """The output channel over TCP (cluster/channel_server.py), with a simulated replica in this
    process: a connection that sends the wrong token is closed unread; a submit the replica refuses
    comes back as that request's error; a stream stopped early is aborted on the replica, and so is
    every request of a channel whose connection closes (nothing is left on the replica)."""
    import asyncio
    import pickle

    from helpers import SIM_PROFILE, InProcessHandle

    from cluster.config import ClusterConfig
    from cluster.replica import EngineReplica
    from records.sampling_params import SamplingParams
    from router.routing.channel import ReplicaChannel, frame

    config = ClusterConfig(engine={"simulate": SIM_PROFILE, "max_model_len": 2048}, pools={"decode": {"replicas": 1}})
    long = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0)

    async def until_empty(replica: EngineReplica) -> None:
        for _ in range(500):
            if replica.leaks() is None:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(replica.leaks())

    async def run() -> None:
        replica = EngineReplica(config.engine_config("decode"), "decode-0")
        try:
            host, port, token = await replica.channel_address()
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(frame(bytes(len(token))) + frame(pickle.dumps(("intruder", None))))
            assert await asyncio.wait_for(reader.read(), 10) == b""          # closed, nothing sent
            writer.close()

            channel = ReplicaChannel(InProcessHandle(replica), "ingress-a", transport="tcp")
            with pytest.raises(ValueError, match="prompt_token_ids"):
                async for _ in channel.stream("bad", [10**9], long):
                    pass
            stream = channel.stream("stopped", list(range(1, 40)), long)
            assert (await anext(stream)).request_id == "stopped"
            await stream.aclose()
            await until_empty(replica)
            running = channel.stream("running", list(range(1, 40)), long)
            await anext(running)
            channel.close()                     # the connection closes under a running request
            await until_empty(replica)
            await running.aclose()
        finally:
            await replica.close()

    asyncio.run(run())


def test_a_channel_message_whose_error_does_not_pickle_ends_that_request_only():
    import pickle

    from cluster.channel_server import _pickled
    from records.deltas import ChannelMessage, StepDelta
    from records.errors import RequestFailedError

    class Local(Exception):          # a class pickle cannot find by name
        pass

    ok = StepDelta("a", [], False, 3)
    message = pickle.loads(_pickled(ChannelMessage([ok, StepDelta.failure("b", Local("boom"))])))
    assert message.deltas[0] == ok
    assert isinstance(message.deltas[1].error, RequestFailedError) and "Local: boom" in str(message.deltas[1].error)


def test_a_tcp_channel_whose_server_cannot_be_reached_goes_over_ray():
    """A replica that answers (Ray's calls) but whose channel server's port cannot be reached (a
    network that lets Ray's ports through and no others): its channel falls back to the Ray
    transport, and requests run on it as before, an early stop aborting on the replica."""
    import asyncio
    import socket

    from helpers import SIM_PROFILE, InProcessHandle

    from cluster.config import ClusterConfig
    from cluster.replica import EngineReplica
    from records.sampling_params import SamplingParams
    from router.routing.channel import ReplicaChannel

    class Fenced(EngineReplica):
        async def channel_address(self):
            host, _, token = await super().channel_address()
            with socket.socket() as s:          # a port nothing listens on
                s.bind((host, 0))
                port = s.getsockname()[1]
            return host, port, token

    config = ClusterConfig(engine={"simulate": SIM_PROFILE, "max_model_len": 2048}, pools={"decode": {"replicas": 1}})
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)

    async def run() -> None:
        replica = Fenced(config.engine_config("decode"), "decode-0")
        channel = ReplicaChannel(InProcessHandle(replica), "ingress-a", transport="tcp")
        try:
            tokens = [t async for d in channel.stream("a", list(range(1, 40)), params) for c in d.choices
                      for t in c.token_ids]
            assert len(tokens) == 4 and channel.transport == "ray"
            stream = channel.stream("b", list(range(1, 40)), SamplingParams(max_tokens=1000, ignore_eos=True))
            await anext(stream)
            await stream.aclose()
            for _ in range(500):
                if replica.leaks() is None:
                    break
                await asyncio.sleep(0.01)
            assert replica.leaks() is None
        finally:
            channel.close()
            await replica.close()

    asyncio.run(run())
