"""One rank: the worker (device, weights, KV tensors), the model runner (a scheduled batch into a
forward and samples), CUDA graphs, the CPU decode plan, LoRA slots, fp8 KV scales, and the per-step
channel and delta the executor sends it."""
