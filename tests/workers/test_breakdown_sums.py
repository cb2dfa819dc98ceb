"""The breakdown names the whole step: on a real gloo dp2 run, per rank the named terms add up to the rank's
measured step time (from the same timestamps), and the service's answer (``GET /v1/runs/{id}/breakdown``) and the
CLI's table add up to the measured step time too: every term is averaged over the same typical steps, and
``unaccounted_s`` (shown by the CLI and the console as "named terms: ...% of the measured step") names the rest.
A median taken term by term (each from a different step) added up to ~80-90% of the step on a loaded machine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from rich.console import Console

from api.cli.observe import print_breakdown
from api.spec import BREAKDOWN_PARTS, BREAKDOWN_ROWS, BREAKDOWN_TERMS, RunBreakdown
from service import store
from service.app.server import create_app
from service.settings import Settings
from service.store.db import make_engine, make_sessionmaker, session_scope
from service.store.metrics import add_metrics
from tests.workers.dist_utils import run_world, tiny_spec

STEPS = 24


@pytest.fixture(scope="module")
def dp2_rows() -> list[dict]:
    return run_world(2, [tiny_spec(steps=STEPS, dp=2, zero=0)])[0]["rows"]


@pytest.fixture
def service(tmp_path) -> Iterator[tuple[TestClient, str]]:
    url = f"sqlite:///{tmp_path / 'meshrun.db'}"
    app = create_app(Settings(start_scheduler=False, data_dir=tmp_path, database_url=url, rate_limit_per_minute=0))
    with TestClient(app) as client:  # the lifespan migrates the database
        engine = make_engine(url)
        yield client, url
        engine.dispose()


def _store_rows(url: str, rows: list[dict]) -> str:
    engine = make_engine(url)
    try:
        with session_scope(make_sessionmaker(engine)) as s:
            run, _ = store.create_run(s, spec={"name": "bd"}, plan=None)
            add_metrics(s, run_id=run.id, attempt=1, rows=rows)
            return run.id
    finally:
        engine.dispose()


def _breakdown(client: TestClient, run_id: str) -> dict:
    r = client.get(f"/v1/runs/{run_id}/breakdown")
    assert r.status_code == 200, r.text
    return r.json()


def _assert_adds_up(bd: dict, world: int) -> None:
    total = bd["step_time_s"]["measured_s"]
    terms = {t["term"]: t for t in bd["terms"]}
    assert list(terms) == list(BREAKDOWN_ROWS)  # the existing terms, in their order
    named = sum(t["measured_s"] for t in bd["terms"])
    assert named == pytest.approx(total, rel=0.05), bd
    assert sum(t["share"] for t in bd["terms"]) == pytest.approx(1.0, abs=0.05), bd
    assert bd["unaccounted_s"] == pytest.approx(total - named, abs=1e-12)
    assert abs(bd["unaccounted_s"]) <= 0.05 * total
    for r in range(world):
        rank_total = bd["step_time_s"]["per_rank_s"][r]
        assert sum(t["per_rank_s"][r] for t in bd["terms"]) == pytest.approx(rank_total, rel=0.05), (r, bd)
        assert bd["ranks"][r]["step_time_s"] == rank_total


def _cli_text(bd: dict) -> str:
    console = Console(record=True, width=200, force_terminal=False)
    print_breakdown(RunBreakdown.model_validate(bd), console)
    return console.export_text()


@pytest.mark.slow
def test_each_ranks_named_terms_tile_its_step(dp2_rows) -> None:
    measured = [r for r in dp2_rows if "breakdown_per_rank" in r]
    assert len(measured) == STEPS
    for row in measured:
        pr = row["breakdown_per_rank"]
        assert set(pr) == set(BREAKDOWN_TERMS)
        for r in range(2):
            parts = sum(pr[t][r] for t in BREAKDOWN_PARTS)
            assert parts == pytest.approx(pr["total"][r], rel=0.05), (row["step"], r, pr)
            assert pr["compute"][r] > 0 and pr["optimizer"][r] > 0 and pr["dp_comm_exposed"][r] > 0


@pytest.mark.slow
def test_the_api_and_cli_breakdown_of_a_dp2_run_add_up_to_the_step(dp2_rows, service) -> None:
    client, url = service
    bd = _breakdown(client, _store_rows(url, dp2_rows))
    assert bd["steps_measured"] >= STEPS - 3 and bd["warmup_steps_excluded"] >= 1
    _assert_adds_up(bd, 2)
    text = _cli_text(bd)
    line = next(ln for ln in text.splitlines() if ln.startswith("named terms: "))
    pct = float(line.split()[2].rstrip("%"))
    assert 95 <= pct <= 105 and "of the measured step (unaccounted " in line, text
    for word in ("compute", "dp comm", "optimizer", "data wait", "other", "step (total)"):
        assert word in text, (word, text)


def test_skewed_terms_still_add_up(service) -> None:
    """Each step one term is large and the others small (as when load hits one phase at a time): a median per
    term would answer 30% of the step; the same steps averaged answer all of it."""
    client, url = service
    rows = []
    for step in range(1, 42):
        big = ("compute", "dp_comm_exposed", "optimizer")[step % 3]
        per_rank = dict.fromkeys(BREAKDOWN_TERMS, 0.0)
        per_rank.update(compute=0.001, dp_comm_exposed=0.001, optimizer=0.001)
        per_rank[big] = 0.008
        per_rank["dp_comm"] = per_rank["dp_comm_exposed"]
        per_rank["total"] = sum(per_rank[t] for t in BREAKDOWN_PARTS)
        pr = {t: [v, v] for t, v in per_rank.items()}
        rows.append({"step": step, "loss": 1.0, "step_time_s": per_rank["total"], "breakdown_per_rank": pr})
    bd = _breakdown(client, _store_rows(url, rows))
    assert bd["step_time_s"]["measured_s"] == pytest.approx(0.010)
    _assert_adds_up(bd, 2)
    assert "named terms: 100.0% of the measured step" in _cli_text(bd)
