"""The API at scale, through HTTP on SQLite and PostgreSQL: cursor pages of every list (runs, metrics, events,
checkpoints, sweeps), the downsampled metric series of a 100,000-row run, and the run summary kept on write."""

from __future__ import annotations

import math
import random

import pytest
from sqlalchemy import insert

from service import store
from service.store.models import Metric
from tests.api.test_runs import SPEC, _error, _submit


def _pages(client, url: str, params: dict | None = None, *, key: str = "items") -> list[list[dict]]:
    """Every page of a list endpoint, following next_cursor."""
    pages, cursor = [], None
    while True:
        body = client.get(url, params={**(params or {}), **({"cursor": cursor} if cursor else {})})
        assert body.status_code == 200, body.text
        data = body.json()
        pages.append(data[key])
        cursor = data.get("next_cursor")
        if not cursor:
            return pages


# ------------------------------------------------------------------------------------------------ metrics
def test_paging_metrics_yields_every_step_once_across_resumed_attempts(client):
    """Attempt 1 reaches step 250; attempt 2 resumes from the checkpoint of step 100 and reaches 180; attempt 3
    resumes from step 150. The series is 1-100 of attempt 1, 101-150 of attempt 2, 151-300 of attempt 3: the
    later attempts hide the abandoned steps, also the ones they have not replayed (181-250 of attempt 1)."""
    run = _submit(client)
    rid = run["id"]
    with client.app.state.session_factory.begin() as s:
        store.add_metrics(s, run_id=rid, attempt=1, rows=[{"step": i, "loss": 1000.0 + i} for i in range(1, 251)])
        store.add_metrics(s, run_id=rid, attempt=2, rows=[{"step": i, "loss": 2000.0 + i} for i in range(101, 181)])
        store.add_metrics(s, run_id=rid, attempt=3, rows=[{"step": i, "loss": 3000.0 + i} for i in range(151, 301)])
    pages = _pages(client, f"/v1/runs/{rid}/metrics", {"limit": 37})
    assert all(len(p) == 37 for p in pages[:-1]) and 0 < len(pages[-1]) <= 37
    rows = [r for p in pages for r in p]
    assert [r["step"] for r in rows] == list(range(1, 301))  # every step exactly once, in order
    expected_attempt = {
        **{i: 1 for i in range(1, 101)},
        **{i: 2 for i in range(101, 151)},
        **{i: 3 for i in range(151, 301)},
    }
    assert all(r["attempt"] == expected_attempt[r["step"]] for r in rows)
    assert all(r["loss"] == 1000.0 * r["attempt"] + r["step"] for r in rows)
    # the same as the store's continuous series in one call, and since_step still pages
    with client.app.state.session_factory() as s:
        assert [(m.step, m.attempt) for m in store.list_metrics(s, run_id=rid)] == [
            (r["step"], r["attempt"]) for r in rows
        ]
    assert [r["step"] for r in client.get(f"/v1/runs/{rid}/metrics", params={"since_step": 298}).json()["items"]] == [
        299,
        300,
    ]
    # one attempt's raw rows page too
    a1 = [r for p in _pages(client, f"/v1/runs/{rid}/metrics", {"attempt": 1, "limit": 100}) for r in p]
    assert [r["step"] for r in a1] == list(range(1, 251))
    # the summary follows the series: last step of attempt 3
    got = client.get(f"/v1/runs/{rid}").json()["summary"]
    assert got["steps_done"] == 300 and got["final_loss"] == 3300.0


def test_metrics_page_size_is_bounded_and_cursors_are_checked(client):
    rid = _submit(client)["id"]
    with client.app.state.session_factory.begin() as s:
        store.add_metrics(s, run_id=rid, attempt=1, rows=[{"step": i, "loss": 1.0} for i in range(1, 1501)])
    first = client.get(f"/v1/runs/{rid}/metrics").json()
    assert len(first["items"]) == 1000 and first["next_cursor"]  # a default page, not the whole history
    assert _error(client.get(f"/v1/runs/{rid}/metrics", params={"limit": 100_000}), 422)["param"] == "limit"
    for bad in ("nonsense", "eyJ4Ijox", first["next_cursor"][:-2] + "!!"):
        assert _error(client.get(f"/v1/runs/{rid}/metrics", params={"cursor": bad}), 422)["param"] == "cursor"
    runs_cursor = client.get("/v1/runs", params={"limit": 1}).json()
    other = _submit(client)
    runs_cursor = client.get("/v1/runs", params={"limit": 1}).json()["next_cursor"]
    assert other and runs_cursor
    err = _error(client.get(f"/v1/runs/{rid}/metrics", params={"cursor": runs_cursor}), 422)
    assert err["param"] == "cursor" and "next_cursor" in err["message"]
    err = _error(client.get(f"/v1/runs/{rid}/metrics", params={"cursor": first["next_cursor"], "attempt": 1}), 422)
    assert err["param"] == "cursor"


