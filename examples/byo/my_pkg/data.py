"""A map-style dataset of (input, target) examples: ``build(**data.args)``; meshrun also passes ``seq_len`` and
``vocab_size`` because the signature names them."""

from __future__ import annotations

import torch


class Strides(torch.utils.data.Dataset):
    """Sequences ``(a + b t) mod V`` with a random start ``a`` and stride ``b`` in [1, max_stride]: the next token
    follows from the last two (learnable in a few steps)."""

    def __init__(self, n: int, seq_len: int, vocab_size: int, max_stride: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        a = torch.randint(0, vocab_size, (n, 1), generator=g)
        b = torch.randint(1, max_stride + 1, (n, 1), generator=g)
        self.seqs = (a + b * torch.arange(seq_len + 1)) % vocab_size  # (n, T + 1)

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.seqs[i]
        return s[:-1], s[1:]


def build(seq_len: int, vocab_size: int, n: int = 512, max_stride: int = 2, seed: int = 0) -> Strides:
    return Strides(n, seq_len, vocab_size, max_stride, seed)
