"""AsyncLLMEngine: the asyncio front of one engine (what the serving layer and Ray actors call).

One background task owns the engine: it applies queued adds and aborts between steps and runs each
step on the engine's own thread, so the event loop stays responsive. A request's outputs (the
cumulative RequestOutput once per step in which it advanced) go to the sink it was submitted with
(`submit`), or stream from `generate()`, whose consumer aborts the request when it stops early.

Delivery never holds up the engine: the loop starts step k + 1 on the engine thread first and hands
step k's outputs to their sinks while it runs (the sinks only read the outputs, which are snapshots).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import engine.tracing as tracing
import records.clock as clock
from engine.llm_engine import LLMEngine
from engine.text.backend_tokenizer import hf_tokenizer
from records.config import EngineConfig
from records.config_resolution import engine_config
from records.engine_stats import EngineStats
from records.errors import EngineDeadError, RequestFailedError
from records.kv_events import KVEvent
from records.lora import LoRARequest
from records.multimodal import ImageInput
from records.outputs import RequestOutput
from records.request import Continuation, NewRequest
from records.sampling_params import SamplingParams

IDLE_POLL_S = 0.002
# Where a request's outputs go: each RequestOutput as the engine makes it, or the exception that ended
# the request (called on the event loop's thread, never after the request's last output).
Sink = Callable[[RequestOutput | BaseException], None]


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        # All of the engine's torch work (loading, the KV-cache sizing forward, every step) runs on
        # one thread: once a second thread runs OpenMP regions, every step slows down for good
        # (measured on 2 cores: a 31 ms batch-1 decode step of the embedded model took 50 ms after
        # steps had run on another thread than the one that loaded it; 60 ms in the actor).
        self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self.engine = self._step_thread.submit(LLMEngine, config).result()
        # Output constraints compile here, off the event loop (the first one also builds the
        # tokenizer's table, about a second), so other requests' outputs keep flowing meanwhile.
        self._grammar_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiling: dict[str, NewRequest] = {}    # request id -> its add, once compiled
        self._sinks: dict[str, Sink] = {}
        self._pending_adds: list[NewRequest] = []
        self._pending_aborts: list[str] = []
        self._pending_calls: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._step_signal: asyncio.Event | None = None      # set (and replaced) after every step
        self.on_step: Callable[[], None] | None = None      # called after every step (on the loop)

    @classmethod
    def from_args(cls, model: str | None = None, **kwargs: Any) -> AsyncLLMEngine:
        return cls(engine_config(model, **kwargs))

    @property
    def tokenizer(self) -> Any:
        """The model's HF tokenizer."""
        return hf_tokenizer(self.engine.tokenizer)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, sink: Sink,
               kv_transfer_params: dict | None = None, prompt: str | None = None,
               continuation: Continuation | None = None, trace_context: dict[str, str] | None = None,
               block_hashes: list[bytes] | None = None, images: tuple[ImageInput, ...] = ()) -> bool:
        """Queue a request whose outputs go to `sink` (see Sink); `continuation`: it resumes after
        tokens another replica generated; `trace_context`: its trace's W3C carrier; `block_hashes`:
        the prompt came prepared by an ingress (LLMEngine.add_request); `images`: its images, as the
        model's processor prepared them there (records/multimodal.py). Validated here, once.
        Raises ValueError for bad input and EngineDeadError if the engine is dead (nothing is
        queued then); a request that fails later reaches its sink as an output
        with a failed choice (`RequestOutput.error()`) or as an exception (an output constraint that cannot
        compile: its ValueError, since it compiles off the loop).
        Returns False, queueing nothing, when an abort of this request id came first and is still
        pending (a caller's abort can overtake its submit: they travel as separate calls)."""
        if self._dead is not None:
            raise EngineDeadError("engine is dead") from self._dead
        self._ensure_loop()
        if request_id in self._sinks:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if request_id in self._pending_aborts:
            self._pending_aborts.remove(request_id)
            return False
        prompt_token_ids = list(prompt_token_ids)
        self.engine.validate(prompt_token_ids, params, compile_constraint=False, prepared=block_hashes is not None)
        self._sinks[request_id] = sink
        # It arrives now: the wait for the loop to take it in is part of its queue time.
        add = NewRequest(request_id, prompt, prompt_token_ids, params, clock.monotonic(), kv_transfer_params,
                         continuation, trace_context, block_hashes, images)
        if params.structured_outputs is None:
            self._queue_add(add)
            return True
        self._compiling[request_id] = add
        loop = asyncio.get_running_loop()
        future = self._grammar_thread.submit(self.engine.compile_constraint, params.structured_outputs)
        future.add_done_callback(lambda f: loop.call_soon_threadsafe(self._compiled, add, f))
        return True

    def _queue_add(self, add: NewRequest) -> None:
        # The step runs in a thread: engine state is touched only by the loop, between steps.
        self._pending_adds.append(add)
        self._wakeup.set()  # type: ignore[union-attr]

    def _compiled(self, add: NewRequest, future: Any) -> None:
        """A request's constraint compiled (on the event loop's thread): queue it, or fail it with
        the compiler's ValueError; nothing if it was aborted meanwhile."""
        rid = add.request_id
        if self._compiling.get(rid) is not add:
            return
        del self._compiling[rid]
        if rid not in self._sinks:           # the engine died meanwhile (its sinks were told)
            return
        error = future.exception()
        if error is None:
            self._queue_add(add)
            return
        sink = self._sinks.pop(rid, None)
        if sink is not None:
            sink(error if isinstance(error, ValueError) else
                 RequestFailedError(f"request {rid!r} could not start: {error!r}"))

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       kv_transfer_params: dict | None = None, prompt: str | None = None,
                       continuation: Continuation | None = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs for one request. Raises ValueError for bad input (before any output),
        RequestFailedError if this request failed while it ran (the engine goes on), and
        EngineDeadError if the engine fails. Closing or cancelling the iterator aborts the request."""
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        if not self.submit(request_id, prompt_token_ids, params, queue.put_nowait, kv_transfer_params, prompt,
                           continuation):
            return                          # aborted before it started
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                error = item.error()
                if error is not None:
                    raise error
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed before the next step and its sink hears no more."""
        self._sinks.pop(request_id, None)
        self._compiling.pop(request_id, None)
        self._pending_adds = [a for a in self._pending_adds if a.request_id != request_id]
        self._pending_aborts.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def take_kv_events(self) -> list[KVEvent]:
        return self.engine.take_kv_events()

    async def wait_for_step(self, timeout: float) -> bool:
        """Wait until the engine finishes a step (True) or `timeout` seconds pass (False)."""
        if self._step_signal is None:
            self._step_signal = asyncio.Event()
        try:
            await asyncio.wait_for(self._step_signal.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    @property
    def is_healthy(self) -> bool:
        return self._dead is None

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        done: list[RequestOutput] = []          # the last step's outputs, not yet delivered
        try:
            while True:
                if self._pending_adds:
                    adds, self._pending_adds = self._pending_adds, []
                    for add in adds:
                        try:
                            self.engine.enqueue(add)
                        except Exception as e:  # noqa: BLE001 - e.g. a layout mismatch: this request only
                            rid = add.request_id
                            sink = self._sinks.pop(rid, None)
                            if sink is not None:
                                sink(e if isinstance(e, ValueError) else
                                     RequestFailedError(f"request {rid!r} could not start: {e!r}"))
                if self._pending_aborts:
                    aborts, self._pending_aborts = self._pending_aborts, []
                    self.engine.abort_request(aborts)
                if self._pending_calls:
                    calls, self._pending_calls = self._pending_calls, []
                    for fn, future in calls:
                        try:
                            result = await loop.run_in_executor(self._step_thread, fn)
                        except Exception as e:  # noqa: BLE001 - the caller's to handle
                            if not future.done():
                                future.set_exception(e)
                        else:
                            if not future.done():
                                future.set_result(result)
                if not self.engine.has_unfinished_requests():
                    self._deliver(done)
                    done = []
                    # Work that came while a call above ran set the wake-up already: clearing it
                    # now would leave that work waiting for the next arrival (nothing awaits between
                    # this check and the clear).
                    if not (self._pending_adds or self._pending_aborts or self._pending_calls):
                        self._wakeup.clear()
                        await self._wakeup.wait()
                    continue
                step = loop.run_in_executor(self._step_thread, self.engine.step)
                delivered, done = done, []       # (never again below, should the step raise)
                self._deliver(delivered)         # while the next step runs
                done = await step
                if self._step_signal is not None:
                    signal, self._step_signal = self._step_signal, None
                    signal.set()
                if self.on_step is not None:
                    self.on_step()
                # Let consumers and new requests in between steps; when only transfers are pending
                # (a pull in flight, blocks under lease) poll them without spinning.
                await asyncio.sleep(IDLE_POLL_S if self.engine.last_step_idle else 0)
        except Exception as e:  # noqa: BLE001 - every request must learn the engine died
            self._dead = e
            self._deliver(done)
            # Their blocks are bookkeeping on this side: free them so nothing is left held.
            self.engine.abort_request(list(self.engine.output.states))
            sinks, self._sinks = self._sinks, {}
            for sink in sinks.values():
                sink(EngineDeadError(f"engine step failed: {e!r}"))
            calls, self._pending_calls = self._pending_calls, []
            for _, future in calls:
                if not future.done():
                    future.set_exception(EngineDeadError(f"engine step failed: {e!r}"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:             # aborted meanwhile
                continue
            if out.finished:
                del self._sinks[out.request_id]
            sink(out)

    def renew_lease(self, request_id: str, seconds: float) -> bool:
        return self.engine.renew_lease(request_id, seconds)

    async def between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine's thread between two steps (what changes the engine's blocks
        from outside a step: a prefix lease for a peer replica) and return its result."""
        if self._dead is not None:
            raise EngineDeadError(f"engine step failed: {self._dead!r}")
        self._ensure_loop()
        future = asyncio.get_running_loop().create_future()
        self._pending_calls.append((fn, future))
        assert self._wakeup is not None
        self._wakeup.set()
        return await future

    # --- weight updates, pause and resume (engine/weight_updates.py), between steps -----------------
    async def pause(self, mode: str = "keep") -> None:
        """Pause at the next step boundary ("keep", "abort": the ended requests' outputs go to their
        callers; "wait": returns once the running requests have finished)."""
        self._deliver(await self.between_steps(lambda: self.engine.weights.pause(mode)))
        while mode == "wait" and self.engine.scheduler.running:
            await self.wait_for_step(1.0)

    async def resume(self) -> None:
        await self.between_steps(self.engine.weights.resume)

    async def update_weights(self, weights: list[tuple[str, Any]], version: str | None = None,
                             lora_request: LoRARequest | None = None) -> str:
        return await self._update(lambda: self.engine.weights.from_tensors(weights, version, lora_request))

    async def update_weights_from_disk(self, path: str, version: str | None = None,
                                       lora_request: LoRARequest | None = None) -> str:
        return await self._update(lambda: self.engine.weights.from_disk(path, version, lora_request))

    async def _update(self, update: Callable[[], str]) -> str:
        """Run an update between steps. A caller that did not pause gets a "wait" pause around it
        (running requests finish first, none is admitted meanwhile), so that no sequence spans two
        versions unless the caller paused with "keep" (the partial rollouts RL frameworks ask for)."""
        if self.engine.weights.paused is not None:
            return await self.between_steps(update)
        await self.pause("wait")
        try:
            return await self.between_steps(update)
        finally:
            await self.resume()

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, backend: str = "gloo") -> None:
        """Join the trainer's group; off the engine's thread (it waits for every member to join, and
        touches nothing a step reads), so the engine serves meanwhile."""
        await asyncio.to_thread(self.engine.weights.join_group, master_address, master_port, rank_offset,
                                world_size, backend)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              version: str | None = None,
                                              lora_request: LoRARequest | None = None) -> str:
        return await self._update(lambda: self.engine.weights.from_group(names, dtypes, shapes, version, lora_request))

    async def encode_images(self, images: list[Any]) -> list[Any]:
        """LLMEngine.encode_images, between steps."""
        return await self.between_steps(lambda: self.engine.encode_images(images))

    async def encoder_stats(self) -> dict[str, int] | None:
        """The first stage's images encoded, received made (an encode pool's) and kept; None for a
        model that takes no images."""
        stats = await self.between_steps(lambda: self.engine.executor.collective_rpc("encoder_stats"))
        return next((s for s in stats if s is not None), None)

    async def check_weights(self, shapes: dict[str, list[int]], lora_request: LoRARequest | None = None) -> None:
        await self.between_steps(lambda: self.engine.weights.check(shapes, lora_request))

    async def lease_prefix(self, block_hashes: list[bytes], adapter: str = "") -> dict[str, Any] | None:
        """LLMEngine.lease_prefix, between steps."""
        return await self.between_steps(lambda: self.engine.lease_prefix(block_hashes, adapter))

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        self._grammar_thread.shutdown(wait=False)
        self.engine.executor.shutdown()
        # (joined off the loop: a step still running holds the engine's tensors until it returns)
        await asyncio.to_thread(self._step_thread.shutdown, True)
        tracing.flush()
