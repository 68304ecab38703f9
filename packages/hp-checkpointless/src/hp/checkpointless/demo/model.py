"""A small GPT-style decoder for the demo, the examples and the benchmarks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hp.checkpointless.demo.sizes import MODEL_SIZES


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, d_model: int = 64, layers: int = 2, heads: int = 4, seq: int = 64,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.blocks(h, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True))




def build_model(size: str, vocab: int, seq: int, dropout: float = 0.0) -> TinyGPT:
    d_model, layers, heads = MODEL_SIZES[size]
    return TinyGPT(vocab=vocab, d_model=d_model, layers=layers, heads=heads, seq=seq, dropout=dropout)


def shard_model(model: TinyGPT, mesh: Any) -> TinyGPT:
    """FSDP2 as torchtitan applies it: each transformer layer, then the root (``mesh``: ``ctx.device_mesh()``'s)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.blocks.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)
