"""model.attention 'eager': the GPT runs the math path softmax(QK^T / sqrt(d)) V, which equals SDPA, and a run
built from a spec asking for it takes that path (so a run and its plan, priced as eager, agree)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from api.spec import ModelSpec
from api.spec.validation import resolve_model
from workers.models import build_model, materialize
from workers.models.gpt import eager_attention


def _grad_fns(t: torch.Tensor) -> set[str]:
    """Names of every autograd node behind ``t``."""
    names: set[str] = set()
    visited: set[int] = set()
    stack = [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in visited:
            continue
        visited.add(id(fn))
        names.add(type(fn).__name__)
        stack += [nxt for nxt, _ in fn.next_functions]
    return names


def test_eager_attention_equals_sdpa_forward_and_backward() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 17, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = eager_attention(q, k, v)
    assert torch.allclose(out, ref, atol=1e-12)
    # the first query sees only the first key: its output is v's first row exactly
    assert torch.allclose(out[:, :, 0], v[:, :, 0], atol=1e-12)
    gref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    gout = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(gref, gout))


def test_a_model_asking_for_eager_takes_the_math_path() -> None:
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = {}
    for attention in ("flash", "eager"):
        cfg = resolve_model(ModelSpec(name="gpt", preset="tiny", vocab_size=64, seq_len=16, attention=attention))
        assert cfg.attention == attention
        model = materialize(build_model(cfg), device="cpu", seed=3)
        out = model(tokens)
        fns = _grad_fns(out)
        sdpa = any("ScaledDotProduct" in n for n in fns)
        # eager: a softmax and a masked_fill in the graph, no SDPA kernel; flash: the reverse
        assert ("SoftmaxBackward0" in fns and "MaskedFillBackward0" in fns) == (attention == "eager")
        assert sdpa == (attention == "flash")
        logits[attention] = out
    assert torch.allclose(logits["flash"], logits["eager"], atol=1e-5)  # same weights (seeded), same function
