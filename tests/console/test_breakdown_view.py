"""The run page's breakdown in a real Chromium against the service without Ray (a dp2 run's rows, with their per-rank
breakdown, written through the store as a driver writes them): every term with its share, the whole step as the
last row, and the line saying how much of the measured step the terms name (they add up to it)."""

from __future__ import annotations

import httpx
import pytest

from api.spec import BREAKDOWN_PARTS, BREAKDOWN_TERMS
from service import store
from service.store.db import session_scope
from tests.console.conftest import start_plain_service, stop_plain_service
from tests.ray.helpers import tiny_spec


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    s = start_plain_service(tmp_path_factory.mktemp("console-breakdown"))
    try:
        yield s
    finally:
        stop_plain_service(s)


def _row(step: int) -> dict:
    """Each step one term is large (as when load hits one phase at a time): medians per term named 30% of it."""
    per_rank = dict.fromkeys(BREAKDOWN_TERMS, 0.0)
    per_rank.update(compute=0.001, dp_comm_exposed=0.001, optimizer=0.001)
    per_rank[("compute", "dp_comm_exposed", "optimizer")[step % 3]] = 0.008
    per_rank["dp_comm"] = per_rank["dp_comm_exposed"]
    per_rank["total"] = sum(per_rank[t] for t in BREAKDOWN_PARTS)
    return {
        "step": step,
        "loss": 5.0 / step,
        "step_time_s": per_rank["total"],
        "breakdown_per_rank": {t: [v, v] for t, v in per_rank.items()},
    }


@pytest.fixture(scope="module")
def run_id(svc) -> str:
    r = httpx.post(f"{svc.url}/v1/runs", json=tiny_spec("breakdown-dp2", dp=2, steps=41), timeout=30)
    assert r.status_code == 201, r.text
    rid = r.json()["id"]
    with session_scope(svc.app.state.session_factory) as s:
        store.transition(s, run_id=rid, to="STARTING", reason="placed")
        store.start_attempt(s, run_id=rid, cause="submitted")
    with session_scope(svc.app.state.session_factory) as s:
        store.transition(s, run_id=rid, to="RUNNING", reason="workers up")
        store.add_metrics(s, run_id=rid, attempt=1, rows=[_row(i) for i in range(1, 42)])
    with session_scope(svc.app.state.session_factory) as s:
        store.transition(s, run_id=rid, to="SUCCEEDED", reason="finished")
    return rid


def test_the_breakdown_names_the_whole_step(svc, run_id, console) -> None:
    page, _ = console(svc.url)
    page.goto(f"{svc.url}/runs/{run_id}")
    page.wait_for_selector('#breakdown[data-state="shown"]')
    table = page.locator("#breakdown table")
    heads = [h.strip().lower() for h in table.locator("thead th").all_inner_texts()]  # CSS upper-cases them
    assert heads[:4] == ["term", "predicted", "measured", "share"], heads
    cells = [[c.strip() for c in r.locator("td").all_inner_texts()] for r in table.locator("tbody tr").all()]
    by_term = {c[0]: c for c in cells}
    assert cells[-1][0] == "step (total)" and cells[-1][2] == "10.0 ms" and cells[-1][3] == "100%", cells
    assert {"compute", "dp comm", "optimizer", "data wait", "other"} <= set(by_term), cells
    assert sum(int(c[3].rstrip("%")) for c in cells[:-1]) in range(98, 103), cells  # whole percents, rounded
    named = page.locator("#breakdown .named-terms").inner_text()
    assert "Named terms: 100.0% of the measured step" in named, named
    page.shot("breakdown-dp2")
    assert page.js_errors == []
