"""Attention, cache, norm, rotary, quantized-linear and LoRA kernels: the pure-torch reference (the
CPU fallback and every kernel's oracle), the C++ CPU kernels (`cpu_ops`, `csrc/`) and Triton on
CUDA; `dispatch` picks the set."""
