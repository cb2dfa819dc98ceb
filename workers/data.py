"""Training data: the global batch of step k is a pure function of (seed, k), whatever the layout.

Sample j of the run (j = k * G + i for step k, global batch G) is window ``perm_e[j mod N]`` of epoch
``e = j // N`` where ``perm_e`` is a permutation seeded by (seed, e) (synthetic data: sample j is generated
from (seed, j)). Data-parallel rank r takes the contiguous slice ``[r G/dp, (r+1) G/dp)`` of the global
batch; ranks of one TP group (and pipeline stages) get the same slice; micro-batches are consecutive slices
of the rank's share. So the mean loss over the global batch is layout-invariant, and a resume at step k
with any layout replays exactly.

The position is the number of samples consumed (``state_dict``: ``step``, ``samples``; checkpoints carry it): a
resume continues at sample ``samples`` whatever the new layout (dp2 -> dp1) and even with another global batch size,
so no sample is seen twice or skipped. A dataset (``custom``) that exposes ``state_dict`` / ``load_state_dict`` has
its own state saved and restored with it.

Sources:
- ``synthetic``: arithmetic sequences ``(a + b t) mod V`` with random a, b per sample (learnable).
- ``text``: byte-level tokens of the files under ``data.path`` (a file or a directory, sorted); without a
  path, the Python standard library's ``.py`` files (``sysconfig.get_paths()["stdlib"]``), capped at 4 MB.
- ``tokens``: a directory of ``.bin`` token files (``data.args.dtype``: uint16 (default) or uint32) and/or
  ``.npy`` arrays, memmapped (never read whole).
- ``custom``: ``data.entrypoint(**data.args)`` returns a map-style dataset (``__len__`` + ``__getitem__``); item j
  is an ``(input, target)`` pair of (seq_len,) tensors, or a LongTensor of seq_len + 1 tokens (input = [:-1],
  target = [1:]). The entrypoint may also accept ``seq_len`` / ``vocab_size`` / ``seed`` keywords; they are
  passed when its signature names them and ``data.args`` does not.
"""

from __future__ import annotations

import functools
import logging
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from api.spec import DataSpec

log = logging.getLogger(__name__)

BUILTIN_CORPUS_BYTES = 4 * 1024 * 1024


def _seed(*parts: int) -> int:
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2))) & 0x7FFF_FFFF_FFFF_FFFF
    return h


class WindowSource:
    """N non-overlapping windows of seq_len + 1 tokens over one or more 1-D token arrays."""

    def __init__(self, arrays: Sequence[np.ndarray], seq_len: int, vocab_size: int, name: str):
        self.arrays = [a for a in arrays if len(a) >= seq_len + 1]
        self.seq_len, self.vocab_size, self.name = seq_len, vocab_size, name
        counts = [(len(a) - 1) // seq_len for a in self.arrays]
        self.offsets = np.cumsum([0] + counts)
        if self.offsets[-1] == 0:
            raise ValueError(
                f"data ({name}) holds fewer than seq_len + 1 = {seq_len + 1} tokens; give more data "
                "or a shorter model.seq_len"
            )

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> torch.Tensor:
        f = int(np.searchsorted(self.offsets, i, side="right") - 1)
        start = (i - int(self.offsets[f])) * self.seq_len
        w = np.asarray(self.arrays[f][start : start + self.seq_len + 1], dtype=np.int64)
        t = torch.from_numpy(w)
        return t % self.vocab_size if int(t.max()) >= self.vocab_size else t


class SyntheticSource:
    """Infinite: sample j = (a + b t) mod V, a and b drawn from a generator seeded by (seed, j)."""

    name = "synthetic"

    def __init__(self, seq_len: int, vocab_size: int, seed: int):
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed

    def __len__(self) -> int:
        return 2**62

    def sample(self, j: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_seed(self.seed, j))
        a = int(torch.randint(0, self.vocab_size, (1,), generator=g))
        b = int(torch.randint(1, 8, (1,), generator=g))
        return (a + b * torch.arange(self.seq_len + 1, dtype=torch.int64)) % self.vocab_size


def _read_files(paths: list[Path], cap_bytes: int | None) -> np.ndarray:
    chunks, total = [], 0
    for p in paths:
        try:
            b = p.read_bytes()
        except OSError:
            continue
        if cap_bytes is not None and total + len(b) > cap_bytes:
            b = b[: cap_bytes - total]
        chunks.append(np.frombuffer(b, dtype=np.uint8))
        total += len(b)
        if cap_bytes is not None and total >= cap_bytes:
            break
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint8)


