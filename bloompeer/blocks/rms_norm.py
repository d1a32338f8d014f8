"""RMSNorm as the Llama family's models and DeepSeek-V3's latent attention compute it, and Qwen3-Next's
zero-centred form."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMSNorm", "ZeroCentredRMSNorm"]


class RMSNorm(nn.Module):
    """Root-mean-square norm, in float32 inside, as transformers computes it: the weight times the
    normed value cast back (Llama's), or the cast after the weight (weight_first: OLMo 2's, gpt-oss's)."""

    def __init__(self, size: int, eps: float, weight_first: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.weight_first = eps, weight_first

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        if self.weight_first:
            return (self.weight * (hidden * torch.rsqrt(variance + self.eps))).to(dtype)
        return self.weight * (hidden * torch.rsqrt(variance + self.eps)).to(dtype)


class ZeroCentredRMSNorm(RMSNorm):
    """Qwen3-Next's RMSNorm (Qwen3NextRMSNorm): its weight stored as an offset from 1 (zeros at init) and
    applied in float32 as (1 + weight), cast back after the multiply."""

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = hidden.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(hidden)
