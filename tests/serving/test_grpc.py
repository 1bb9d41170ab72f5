"""The gRPC Generation service through Ray Serve's gRPC proxy (127.0.0.1), beside the HTTP API on the
same Serve app (the shared apps of tests/serving/conftest.py: a real `grpc` client, a local Ray, a
tiny model), and the proxy's cancellation repair (unit: no Ray)."""
from __future__ import annotations

import asyncio
import contextlib

import openai
import pytest

from engine import LLM, SamplingParams
from serving.apps import API_KEY, LIMITED, grpc_metadata

ray = pytest.importorskip("ray", reason="the serving tests need ray[serve] (make setup installs it)")
grpc = pytest.importorskip("grpc")


@pytest.mark.ray
def test_models_tokenize_health(grpc_server):
    stub, pb2 = grpc_server["stub"], grpc_server["pb2"]
    assert grpc_server["model"]
    tok = stub.Tokenize(pb2.TokenizeRequest(text="Hello world"), metadata=grpc_metadata())
    assert tok.count == len(tok.tokens) > 0 and tok.max_model_len == 1024
    health = stub.Health(pb2.HealthRequest(), metadata=grpc_metadata())
    assert health.healthy and dict(health.pools["decode"].replicas) == {"decode-0": True, "decode-1": True}


@pytest.mark.ray
def test_stream_equals_http_and_offline_engine(grpc_server, tiny_llama):
    """Greedy: the gRPC stream's token ids are the offline engine's, its text is the HTTP path's
    (streamed and not), and usage adds up."""
    stub, pb2 = grpc_server["stub"], grpc_server["pb2"]
    prompt = "The quick brown fox jumps over the lazy dog and"
    llm = LLM(tiny_llama, dtype="float32", max_model_len=1024)
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    want_ids, want_text = list(out.outputs[0].token_ids), out.outputs[0].text
    http = openai.OpenAI(base_url=f"{grpc_server['http']}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    http_text = http.completions.create(model=grpc_server["model"], prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text
    http_stream = "".join(c.choices[0].text for c in http.completions.create(
        model=grpc_server["model"], prompt=prompt, max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)

    request = pb2.GenerateRequest(text=prompt, sampling=pb2.SamplingOptions(
        temperature=0, max_tokens=24, ignore_eos=True, logprobs=2))
    messages = list(stub.Generate(request, metadata=grpc_metadata(), timeout=120))
    tokens = [m for m in messages if m.index == 0]
    ids = [t for m in tokens for t in m.token_ids]
    assert ids == want_ids
    assert "".join(m.text for m in tokens) == want_text == http_text == http_stream
    assert tokens[-1].finish_reason == "length" and all(m.finish_reason == "" for m in tokens[:-1])
    assert {m.weight_version for m in tokens} == {"0"}       # the weights as loaded (docs/rl.md)
    assert len(tokens) > 1                                       # streamed, not one final message
    logprobs = [lp for m in tokens for lp in m.logprobs]
    assert [lp.token_id for lp in logprobs] == ids
    assert all(lp.logprob == max(t.logprob for t in lp.top) for lp in logprobs)    # greedy picks the best
    usage = messages[-1].usage
    assert messages[-1].index == -1 and usage.completion_tokens == 24
    assert usage.prompt_tokens == stub.Tokenize(pb2.TokenizeRequest(text=prompt), metadata=grpc_metadata()).count

    # token-id prompts take the same path
    by_ids = pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=list(out.prompt_token_ids)),
                                 sampling=pb2.SamplingOptions(temperature=0, max_tokens=24, ignore_eos=True))
    assert [t for m in stub.Generate(by_ids, metadata=grpc_metadata(), timeout=120) for t in m.token_ids] == want_ids


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if not hasattr(result, "SerializeToString"):     # a stream: errors come on iteration
            list(result)
    return err.value.code(), err.value.details()


@pytest.mark.ray
def test_structured_outputs(grpc_server):
    """A choice and a regex constraint through protobuf: the streamed text obeys it."""
    stub, pb2 = grpc_server["stub"], grpc_server["pb2"]
    for constraint, check in ((pb2.StructuredOutputs(choice=pb2.Choices(choices=["north", "south"])),
                               lambda t: t in ("north", "south")),
                              (pb2.StructuredOutputs(regex="[0-9]{4}"), lambda t: len(t) == 4 and t.isdigit())):
        sampling = pb2.SamplingOptions(max_tokens=12, temperature=0.9, seed=5, structured_outputs=constraint)
        text = "".join(m.text for m in stub.Generate(pb2.GenerateRequest(text="Where?", sampling=sampling),
                                                     metadata=grpc_metadata(), timeout=60))
        assert check(text), text


