"""A small GPT-style decoder and a deterministic synthetic corpus, shared by the examples."""

from __future__ import annotations

import torch
from torch import nn


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, d_model: int = 64, layers: int = 2, heads: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.blocks(h, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True))


def batch(step: int, rank: int, world: int, seed: int, size: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of (step, rank, world): a pure function of the seed, so a replayed step sees the same data.

    The corpus is a noisy arithmetic sequence per row, learnable by a small model.
    """
    g = torch.Generator().manual_seed(hash((seed, step, rank, world)) % (2**63))
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    rows = (start + stride * torch.arange(seq + 1)) % vocab
    noise = torch.rand(rows.shape, generator=g) < 0.05
    rows = torch.where(noise, torch.randint(0, vocab, rows.shape, generator=g), rows)
    return rows[:, :-1], rows[:, 1:]
