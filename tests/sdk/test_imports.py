"""The SDK must load on a laptop without torch or ray: importing it must not import them, even indirectly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_sdk_imports_without_torch_or_ray():
    p = _run("import api.client, sys; from api.client import Client; Client('http://x');"
             "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ray', 'sqlalchemy', 'fastapi'));"
             "assert not bad, bad")
    assert p.returncode == 0, p.stderr


def test_sdk_works_when_torch_and_ray_cannot_be_imported():
    # a client laptop without them: make their import fail and use the SDK's offline parts
    p = _run("import sys; sys.modules['torch'] = None; sys.modules['ray'] = None\n"
             "from api.client import Client, parse_layout, RunSpec\n"
             "assert parse_layout('dp=2,tp=2') == {'dp': 2, 'tp': 2}\n"
             "RunSpec.model_validate({'layout': {'dp': 2}})")
    assert p.returncode == 0, p.stderr


def test_api_package_init_stays_light():
    p = _run("import api, sys; assert [m for m in sys.modules if m.startswith(('torch', 'ray', 'service'))] == []")
    assert p.returncode == 0, p.stderr
