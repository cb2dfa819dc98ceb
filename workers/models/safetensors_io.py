"""A minimal reader and writer of the safetensors format (torch and the standard library only).

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N bytes of
JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``, then the raw
little-endian tensor bytes. The runtime image does not carry the ``safetensors`` package, so meshrun reads
(memory-mapped, one tensor at a time) and writes it here; ``transformers`` reads what this writes.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 << 20


class SafetensorsFile:
    """One ``.safetensors`` file, memory-mapped; ``get(name)`` copies one tensor out."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if len(self._mm) < 8:
            raise ValueError(f"{self.path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", self._mm[:8])
        if n > min(_MAX_HEADER, len(self._mm) - 8):
            raise ValueError(f"{self.path} is not a safetensors file (header length {n})")
        header: dict[str, Any] = json.loads(bytes(self._mm[8 : 8 + n]))
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries: dict[str, dict[str, Any]] = header
        self._base = 8 + n

    def keys(self) -> list[str]:
        return list(self.entries)

    def get(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        dtype = _DTYPES.get(e["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: tensor {name} has dtype {e['dtype']}, which meshrun does not read")
        begin, end = (self._base + int(o) for o in e["data_offsets"])
        shape = [int(s) for s in e["shape"]]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        buf = bytearray(self._mm[begin:end])  # a private copy: the tensor owns its memory
        return torch.frombuffer(buf, dtype=dtype).reshape(shape).clone()

    def close(self) -> None:
        self._mm.close()


class SafetensorsDir:
    """Every ``*.safetensors`` file of a directory as one name -> tensor lookup (sharded checkpoints too)."""

    def __init__(self, path: str | Path):
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path} holds no *.safetensors file")
        self.files = [SafetensorsFile(f) for f in files]
        self._where = {k: f for f in self.files for k in f.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"the Hugging Face weights have no tensor '{name}'")
        return self._where[name].get(name)

    def close(self) -> None:
        for f in self.files:
            f.close()


def save_file(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (contiguous CPU copies are made) as one safetensors file at ``path``."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in _NAMES:
            raise ValueError(f"tensor {name} has dtype {t.dtype}, which safetensors cannot hold")
        data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)
