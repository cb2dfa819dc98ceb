"""The console against the live service with real runs on the shared Ray cluster, in a real Chromium: the runs
table, a run's page and its loss chart, compare, the planner form, sweeps and cluster pages, the API docs offline,
the Ray job link through the service, cancel and resume (on a new layout) from the page, and no request leaving
the service's origin."""

from __future__ import annotations

import httpx
import pytest

from tests.ray.helpers import metrics, submit, tiny_spec, wait_for, wait_for_step

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def finished(live_service):
    """Two tiny runs that differ in layout and learning rate, both SUCCEEDED."""
    url = live_service.url
    a = submit(url, tiny_spec("console-a", steps=6))
    b = submit(url, tiny_spec("console-b", dp=2, steps=6, optimizer={"lr": 1e-3}))
    return [wait_for(url, r["id"], {"SUCCEEDED"}, timeout_s=300) for r in (a, b)]


def test_runs_table_run_page_and_loss_chart(live_service, finished, console):
    url = live_service.url
    a, b = finished
    page, reqs = console(url)

    page.goto(url + "/")
    row = page.locator(f"tr[data-run-id='{a['id']}']")
    row.wait_for()
    assert row.get_attribute("data-status") == "SUCCEEDED"
    assert "console-a" in row.inner_text() and "succeeded" in row.locator(".badge").inner_text().lower()
    assert "6/6" in row.inner_text()  # progress
    page.shot("runs")
    # filter by name: only the matching run stays
    page.fill("input[name=q]", "console-b")
    page.wait_for_function(f"!document.querySelector(\"tr[data-run-id='{a['id']}']\")")
    assert page.locator(f"tr[data-run-id='{b['id']}']").count() == 1
    page.fill("input[name=q]", "")

    # the run page draws its loss chart with every metric row
    rows = metrics(url, a["id"])
    assert len(rows) == 6
    page.goto(f"{url}/runs/{a['id']}")
    page.wait_for_function("window.meshrunCharts && window.meshrunCharts.loss")
    drawn = page.evaluate("[meshrunCharts.loss.data[0], meshrunCharts.loss.data[1]]")
    assert drawn[0] == [r["step"] for r in rows]
    assert drawn[1] == pytest.approx([r["loss"] for r in rows])
    for name in ("tokens_per_s", "step_time_s", "peak_memory_bytes"):
        assert page.evaluate(f"meshrunCharts.{name}.data[0].length") == len(rows), name
    text = page.inner_text("main")
    assert "Timeline" in text and "Succeeded" in text and "Checkpoints" in text
    assert "Not measured for this run" in text  # no breakdown / stragglers recorded for it
    page.wait_for_function("document.getElementById('logs').textContent !== 'Loading…'")
    page.shot("run")

    # the Ray job opens through the service (the dashboard's token is added by the service)
    # ... on an origin of its own (service.app.ray_origin)
    ray_url = live_service.ray_url
    link = page.get_attribute("#ray-job-link", "href")
    assert link == f"{ray_url}/ray/#/jobs/{a['ray_job_id']}"
    api_run = httpx.get(f"{url}/v1/runs/{a['id']}", timeout=30).json()
    assert api_run["dashboard_url"] == link
    assert reqs.outside() == [], reqs.outside()
    page.goto(link)
    page.wait_for_function(f"document.body.innerText.includes('{a['ray_job_id']}')", timeout=60_000)
    assert "Authentication" not in page.inner_text("body")
    page.shot("ray-job")
    jobs = page.evaluate("fetch('/ray/api/jobs/').then(r => r.json())")
    job = next(j for j in jobs if j.get("submission_id") == a["ray_job_id"])
    assert job["metadata"]["job_name"] == "console-a"  # the name Ray's job list shows
    # a script on the dashboard's origin can neither read the API nor act on it
    before = len(httpx.get(f"{url}/v1/runs", params={"limit": 200}, timeout=30).json()["items"])
    read = page.evaluate("u => fetch(u + '/v1/runs').then(r => 'read', e => 'blocked')", url)
    spec = tiny_spec("from-ray-page", steps=2)  # a valid spec: only the origin check can refuse it
    posted = page.evaluate("""([u, spec]) => fetch(u + '/v1/runs', {method: 'POST', credentials: 'include',
        mode: 'no-cors', headers: {'Content-Type': 'text/plain'}, body: JSON.stringify(spec)})
        .then(r => 'sent', e => 'blocked')""", [url, spec])
    assert read == "blocked" and posted in ("sent", "blocked")
    provoked = [v for v in page.csp_violations if v[0].startswith(ray_url)]  # the dashboard's CSP blocked both
    assert provoked and all(f"{url}/v1/runs" in text for _, text in provoked), provoked
    page.csp_violations[:] = [v for v in page.csp_violations if v not in provoked]
    after = httpx.get(f"{url}/v1/runs", params={"limit": 200}, timeout=30).json()["items"]
    assert len(after) == before and not any(r["name"] == "from-ray-page" for r in after)


