"""GPT-2 shaped decoder (nanoGPT style, torchtitan-friendly names).

Shapes: B batch, T tokens, h d_model, f d_ff, V vocab, s max positions, H heads, d = h / H.

- ``tok_emb`` Embedding(V, h) + ``pos_emb`` Embedding(s, h)
- ``layers``: ModuleDict "0".."L-1" of ``Block``: x + attn(ln_1(x)); x + mlp(ln_2(x))
  - attn: ``wq, wk, wv`` Linear(h, h, bias) (column-parallel), causal SDPA (or, ``Arch.attention == "eager"``,
    ``eager_attention``: softmax(QK^T / sqrt(d)) V unfused), ``wo`` Linear(h, h, bias)
  - mlp: ``w1`` Linear(h, f, bias), GELU, ``w2`` Linear(f, h, bias)
- ``norm`` LayerNorm(h), ``output`` Linear(h, V, bias=False) (untied, no dropout)

``Arch`` switches the blocks to the Llama family for Hugging Face models (``workers/models/hf.py``): RMSNorm,
SwiGLU (``mlp.w3``), rotary positions instead of ``pos_emb``, fewer key/value heads (``wk``/``wv`` of
n_kv_heads x d). The default ``Arch()`` is the GPT-2 shape above.

The parameter count equals ``api.spec.presets.gpt_param_count`` exactly (tested).

Pipeline parallel: a stage-local copy sets ``tok_emb``/``pos_emb`` to None (the input is already a hidden
state ``(B, T, h)``) and/or ``norm``/``output`` to None (the hidden state is returned), and keeps only its
``layers`` keys (see ``split_for_pipeline``). Attention views use LOCAL heads (``view(B, T, -1, d)``) so the
same code runs under tensor parallelism.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Arch:
    """Block flavour: GPT-2 (the default: LayerNorm, GELU, learned positions, biases) or Llama-family (RMSNorm,
    SwiGLU ``w2(silu(w1 x) * w3 x)``, RoPE, ``n_kv_heads`` < heads for grouped-query attention). Built from a
    Hugging Face config.json by ``workers.models.hf``."""

    norm: str = "layer"  # layer | rms
    norm_eps: float = 1e-5
    act: str = "gelu"  # gelu | gelu_tanh | swiglu
    rope_theta: float | None = None  # None: learned position embeddings
    n_kv_heads: int | None = None  # None: = n_heads
    qkv_bias: bool = True
    o_bias: bool = True
    mlp_bias: bool = True
    attention: str = "flash"  # flash: fused SDPA | eager: the math path softmax(QK^T / sqrt(d)) V (``eager_attention``)


def _norm(d_model: int, arch: Arch) -> nn.Module:
    return nn.RMSNorm(d_model, eps=arch.norm_eps) if arch.norm == "rms" else nn.LayerNorm(d_model, eps=arch.norm_eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention by its math, unfused (model.attention 'eager', what ``service.planner`` prices as eager):
    q is scaled by 1/sqrt(d), ``QK^T`` is one batched GEMM writing the (B, H, T, T) scores, the future is masked
    (``masked_fill``), ``softmax`` runs over the last dim and its probabilities (kept for backward) multiply V in a
    second batched GEMM. Equal to ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` up to rounding."""
    T, S = q.shape[-2], k.shape[-2]
    scores = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)  # (B, H, T, S)
    future = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return probs @ v