def test_downsampled_series_of_a_100000_row_run_keeps_min_and_max(client):
    rid = _submit(client)["id"]
    rng = random.Random(7)
    n = 100_000
    losses = [5.0 * math.exp(-i / 20_000) + rng.uniform(-0.05, 0.05) for i in range(1, n + 1)]
    losses[31_337] = 9.75  # a spike (the maximum) and a dip (the minimum) that a chart must show
    losses[77_777] = -1.25
    with client.app.state.session_factory.begin() as s:  # one executemany (add_metrics per batch is tested above)
        s.execute(
            insert(Metric),
            [
                {"run_id": rid, "attempt": 1, "step": i + 1, "loss": losses[i], "tokens_per_s": 1000.0 + (i % 7)}
                for i in range(n)
            ],
        )
        store.recompute_stats(s, run_id=rid)
    r = client.get(f"/v1/runs/{rid}/metrics", params={"points": 500})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["downsampled"] is True and body["series_rows"] == n and body["next_cursor"] is None
    items = body["items"]
    assert len(items) == 500
    steps = [m["step"] for m in items]
    assert steps == sorted(steps) and len(set(steps)) == 500
    got = [m["loss"] for m in items]
    assert min(got) == min(losses) == -1.25 and max(got) == max(losses) == 9.75
    # points over the whole run: the first and the last bucket are drawn
    assert steps[0] <= n // 250 and steps[-1] > n - n // 250
    # every point is a real row
    assert all(m["loss"] == losses[m["step"] - 1] for m in items)
    # another field keeps its own extremes
    tps = [
        m["tokens_per_s"]
        for m in client.get(f"/v1/runs/{rid}/metrics", params={"points": 100, "field": "tokens_per_s"}).json()["items"]
    ]
    assert len(tps) == 100 and min(tps) == 1000.0 and max(tps) == 1006.0
    # a series with fewer rows than points comes back whole
    small = _submit(client)["id"]
    with client.app.state.session_factory.begin() as s:
        store.add_metrics(s, run_id=small, attempt=1, rows=[{"step": i, "loss": 1.0 / i} for i in range(1, 8)])
    body = client.get(f"/v1/runs/{small}/metrics", params={"points": 500}).json()
    assert [m["step"] for m in body["items"]] == list(range(1, 8)) and body["series_rows"] == 7
    assert body["downsampled"] is False
    assert _error(client.get(f"/v1/runs/{small}/metrics", params={"points": 1}), 422)["param"] == "points"
    assert _error(client.get(f"/v1/runs/{small}/metrics", params={"points": 10, "field": "bogus"}), 422)


def test_downsampled_series_follows_resumed_attempts(client):
    rid = _submit(client)["id"]
    with client.app.state.session_factory.begin() as s:
        store.add_metrics(s, run_id=rid, attempt=1, rows=[{"step": i, "loss": 100.0} for i in range(1, 2001)])
        store.add_metrics(s, run_id=rid, attempt=2, rows=[{"step": i, "loss": 1.0} for i in range(1001, 3001)])
    items = client.get(f"/v1/runs/{rid}/metrics", params={"points": 200}).json()["items"]
    assert len(items) == 200
    assert all((m["attempt"], m["loss"]) == ((1, 100.0) if m["step"] <= 1000 else (2, 1.0)) for m in items)