def builtin_corpus_files() -> list[Path]:
    """The standard library's own ``.py`` files, sorted. Installed packages are pruned from the walk, not filtered
    after it: ``site-packages`` under the interpreter's lib directory can hold tens of thousands of files (walking
    them took 1.8 s per rank at every run start on a quiet machine, ~10 s on a loaded one). Cached: the list does
    not change while a process runs."""
    return list(_stdlib_sources(sysconfig.get_paths()["stdlib"]))


@functools.cache
def _stdlib_sources(stdlib: str) -> tuple[Path, ...]:
    found: list[Path] = []
    for d, dirs, files in os.walk(stdlib):
        dirs[:] = [x for x in dirs if x not in ("site-packages", "dist-packages")]
        found.extend(Path(d, f) for f in files if f.endswith(".py") and os.path.isfile(os.path.join(d, f)))
    return tuple(sorted(found))


def make_source(data: DataSpec, *, seq_len: int, vocab_size: int, seed: int):
    if data.source == "synthetic":
        return SyntheticSource(seq_len, vocab_size, seed)
    if data.source == "text":
        if data.path:
            root = Path(data.path).expanduser()
            if not root.exists():
                raise FileNotFoundError(f"data.path {root} does not exist; give a text file or directory")
            files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
            arr = _read_files(files, None)
        else:
            arr = _read_files(builtin_corpus_files(), BUILTIN_CORPUS_BYTES)
        return WindowSource([arr], seq_len, vocab_size, f"text:{data.path or 'stdlib'}")
    if data.source == "tokens":
        if not data.path:
            raise ValueError("data.source 'tokens' needs data.path: a directory of .bin token files")
        dtype = np.dtype(data.args.get("dtype", "uint16"))
        if dtype not in (np.uint16, np.uint32):
            raise ValueError("data.args.dtype must be uint16 or uint32")
        root = Path(data.path).expanduser()
        if not root.exists():
            raise FileNotFoundError(f"data.path {root} does not exist; give a directory of .bin/.npy token files")
        files = [root] if root.is_file() else sorted([*root.glob("*.bin"), *root.glob("*.npy")])
        if not files:
            raise FileNotFoundError(f"no .bin or .npy token files under data.path {root}")
        arrays = [
            np.load(f, mmap_mode="r").reshape(-1) if f.suffix == ".npy" else np.memmap(f, dtype=dtype, mode="r")
            for f in files
        ]
        return WindowSource(arrays, seq_len, vocab_size, f"tokens:{root}")
    if data.source == "custom":
        return _custom_source(data, seq_len=seq_len, vocab_size=vocab_size, seed=seed)
    raise ValueError(f"unknown data.source {data.source!r}")


def _custom_source(data: DataSpec, *, seq_len: int, vocab_size: int, seed: int) -> Any:
    import inspect

    from workers.user_code import UserCodeError, import_entrypoint

    if not data.entrypoint:
        raise UserCodeError("data.entrypoint", "data.source 'custom' needs data.entrypoint 'package.module:function'")
    fn = import_entrypoint(data.entrypoint, param="data.entrypoint")
    kwargs = dict(data.args)
    try:
        params = inspect.signature(fn).parameters
        for k, v in (("seq_len", seq_len), ("vocab_size", vocab_size), ("seed", seed)):
            if k in params and k not in kwargs:
                kwargs[k] = v
    except (TypeError, ValueError):  # builtins / C callables without a signature
        pass
    try:
        ds = fn(**kwargs)
    except TypeError as e:
        raise UserCodeError("data.args", f"{data.entrypoint}(**data.args) failed: {e}; check the argument names") from e
    if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
        raise UserCodeError(
            "data.entrypoint",
            f"{data.entrypoint} returned {type(ds).__name__}, not a map-style dataset (needs __len__ and __getitem__)",
        )
    if len(ds) == 0:
        raise UserCodeError("data.entrypoint", f"{data.entrypoint} returned an empty dataset")
    return ds