def test_compare_shows_curves_and_the_fields_that_differ(live_service, finished, console):
    url = live_service.url
    a, b = finished
    page, reqs = console(url)
    page.goto(f"{url}/compare?run={a['id']}&run={b['id']}")
    page.wait_for_function("window.meshrunCharts && window.meshrunCharts.cmp_loss_step")
    diffs = {r.locator("td").nth(0).inner_text(): [c.inner_text() for c in r.locator("td").all()[1:]]
             for r in page.locator("#diff-table tbody tr").all()}
    assert diffs["layout.dp"] == ["1", "2"]
    assert diffs["optimizer.lr"] == ["0.003", "0.001"]
    assert diffs["name"] == ["console-a", "console-b"]
    assert "model.preset" not in diffs  # equal fields are not listed
    series = page.evaluate("meshrunCharts.cmp_loss_step.series.map(s => s.label)")
    assert series[1:] == ["console-a", "console-b"]
    page.shot("compare")
    assert reqs.outside() == []


def test_plan_form_returns_ranked_layouts(live_service, console):
    url = live_service.url
    page, reqs = console(url)
    page.goto(url + "/plan")
    page.select_option("select[name=preset]", "7b")
    page.select_option("select[name=device]", "H100")
    page.fill("input[name=gpus_per_node]", "8")
    page.fill("input[name=nodes]", "4")
    page.fill("input[name=global_batch_size]", "512")
    with page.expect_response("**/ui/plan"):
        page.click("#plan-submit")
    page.wait_for_selector("#plan-ranked tbody tr")
    ranked = page.locator("#plan-ranked tbody tr")
    assert ranked.count() == 10
    tps = [float(r.get_attribute("data-tps")) for r in ranked.all()]
    assert tps == sorted(tps, reverse=True) and tps[0] > 0
    assert "Rejected" in page.inner_text("#plan-results")
    head = page.inner_text("#plan-ranked h2")
    assert "attention flash" in head and "kernels megatron" in head and "factors: defaults" in head
    assert " – " in ranked.first.inner_text()  # the step time's interval under its bar
    page.shot("plan")

    # plan a one-device layout and submit the best one as a run on this service's (CPU) Ray cluster
    page.select_option("select[name=preset]", "tiny")
    page.select_option("select[name=device]", "L4")
    page.select_option("select[name=precision]", "fp32")
    page.fill("input[name=gpus_per_node]", "1")
    page.fill("input[name=nodes]", "1")
    page.fill("input[name=global_batch_size]", "4")
    with page.expect_response("**/ui/plan"):
        page.click("#plan-submit")
    page.wait_for_selector("#plan-ranked tbody tr[data-tps]")
    assert page.locator("#plan-ranked tbody tr").count() >= 1
    page.click("#plan-ranked tbody tr:first-child [data-submit-layout]")
    page.fill("#submit-form input[name=name]", "console-planned")
    page.fill("#submit-form input[name=steps]", "3")
    page.click("#submit-run")
    page.wait_for_url(f"{url}/runs/run-*")
    run_id = page.url.rsplit("/", 1)[1]
    done = wait_for(url, run_id, {"SUCCEEDED"}, timeout_s=300)
    assert done["name"] == "console-planned" and done["summary"]["steps_done"] == 3
    assert reqs.outside() == []


