"""Ray Serve's own floor for `benchmarks/ingress_capacity.py`: a bare FastAPI deployment that answers
a streamed chat completion with the chunks an OpenAI server sends (a role chunk, one per token, a
finish chunk, `[DONE]`) and does nothing else: no tokenizer, no router, no engine. What it
sustains per ingress CPU-second is the most any Serve ingress can, on this machine, through the
proxy (or with `--direct-ingress`, serving the port itself); pdserve's ingress is measured against it.

    .venv/bin/python benchmarks/serve_floor.py --port 8123 [--direct-ingress]    # runs until killed

FLOOR_GAP_MS=10 sends the token chunks that many milliseconds apart, as an engine's steps make them
(back to back, Serve ships them in a few messages).
"""
import argparse
import asyncio
import json
import os
import signal
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--direct-ingress", action="store_true")
    args = ap.parse_args()
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    if args.direct_ingress:       # as records/serving.py: ServingSpec.direct_ingress_env
        os.environ.update({"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
                           "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(args.port),
                           "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(args.port + 1)})
    # Ray and Serve load here, after the environment their processes inherit is set. (No `from
    # __future__ import annotations` in this file: FastAPI reads the handlers' annotations in the
    # replica, where the pickled class has none of this module's names.)
    import ray
    from ray import serve

    api = FastAPI()
    GAP_S = float(os.environ.get("FLOOR_GAP_MS", "0")) / 1e3

    @serve.deployment(name="openai-ingress", ray_actor_options={"num_cpus": 1}, max_ongoing_requests=100000)
    @serve.ingress(api)
    class Floor:
        @api.get("/health")
        async def health(self) -> JSONResponse:
            return JSONResponse({"status": "ok"})

        @api.get("/v1/models")
        async def models(self) -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": "floor", "object": "model"}]})

        @api.post("/v1/chat/completions")
        async def chat(self, request: Request) -> StreamingResponse:
            body = await request.json()
            n = int(body.get("max_tokens") or 16)
            created, rid = int(time.time()), f"chatcmpl-{time.monotonic_ns()}"

            def chunk(delta: dict, finish: str | None = None) -> str:
                return "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                              "model": body.get("model"), "choices": [
                                                  {"index": 0, "delta": delta, "logprobs": None,
                                                   "finish_reason": finish}]}) + "\n\n"

            async def stream():
                yield chunk({"role": "assistant", "content": ""})
                for i in range(n):
                    if GAP_S:           # tokens a step apart, as an engine makes them
                        await asyncio.sleep(GAP_S)
                    yield chunk({"content": f" t{i}"})
                yield chunk({}, "length")
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 0 if args.direct_ingress else args.port})
    serve.run(Floor.bind(), name="floor", route_prefix="/")
    print(f"serving on http://127.0.0.1:{args.port}", flush=True)
    stop = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        time.sleep(0.5)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
