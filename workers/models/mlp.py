"""MLP token model (no attention): embedding -> L residual blocks -> final LayerNorm -> head.

Block: x + w2(GELU(w1(ln(x)))) with ``ln`` LayerNorm(h), ``w1`` Linear(h, f), ``w2`` Linear(f, h) (biases).
Parameter count equals ``api.spec.presets.mlp_param_count``. Same pipeline conventions as ``GPT``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.gpt import _transformer_tp_plan, split_for_pipeline, stage_layer_keys


class MLPBlock(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.w1 = nn.Linear(d_model, d_ff, bias=True)
        self.w2 = nn.Linear(d_ff, d_model, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.gelu(self.w1(self.ln(x))))


class MLPModel(nn.Module):
    block_class = MLPBlock

    def __init__(
        self, *, n_layers: int, d_model: int, vocab_size: int, seq_len: int, d_ff: int | None = None, **_: object
    ):
        super().__init__()
        self.n_layers, self.d_model, self.vocab_size = n_layers, d_model, vocab_size
        self.seq_len, self.d_ff = seq_len, d_ff or 4 * d_model
        self.tok_emb: nn.Embedding | None = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleDict({str(i): MLPBlock(d_model, self.d_ff) for i in range(n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(d_model)
        self.output: nn.Linear | None = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) if self.tok_emb is not None else tokens  # (B, T, h)
        for block in self.layers.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is not None:
            x = self.output(x)  # (B, T, V)
        return x

    def tp_plan(self, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict:
        return _transformer_tp_plan(
            self, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, attention=False
        )

    def stage_layer_keys(self, n_stages: int) -> list[list[str]]:
        return stage_layer_keys(list(self.layers.keys()), n_stages)

    def split_for_pipeline(self, stage_idx: int, n_stages: int) -> MLPModel:
        part = split_for_pipeline(self, stage_idx, n_stages, first=("tok_emb",), last=("norm", "output"))
        assert isinstance(part, MLPModel)
        return part

    def flops_per_token(self) -> float:
        h, f, V = self.d_model, self.d_ff, self.vocab_size
        return 6.0 * (self.n_layers * 2 * h * f + V * h)
