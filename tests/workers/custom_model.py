"""A user model for the bring-your-own-model tests (entrypoint ``tests.workers.custom_model:build``)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class UpDown(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 32, n: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(UpDown(d) for _ in range(n))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build(vocab: int = 256, d: int = 32, n: int = 2) -> nn.Module:
    return TinyLM(vocab, d, n)


TP_PLAN = {"emb": "vocab_parallel", "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
