"""Chooses the kernel implementation: Triton on CUDA, the torch reference elsewhere.

`PDSERVE_KERNELS=reference|triton|auto` (default auto) forces one. `triton` off CUDA needs
`TRITON_INTERPRET=1` (Triton's CPU interpreter: slow, for tests).
"""
from __future__ import annotations

import os
from functools import lru_cache
from types import ModuleType

import torch

from kernels import reference

CHOICES = ("auto", "reference", "triton")


def get_kernels(device: torch.device | str = "cpu") -> ModuleType:
    choice = os.environ.get("PDSERVE_KERNELS", "auto")
    if choice not in CHOICES:
        raise ValueError(f"PDSERVE_KERNELS must be one of {CHOICES}; got {choice!r}")
    device = torch.device(device)
    if choice == "reference" or (choice == "auto" and device.type != "cuda"):
        return reference
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"PDSERVE_KERNELS=triton on {device.type} needs TRITON_INTERPRET=1 "
                         f"(Triton compiles for CUDA only)")
    try:
        from kernels import triton_ops  # noqa: PLC0415 (Triton is imported only where it runs)
    except ImportError as e:
        raise ValueError(f"PDSERVE_KERNELS={choice}: Triton is not installed ({e})") from e
    return triton_ops


def kernels_for(x: torch.Tensor) -> ModuleType:
    """The kernel set for a tensor's device (what the model's layers call per forward)."""
    return _cached(x.device.type, os.environ.get("PDSERVE_KERNELS", "auto"))


@lru_cache(maxsize=None)
def _cached(device_type: str, choice: str) -> ModuleType:
    return get_kernels(device_type)