def apply_rope(q: torch.Tensor, k: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Hugging Face Llama's half-split form) of (B, H, T, d) q and k."""
    T, d = q.shape[-2], q.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=q.device).float() / d))  # (d/2,)
    freqs = torch.arange(T, device=q.device).float()[:, None] * inv_freq[None, :]  # (T, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, d)
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, arch: Arch = Arch()):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.rope_theta = arch.rope_theta
        self.groups = n_heads // (arch.n_kv_heads or n_heads)  # query heads per key/value head
        self.eager = arch.attention == "eager"
        kv_dim = self.head_dim * (arch.n_kv_heads or n_heads)
        self.wq = nn.Linear(d_model, d_model, bias=arch.qkv_bias)
        self.wk = nn.Linear(d_model, kv_dim, bias=arch.qkv_bias)
        self.wv = nn.Linear(d_model, kv_dim, bias=arch.qkv_bias)
        self.wo = nn.Linear(d_model, d_model, bias=arch.o_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # global (B, T, h) even when x is a DTensor under sequence parallel
        # (B, T, H_local, d) -> (B, H_local, T, d); H_local = H / tp under tensor parallel (KV heads likewise)
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.rope_theta is not None:
            q, k = apply_rope(q, k, self.rope_theta)
        if self.groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
            k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
        if self.eager:
            y = eager_attention(q, k, v)  # (B, H_local, T, d)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H_local, T, d)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, h_local)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, arch: Arch = Arch()):
        super().__init__()
        self.act = arch.act
        self.w1 = nn.Linear(d_model, d_ff, bias=arch.mlp_bias)
        self.w2 = nn.Linear(d_ff, d_model, bias=arch.mlp_bias)
        self.w3 = nn.Linear(d_model, d_ff, bias=arch.mlp_bias) if arch.act == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh" if self.act == "gelu_tanh" else "none"))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, arch: Arch = Arch()):
        super().__init__()
        self.ln_1 = _norm(d_model, arch)
        self.attn = Attention(d_model, n_heads, arch)
        self.ln_2 = _norm(d_model, arch)
        self.mlp = FeedForward(d_model, d_ff, arch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    block_class = Block

    def __init__(
        self,
        *,
        n_layers: int,
        d_model: int,
        n_heads: int,
        vocab_size: int,
        seq_len: int,
        d_ff: int | None = None,
        arch: Arch = Arch(),
        n_positions: int | None = None,
        pretrained: str | None = None,
    ):
        """``n_positions``: rows of the learned position table (default seq_len); ``pretrained``: a Hugging Face
        directory whose weights ``workers.models.init_weights`` loads instead of drawing random ones."""
        super().__init__()
        self.n_layers, self.d_model, self.n_heads = n_layers, d_model, n_heads
        self.vocab_size, self.seq_len, self.d_ff = vocab_size, seq_len, d_ff or 4 * d_model
        self.arch, self.pretrained = arch, pretrained
        self.tok_emb: nn.Embedding | None = nn.Embedding(vocab_size, d_model)
        self.pos_emb: nn.Embedding | None = (
            nn.Embedding(n_positions or seq_len, d_model) if arch.rope_theta is None else None
        )
        self.layers = nn.ModuleDict({str(i): Block(d_model, n_heads, self.d_ff, arch) for i in range(n_layers)})
        self.norm: nn.Module | None = _norm(d_model, arch)
        self.output: nn.Linear | None = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, V); or hidden (B, T, h) in/out for pipeline stages."""
        if self.tok_emb is not None:
            x = self.tok_emb(tokens)  # (B, T, h) (or a T/tp shard under SP)
            if self.pos_emb is not None:
                pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)  # (1, T)
                x = x + self.pos_emb(pos)
        else:
            x = tokens
        for block in self.layers.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is not None:
            x = self.output(x)
        return x

    # ---------------------------------------------------------------------------------- parallel plans
    def tp_plan(self, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict:
        """Module-name pattern -> ParallelStyle (Megatron layout; torchtitan's llama plan with pos_emb).

        Without SP the residual stream is replicated (plain tensors); with SP it is a plain local shard
        ``(B, T/tp, h)`` between modules, gathered before attention/MLP and reduce-scattered after.
        ``loss_parallel`` leaves logits as a vocab-sharded DTensor (use ``loss_parallel()`` around the loss).
        """
        return _transformer_tp_plan(
            self,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            attention=True,
            gated=self.arch.act == "swiglu",
        )

    def stage_layer_keys(self, n_stages: int) -> list[list[str]]:
        return stage_layer_keys(list(self.layers.keys()), n_stages)

    def split_for_pipeline(self, stage_idx: int, n_stages: int) -> GPT:
        part = split_for_pipeline(self, stage_idx, n_stages, first=("tok_emb", "pos_emb"), last=("norm", "output"))
        assert isinstance(part, GPT)
        return part

    def flops_per_token(self) -> float:
        """Model FLOPs per trained token (fwd+bwd, GEMMs; Megatron/Korthikanti eq. 7 divided by B s)."""
        # 72 L h^2 + 12 L s h + 6 V h for d_ff = 4h (Megatron); generalised to any d_ff, SwiGLU and GQA
        L, h, s, V, f = self.n_layers, self.d_model, self.seq_len, self.vocab_size, self.d_ff
        kvd = h // self.n_heads * (self.arch.n_kv_heads or self.n_heads)
        mlp = (3 if self.arch.act == "swiglu" else 2) * h * f
        return 6.0 * L * (2 * h * h + 2 * h * kvd + mlp) + 12.0 * L * s * h + 6.0 * V * h


# --------------------------------------------------------------------------------------- shared helpers
def _transformer_tp_plan(
    model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool, attention: bool, gated: bool = False
) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    sp = sequence_parallel
    plan: dict = {}
    if getattr(model, "tok_emb", None) is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())
        if sp and getattr(model, "pos_emb", None) is not None:
            # positions (1, T) -> (1, T, h) reduce-scattered along T: matches the token-embedding shard
            plan["pos_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(model, "output", None) is not None:
        if sp and getattr(model, "norm", None) is not None:
            plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    layers: nn.ModuleDict = model.get_submodule("layers")  # type: ignore[assignment]
    for key in layers.keys():
        p = f"layers.{key}."
        if attention:
            if sp:
                plan[p + "ln_1"] = SequenceParallel()
                plan[p + "attn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            for w in ("wq", "wk", "wv"):
                plan[p + f"attn.{w}"] = ColwiseParallel()
            plan[p + "attn.wo"] = RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())
            if sp:
                plan[p + "ln_2"] = SequenceParallel()
                plan[p + "mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan[p + "mlp.w1"] = ColwiseParallel()
            if gated:  # SwiGLU's second input projection, sharded like w1
                plan[p + "mlp.w3"] = ColwiseParallel()
            plan[p + "mlp.w2"] = RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())
        else:
            if sp:
                plan[p + "ln"] = SequenceParallel()
                plan[p + "w1"] = ColwiseParallel(input_layouts=Shard(1))
            else:
                plan[p + "w1"] = ColwiseParallel()
            plan[p + "w2"] = RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())
    return plan


def stage_layer_keys(keys: list[str], n_stages: int) -> list[list[str]]:
    """Contiguous, balanced split of the block keys into ``n_stages`` stages (earlier stages get the extra).

    The first stage also holds the embeddings and the last the final norm and head.
    """
    if n_stages < 1 or n_stages > len(keys):
        raise ValueError(
            f"cannot split {len(keys)} layers into {n_stages} pipeline stages; use 1 <= stages <= {len(keys)}"
        )
    q, r = divmod(len(keys), n_stages)
    out, i = [], 0
    for s in range(n_stages):
        n = q + (1 if s < r else 0)
        out.append(keys[i : i + n])
        i += n
    return out


def split_for_pipeline(
    model: nn.Module, stage_idx: int, n_stages: int, *, first: tuple[str, ...], last: tuple[str, ...]
) -> nn.Module:
    """A deep copy of ``model`` holding only stage ``stage_idx``'s modules (works on the meta device).

    Parameter names are unchanged (``layers.3.attn.wq.weight`` stays), so checkpoints of any split load
    into any other split.
    """
    layers: nn.ModuleDict = model.get_submodule("layers")  # type: ignore[assignment]
    keep = set(stage_layer_keys(list(layers.keys()), n_stages)[stage_idx])
    part = copy.deepcopy(model)
    part_layers: nn.ModuleDict = part.get_submodule("layers")  # type: ignore[assignment]
    for k in list(part_layers.keys()):
        if k not in keep:
            del part_layers[k]
    if stage_idx != 0:
        for name in first:
            setattr(part, name, None)
    if stage_idx != n_stages - 1:
        for name in last:
            setattr(part, name, None)
    return part


def residual_std(model: nn.Module) -> float:
    n_layers = getattr(model, "n_layers", 1)
    return 0.02 / math.sqrt(2 * n_layers)
