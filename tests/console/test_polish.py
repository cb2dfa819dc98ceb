"""Console details that made working runs look broken, in a real Chromium against the service without Ray (runs and
their metrics written through the store, as a driver writes them): an early-stopped sweep trial shows as
early-stopped with no Resume; a pp run has no flat "0 B" cross-group traffic chart; the step-time axis uses one unit;
the Preempted filter chip has its coloured dot; Compare's collapsed "Choose runs" shows an arrow and what is chosen;
sizes use the one binary format."""

from __future__ import annotations

import httpx
import pytest

from service import store
from service.store.db import session_scope
from service.store.models import Sweep
from tests.console.conftest import start_plain_service, stop_plain_service
from tests.ray.helpers import tiny_spec

EARLY = "early-stopped: tokens_per_s 812 after 2 measured steps is below the median of the other trials"


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    s = start_plain_service(tmp_path_factory.mktemp("console-polish"))
    try:
        yield s
    finally:
        stop_plain_service(s)


def _submit(url: str, spec: dict) -> str:
    r = httpx.post(f"{url}/v1/runs", json=spec, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["id"]


@pytest.fixture(scope="module")
def runs(svc) -> dict[str, str]:
    url, factory = svc.url, svc.app.state.session_factory
    pp = _submit(url, tiny_spec("polish-pp2", pp=2, steps=3))
    trial = _submit(url, tiny_spec("polish-trial", steps=3))
    with session_scope(factory) as s:
        store.transition(s, run_id=pp, to="STARTING", reason="placed")
        store.start_attempt(s, run_id=pp, cause="submitted")
    with session_scope(factory) as s:
        store.transition(s, run_id=pp, to="RUNNING", reason="workers up")
        rows = [
            {"step": i, "loss": 5.0 / i, "tokens_per_s": 900.0, "step_time_s": t, "cross_group_bytes": 0}
            for i, t in ((1, 0.4), (2, 0.9), (3, 1.3))
        ]
        store.add_metrics(s, run_id=pp, attempt=1, rows=rows)
    with session_scope(factory) as s:
        store.transition(s, run_id=pp, to="SUCCEEDED", reason="finished")
        s.add(Sweep(id="sw-polish", name="polish", spec={}, status="RUNNING"))
        s.flush()
        store.get_run(s, run_id=trial).sweep_id = "sw-polish"
        store.transition(s, run_id=trial, to="CANCELLED", reason=EARLY)
    return {"pp": pp, "trial": trial}


def test_early_stopped_trial_preempted_chip_and_sizes(svc, runs, console) -> None:
    page, reqs = console(svc.url)
    page.goto(f"{svc.url}/")
    row = page.locator(f'tr[data-run-id="{runs["trial"]}"]')
    assert row.locator(".badge").inner_text().strip().lower() == "early-stopped"
    assert row.locator("[data-resume]").count() == 0
    dot = page.locator("label.chip.st-preempted i")
    colour = dot.evaluate("e => getComputedStyle(e).backgroundColor")
    assert colour not in ("rgba(0, 0, 0, 0)", "transparent", ""), colour
    sizes = page.evaluate("[1000 * 1024, 7487 * 1024, 512].map(meshrun.fmt.bytes)")
    assert sizes == ["1000 KiB", "7.31 MiB", "512 B"]  # as api.spec.units.format_bytes
    page.goto(f"{svc.url}/runs/{runs['trial']}")
    assert page.locator("#run-status .badge").inner_text().strip().lower() == "early-stopped"
    assert page.locator("[data-resume]").count() == 0
    page.shot("polish-trial")
    assert page.js_errors == [] and reqs.outside() == []


def test_pp_run_charts(svc, runs, console) -> None:
    page, _ = console(svc.url)
    page.goto(f"{svc.url}/runs/{runs['pp']}")
    page.wait_for_function("window.meshrunCharts && window.meshrunCharts.step_time_s")
    assert page.locator('[data-sync-chart="cross_group_bytes"]').is_hidden()  # a pp run has no such traffic
    ticks = page.evaluate("meshrunCharts.step_time_s.axes[1]._values.filter(v => v)")
    units = {t.split()[-1] for t in ticks}
    assert len(ticks) >= 2 and len(units) == 1, ticks  # never "0.00 ms" next to "1.00 s"
    page.shot("polish-pp")
    assert page.js_errors == []


def test_compare_collapsed_picker_has_an_arrow_and_a_summary(svc, runs, console) -> None:
    page, _ = console(svc.url)
    page.goto(f"{svc.url}/compare?run={runs['pp']}&run={runs['trial']}")
    picker = page.locator("details.picker")
    assert picker.get_attribute("open") is None  # two runs chosen: collapsed
    summary = picker.locator("summary")
    arrow = summary.evaluate("e => getComputedStyle(e, '::before').content")
    assert "▸" in arrow, arrow
    text = summary.inner_text()
    assert "2 chosen" in text and "polish-pp2" in text and "polish-trial" in text, text
    summary.click()
    assert "▾" in summary.evaluate("e => getComputedStyle(e, '::before').content")
    page.shot("polish-compare")
