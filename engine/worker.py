"""Worker: one rank. Owns the device, the model's weights, the KV cache tensors and the runner.

Its public methods are the RPC surface an executor calls (in-process, or on a Ray actor).
"""
from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.models.registry import get_model_class
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.weights import iterate_weights
from kv_transfer.base import KVConnectorWorker, KVLayout

# Default KV budget when neither num_kv_blocks nor kv_cache_memory_bytes is given.
DEFAULT_KV_CACHE_BYTES = 1 << 30


class Worker:
    def __init__(self, config: EngineConfig, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.runner: ModelRunner | None = None
        self.kv_connector: KVConnectorWorker | None = None

    def load_model(self) -> None:
        mc = self.config.model_config
        cls = get_model_class(mc.architecture)
        with torch.device(self.device):
            model = cls(mc.hf_config, mc.dtype, mc.max_model_len)
        model.load_weights(iterate_weights(mc.model, mc.gguf_file, mc.hf_config))
        model.eval()
        self.runner = ModelRunner(model, self.config.cache_config.block_size, self.device, mc.seed)

    def bytes_per_block(self) -> int:
        mc, cc = self.config.model_config, self.config.cache_config
        elem = torch.empty((), dtype=mc.dtype).element_size()
        return 2 * cc.block_size * mc.num_kv_heads * mc.head_dim * elem * mc.num_layers

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) from the cache config."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        per_block = self.bytes_per_block()
        if cc.num_kv_blocks is not None:
            num_blocks = cc.num_kv_blocks
        elif cc.kv_cache_memory_bytes is not None:
            num_blocks = cc.kv_cache_memory_bytes // per_block
        else:
            # Enough for max_num_seqs full-length sequences, capped by the default budget.
            wanted = sc.max_num_seqs * -(-sc.max_model_len // cc.block_size)
            num_blocks = min(wanted, DEFAULT_KV_CACHE_BYTES // per_block)
        if num_blocks * cc.block_size < sc.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks x {cc.block_size} tokens, less than one "
                f"sequence of max_model_len={sc.max_model_len}; raise num_kv_blocks / "
                f"kv_cache_memory_bytes or lower max_model_len")
        num_cpu_blocks = cc.swap_space_bytes // per_block if sc.preemption_mode == "swap" else 0
        return num_blocks, num_cpu_blocks

    def init_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate zeroed KV tensors (zeros: padded slots must never hold NaN, attention masks them
        with a zero weight and 0 * NaN is NaN)."""
        mc, cc = self.config.model_config, self.config.cache_config
        shape = (2, num_blocks, cc.block_size, mc.num_kv_heads, mc.head_dim)
        cpu_shape = (2, num_cpu_blocks, cc.block_size, mc.num_kv_heads, mc.head_dim)
        assert self.runner is not None
        self.runner.kv_caches = [torch.zeros(shape, dtype=mc.dtype, device=self.device)
                                 for _ in range(mc.num_layers)]
        self.runner.cpu_caches = [torch.zeros(cpu_shape, dtype=mc.dtype, device="cpu")
                                  for _ in range(mc.num_layers)] if num_cpu_blocks else []
        if self.config.kv_transfer_config is not None:
            from kv_transfer.factory import create_connector_worker  # noqa: PLC0415 (import cycle)

            self.kv_connector = create_connector_worker(
                self.config.kv_transfer_config, KVLayout.from_config(self.config))
            self.kv_connector.register_kv_caches(self.runner.kv_caches)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None
        return self.runner.execute(sched)

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
