"""Measure the figures the planner's device table needs, on the GPU this runs on (torch only, no meshrun import).

    python bench/measure_device.py --out device.json            # everything (about 4 minutes on an H100)
    python bench/measure_device.py --out device.json --quick    # a few shapes of each (a smoke test; CPU works)

What it measures (all with CUDA events after warm-up, the median of the timed repetitions):
- ``gemm``: bf16 matrix products ``(m, k) x (k, n)`` in the three layouts a ``nn.Linear`` runs (forward x W^T,
  input-gradient dY W, weight-gradient dY^T X) over transformer-shaped sizes: the achieved FLOP/s per shape,
  from which ``service.planner.kernels`` fits its shape-dependent efficiency curve.
- ``elementwise``: bytes/s of copies, GELU and LayerNorm over growing tensors (HBM bandwidth, and the fixed
  cost of one kernel where the tensor is small).
- ``launch``: the host-side cost of one eager kernel launch (tiny adds in a loop).
- ``attention``: causal ``scaled_dot_product_attention`` (flash) forward and forward+backward by sequence length.
- ``adam``: fused AdamW step time per parameter.
- ``gpt``: whole training steps of GPT-2 shaped models (bf16 autocast, fp32 master weights, fused AdamW) by
  hidden size and micro-batch size, with peak allocated and reserved memory: end-to-end data for the planner.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


def _timer(fn, *, min_time_s: float = 0.02, min_reps: int = 3, max_reps: int = 50, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    times: list[float] = []
    total = 0.0
    while len(times) < min_reps or (total < min_time_s and len(times) < max_reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            t = a.elapsed_time(b) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
        times.append(t)
        total += t
    return statistics.median(times)


def measure_gemm(dev: torch.device, quick: bool) -> list[dict]:
    ms = [256, 1024, 4096, 16384] if not quick else [256, 1024]
    ns = [128, 512, 1536, 4096, 12288, 50304] if not quick else [128, 1536]
    ks = [128, 512, 1536, 4096, 12288] if not quick else [128, 1536]
    out = []
    for m in ms:
        for n in ns:
            for k in ks:
                if m * n * k > 6e12:
                    continue
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
                for layout, fn in (
                    ("fwd", lambda x=x, w=w: x @ w.t()),  # (m, k) x (k, n)
                    ("dgrad", lambda dy=dy, w=w: dy @ w),  # (m, n) x (n, k): output (m, k), reduction n
                    ("wgrad", lambda dy=dy, x=x: dy.t() @ x),  # (n, m) x (m, k): output (n, k), reduction m
                ):
                    t = _timer(fn)
                    out.append({"m": m, "n": n, "k": k, "layout": layout, "time_s": t, "flops": 2.0 * m * n * k})
    return out


def measure_elementwise(dev: torch.device, quick: bool) -> list[dict]:
    out = []
    sizes = [2**p for p in range(10, 29, 2)] if not quick else [2**10, 2**16]
    for n in sizes:
        x = torch.randn(n, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        h = 1024
        rows = max(1, n // h)
        x2 = x[: rows * h].view(rows, h)
        ln = nn.LayerNorm(h, device=dev, dtype=torch.bfloat16)
        for op, fn, nbytes in (
            ("copy", lambda x=x, y=y: y.copy_(x), 4 * n),
            ("gelu", lambda x=x: F.gelu(x), 4 * n),
            ("layernorm", lambda ln=ln, x2=x2: ln(x2), 4 * rows * h),
        ):
            t = _timer(fn)
            out.append({"op": op, "elements": n, "bytes": nbytes, "time_s": t})
    return out


def measure_launch(dev: torch.device) -> dict:
    x = torch.zeros(1, device=dev)
    for _ in range(100):
        x.add_(1)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return {"per_launch_s": (time.perf_counter() - t0) / n}


def measure_attention(dev: torch.device, quick: bool) -> list[dict]:
    out = []
    seqs = [256, 512, 1024, 2048, 4096, 8192] if not quick else [256]
    for d in (64, 128):
        for s in seqs:
            heads = 16
            b = max(1, 16384 // s)
            q, k, v = (
                torch.randn(b, heads, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
            )
            fwd = _timer(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            g = torch.randn(b, heads, s, d, device=dev, dtype=torch.bfloat16)

            def fwd_bwd(q=q, k=k, v=v, g=g) -> None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                o.backward(g)

            both = _timer(fwd_bwd)
            causal_flops = 4.0 * b * heads * s * s * d / 2  # QK^T and PV, causal half
            out.append(
                {
                    "b": b,
                    "heads": heads,
                    "s": s,
                    "d": d,
                    "fwd_s": fwd,
                    "fwd_bwd_s": both,
                    "fwd_flops_causal": causal_flops,
                }
            )
    return out


def measure_adam(dev: torch.device, quick: bool) -> list[dict]:
    out = []
    for n in [10**6, 10**7, 10**8, 4 * 10**8] if not quick else [10**6]:
        p = torch.zeros(n, device=dev, requires_grad=True)
        p.grad = torch.randn(n, device=dev)
        opt = torch.optim.AdamW([p], lr=1e-4, fused=dev.type == "cuda")
        t = _timer(opt.step, min_reps=5)
        out.append({"params": n, "time_s": t})
        del p, opt
    return out


class Block(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(h, h) for _ in range(4))
        self.w1, self.w2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, h = x.shape
        y = self.ln_1(x)
        q, k, v = (w(y).view(B, T, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, h)
        x = x + self.wo(a)
        return x + self.w2(F.gelu(self.w1(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, L: int, h: int, heads: int, V: int, s: int, recompute: bool):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, h), nn.Embedding(s, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(L))
        self.norm, self.out = nn.LayerNorm(h), nn.Linear(h, V, bias=False)
        self.recompute = recompute

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            if self.recompute:
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return self.out(self.norm(x))


def measure_gpt(dev: torch.device, quick: bool) -> list[dict]:
    configs = [  # (name, L, h, heads, s)
        ("125m", 12, 768, 12, 2048),
        ("350m", 24, 1024, 16, 2048),
        ("760m", 24, 1536, 16, 2048),
        ("1.3b", 24, 2048, 16, 2048),
        ("2.7b", 32, 2560, 32, 2048),
    ]
    if quick:
        configs = [("tiny", 2, 128, 4, 128)]
    V = 50304 if not quick else 256
    out = []
    for name, L, h, heads, s in configs:
        for recompute in (False, True):
            for mb in (1, 2, 4, 8):
                if recompute and mb not in (1, 4):
                    continue
                model = opt = idx = step = None  # free the previous model before measuring this one's peak
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                row = {
                    "model": name,
                    "n_layers": L,
                    "d_model": h,
                    "n_heads": heads,
                    "seq_len": s,
                    "vocab": V,
                    "micro_batch": mb,
                    "recompute": recompute,
                }
                try:
                    model = GPT(L, h, heads, V, s, recompute).to(dev)
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
                    idx = torch.randint(0, V, (mb, s), device=dev)

                    def step(model=model, opt=opt, idx=idx) -> None:
                        with torch.autocast(dev.type, dtype=torch.bfloat16):
                            logits = model(idx)
                            loss = F.cross_entropy(logits.view(-1, V).float(), idx.view(-1))
                        loss.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)

                    t = _timer(step, min_time_s=0.5, min_reps=5, max_reps=12, warmup=3)
                    row["step_s"] = t
                    row["n_params"] = sum(p.numel() for p in model.parameters())
                    if dev.type == "cuda":
                        row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
                        row["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
                except torch.OutOfMemoryError:
                    row["oom"] = True
                out.append(row)
                print(json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="device.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma list of sections")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    res: dict = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d"),
    }
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        res["sms"] = p.multi_processor_count
        res["memory_bytes"] = p.total_memory
    sections = {
        "launch": lambda: measure_launch(dev),
        "elementwise": lambda: measure_elementwise(dev, args.quick),
        "gemm": lambda: measure_gemm(dev, args.quick),
        "attention": lambda: measure_attention(dev, args.quick),
        "adam": lambda: measure_adam(dev, args.quick),
        "gpt": lambda: measure_gpt(dev, args.quick),
    }
    only = [s for s in args.only.split(",") if s] or list(sections)
    for name in only:
        t0 = time.perf_counter()
        res[name] = sections[name]()
        print(f"# {name}: {time.perf_counter() - t0:.1f}s", flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f)
    if "gemm" in res:
        best = max(res["gemm"], key=lambda r: r["flops"] / r["time_s"])
        print(f"# best gemm {best['flops'] / best['time_s'] / 1e12:.0f} TFLOP/s at {best}")


if __name__ == "__main__":
    main()
