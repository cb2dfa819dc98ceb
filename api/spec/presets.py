"""Model presets: plain data shared by the planner (pure Python) and the workers (torch).

A GPT preset is GPT-2 shaped: learned position embeddings, pre-LayerNorm blocks with biases, a GELU MLP
of width ``d_ff`` (4 x d_model unless given), causal self-attention, a final LayerNorm and an untied
output head without bias. ``api.spec.presets.gpt_param_count`` counts exactly the parameters of that model;
the workers' model must agree (a test builds it on the meta device and compares).

An MLP preset is a token model without attention: embedding -> n_layers residual MLP blocks -> head. It
exists for quick data-parallel checks and as the simplest non-transformer model.
"""

from __future__ import annotations

from typing import Any

# name -> fields of a GPT config. seq_len is the default context; a spec may override it.
GPT_PRESETS: dict[str, dict[str, int]] = {
    # trains on a 2-core CPU in seconds; vocab 256 = byte-level tokens
    "tiny": dict(n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=64),
    # a little larger, still CPU-friendly (benchmarks, planner calibration)
    "small": dict(n_layers=4, d_model=128, n_heads=4, vocab_size=256, seq_len=128),
    # GPT-3 paper shapes (Brown et al. 2020, table 2.1) with a padded GPT-2 vocabulary
    "125m": dict(n_layers=12, d_model=768, n_heads=12, vocab_size=50304, seq_len=2048),
    "350m": dict(n_layers=24, d_model=1024, n_heads=16, vocab_size=50304, seq_len=2048),
    "1.3b": dict(n_layers=24, d_model=2048, n_heads=16, vocab_size=50304, seq_len=2048),
    "2.7b": dict(n_layers=32, d_model=2560, n_heads=32, vocab_size=50304, seq_len=2048),
    "7b": dict(n_layers=32, d_model=4096, n_heads=32, vocab_size=50304, seq_len=2048),
    "13b": dict(n_layers=40, d_model=5120, n_heads=40, vocab_size=50304, seq_len=2048),
    "70b": dict(n_layers=80, d_model=8192, n_heads=64, vocab_size=50304, seq_len=4096),
    "175b": dict(n_layers=96, d_model=12288, n_heads=96, vocab_size=50304, seq_len=2048),
}

MLP_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layers=2, d_model=64, n_heads=1, vocab_size=256, seq_len=64),
    "small": dict(n_layers=4, d_model=256, n_heads=1, vocab_size=256, seq_len=128),
}

PRESETS: dict[str, dict[str, dict[str, int]]] = {"gpt": GPT_PRESETS, "mlp": MLP_PRESETS}


def gpt_param_count(
    *, n_layers: int, d_model: int, vocab_size: int, seq_len: int, d_ff: int | None = None, **_: Any
) -> int:
    """Exact parameter count of the workers' GPT (untied head, biases, LayerNorms).

    Per block: qkv (3h^2 + 3h) + proj (h^2 + h) + mlp (2 h f + f + h) + 2 LayerNorms (4h).
    Plus token embedding V h, position embedding s h, final LayerNorm 2h, head V h (no bias).
    With f = 4h this is Megatron's 12 L h^2 (1 + 13/(12h)) + (V + s) h, plus the untied head and final LN.
    """
    h, f = d_model, d_ff or 4 * d_model
    per_block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    return n_layers * per_block + vocab_size * h + seq_len * h + 2 * h + vocab_size * h


def mlp_param_count(*, n_layers: int, d_model: int, vocab_size: int, d_ff: int | None = None, **_: Any) -> int:
    """Exact parameter count of the workers' MLP token model.

    Per block: LayerNorm (2h) + up (h f + f) + down (f h + h). Plus embedding V h, final LN 2h, head V h.
    """
    h, f = d_model, d_ff or 4 * d_model
    per_block = 2 * h + h * f + f + f * h + h
    return n_layers * per_block + vocab_size * h + 2 * h + vocab_size * h
