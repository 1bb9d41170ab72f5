"""An engine's weights as a trainer changes them (RL rollouts): updates on every rank between steps,
the weight version each request's tokens came from, and pause / resume at a step boundary.

Updates (engine/worker/weight_sync.py does each rank's part): from a checkpoint directory, from
tensors (in-process, or Ray object references through the executor), or broadcast by the trainer
over a weight-update group its ranks joined. Each is checked on every rank before any tensor changes
(a wrong name or shape is a ValueError naming it; the old weights keep serving). After one, the prefix
cache and the offload tier forget every block (their KV is the old weights'; the router's index hears
AllCleared), the requests holding blocks register none of theirs, a request with no token yet
computes its prompt again (its pull, if one is under way, thrown away when it lands), leases of
prompts prefilled for a decode engine end (that engine computes them), and the version moves on: each
request records (first output token, version) per range, so a sequence that ran across the update
(pause "keep", the partial rollouts of RL frameworks) says which tokens came from which weights.

Pause modes (SGLang's and vLLM's): "keep" stops stepping, every request keeping its place and KV;
"abort" ends every request with finish reason "abort" and what it generated, and stops; "wait" lets
running requests finish and admits no waiting one. `resume` goes on. Requests that arrive while
paused wait.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from records.request import RequestStatus

if TYPE_CHECKING:
    import torch

    from records.lora import LoRARequest
    from records.outputs import RequestOutput

PAUSE_MODES = ("keep", "abort", "wait")


class WeightUpdates:
    def __init__(self, engine: Any) -> None:
        """engine: the LLMEngine whose executor, scheduler, outputs and KV cache it works on."""
        self.engine = engine
        self.version = "0"
        self.num_updates = 0
        self.paused: str | None = None       # a PAUSE_MODES entry while paused
        # Outputs of pipelined batches that finished before a pause or an update took effect: the
        # engine's next step returns them (the step thread is the only one that delivers).
        self.held: list[RequestOutput] = []

    def take_held(self) -> list[RequestOutput]:
        held, self.held = self.held, []
        return held

    # --- pause ------------------------------------------------------------------------------------
    def pause(self, mode: str = "keep") -> list[RequestOutput]:
        """Pause at this step boundary; the outputs of requests ended ("abort"), else []."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}; got {mode!r}")
        self.held += self.engine.drain()     # batches under way finish first (a pipelined engine)
        self.paused = mode
        self.engine.scheduler.admitting = mode != "wait"
        return self.engine.output.abort_all() if mode == "abort" else []

    @property
    def stepping(self) -> bool:
        """Whether the engine runs steps now (not paused "keep" or "abort")."""
        return self.paused in (None, "wait")

    def resume(self) -> None:
        self.paused = None
        self.engine.scheduler.admitting = True

    # --- updates ----------------------------------------------------------------------------------
    # Each takes the model's tensors (HF names), or with `lora` the adapter's (PEFT names, as in its
    # adapter_model.safetensors; a directory is then a PEFT adapter's): an RL policy that is a LoRA
    # adapter over a frozen base.
    def check(self, shapes: dict[str, Sequence[int]], lora: LoRARequest | None = None) -> None:
        """ValueError naming a tensor the model's checkpoint (or the adapter) lacks with that shape."""
        if lora is not None:
            self.engine.check_adapter(lora)
        self.engine.executor.collective_rpc("check_weights", {n: list(s) for n, s in shapes.items()}, lora)

    def from_tensors(self, weights: list[tuple[str, torch.Tensor]], version: str | None = None,
                     lora: LoRARequest | None = None) -> str:
        return self._update("update_weights", (weights,), version, lora)

    def from_disk(self, path: str, version: str | None = None, lora: LoRARequest | None = None) -> str:
        return self._update("update_weights_from_disk", (path,), version, lora)

    def join_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   backend: str = "gloo") -> None:
        """Every rank joins the trainer's weight-update group (ranks rank_offset ...)."""
        self.engine.executor.collective_rpc("init_weights_update_group", master_address, master_port,
                                            rank_offset, world_size, backend)

    def from_group(self, names: list[str], dtypes: list[str], shapes: list[Sequence[int]],
                   version: str | None = None, lora: LoRARequest | None = None) -> str:
        """Receive the trainer's broadcast of these tensors, in order (checked on every rank first:
        a trainer should `check` before it sends, since a refused update receives nothing)."""
        self.check(dict(zip(names, shapes, strict=True)), lora)
        return self._update("update_weights_from_group", (names, dtypes, [list(s) for s in shapes]), version, lora)

    def _update(self, method: str, args: tuple[Any, ...], version: str | None, lora: LoRARequest | None) -> str:
        """Worker.`method`(*args, lora) on every rank, once the batches under way finished; the new version."""
        if lora is not None:
            self.engine.check_adapter(lora)
        self.held += self.engine.drain()
        self.engine.executor.collective_rpc(method, *args, lora)
        return self._updated(version)

    def _updated(self, version: str | None) -> str:
        engine, scheduler, kv = self.engine, self.engine.scheduler, self.engine.kv_cache_manager
        self.num_updates += 1
        self.version = str(version) if version is not None else str(self.num_updates)
        kv.reset_prefix_cache(force=True)
        for request in list(scheduler.requests.values()):
            self.start(request, len(request.output_token_ids))
            if request.output_token_ids:
                continue        # its tokens so far are the old weights' (a span, as its versions say)
            # Nothing came of its KV yet: computed again under the new weights, so that its output is
            # wholly theirs (a pull under way lands and is then thrown away: KVLoads.finish).
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                request.kv_stale = True
            elif request.num_computed_tokens and request.status == RequestStatus.RUNNING:
                scheduler.restart(request)
            elif request.num_computed_tokens and request.status == RequestStatus.WAITING:
                kv.free(request)
                request.compute_again()
                request.num_cached_tokens = 0
        if engine.transfers is not None:        # prompts prefilled here for a decode engine: pulled no more
            for request_id in list(engine.kv_connector.leases):
                engine.transfers.abort(request_id)
        return self.version

    def start(self, request: Any, first_token: int = 0) -> None:
        """The current version produces the request's tokens from `first_token` on. (The list is
        replaced, never changed in place: every output of the request shares it, uncopied.)"""
        ranges = request.weight_versions
        kept = ranges[:-1] if ranges and ranges[-1][0] == first_token else ranges
        request.weight_versions = [*kept, (first_token, self.version)]
