"""The one way meshrun shows a size: binary units (B, KiB, MiB, GiB, TiB: powers of 1024), three significant
digits. The CLI, the console's pages and its charts (``console.js`` ``fmt.bytes``, the same rule) all use it, so a
size reads the same wherever it is shown."""

from __future__ import annotations

UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float | None, missing: str = "-") -> str:
    """``7487 * 1024`` -> ``"7.31 MiB"``; ``512`` -> ``"512 B"``; ``1023 * 1024`` -> ``"1023 KiB"``."""
    if n is None:
        return missing
    v, i = float(n), 0
    while abs(v) >= 1024 and i < len(UNITS) - 1:
        v /= 1024
        i += 1
    if i == 0:
        return f"{int(v)} B"
    digits = 0 if abs(v) >= 100 else 1 if abs(v) >= 10 else 2
    return f"{v:.{digits}f} {UNITS[i]}"
