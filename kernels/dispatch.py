"""Chooses the kernel implementation: Triton on CUDA, the torch reference elsewhere.

`PDSERVE_KERNELS=reference|triton` forces one. Until the Triton kernels land, every device uses the
reference.
"""
from __future__ import annotations

import os
from types import ModuleType

import torch

from kernels import reference


def get_kernels(device: torch.device | str = "cpu") -> ModuleType:
    choice = os.environ.get("PDSERVE_KERNELS", "auto")
    if choice not in ("auto", "reference", "triton"):
        raise ValueError(f"PDSERVE_KERNELS must be auto, reference or triton; got {choice!r}")
    if choice == "triton":
        raise ValueError("PDSERVE_KERNELS=triton: the Triton kernels are not built yet")
    return reference
