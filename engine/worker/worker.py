"""Worker: one rank. Owns the device, the model's weights (its shard), the KV cache tensors of its
layers and heads, and the runner.

Its public methods are the RPC surface an executor calls (in-process, or on a Ray actor, where
`init_distributed` first joins the engine's process group).
"""
from __future__ import annotations

import functools
import logging
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from safetensors.torch import load_file

import engine.worker.step_channel as step_channel
from engine.loading.quant_checkpoint import model_weights
from engine.model.layers.attention import Attention
from engine.model.layers.moe import FusedMoE
from engine.model.models.registry import get_model_class
from engine.model.models.vision_language import with_vision
from engine.model.parallel_state import get_parallel_state, init_parallel_state, pp_layer_range
from engine.sample.structured_output import Constraints
from engine.worker.encoder_cache import EncoderCache
from engine.worker.host_memory import keep_freed_memory, prefault_in_background, zeroed
from engine.worker.kv_scales import calibrate_kv_scales
from engine.worker.kv_tier_store import TierStore
from engine.worker.lora_slots import LoRASlots
from engine.worker.model_runner import ModelRunner
from engine.worker.step_codec import StepDecoder
from engine.worker.weight_sync import WeightSync
from kernels.dispatch import FP8_MIN_CAPABILITY, cuda_capability, has_fp8
from kernels.gguf_format import GGUF_BLOCK_BYTES
from kv_transfer.base import KVConnectorWorker
from kv_transfer.factory import create_connector_worker
from records.config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from records.dtypes import KV_DTYPE_SIZES
from records.kv_layout import KVLayout
from records.lora import ADAPTER_WEIGHTS, LoRARequest
from records.model_source import is_vision_language
from records.step import ModelRunnerOutput, SchedulerOutput
from records.transfer import TransferReport

logger = logging.getLogger(__name__)