def test_cancel_and_resume_on_a_new_layout_from_the_page(live_service, console):
    url = live_service.url
    run = submit(url, tiny_spec("console-resume", steps=400, checkpoint={"every_steps": 2, "keep": 2}))
    wait_for_step(url, run["id"], 3, timeout_s=300)
    page, reqs = console(url)
    page.on("dialog", lambda d: d.accept())
    page.goto(f"{url}/runs/{run['id']}")
    page.click("button[data-cancel]")
    wait_for(url, run["id"], {"CANCELLED"}, timeout_s=120)
    page.reload()
    page.click("button[data-resume]")
    page.fill("#resume-form input[name=dp]", "2")
    # the click returns before the page's POST is answered: wait for it (a GET right after can still see CANCELLED)
    with page.expect_response(lambda r: r.url.endswith("/resume") and r.request.method == "POST") as answer:
        page.click("#resume-submit")
    assert answer.value.status == 200, answer.value.text()
    resumed = wait_for(url, run["id"], {"QUEUED", "STARTING", "RUNNING"}, timeout_s=60)
    assert resumed["spec"]["layout"]["dp"] == 2
    page.wait_for_selector("#run-live:not([data-status='CANCELLED'])")  # the page reloaded after the resume
    page.shot("run-resumed")
    httpx.post(f"{url}/v1/runs/{run['id']}/cancel", timeout=30)  # leave the cluster free
    wait_for(url, run["id"], {"CANCELLED"}, timeout_s=120)
    assert reqs.outside() == []


def test_sweeps_cluster_and_docs_pages_render_offline(live_service, finished, console, monkeypatch):
    from tests.sweeps.test_sweep_ray import sweep_body, wait_sweep

    url = live_service.url
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    # two trials run; tp=3 is skipped (it does not divide 4 heads) with its reason
    r = httpx.post(f"{url}/v1/sweeps", json=sweep_body("console-sweep", [{"dp": 1}, {"dp": 2}, {"tp": 3}], [2],
                                                       steps=4, warmup=1), timeout=60)
    assert r.status_code == 201, r.text
    sw = wait_sweep(url, r.json()["id"], timeout_s=400)
    page, reqs = console(url)
    page.goto(url + "/sweeps")
    assert page.inner_text("h1") == "Sweeps"
    assert page.locator(f"a[href='/sweeps/{sw['id']}']").count() == 1
    page.shot("sweeps")
    page.goto(f"{url}/sweeps/{sw['id']}")
    page.wait_for_function("window.meshrunCharts && window.meshrunCharts.sweep_scatter")
    measured = [t for t in sw["trials"] if t["measured_tokens_per_s"] is not None]
    assert page.evaluate("meshrunCharts.sweep_scatter.data[1].filter(v => v != null).length") == len(measured)
    text = page.inner_text("main")
    assert "does not divide" in text or "divide" in text  # the skipped trial's reason
    if sw["best_trial"]:
        assert "best" in page.inner_text("tr.best")
    page.shot("sweep")
    page.goto(url + "/cluster")
    page.wait_for_selector("table")
    assert "alive" in page.inner_text("main").lower() and "Queue" in page.inner_text("main")
    page.shot("cluster")
    page.goto(url + "/docs")
    page.wait_for_selector(".swagger-ui .info .title")
    assert "meshrun" in page.inner_text(".swagger-ui .info .title")
    page.shot("docs", full_page=False)
    page.goto(url + "/redoc")
    page.wait_for_selector("h1")
    assert "meshrun" in page.inner_text("h1")
    page.shot("redoc", full_page=False)
    page.emulate_media(color_scheme="dark")
    page.goto(f"{url}/runs/{finished[0]['id']}")
    page.wait_for_function("window.meshrunCharts && window.meshrunCharts.loss")
    page.shot("run-dark")
    assert reqs.outside() == [], reqs.outside()