class StepBatches:
    """Deterministic per-step batches for one data-parallel rank (DistributedSampler-like).

    ``batch(step)`` -> (inputs, targets) of shape (G/dp, T) for 0-based ``step``; ``micro_batches(step)``
    splits them into (micro_batch_size, T) slices. ``epoch`` / ``set_epoch`` follow the sample position.
    """

    def __init__(
        self, source: Any, *, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int
    ):
        if global_batch_size % (dp_size * micro_batch_size):
            raise ValueError(
                f"global_batch_size={global_batch_size} is not a multiple of dp x micro_batch_size "
                f"= {dp_size} x {micro_batch_size}"
            )
        self.source, self.seed = source, seed
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.per_rank = global_batch_size // dp_size
        self.step = 0  # next step to produce (0-based)
        # sample index of the first sample of 0-based step k: base_sample + (k - base_step) * global_batch_size
        self.base_step, self.base_sample = 0, 0
        self._perm_cache: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ sampler semantics
    @property
    def num_samples(self) -> int:
        return len(self.source)

    def first_sample(self, step: int) -> int:
        """The run's sample index of the first sample of 0-based ``step``."""
        return self.base_sample + (step - self.base_step) * self.global_batch_size

    @property
    def epoch(self) -> int:
        return self.first_sample(self.step) // self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Jump to the first step of ``epoch`` (rounded down to a step boundary)."""
        self.step = self.base_step + (epoch * self.num_samples - self.base_sample) // self.global_batch_size

    def state_dict(self, step: int | None = None) -> dict:
        """The position before 0-based ``step`` (default: ``self.step``), i.e. after ``step`` steps."""
        at = self.step if step is None else int(step)
        out: dict[str, Any] = {
            "step": at,
            "samples": self.first_sample(at),
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
        }
        source_state = getattr(self.source, "state_dict", None)
        if callable(source_state):
            out["source"] = source_state()
        return out

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` (a ``state_dict``, maybe of another layout or global batch size) stopped."""
        self.step = int(state["step"])
        old_gbs = int(state.get("global_batch_size") or self.global_batch_size)
        samples = state.get("samples")
        self.base_step = self.step
        self.base_sample = int(samples) if samples is not None else self.step * old_gbs
        if int(state.get("seed", self.seed)) != self.seed:
            log.warning("data position saved with seed %s, resumed with seed %s", state.get("seed"), self.seed)
        load = getattr(self.source, "load_state_dict", None)
        if "source" in state and callable(load):
            load(state["source"])

    # ------------------------------------------------------------------ batches
    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perm_cache:
            g = torch.Generator().manual_seed(_seed(self.seed, 7919, epoch))
            self._perm_cache = {epoch: torch.randperm(self.num_samples, generator=g)}
        return self._perm_cache[epoch]

    def sample(self, j: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Sample j: a (T+1,) token tensor, or an (input, target) pair from a custom dataset."""
        if isinstance(self.source, SyntheticSource):
            return self.source.sample(j)
        n = self.num_samples
        item = self.source[int(self._perm(j // n)[j % n])]
        if isinstance(item, (tuple, list)) and len(item) == 2:
            x, y = item
            x = torch.as_tensor(x)
            return (x if x.is_floating_point() else x.to(torch.int64)), torch.as_tensor(y, dtype=torch.int64)
        return torch.as_tensor(item, dtype=torch.int64)

    def global_indices(self, step: int) -> range:
        return range(self.first_sample(step), self.first_sample(step) + self.global_batch_size)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.first_sample(step) + self.dp_rank * self.per_rank
        items = [self.sample(j) for j in range(start, start + self.per_rank)]
        if isinstance(items[0], tuple):  # (input, target) examples
            pairs = [it for it in items if isinstance(it, tuple)]
            return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])
        seqs = torch.stack([it for it in items if isinstance(it, torch.Tensor)])  # (G/dp, T+1)
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, y = self.batch(step)
        mb = self.micro_batch_size
        return [(x[i : i + mb], y[i : i + mb]) for i in range(0, self.per_rank, mb)]

    def __iter__(self):
        while True:
            out = self.micro_batches(self.step)
            self.step += 1
            yield out


def build_batches(
    data: DataSpec,
    *,
    seq_len: int,
    vocab_size: int,
    seed: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
) -> StepBatches:
    src = make_source(data, seq_len=seq_len, vocab_size=vocab_size, seed=seed)
    log.info(
        "data %s: %s samples",
        getattr(src, "name", type(src).__name__),
        "inf" if isinstance(src, SyntheticSource) else len(src),
    )
    return StepBatches(
        src,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
    )