@pytest.mark.ray
def test_error_codes(grpc_server):
    stub, pb2 = grpc_server["stub"], grpc_server["pb2"]

    def gen(md=None, **kwargs):
        sampling = kwargs.pop("sampling", pb2.SamplingOptions(max_tokens=4))
        return lambda: stub.Generate(pb2.GenerateRequest(sampling=sampling, **kwargs),
                                     metadata=md or grpc_metadata(), timeout=60)

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
    for md in (grpc_metadata(key=None), grpc_metadata(key="wrong")):
        assert _code(gen(md, text="x"))[0] == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda md=md: stub.Models(pb2.ModelsRequest(), metadata=md))[0] == \
            grpc.StatusCode.UNAUTHENTICATED

    # RESOURCE_EXHAUSTED from the app that admits one request at a time, while one stream is open.
    # (It serves two models: a request names one, or is refused naming them.)
    code, details = _code(gen(grpc_metadata(LIMITED, None), text="x"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "model is required" in details and "'qwen'" in details
    held = stub.Generate(pb2.GenerateRequest(text="hold", model="tiny",
                                             sampling=pb2.SamplingOptions(max_tokens=500, ignore_eos=True)),
                         metadata=grpc_metadata(LIMITED, None), timeout=120)
    next(held)
    code, details = _code(gen(grpc_metadata(LIMITED, None), text="x", model="tiny-chat"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit is 1" in details
    held.cancel()
    # and the server keeps answering
    assert [m for m in stub.Generate(pb2.GenerateRequest(text="still here", sampling=pb2.SamplingOptions(max_tokens=2)),
                                     metadata=grpc_metadata(), timeout=60) if m.token_ids]


@pytest.mark.ray
def test_cancel_mid_stream_frees_every_block(grpc_server, eventually_no_leaks):
    """Eight streams of up to 900 tokens, cancelled after their first messages: the engine stops
    every one of them (fewer tokens in all than one stream asked for) and every block comes back."""
    stub, pb2 = grpc_server["stub"], grpc_server["pb2"]
    replicas = ray.get(grpc_server["managers"][0].replicas.remote("decode"))

    def engines() -> list:
        return [s.engine for s in ray.get([r.stats.remote() for r in replicas.values()])]

    before = sum(e.generation_tokens for e in engines())
    calls = [stub.Generate(pb2.GenerateRequest(text=f"request {i} says", sampling=pb2.SamplingOptions(
        max_tokens=900, ignore_eos=True, temperature=0)), metadata=grpc_metadata(), timeout=300) for i in range(8)]
    for call in calls:
        assert next(call).token_ids
        next(call)
    assert sum(e.num_requests_running for e in engines()) > 0
    for call in calls:
        call.cancel()
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED
    assert eventually_no_leaks(replicas, timeout=20)
    generated = sum(e.generation_tokens for e in engines()) - before
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


@pytest.mark.ray
def test_grpc_listens_on_the_serving_host_only(grpc_server, apps):
    """With serving.host 127.0.0.1 and a grpc_port, Serve's proxy listens for gRPC on loopback (Ray
    would open "[::]:port"), and no process of this local Ray listens beyond loopback."""
    import os

    import psutil

    _, grpc_port, _, _ = apps
    # The local Ray's processes (the server): this test process's own listeners (the OTLP receiver,
    # NIXL agents other tests made here) are not the server's.
    tree = psutil.Process(os.getpid()).children(recursive=True)
    listening = []
    for p in tree:
        try:
            listening += [(p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
    loopback = ("127.0.0.1", "::ffff:127.0.0.1")        # gRPC's socket may be IPv6, mapped
    grpc_listeners = [entry for entry in listening if entry[2] == grpc_port]
    assert grpc_listeners and all(ip in loopback for _, ip, _ in grpc_listeners), grpc_listeners
    exposed = [entry for entry in listening if not (entry[1].startswith(("127.", "::ffff:127.")) or entry[1] == "::1")]
    assert exposed == [], exposed
