"""The gRPC Generation service through Ray Serve's gRPC proxy (127.0.0.1), beside the HTTP API on the
same Serve app (a real `grpc` client, a local Ray, a tiny model); and the protobuf control-plane
messages (KV-transfer handshake and parameters, KV events): round trips and refusals (unit)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time

import openai
import pytest
from helpers import free_port

from engine import LLM, SamplingParams

ray = pytest.importorskip("ray", reason="the serving tests need ray[serve] (make setup installs it)")
grpc = pytest.importorskip("grpc")

API_KEY = "grpc-key"
MAIN, LIMITED = "pdserve-grpc", "pdserve-grpc-limited"


def _md(app: str = MAIN, key: str | None = API_KEY) -> list[tuple[str, str]]:
    md = [("application", app)]       # Serve's proxy routes by app when several are deployed
    if key is not None:
        md.append(("authorization", f"Bearer {key}"))
    return md


@pytest.fixture(scope="module")
def server(tiny_llama, eventually_no_leaks):
    from ray import serve

    from cluster.config import ClusterConfig
    from cluster.launch import grpc_start_options, init_ray
    from cluster.manager import MANAGER_NAME
    from pdserve_proto import pb2, pb2_grpc
    from router.app import build_app

    init_ray(num_cpus=8)
    http_port, grpc_port = free_port(), free_port()
    engine = {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 16}
    main = ClusterConfig(model=tiny_llama, engine=engine, pools={"decode": {"replicas": 1, "num_cpus": 1}},
                         serving={"port": http_port, "grpc_port": grpc_port, "api_key": API_KEY}, name=MAIN)
    limited = ClusterConfig(model=tiny_llama, engine=engine, pools={"decode": {"replicas": 1, "num_cpus": 1}},
                            serving={"port": http_port, "grpc_port": grpc_port, "max_in_flight": 1},
                            name=LIMITED)
    serve.start(http_options={"host": "127.0.0.1", "port": http_port}, **grpc_start_options(main))
    serve.run(build_app(main), name=MAIN, route_prefix="/")
    serve.run(build_app(limited), name=LIMITED, route_prefix="/limited")
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    stub = pb2_grpc.GenerationStub(channel)
    deadline = time.monotonic() + 120
    while True:
        try:
            if stub.Health(pb2.HealthRequest(), metadata=_md(), timeout=10).healthy:
                break
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)
    managers = [ray.get_actor(MANAGER_NAME, namespace=c.name) for c in (main, limited)]
    yield {"stub": stub, "pb2": pb2, "http": f"http://127.0.0.1:{http_port}", "managers": managers,
           "model": stub.Models(pb2.ModelsRequest(), metadata=_md()).models[0].id}
    channel.close()
    for manager in managers:
        assert eventually_no_leaks(ray.get(manager.replicas.remote("decode"))), "a replica kept blocks"
    serve.shutdown()                  # frees both ports for the next module's Serve
    for manager in managers:
        ray.get(manager.shutdown.remote())
        ray.kill(manager)


@pytest.mark.ray
def test_models_tokenize_health(server):
    stub, pb2 = server["stub"], server["pb2"]
    assert server["model"]
    tok = stub.Tokenize(pb2.TokenizeRequest(text="Hello world"), metadata=_md())
    assert tok.count == len(tok.tokens) > 0 and tok.max_model_len == 1024
    health = stub.Health(pb2.HealthRequest(), metadata=_md())
    assert health.healthy and dict(health.pools["decode"].replicas) == {"decode-0": True}


@pytest.mark.ray
def test_stream_equals_http_and_offline_engine(server, tiny_llama):
    """Greedy: the gRPC stream's token ids are the offline engine's, its text is the HTTP path's
    (streamed and not), and usage adds up."""
    stub, pb2 = server["stub"], server["pb2"]
    prompt = "The quick brown fox jumps over the lazy dog and"
    llm = LLM(tiny_llama, dtype="float32", max_model_len=1024)
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    want_ids, want_text = list(out.outputs[0].token_ids), out.outputs[0].text
    http = openai.OpenAI(base_url=f"{server['http']}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    http_text = http.completions.create(model=server["model"], prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text
    http_stream = "".join(c.choices[0].text for c in http.completions.create(
        model=server["model"], prompt=prompt, max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)

    request = pb2.GenerateRequest(text=prompt, sampling=pb2.SamplingOptions(
        temperature=0, max_tokens=24, ignore_eos=True, logprobs=2))
    messages = list(stub.Generate(request, metadata=_md(), timeout=120))
    tokens = [m for m in messages if m.index == 0]
    ids = [t for m in tokens for t in m.token_ids]
    assert ids == want_ids
    assert "".join(m.text for m in tokens) == want_text == http_text == http_stream
    assert tokens[-1].finish_reason == "length" and all(m.finish_reason == "" for m in tokens[:-1])
    assert len(tokens) > 1                                       # streamed, not one final message
    logprobs = [lp for m in tokens for lp in m.logprobs]
    assert [lp.token_id for lp in logprobs] == ids
    assert all(lp.logprob == max(t.logprob for t in lp.top) for lp in logprobs)    # greedy picks the best
    usage = messages[-1].usage
    assert messages[-1].index == -1 and usage.completion_tokens == 24
    assert usage.prompt_tokens == stub.Tokenize(pb2.TokenizeRequest(text=prompt), metadata=_md()).count

    # token-id prompts take the same path
    by_ids = pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=list(out.prompt_token_ids)),
                                 sampling=pb2.SamplingOptions(temperature=0, max_tokens=24, ignore_eos=True))
    assert [t for m in stub.Generate(by_ids, metadata=_md(), timeout=120) for t in m.token_ids] == want_ids


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if not hasattr(result, "SerializeToString"):     # a stream: errors come on iteration
            list(result)
    return err.value.code(), err.value.details()


@pytest.mark.ray
def test_structured_outputs(server):
    """A choice and a regex constraint through protobuf: the streamed text obeys it."""
    stub, pb2 = server["stub"], server["pb2"]
    for constraint, check in ((pb2.StructuredOutputs(choice=pb2.Choices(choices=["north", "south"])),
                               lambda t: t in ("north", "south")),
                              (pb2.StructuredOutputs(regex="[0-9]{4}"), lambda t: len(t) == 4 and t.isdigit())):
        sampling = pb2.SamplingOptions(max_tokens=12, temperature=0.9, seed=5, structured_outputs=constraint)
        text = "".join(m.text for m in stub.Generate(pb2.GenerateRequest(text="Where?", sampling=sampling),
                                                     metadata=_md(), timeout=60))
        assert check(text), text


@pytest.mark.ray
def test_error_codes(server):
    stub, pb2 = server["stub"], server["pb2"]

    def gen(md=None, **kwargs):
        sampling = kwargs.pop("sampling", pb2.SamplingOptions(max_tokens=4))
        return lambda: stub.Generate(pb2.GenerateRequest(sampling=sampling, **kwargs),
                                     metadata=md or _md(), timeout=60)

    code, details = _code(gen(text="x", sampling=pb2.SamplingOptions(temperature=-1)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in details
    code, details = _code(gen(text="x", sampling=pb2.SamplingOptions(top_p=1.5)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in details
    code, details = _code(gen())                                            # no prompt at all
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in details
    code, details = _code(gen(token_ids=pb2.TokenIds(ids=[5] * 1000), sampling=pb2.SamplingOptions(max_tokens=100)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in details and "max_model_len" in details
    bad = pb2.StructuredOutputs(json_schema='{"type": "objectx"}')
    code, details = _code(gen(text="x", sampling=pb2.SamplingOptions(structured_outputs=bad)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "structured_outputs.json cannot be compiled" in details
    code, details = _code(gen(text="x", model="no-such-model"))
    assert code == grpc.StatusCode.NOT_FOUND and "no-such-model" in details
    for md in (_md(key=None), _md(key="wrong")):
        assert _code(gen(md, text="x"))[0] == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda md=md: stub.Models(pb2.ModelsRequest(), metadata=md))[0] == \
            grpc.StatusCode.UNAUTHENTICATED

    # RESOURCE_EXHAUSTED from the app that admits one request at a time, while one stream is open.
    held = stub.Generate(pb2.GenerateRequest(text="hold",
                                             sampling=pb2.SamplingOptions(max_tokens=500, ignore_eos=True)),
                         metadata=_md(LIMITED, None), timeout=120)
    next(held)
    code, details = _code(gen(_md(LIMITED, None), text="x"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit is 1" in details
    held.cancel()
    # and the server keeps answering
    assert [m for m in stub.Generate(pb2.GenerateRequest(text="still here", sampling=pb2.SamplingOptions(max_tokens=2)),
                                     metadata=_md(), timeout=60) if m.token_ids]


@pytest.mark.ray
def test_cancel_mid_stream_frees_every_block(server, eventually_no_leaks):
    """Eight streams of up to 900 tokens, cancelled after their first messages: the engine stops
    every one of them (fewer tokens in all than one stream asked for) and every block comes back."""
    stub, pb2 = server["stub"], server["pb2"]
    replicas = ray.get(server["managers"][0].replicas.remote("decode"))
    [replica] = replicas.values()
    before = ray.get(replica.stats.remote())["generation_tokens"]
    calls = [stub.Generate(pb2.GenerateRequest(text=f"request {i} says", sampling=pb2.SamplingOptions(
        max_tokens=900, ignore_eos=True, temperature=0)), metadata=_md(), timeout=300) for i in range(8)]
    for call in calls:
        assert next(call).token_ids
        next(call)
    assert ray.get(replica.stats.remote())["num_requests_running"] > 0
    for call in calls:
        call.cancel()
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED
    assert eventually_no_leaks(replicas, timeout=20)
    generated = ray.get(replica.stats.remote())["generation_tokens"] - before
    # Not one stream ran on to its 900 tokens: a cancel that reached the proxy while it wrote a
    # message once went no further (pdserve_proto/serve_proxy.py); here about 60-120 are made.
    assert generated < 900, f"{generated} tokens: cancelled requests kept running"


# --- Serve proxy repair (unit: no Ray) ------------------------------------------------------------------
def _serve_like_handler(log: list[str]):
    """Shaped like Serve 2.60's proxy stream: `except BaseException` around the replica stream, then a
    final status. Closing it at a yield (GeneratorExit) never reaches the awaited replica call."""
    async def handler(request, context):
        try:
            for i in range(1000):
                try:
                    await asyncio.sleep(0.001)          # awaiting the replica's next message
                except asyncio.CancelledError:
                    log.append("replica cancelled")
                    raise
                yield f"{request}-{i}"
        except BaseException as e:  # noqa: BLE001 - what Serve's proxy does
            log.append(f"caught {type(e).__name__}")
        yield "status"
        log.append("access log")        # Serve reads context.peer() here: the call must still be alive
    return handler


def test_cancel_on_close_cancels_the_replica_call_when_the_client_leaves_between_messages():
    from pdserve_proto.serve_proxy import cancel_on_close

    async def main():
        bare, repaired = [], []
        for log, wrap in ((bare, lambda h: h), (repaired, cancel_on_close)):
            stream = wrap(_serve_like_handler(log))("r", None)
            assert [await anext(stream), await anext(stream)] == ["r-0", "r-1"]
            with pytest.raises(RuntimeError) if wrap is not cancel_on_close else contextlib.nullcontext():
                await stream.aclose()           # the client went away while a message was written
            if wrap is cancel_on_close:         # the handler ended before the call did
                assert repaired[-1] == "access log", repaired
            await asyncio.sleep(0.05)
        assert "replica cancelled" not in bare      # the bug being repaired
        assert repaired[0] == "replica cancelled"

        whole = [m async for m in cancel_on_close(_serve_like_handler([]))("r", None)]
        assert whole[:2] == ["r-0", "r-1"] and whole[-1] == "status" and len(whole) == 1001
        with pytest.raises(ValueError, match="bad request"):
            [m async for m in cancel_on_close(_raising_handler)("fail", None)]

    asyncio.run(main())


def test_serve_handlers_read_the_peer_only_while_the_call_is_alive():
    """Serve's handler reads context.peer() as it ends; once gRPC has freed a cancelled call that
    read crashed the proxy. The repaired handlers see a context whose peer was read at the start."""
    from pdserve_proto.serve_proxy import cancel_on_close, peer_once

    class FreedCall:
        def __init__(self) -> None:
            self.freed = False
            self.code = None

        def peer(self) -> str:
            assert not self.freed, "peer() on a freed call"
            return "ipv4:127.0.0.1:5555"

        def set_code(self, code) -> None:
            self.code = code

    async def streaming(request, context):
        yield "first"
        context.set_code("OK")
        yield context.peer()                    # what Serve's access log reads, at the end

    async def unary(request, context):
        await asyncio.sleep(0)
        return context.peer()

    async def main():
        call = FreedCall()
        stream = cancel_on_close(streaming)("r", call)
        assert await anext(stream) == "first"
        call.freed = True                       # the client cancelled; gRPC let go of the call
        assert await anext(stream) == "ipv4:127.0.0.1:5555" and call.code == "OK"
        await stream.aclose()
        call = FreedCall()
        pending = asyncio.ensure_future(peer_once(unary)("r", call))   # gRPC awaits it at once
        await asyncio.sleep(0)
        call.freed = True
        assert await pending == "ipv4:127.0.0.1:5555"

    asyncio.run(main())


async def _raising_handler(request, context):
    yield "first"
    raise ValueError("bad request")


# --- control plane (unit: no Ray) -----------------------------------------------------------------------
def _remote(address: dict | list[dict], connector: str = "nixl", **layout_changes):
    from kv_transfer.layout import KVLayout
    from kv_transfer.params import RemotePrefill

    fields = {"model": "LlamaForCausalLM:0123abcd", "num_layers": 2, "block_size": 16, "num_kv_heads": 2,
              "head_dim": 16, "dtype": "float32", **layout_changes}
    layout = KVLayout(**fields)
    return RemotePrefill(engine_id="p-0", request_id="cmpl-1", block_ids=[3, 9, 4],
                         block_hashes=[bytes([i]) * 32 for i in range(2)], num_tokens=40, lease_slot=7,
                         lease_token=(1 << 50) + 5, lease_expires_at=1_800_000_000.25, layout=layout,
                         addresses=address if isinstance(address, list) else [address], connector=connector)


NIXL_ADDRESS = {"agent_metadata": "bWV0YQ==", "kv_addrs": [1 << 40, (1 << 40) + 4096], "num_blocks": 64,
                "lease_addr": 1 << 41, "num_lease_slots": 4096, "mem": "DRAM", "device_id": 0}


@pytest.mark.parametrize("address,connector", [
    (NIXL_ADDRESS, "nixl"), ([NIXL_ADDRESS, {**NIXL_ADDRESS, "agent_metadata": "cmFuazE="}], "nixl"),
    ({"host": "10.0.0.7", "port": 29517}, "torch_dist")])
def test_remote_prefill_round_trips_through_protobuf(address, connector):
    from kv_transfer.params import RemotePrefill

    tp = len(address) if isinstance(address, list) else 1
    remote = _remote(address, connector, tp_size=tp)
    assert len(remote.addresses) == tp
    params = remote.to_dict()
    assert isinstance(params["pdserve_kv"], bytes)
    assert RemotePrefill.from_proto_bytes(params["pdserve_kv"]) == remote
    # The protobuf form is what D reads: the readable keys beside it are only a view.
    assert RemotePrefill.from_dict({**params, "remote_block_ids": [0], "layout": {}}) == remote


def _reencoded(data: bytes, **changes) -> bytes:
    from pdserve_proto import pb2

    msg = pb2.RemotePrefill.FromString(data)
    for path, value in changes.items():
        target = msg
        *parents, leaf = path.split("__")
        for p in parents:
            target = getattr(target, p)
        setattr(target, leaf, value)
    return msg.SerializeToString()


def test_handshake_refuses_other_schema_connector_or_layout():
    from engine.config import KVTransferConfig
    from engine.errors import KVLayoutMismatch, SchemaVersionMismatch
    from kv_transfer.base import KVConnectorScheduler
    from kv_transfer.params import CONNECTOR_VERSION, RemotePrefill
    from pdserve_proto import CONTROL_SCHEMA_VERSION

    mine = _remote(NIXL_ADDRESS)
    scheduler = KVConnectorScheduler(KVTransferConfig("nixl", "d-0"), mine.layout)
    hashes = mine.block_hashes + [b"x" * 32]

    def parse(data: bytes):
        return scheduler.parse({"do_remote_prefill": True, "pdserve_kv": data}, hashes, 48)

    good = mine.to_proto_bytes()
    assert parse(good) == mine
    with pytest.raises(SchemaVersionMismatch, match=f"schema_version is {CONTROL_SCHEMA_VERSION + 1} .* reads "
                                                    f"version {CONTROL_SCHEMA_VERSION}"):
        parse(_reencoded(good, schema_version=CONTROL_SCHEMA_VERSION + 1))
    with pytest.raises(SchemaVersionMismatch, match="KVHandshake"):
        parse(_reencoded(good, handshake__schema_version=0))
    with pytest.raises(KVLayoutMismatch, match="protocol is version"):
        parse(_reencoded(good, handshake__connector_version=CONNECTOR_VERSION + 1))
    with pytest.raises(KVLayoutMismatch, match="connector is 'torch_dist'"):
        parse(_remote({"host": "h", "port": 1}, "torch_dist").to_proto_bytes())
    for field, value in (("block_size", 32), ("dtype", "bfloat16"), ("num_kv_heads", 4),
                         ("model", "Qwen2ForCausalLM:ffff")):
        with pytest.raises(KVLayoutMismatch, match=f"prefill engine's {field} is"):
            parse(_remote(NIXL_ADDRESS, **{field: value}).to_proto_bytes())
    # TP sizes may differ (each rank pulls its heads), but every prefill rank needs an address.
    assert parse(_remote([NIXL_ADDRESS] * 2, tp_size=2).to_proto_bytes()).layout.tp_size == 2
    with pytest.raises(ValueError, match="carries 1 rank addresses for a prefill engine of tensor_parallel_size 2"):
        parse(_remote(NIXL_ADDRESS, tp_size=2).to_proto_bytes())
    with pytest.raises(ValueError, match="not a RemotePrefill"):
        RemotePrefill.from_proto_bytes(b"\xff\xff\xff")


def test_kv_events_round_trip_and_version_refusal():
    from engine.errors import SchemaVersionMismatch
    from engine.outputs import AllCleared, BlockRemoved, BlockStored
    from pdserve_proto import CONTROL_SCHEMA_VERSION, pb2
    from pdserve_proto.kv_events import decode_kv_events, encode_kv_events
    from router.prefix_index import PrefixIndex

    a, b, c = (bytes([i]) * 32 for i in range(3))
    events = [BlockStored([a, b]), BlockRemoved([a]), AllCleared(), BlockStored([c]), BlockStored([])]
    data = encode_kv_events(12, events, "decode-0")
    assert decode_kv_events(data) == (12, events)
    index = PrefixIndex()
    index.apply("decode-0", decode_kv_events(data)[1])
    assert index.match([c]) == {"decode-0": 1} and index.num_blocks("decode-0") == 1

    newer = pb2.KVEventBatch.FromString(data)
    newer.schema_version = CONTROL_SCHEMA_VERSION + 1
    with pytest.raises(SchemaVersionMismatch, match="replica decode-0"):
        decode_kv_events(newer.SerializeToString())
    with pytest.raises(ValueError, match="not a KVEventBatch"):
        decode_kv_events(b"\x0a\xff")


def test_stubs_are_generated_not_committed():
    """The generated modules come from the cache keyed by the schema's hash, never from the repo."""
    import pdserve_proto

    assert pdserve_proto.pb2.__file__.startswith(pdserve_proto._dir)
    here = os.path.dirname(pdserve_proto.PROTO_PATH)
    assert not os.path.realpath(pdserve_proto._dir).startswith(os.path.realpath(here))
    assert not [f for f in os.listdir(here) if f.endswith(("_pb2.py", "_pb2_grpc.py"))]


def test_stub_generation_leaves_nixl_importable(tmp_path):
    """Generating the stubs in a fresh cache must not load protoc's compiler into this process: with
    it loaded, importing NIXL's bindings aborted the interpreter (a clean clone's first test run)."""
    pytest.importorskip("nixl", reason="needs the nixl package (the kv extra)")
    code = "import pdserve_proto, sys, nixl; print('grpc_tools._protoc_compiler' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PDSERVE_PROTO_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"
    assert any(name.endswith("pdserve_pb2.py") for name in map(str, tmp_path.rglob("*.py")))
