"""The Ray dashboard proxy inside project walls (issue 34): two projects' tokens against a real Ray dashboard.

Two Ray jobs carry the project in their metadata like meshrun's own submissions (service.control.scheduler); each
prints a secret of its project into its driver log. In ``project`` mode a project's token sees its own job in the
list, its details, its logs and its driver log file, and gets 404 for the other project's and for the rest of the
dashboard's data; admins see everything. The default mode (``admins``) refuses non-admin tokens."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest

from service.security import tokens as auth
from tests.conftest import start_live_service, stop_live_service


@pytest.fixture(scope="module")
def walled(ray_cluster, tmp_path_factory):
    svc = start_live_service(ray_cluster=ray_cluster, data_dir=tmp_path_factory.mktemp("ray-walls"), auth="on",
                             ray_dashboard_proxy="project")
    try:
        yield svc
    finally:
        stop_live_service(svc)


def _token(svc, project: str, name: str, **kw) -> dict[str, str]:
    with svc.session_factory.begin() as s:
        return {"Authorization": f"Bearer {auth.create_token(s, project, name, **kw)}"}


def _job(svc, project: str) -> tuple[str, str]:
    sid = f"meshrun-walls-{project}-{secrets.token_hex(3)}-1"
    secret = f"secret-of-{project}-{secrets.token_hex(4)}"
    svc.runtime.jobs.submit(entrypoint=f"echo {secret}", submission_id=sid,
                            metadata={"run_id": sid, "project": project, "meshrun": "run"})
    return sid, secret


def _wait(svc, sid: str) -> None:
    deadline = time.monotonic() + 120
    while svc.runtime.jobs.state(sid).status not in ("SUCCEEDED", "FAILED", "STOPPED"):
        assert time.monotonic() < deadline, f"Ray job {sid} did not finish"
        time.sleep(1)


def test_ray_proxy_shows_each_project_only_its_own_jobs(walled):
    url = walled.url
    alpha, beta = _token(walled, "alpha", "ann"), _token(walled, "beta", "bob")
    admin = _token(walled, "ops", "root", admin=True)
    (a_sid, a_secret), (b_sid, b_secret) = _job(walled, "alpha"), _job(walled, "beta")
    _wait(walled, a_sid)
    _wait(walled, b_sid)

    def get(path: str, headers: dict[str, str], **params) -> httpx.Response:
        return httpx.get(f"{walled.ray_url}/ray/{path}", headers=headers, params=params, timeout=60)

    # the job list is filtered to the caller's project; admins see both
    listed = {j["submission_id"] for j in get("api/jobs/", alpha).json()}
    assert a_sid in listed and b_sid not in listed
    assert {j.get("metadata", {}).get("project") for j in get("api/jobs/", beta).json()} == {"beta"}
    assert {a_sid, b_sid} <= {j["submission_id"] for j in get("api/jobs/", admin).json()}

    # details and logs of one's own job; 404 for the other project's
    mine = get(f"api/jobs/{a_sid}", alpha)
    assert mine.status_code == 200 and mine.json()["metadata"]["project"] == "alpha"
    assert a_secret in get(f"api/jobs/{a_sid}/logs", alpha).text
    assert get(f"api/jobs/{b_sid}", alpha).status_code == 404
    theirs = get(f"api/jobs/{b_sid}/logs", alpha)
    assert theirs.status_code == 404 and b_secret not in theirs.text

    # driver log files by name (what the audit used), by submission id; other selectors are refused
    node = get(f"api/jobs/{b_sid}", admin).json()["driver_node_id"]
    assert b_secret in get("api/v0/logs/file", admin, node_id=node, filename=f"job-driver-{b_sid}.log").text
    for params in ({"node_id": node, "filename": f"job-driver-{b_sid}.log"}, {"submission_id": b_sid},
                   {"node_id": node, "filename": "raylet.out"}, {"node_id": node, "pid": "1"},
                   {"node_id": node, "filename": f"job-driver-{a_sid}.log", "submission_id": b_sid}):
        r = get("api/v0/logs/file", alpha, **params)
        assert r.status_code == 404 and b_secret not in r.text, params
    a_node = get(f"api/jobs/{a_sid}", alpha).json()["driver_node_id"]
    own = get("api/v0/logs/file", alpha, node_id=a_node, filename=f"job-driver-{a_sid}.log")
    assert own.status_code == 200 and a_secret in own.text

    # the dashboard's pages load; its other data (nodes, actors, tasks, log listings) is not the project's
    assert get("", alpha).status_code == 200
    for path in ("nodes?view=summary", "api/v0/tasks", "api/v0/actors", "api/v0/logs", "logical/actors",
                 "api/cluster_status", "static/../api/v0/tasks"):
        assert get(path, alpha).status_code == 404, path
        assert get(path.split("?")[0], admin).status_code != 403

    # the default mode: admins only
    walled.settings.ray_dashboard_proxy = "admins"
    try:
        assert get("api/jobs/", alpha).status_code == 403
        assert b_sid in {j["submission_id"] for j in get("api/jobs/", admin).json()}
    finally:
        walled.settings.ray_dashboard_proxy = "project"
    # no token: the sign-in page, never the dashboard
    signin = httpx.get(f"{walled.ray_url}/ray/api/jobs/", timeout=30, follow_redirects=False)
    assert signin.status_code == 303 and signin.headers["location"].startswith(f"{url}/signin?next=")
