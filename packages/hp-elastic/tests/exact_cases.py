"""Shared gradients for the exact-mode tests: M=12 float32 micro-batch gradients from a fixed seed,
with magnitudes spanning ~30 orders of magnitude and exact zeros (a whole micro-batch of them too)."""

from __future__ import annotations

import torch

M, P = 12, 4096


def micro_grads(seed: int = 1234) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for m in range(M):
        mag = torch.pow(10.0, torch.empty(P, dtype=torch.float64).uniform_(-25, 5, generator=gen))
        g = (torch.randn(P, dtype=torch.float64, generator=gen) * mag).to(torch.float32)
        g[m::7] = 0.0
        out.append(torch.zeros(P) if m == 5 else g)
    return out
