"""A small pre-norm transformer LM written without meshrun: ``build(**model.args) -> nn.Module``.

The attention reshapes with ``-1`` heads, so a column-wise split of ``qkv`` projections over tensor-parallel
ranks keeps whole heads per rank (the declared plan ``TP_PLAN`` below, also written in the example specs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.head_dim = d // n_heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, d)
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, hd)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, n_heads)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Embeddings(nn.Module):
    def __init__(self, vocab: int, d: int, seq_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq_len, d)
        self.register_buffer("positions", torch.arange(seq_len), persistent=False)  # kept by meshrun's init

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, d)
        return self.tok(tokens) + self.pos(self.positions[: tokens.shape[1]])


class TinyTransformer(nn.Module):
    """embed -> blocks -> norm -> head. Each top-level module maps one tensor to the next, so pipeline stages
    (split points like ``blocks.1``) work: meshrun replaces the modules a stage drops by ``nn.Identity``."""

    def __init__(self, vocab: int, d: int, n_layers: int, n_heads: int, seq_len: int):
        super().__init__()
        self.embed = Embeddings(vocab, d, seq_len)
        self.blocks = nn.ModuleList(Block(d, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> logits (B, T, V)
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def build(vocab: int = 256, d: int = 64, n_layers: int = 2, n_heads: int = 4, seq_len: int = 64) -> nn.Module:
    return TinyTransformer(vocab, d, n_layers, n_heads, seq_len)


# module-name patterns -> torch TP styles (copy into spec.model.tp_plan)
TP_PLAN = {
    "embed.tok": "vocab_parallel",
    "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.up": "colwise", "blocks.*.down": "rowwise",
}
