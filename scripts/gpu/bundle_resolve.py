"""Complete the extracted GPU bundle against the image's own packages (run with the image's python3, bundle not
on the path).

    python3 bundle_resolve.py DIR [REPO]

DIR holds ``site/`` (packages the image lacks) and ``fallback/<name>/`` (packages the image has, at the versions
the bundle was resolved with). Every requirement of the packages in ``site/`` (Ray with its default, train and tune
extras) and of meshrun's pyproject.toml is checked against what the image has; where the image's version does
not satisfy it, the fallback of that package is copied into ``site/`` (which comes first on PYTHONPATH), and its
own requirements are checked in turn. Prints one line per copied fallback and per requirement left unmet, and
writes the same to ``DIR/resolve.txt``.
"""

from __future__ import annotations

import importlib.metadata as md
import shutil
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

EXTRAS = {"ray": {"default", "train", "tune"}}
NOT_NEEDED = {"psycopg"}  # meshrun uses SQLite on the device


def dists_in(folder: Path) -> dict[str, tuple[str, list[str]]]:
    out: dict[str, tuple[str, list[str]]] = {}
    for d in md.distributions(path=[str(folder)]):
        out[canonicalize_name(d.metadata["Name"])] = (d.version, d.requires or [])
    return out


def applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in extras | {""})


def main() -> int:
    root = Path(sys.argv[1])
    repo = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    site, fallback = root / "site", root / "fallback"
    image: dict[str, str] = {}
    for d in md.distributions():  # the image only: the bundle is not on sys.path here
        image.setdefault(canonicalize_name(d.metadata["Name"]), d.version)
    bundle = dists_in(site)
    fallbacks = {}
    for f in sorted(fallback.iterdir()) if fallback.is_dir() else []:
        for name, (ver, reqs) in dists_in(f).items():
            fallbacks[name] = (ver, reqs, f)
    have = {**image, **{n: v for n, (v, _) in bundle.items()}}
    queue: list[tuple[str, str, set[str]]] = []
    for name, (_, reqs) in bundle.items():
        queue += [(name, r, EXTRAS.get(name, set())) for r in reqs]
    if repo is not None and (repo / "pyproject.toml").exists():
        deps = tomllib.loads((repo / "pyproject.toml").read_text())["project"][
            "dependencies"
        ]
        queue += [("meshrun", r, set()) for r in deps]
    lines: list[str] = []
    copied: set[str] = set()
    while queue:
        who, text, extras = queue.pop(0)
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if not applies(req, extras) or name in NOT_NEEDED or name in bundle:
            continue
        got = have.get(name)
        if got is not None and req.specifier.contains(Version(got), prereleases=True):
            continue
        fb = fallbacks.get(name)
        if (
            fb
            and name not in copied
            and req.specifier.contains(Version(fb[0]), prereleases=True)
        ):
            shutil.copytree(fb[2], site, dirs_exist_ok=True)
            copied.add(name)
            have[name] = fb[0]
            lines.append(
                f"overlay {name}=={fb[0]} (image has {got}; {who} needs {req})"
            )
            sub = {e for e in req.extras}
            queue += [(name, r, sub) for r in fb[1]]
        else:
            lines.append(
                f"UNMET {who} needs {req}; image has {got}"
                + (f", fallback {fb[0]}" if fb else ", no fallback")
            )
    if not lines:
        lines.append("all requirements met by the image and the bundle")
    (root / "resolve.txt").write_text("\n".join(lines) + "\n")
    print("\n".join("bundle: " + ln for ln in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