def test_async_ps_run_page_draws_its_staleness_and_traffic(live_service, console):
    """An async_ps run (one worker slowed, so the other runs ahead): its page draws staleness (mean and max) and
    the cross-group bytes per step from its rows; replica divergence (local SGD / DiLoCo only) stays hidden."""
    url = live_service.url
    spec = tiny_spec("console-async-ps", dp=2, steps=6, layout={"sync": "async_ps", "max_staleness": 2},
                     faults={"slow_rank": {"rank": 1, "delay_s": 0.2}},
                     resources={"device": "cpu", "cpus_per_worker": 0.5})
    run = wait_for(url, submit(url, spec)["id"], {"SUCCEEDED"}, timeout_s=400)
    rows = metrics(url, run["id"])
    assert [r["step"] for r in rows] == list(range(1, 7))
    page, reqs = console(url)
    page.goto(f"{url}/runs/{run['id']}")
    page.wait_for_function("window.meshrunCharts && meshrunCharts.staleness && meshrunCharts.cross_group_bytes")
    assert page.evaluate("meshrunCharts.staleness.series.map(s => s.label)") == ["step", "mean", "max"]
    drawn = page.evaluate("meshrunCharts.staleness.data")
    assert drawn[0] == [r["step"] for r in rows]
    assert drawn[1] == pytest.approx([r["staleness_mean"] for r in rows])
    assert drawn[2] == [r["staleness_max"] for r in rows]
    assert page.evaluate("meshrunCharts.cross_group_bytes.data[1]") == [r["cross_group_bytes"] for r in rows]
    for name in ("staleness", "cross_group_bytes"):  # really drawn: a visible canvas with a size
        card = page.locator(f"[data-sync-chart='{name}']")
        assert card.is_visible() and card.locator("canvas").bounding_box()["width"] > 100, name
    assert "bound 2" in page.inner_text("[data-sync-chart='staleness']")
    assert page.locator("[data-sync-chart='replica_divergence']").is_hidden()
    assert "replica_divergence" not in page.evaluate("Object.keys(meshrunCharts)")
    page.shot("run-async-ps")
    assert reqs.outside() == [], reqs.outside()


def test_diloco_run_page_draws_replica_divergence(live_service, console):
    """A DiLoCo run (H = 2): its page draws the replicas' divergence before each sync and the cross-group bytes;
    staleness (async_ps only) stays hidden."""
    url = live_service.url
    spec = tiny_spec("console-diloco", dp=2, steps=4, layout={"sync": "diloco", "sync_every_steps": 2})
    run = wait_for(url, submit(url, spec)["id"], {"SUCCEEDED"}, timeout_s=400)
    rows = metrics(url, run["id"])
    divergence = [r["replica_divergence"] for r in rows]
    assert [d is not None for d in divergence] == [False, True, False, True]  # at each sync
    page, reqs = console(url)
    page.goto(f"{url}/runs/{run['id']}")
    page.wait_for_function("window.meshrunCharts && meshrunCharts.replica_divergence")
    drawn = page.evaluate("meshrunCharts.replica_divergence.data[1]")
    assert [d is None for d in drawn] == [d is None for d in divergence]
    assert [d for d in drawn if d is not None] == pytest.approx([d for d in divergence if d is not None])
    assert page.evaluate("meshrunCharts.cross_group_bytes.data[1]") == [r["cross_group_bytes"] for r in rows]
    for name in ("replica_divergence", "cross_group_bytes"):
        card = page.locator(f"[data-sync-chart='{name}']")
        assert card.is_visible() and card.locator("canvas").bounding_box()["width"] > 100, name
    assert "every 2 steps" in page.inner_text("[data-sync-chart='replica_divergence']")
    assert page.locator("[data-sync-chart='staleness']").is_hidden()
    page.shot("run-diloco")
    assert reqs.outside() == [], reqs.outside()