class Worker:
    def __init__(self, config: EngineConfig, device: str | torch.device = "cpu", rank: int = 0,
                 num_threads: int | None = None) -> None:
        if num_threads:
            # A 1-CPU Ray actor runs torch single-threaded unless told otherwise.
            torch.set_num_threads(num_threads)
        if torch.device(device).type == "cpu":
            keep_freed_memory()
        self.config = config
        self.num_threads = num_threads
        self.device = torch.device(device)
        self.rank = rank
        if config.cache_config.is_fp8 and not has_fp8(self.device):
            raise ValueError(f"kv_cache_dtype='fp8' needs a GPU of compute capability "
                             f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or more (Ada, Hopper) for its e4m3 "
                             f"kernels; {self.device} has {'.'.join(map(str, cuda_capability(self.device)))} "
                             f"(use kv_cache_dtype='auto')")
        self.runner: ModelRunner | None = None
        self.kv_connector: KVConnectorWorker | None = None
        self.tier_store: TierStore | None = None       # the offload tier's bytes (kv_offloading_size)
        self.decoder = StepDecoder()          # the requests' state the Ray executor sent (step deltas)

    # --- joining the engine's ranks (Ray executor only) -------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """An address and free port on this node for the process group's store (asked of rank 0)."""
        import ray  # noqa: PLC0415

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_distributed(self, init_method: str) -> None:
        pc = self.config.parallel_config
        init_parallel_state(self.rank, pc.tensor_parallel_size, pc.pipeline_parallel_size, init_method,
                            self.device, layer_partition=pc.layer_partition,
                            expert_parallel=pc.enable_expert_parallel, moe_dispatch=pc.moe_dispatch)

    def placement(self) -> dict[str, Any]:
        """Where this rank runs (for placement checks and logs)."""
        import ray  # noqa: PLC0415

        state = get_parallel_state()
        return {"rank": self.rank, "tp_rank": state.tp_rank, "pp_rank": state.pp_rank, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
                "num_threads": torch.get_num_threads()}

    def layer_range(self) -> tuple[int, int]:
        """[start, end) of the model's layers this rank's stage holds."""
        state = get_parallel_state()
        return pp_layer_range(self.config.model_config.num_layers, state.pp_rank, state.pp_size,
                              self.config.parallel_config.layer_partition)

    def num_local_layers(self) -> int:
        start, end = self.layer_range()
        return end - start

    def num_local_kv_heads(self) -> int:
        return max(1, self.config.model_config.num_kv_heads // get_parallel_state().tp_size)

    def load_model(self) -> None:
        mc = self.config.model_config
        cls = get_model_class(mc.architecture)
        if is_vision_language(mc.hf_config):
            cls = with_vision(cls)
        with torch.device(self.device):
            model = cls(mc.hf_config, mc.torch_dtype, mc.max_model_len)
        self.weight_sync = WeightSync(dense_copies=mc.quantization.endswith("+dense"))
        model.load_weights(self.weight_sync.recording(model_weights(mc)), dense_copies=self.weight_sync.dense_copies)
        if mc.quantize_activations:
            for module in model.modules():
                if getattr(module, "qtype", None) in GGUF_BLOCK_BYTES:
                    module.int8_activations = True
        model.eval()
        self.runner = ModelRunner(model, self.config.cache_config.block_size, self.device, mc.seed,
                                  self.config.parallel_config.pipeline_micro_batches)
        self.runner.constraints = Constraints(mc.model, mc.gguf_file, mc.vocab_size)
        if getattr(model, "vision", None) is not None:
            self.runner.encoder = EncoderCache(model)
        if mc.quantize_activations and not hasattr(self.runner.kernels, "gguf_linear_int8"):
            raise ValueError(f"quantize_activations needs the C++ CPU kernels (or the torch reference); the "
                             f"kernel set here is {self.runner.kernels.__name__} (PDSERVE_KERNELS)")
        if self.config.lora_config is not None:
            self.runner.lora = LoRASlots(model, self.config.lora_config, mc.torch_dtype, self.device,
                                         self.runner.kernels)
        cc = self.config.cache_config
        if cc.is_fp8 and cc.calculate_kv_scales:
            scales = calibrate_kv_scales(self.runner, mc.model, mc.gguf_file, mc.vocab_size, mc.max_model_len)
            self.config = replace(self.config, cache_config=replace(cc, kv_scales=scales))
        if self.config.cache_config.kv_scales:
            start, _ = self.layer_range()
            for i, attn in enumerate(m for m in model.modules() if isinstance(m, Attention)):
                attn.k_scale, attn.v_scale = self.config.cache_config.kv_scales[start + i]

    def kv_scales(self) -> tuple[tuple[float, float], ...]:
        """The fp8 cache's per-layer (K, V) scales this rank uses (from the checkpoint, or calibrated
        at load), () for all 1.0."""
        return self.config.cache_config.kv_scales

    def num_kv_tensors(self) -> int:
        """This rank's KV cache tensors: one per layer, or the hybrid grouping's slot tensors."""
        groups = self.config.kv_groups
        return groups.num_slots if groups.hybrid else self.num_local_layers()

    def bytes_per_block(self) -> int:
        mc, cc = self.config.model_config, self.config.cache_config
        return (2 * cc.block_size * self.num_local_kv_heads() * mc.head_dim * KV_DTYPE_SIZES[self.config.kv_dtype]
                * self.num_kv_tensors())

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) from the cache config (EngineConfig.kv_cache_blocks)."""
        return self.config.kv_cache_blocks(self.bytes_per_block(), DEFAULT_KV_CACHE_BYTES)

    def tier_slots(self) -> tuple[int, int]:
        """(host, disk) slots of the offload tier (EngineConfig.tier_slots)."""
        return self.config.tier_slots(self.bytes_per_block() * self.config.parallel_config.world_size)

    def init_cache(self, num_blocks: int, num_cpu_blocks: int, num_host_slots: int = 0,
                   num_disk_slots: int = 0) -> None:
        """Allocate zeroed KV tensors (zeros: padded slots must never hold NaN, attention masks them
        with a zero weight and 0 * NaN is NaN), their pages faulted in by a thread of idle priority
        (host_memory.prefault_in_background), and the offload tier's stores when it has slots."""
        mc, cc = self.config.model_config, self.config.cache_config
        heads, tensors = self.num_local_kv_heads(), self.num_kv_tensors()
        shape = (2, num_blocks, cc.block_size, heads, mc.head_dim)
        cpu_shape = (2, num_cpu_blocks, cc.block_size, heads, mc.head_dim)
        assert self.runner is not None
        dtype = getattr(torch, self.config.kv_dtype)
        runner = self.runner
        runner.kv_buffers = [zeroed(shape, dtype, self.device) for _ in range(tensors)]
        runner.cpu_caches = [zeroed(cpu_shape, dtype, torch.device("cpu"))
                             for _ in range(tensors)] if num_cpu_blocks else []
        groups = self.config.kv_groups
        if groups.hybrid:     # each layer reads its slot tensor through its group's table
            runner.kv_caches = [runner.kv_buffers[slot] for _, slot in groups.layer_slots]
            runner.set_kv_groups(groups)
        else:
            runner.kv_caches = runner.kv_buffers
        runner.capture_cuda_graphs(mc.cuda_graph_sizes, mc.max_model_len)
        if num_host_slots:
            self.tier_store = runner.tier_store = TierStore(
                runner.kv_buffers, num_host_slots, num_disk_slots, cc.offload_disk_path, self.rank)
        if self.config.kv_transfer_config is not None:
            self.kv_connector = create_connector_worker(
                self.config.kv_transfer_config,
                KVLayout.from_config(self.config, get_parallel_state().tp_rank, get_parallel_state().pp_rank))
            self.kv_connector.register_kv_caches(runner.kv_buffers)
        # Last: a KV connector's transport (UCX) patches libc as it starts, which a thread running
        # meanwhile must stay out of (host_memory._SYS_MADVISE).
        prefault_in_background(runner.kv_buffers, num_blocks)

    def kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's heads of these blocks in every layer, [layers, 2, n, block_size, heads, d], on
        the CPU (for checks: what a transfer moved; engines with a KV connector)."""
        assert self.kv_connector is not None
        return self.kv_connector.gather_blocks(block_ids).cpu()

    def kv_pull_log(self) -> list[Any]:
        """This rank's finished pulls since the last call (KVConnectorWorker.take_pull_log)."""
        assert self.kv_connector is not None
        return self.kv_connector.take_pull_log()

    def kv_block_bytes(self, block_ids: list[int]) -> torch.Tensor:
        """`kv_blocks` as raw bytes (uint8): what goes through Ray, which cannot unpickle fp8."""
        return self.kv_blocks(block_ids).view(torch.uint8)

    def kv_address(self) -> tuple[str, dict[str, Any]]:
        """(engine id, address) of this rank's connector worker (after init_cache)."""
        assert self.kv_connector is not None
        return self.kv_connector.engine_id, self.kv_connector.address()

    def step(self, sched: SchedulerOutput | None, kv_ops: list[tuple[Any, ...]], isolate_failures: bool = False
             ) -> tuple[ModelRunnerOutput | None, TransferReport | None]:
        """One step message: the engine's KV connector orders (before the forward pass: a lease
        ended here is refused before its blocks can be rewritten), the model step if there is one,
        then this rank's transfer report.

        `isolate_failures` (a single-rank engine only: with several ranks one rank's failure leaves
        the others out of step): a model step that raises becomes an output in which each of the
        step's requests failed, and the transfer report still goes out.

        The offload tier's saves run first of all (a pull ordered here may write into a block the
        tier still has to copy); its failed orders go back in the output (on every rank that has
        any: the executor gathers them)."""
        tier_failed = []
        if sched is not None and sched.tier_saves:
            assert self.tier_store is not None
            tier_failed = self.tier_store.run(sched.tier_saves)
        if self.kv_connector is not None:
            self.kv_connector.apply(kv_ops)
        output = None
        if sched is not None:
            try:
                output = self.execute_model(sched)
            except Exception as e:
                if not isolate_failures:
                    raise
                logger.exception("engine step failed; failing its %d request(s)", len(sched.scheduled))
                output = ModelRunnerOutput.for_failed_step(sched, e)
            tier_failed += self.runner.take_tier_failed() if self.runner is not None else []
            if tier_failed:
                output = output if output is not None else ModelRunnerOutput(sampled={})
                output.tier_failed.extend(tier_failed)
        return output, (self.kv_connector.poll() if self.kv_connector is not None else None)

    def execute_serialized(self, payload: bytes) -> tuple[ModelRunnerOutput | None, TransferReport | None]:
        """`step` on a pickled (step delta or None, KV orders) (the Ray executor's one message per
        step, engine/worker/step_codec.py)."""
        assert self.runner is not None
        delta, kv_ops = pickle.loads(payload)
        return self.step(None if delta is None else self.decoder.decode(delta), kv_ops)

    def serve_steps(self, host: str, port: int) -> None:
        """Run steps from the engine's StepChannel until it closes (the Ray executor's step loop,
        engine/worker/step_channel.py): each frame is a pickled (step delta or None, KV orders), each
        reply `(True, (output, transfer report))` (output None off the driver rank) or
        `(False, traceback)`."""
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        sock = step_channel.connect(host, port, self.rank)
        try:
            while True:
                try:
                    payload = step_channel.recv_frame(sock)
                except step_channel.ChannelClosed:
                    return
                try:
                    reply = (True, self.execute_serialized(payload))
                except Exception:  # noqa: BLE001 - reported to the engine, which stops
                    reply = (False, traceback.format_exc())
                step_channel.send_frame(sock, pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        finally:
            sock.close()

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step; the output on the driver rank (TP 0 of the last stage), None elsewhere."""
        assert self.runner is not None
        return self.runner.execute(sched)

    # --- weight updates (engine/worker/weight_sync.py; the engine runs them between steps) ----------
    def check_weights(self, shapes: dict[str, list[int]], lora: LoRARequest | None = None) -> None:
        """ValueError naming a tensor this model's checkpoint (or adapter `lora`) does not have with
        that shape."""
        check, _ = self._update_target(lora)
        check(shapes)

    def update_weights(self, weights: list[tuple[str, torch.Tensor]], lora: LoRARequest | None = None) -> None:
        """Load these whole tensors (checked first) into the model: HF-named, or PEFT-named into
        adapter `lora` (engine/worker/lora_slots.py)."""
        check, apply = self._update_target(lora)
        check({name: list(t.shape) for name, t in weights})
        apply(weights)

    def update_weights_from_disk(self, path: str, lora: LoRARequest | None = None) -> None:
        """From a checkpoint directory of the model, or a PEFT adapter directory for adapter `lora`."""
        assert self.runner is not None
        if lora is not None:
            self.update_weights(list(load_file(os.path.join(path, ADAPTER_WEIGHTS)).items()), lora)
            return
        self.weight_sync.from_disk(self.runner.model, path, self.config.model_config.hf_config)
        self._weights_changed()

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, backend: str) -> None:
        """Join the trainer's weight-update group as member `rank_offset` + this rank."""
        self.weight_sync.join(master_address, master_port, rank_offset + self.rank, world_size, backend)

    def update_weights_from_group(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                  lora: LoRARequest | None = None) -> None:
        """Receive these tensors from the group's trainer (after `check_weights` passed on every rank)."""
        _, apply = self._update_target(lora)
        apply(self.weight_sync.receive(names, dtypes, shapes, self.device))

    def _update_target(self, lora: LoRARequest | None) -> tuple[Callable[[dict[str, Any]], None],
                                                                Callable[[list[tuple[str, torch.Tensor]]], None]]:
        """(check, apply) of an update of the model's weights, or of adapter `lora`'s."""
        assert self.runner is not None
        runner = self.runner
        if lora is not None:
            if runner.lora is None:
                raise ValueError("lora_request: this engine serves no adapters; start it with enable_lora=True")
            return functools.partial(runner.lora.check_update, lora), functools.partial(runner.lora.update, lora)

        def apply(weights: list[tuple[str, torch.Tensor]]) -> None:
            self.weight_sync.apply(runner.model, weights)
            self._weights_changed()
        return functools.partial(self.weight_sync.check, runner.model), apply

    def _weights_changed(self) -> None:
        """Forget what was made of the old weights: the CPU decode plan (rebuilt at the next decode
        step) and the images' embeddings."""
        assert self.runner is not None
        self.runner.decode_plan = False
        if self.runner.encoder is not None:
            self.runner.encoder.clear()

    def encode_images(self, images: list[Any]) -> list[torch.Tensor] | None:
        """Each image's embeddings (a vision-language model's first stage; None on other stages)."""
        assert self.runner is not None
        return self.runner.encoder.encode(images) if self.runner.encoder is not None else None

    def encoder_stats(self) -> dict[str, int] | None:
        """Images encoded here, received made, kept, and the cache's queries and hits (a
        vision-language model's first stage)."""
        encoder = self.runner.encoder if self.runner is not None else None
        return None if encoder is None else {"encodes": encoder.encodes, "received": encoder.received,
                                             "kept": len(encoder.kept), "queries": encoder.queries,
                                             "hits": encoder.hits}

    def expert_load(self) -> dict[int, int]:
        """Rows (token, expert) each MoE expert this rank holds has run, summed over its layers,
        by global expert id; {} for a dense model."""
        layers = [m for m in self.runner.model.modules() if isinstance(m, FusedMoE)]
        if not layers:
            return {}
        # one read from the device for all layers (each holds the same experts; the last slot
        # counts the other ranks' experts)
        counts = torch.stack([m.expert_tokens[:-1] for m in layers]).sum(0).tolist()
        return {layers[0].expert_start + i: n for i, n in enumerate(counts)}

    def tier_stats(self) -> dict[str, float]:
        """This rank's offload-tier counters (TierStore.stats); {} without a tier."""
        return self.tier_store.stats() if self.tier_store is not None else {}

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        if self.tier_store is not None:
            self.tier_store.shutdown()