# ------------------------------------------------------------------------------------------------ summary
def test_run_summary_is_kept_on_write_and_matches_the_rows(client):
    """After every write (appends, a re-sent step, a resume that hides steps, late rows of an old attempt) the
    maintained summary equals the one computed from the rows."""
    rid = _submit(client)["id"]
    rng = random.Random(3)

    def row(step: int, attempt: int) -> dict:
        return {
            "step": step,
            "loss": rng.uniform(0, 10),
            "tokens_per_s": rng.choice([None, rng.uniform(1, 99)]),
            "mfu": rng.uniform(0, 0.5),
            "peak_memory_bytes": rng.randrange(1, 10**9),
        }

    writes = [
        (1, range(1, 40)),
        (1, range(40, 61)),
        (1, range(55, 58)),  # append, append, re-send
        (2, range(30, 50)),
        (2, range(50, 90)),
        (1, range(61, 70)),  # resume (hides 30-60), late rows
        (3, range(95, 120)),
        (3, range(120, 121)),
    ]  # resume past the end (hides nothing)
    for attempt, steps in writes:
        with client.app.state.session_factory.begin() as s:
            store.add_metrics(s, run_id=rid, attempt=attempt, rows=[row(i, attempt) for i in steps])
        live = client.get(f"/v1/runs/{rid}").json()["summary"]
        with client.app.state.session_factory() as s:
            rows = store.list_metrics(s, run_id=rid)
        tps = [r.tokens_per_s for r in rows if r.tokens_per_s is not None]
        assert live["steps_done"] == rows[-1].step and live["final_loss"] == pytest.approx(rows[-1].loss)
        assert live["mean_tokens_per_s"] == pytest.approx(sum(tps) / len(tps))
        assert live["mean_mfu"] == pytest.approx(sum(r.mfu for r in rows) / len(rows))
        assert live["peak_memory_bytes"] == max(r.peak_memory_bytes for r in rows)
        listed = next(r for r in client.get("/v1/runs").json()["items"] if r["id"] == rid)
        assert listed["summary"] == live


# ---------------------------------------------------------------------------------------------- the lists
def test_runs_pages_by_cursor_newest_first(client):
    ids = [_submit(client, {**SPEC, "name": f"page-{i}"})["id"] for i in range(7)]
    pages = _pages(client, "/v1/runs", {"limit": 3})
    assert [len(p) for p in pages] == [3, 3, 1]
    assert [r["id"] for p in pages for r in p] == ids[::-1]
    named = _pages(client, "/v1/runs", {"limit": 1, "name": "page-3"})
    assert [r["id"] for p in named for r in p] == [ids[3]]
    first = client.get("/v1/runs", params={"limit": 3}).json()
    assert first["total"] == 7 and first["total_exact"] is True
    err = _error(client.get("/v1/runs", params={"cursor": first["next_cursor"], "offset": 3}), 422)
    assert err["param"] == "offset"
    assert [r["id"] for r in client.get("/v1/runs", params={"limit": 3, "offset": 3}).json()["items"]] == ids[::-1][
        3:6
    ]  # offset paging still works


def test_events_and_checkpoints_page(client, tmp_path):
    rid = _submit(client)["id"]
    before = client.get(f"/v1/runs/{rid}/events").json()["items"]
    with client.app.state.session_factory.begin() as s:
        for i in range(25):
            store.add_event(s, run_id=rid, kind="straggler" if i % 5 == 0 else "note", reason=f"event {i}")
        for step in range(10, 130, 10):
            (tmp_path / f"ck{step}").mkdir()  # the listing shows only checkpoints still on disk
            store.add_checkpoint(s, run_id=rid, attempt=1, step=step, path=str(tmp_path / f"ck{step}"))
    events = [e for p in _pages(client, f"/v1/runs/{rid}/events", {"limit": 4}) for e in p]
    assert events[: len(before)] == before and len(events) == len(before) + 25
    assert len({e["id"] for e in events}) == len(events)
    newest = [e for p in _pages(client, f"/v1/runs/{rid}/events", {"limit": 4, "order": "desc"}) for e in p]
    assert [e["id"] for e in newest] == [e["id"] for e in events][::-1]
    strag = [e for p in _pages(client, f"/v1/runs/{rid}/events", {"kind": "straggler", "limit": 2}) for e in p]
    assert [e["reason"] for e in strag] == [f"event {i}" for i in range(0, 25, 5)]
    cks = _pages(client, f"/v1/runs/{rid}/checkpoints", {"limit": 5})
    assert [len(p) for p in cks] == [5, 5, 2]
    assert [c["step"] for p in cks for c in p] == list(range(10, 130, 10))
