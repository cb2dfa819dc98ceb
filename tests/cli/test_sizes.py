"""Sizes read the same everywhere: one formatter (``api.spec.units.format_bytes``, binary units) for the CLI's
artifact and checkpoint lists, the console's pages (and ``console.js``, checked in tests/console); and a downloaded
artifact is the stored file, byte for byte, so its size is the one the list shows."""

from __future__ import annotations

import json
import uuid

import pytest
from typer.testing import CliRunner

from api.cli import app
from api.spec.units import format_bytes
from service.app.console.web import _bytes
from tests.cli.test_cli import EXAMPLES

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.mark.parametrize(
    "n,text",
    [
        (None, "-"),
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1000 * 1024, "1000 KiB"),  # not "1.00e+3 KiB"
        (7487 * 1024, "7.31 MiB"),
        (15 * 2**20 + 2**19, "15.5 MiB"),
        (2**30, "1.00 GiB"),
        (80 * 2**30, "80.0 GiB"),
    ],
)
def test_format_bytes(n, text) -> None:
    assert format_bytes(n) == text


def test_console_pages_use_the_same_formatter() -> None:
    for n in (0, 1536, 7487 * 1024, 3 * 2**30):
        assert _bytes(n) == format_bytes(n)
    assert _bytes(None) == "–"


def test_artifact_list_and_download_agree(api_server, tmp_path) -> None:
    r = runner.invoke(
        app,
        [
            "--url",
            api_server.url,
            "submit",
            str(EXAMPLES / "dp.yaml"),
            "--name",
            f"sizes-{uuid.uuid4().hex[:8]}",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    run_id = json.loads(r.stdout)["id"]
    # a Chrome trace as the profiler writes it: indented JSON (a re-serialised copy would be smaller)
    trace = {
        "traceEvents": [{"name": f"op{i}", "ph": "X", "ts": i, "dur": 1, "args": {"k": "v" * 20}} for i in range(4000)]
    }
    content = json.dumps(trace, indent=2).encode()
    from service.store.artifacts import add_artifact

    with api_server.session() as s:
        add_artifact(s, run_id=run_id, attempt=1, rank=0, name="rank0.trace.json", content=content)
    size = format_bytes(len(content))
    assert size.endswith("KiB") or size.endswith("MiB")

    r = runner.invoke(app, ["--url", api_server.url, "artifact", run_id])
    assert r.exit_code == 0, r.output
    assert size in r.stdout, (size, r.stdout)
    r = runner.invoke(app, ["--url", api_server.url, "artifact", run_id, "rank0.trace.json", "-o", str(tmp_path)])
    assert r.exit_code == 0, r.output
    written = tmp_path / "rank0.trace.json"
    assert written.read_bytes() == content  # the stored file, not a re-serialised (smaller) copy
    assert f"({size})" in r.stdout, r.stdout
