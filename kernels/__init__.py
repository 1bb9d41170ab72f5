"""Attention and cache kernels: pure-torch references (CPU path and oracle) and Triton on CUDA."""
