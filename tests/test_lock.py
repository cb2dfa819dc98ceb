"""The dependency locks agree with pyproject.toml, and the README's two commands and CI install from them.

pyproject.toml keeps compatible ranges (for people who install meshrun as a library); requirements/*.lock pin
every package the README installs, with hashes (``bash scripts/lock.sh`` refreshes them). These checks need no
network: they read the files.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCKS = {"runtime": ROOT / "requirements" / "runtime.lock", "dev": ROOT / "requirements" / "dev.lock"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


def _pins(path: Path) -> dict[str, Version]:
    """name -> pinned version, checking that each package entry is an exact pin that carries hashes."""
    pins: dict[str, Version] = {}
    entries = re.split(r"\n(?=\S)", path.read_text())  # an entry: its pin line and the indented lines after it
    for entry in entries:
        head = entry.split("\n", 1)[0]
        if not head or head.startswith(("#", "-")):
            continue
        m = PIN.match(head)
        assert m, f"{path.name}: not an exact pin: {head!r}"
        assert "--hash=sha256:" in entry, f"{path.name}: {m.group(1)} has no hash"
        pins[canonicalize_name(m.group(1))] = Version(m.group(2))
    return pins


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _torch_pin() -> str:
    """The one requirement line of requirements/torch.txt, e.g. ``torch==2.13.0``."""
    lines = [ln for ln in (ROOT / "requirements" / "torch.txt").read_text().splitlines() if ln and ln[0] != "#"]
    assert len(lines) == 1 and lines[0].startswith("torch=="), lines
    return lines[0]


@pytest.fixture(scope="module")
def pins() -> dict[str, dict[str, Version]]:
    return {name: _pins(path) for name, path in LOCKS.items()}


def _check(requirements: list[str], locked: dict[str, Version], lock: str) -> None:
    for line in requirements:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name == "torch":  # installed first by the README (CPU or CUDA build), never from the lock
            assert name not in locked, f"{lock}.lock pins torch; the README installs torch itself"
            continue
        assert name in locked, f"{req.name} (pyproject.toml) is missing from {lock}.lock: run bash scripts/lock.sh"
        assert req.specifier.contains(locked[name], prereleases=True), (
            f"{lock}.lock pins {req.name}=={locked[name]}, outside pyproject.toml's {req.specifier}: "
            "run bash scripts/lock.sh --keep"
        )


def test_every_runtime_dependency_is_locked_within_its_range(pins):
    for lock in ("runtime", "dev"):
        _check(_project()["dependencies"], pins[lock], lock)


def test_every_dev_dependency_is_locked_within_its_range(pins):
    _check(_project()["optional-dependencies"]["dev"], pins["dev"], "dev")


def test_the_runtime_lock_is_the_dev_lock_s_versions(pins):
    differ = {n: (v, pins["dev"].get(n)) for n, v in pins["runtime"].items() if pins["dev"].get(n) != v}
    assert not differ, f"runtime.lock and dev.lock disagree (runtime, dev): {differ}"


def test_the_locks_were_resolved_for_the_torch_the_readme_installs(pins):
    torch_range = next(Requirement(r) for r in _project()["dependencies"] if r.startswith("torch"))
    assert torch_range.specifier.contains(_torch_pin().split("==")[1])
    # the CPU wheel's dependencies are locked; a CUDA build's would drag gigabytes of nvidia-* packages in
    assert "sympy" in pins["dev"] and not [n for n in pins["dev"] if n.startswith(("nvidia-", "triton"))]


def test_the_readme_commands_and_ci_install_from_the_locks():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    torch_pin = _torch_pin()
    first = next(ln for ln in readme.splitlines() if ln.endswith("meshrun demo") and "pip install" in ln)
    second = next(ln for ln in readme.splitlines() if "&& python -m pytest" in ln and "pip install" in ln)
    assert f"pip install {torch_pin}" in first and "-r requirements/runtime.lock" in first, first
    assert f"pip install {torch_pin}" in second and "-r requirements/dev.lock" in second, second
    for cmd in (first, second):
        assert "--require-hashes" in cmd and "pip install --no-deps -e ." in cmd, cmd
    assert second in ci, ".ci/run must run exactly the README's test command"
    assert "pip freeze" in second, "the test command prints the versions it installed"
