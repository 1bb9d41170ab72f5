"""RMSNorm with an optional fused residual add (computed in fp32, like transformers)."""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from engine.model.layers.linear import _copy_checked
from kernels.dispatch import kernels_for


class RMSNorm(nn.Module):
    kernels: ModuleType | None = None     # bound once by ModelRunner (bind_kernels); else looked up per call

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = lambda p, t, s=None: _copy_checked(p.data, t)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normalized x + residual, x + residual)."""
        return (self.kernels or kernels_for(x)).rms_norm(x, self.weight, self.eps, residual)
