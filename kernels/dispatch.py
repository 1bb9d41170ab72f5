"""Chooses the kernel implementation: Triton on CUDA; on CPU the compiled CPU kernels, or the torch
reference where they cannot be built.

`PDSERVE_KERNELS=auto|cpu|reference|triton` (default auto) forces one. `cpu` fails where the C++
extension cannot be built (auto falls back to the reference with a warning that says why).
`triton` off CUDA needs `TRITON_INTERPRET=1` (Triton's CPU interpreter: slow, for tests).
"""
from __future__ import annotations

import logging
import os
from functools import lru_cache
from types import ModuleType

import torch

from kernels import reference

CHOICES = ("auto", "cpu", "reference", "triton")
logger = logging.getLogger("pdserve.kernels")


def get_kernels(device: torch.device | str = "cpu") -> ModuleType:
    choice = os.environ.get("PDSERVE_KERNELS", "auto")
    if choice not in CHOICES:
        raise ValueError(f"PDSERVE_KERNELS must be one of {CHOICES}; got {choice!r}")
    device = torch.device(device)
    if choice == "reference" or (choice == "auto" and device.type not in ("cuda", "cpu")):
        return reference
    if choice == "cpu" or (choice == "auto" and device.type == "cpu"):
        if device.type != "cpu":
            raise ValueError(f"PDSERVE_KERNELS=cpu runs on CPU tensors only; the device is {device.type}")
        return _cpu_kernels(required=choice == "cpu")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"PDSERVE_KERNELS=triton on {device.type} needs TRITON_INTERPRET=1 "
                         f"(Triton compiles for CUDA only)")
    try:
        from kernels import triton_ops  # noqa: PLC0415 (Triton is imported only where it runs)
    except ImportError as e:
        raise ValueError(f"PDSERVE_KERNELS={choice}: Triton is not installed ({e})") from e
    return triton_ops


def _cpu_kernels(required: bool) -> ModuleType:
    error = _cpu_build_error()
    if error is None:
        from kernels import cpu_ops  # noqa: PLC0415
        return cpu_ops
    if required:
        raise ValueError(f"PDSERVE_KERNELS=cpu: the C++ CPU kernels are unavailable: {error}")
    return reference


@lru_cache(maxsize=None)
def _cpu_build_error() -> str | None:
    """None once the C++ CPU kernels are loaded in this process, else why they cannot be (warned once)."""
    from kernels import cpu_ops  # noqa: PLC0415
    try:
        cpu_ops.load()
    except cpu_ops.BuildError as e:
        logger.warning("C++ CPU kernels unavailable, using the torch reference kernels: %s", e)
        return str(e)
    return None


def kernels_for(x: torch.Tensor) -> ModuleType:
    """The kernel set for a tensor's device (what the model's layers call per forward)."""
    return _cached(x.device.type, os.environ.get("PDSERVE_KERNELS", "auto"))


@lru_cache(maxsize=None)
def _cached(device_type: str, choice: str) -> ModuleType:
    return get_kernels(device_type)


# fp8 (e4m3) arithmetic on CUDA: cuBLASLt's fp8 GEMM (torch._scaled_mm) and Triton's e4m3
# conversions need compute capability 8.9 (Ada, Hopper) or more.
FP8_MIN_CAPABILITY = (8, 9)


def cuda_capability(device: torch.device | str) -> tuple[int, int] | None:
    """The CUDA device's compute capability, None for any other device."""
    device = torch.device(device)
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def has_fp8(device: torch.device | str) -> bool:
    """Whether fp8 GEMMs and e4m3 conversions run on `device` (CPUs: through oneDNN and torch)."""
    capability = cuda_capability(device)
    return capability is None or capability >= FP8_MIN_CAPABILITY
