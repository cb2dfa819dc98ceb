"""The Ray dashboard on an origin of its own (issue 34, Low: "the Ray dashboard shares the console's origin"):
``service.app.ray_origin``. One app serves two listeners; the port a request arrived on decides what it may reach.
The end-to-end checks on a real dashboard are in tests/ray/test_runs.py and, in Chromium, tests/console/test_pages.py.
"""

from __future__ import annotations

import socket

import pytest

from service.app.server import listen_sockets
from service.settings import Settings
from tests.api.test_security import SPEC, _error

RAY = "http://testserver:8001"  # the default: the service's port (8000) + 1


def test_ray_paths_on_the_service_port_redirect_to_the_dashboard_origin(client):
    r = client.get("/ray/api/jobs/?limit=3", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == f"{RAY}/ray/api/jobs/?limit=3"
    r = client.get("/ray", follow_redirects=False, headers={"Host": "localhost:8000"})
    assert r.status_code == 307 and r.headers["location"] == "http://localhost:8001/ray"


def test_the_dashboard_port_serves_only_the_dashboard(client):
    for path in ("/", "/v1/runs", "/runs/x", "/signin", "/openapi.json", "/docs", "/metrics"):
        err = _error(client.get(RAY + path, follow_redirects=False), 404)
        assert "only the Ray dashboard" in err["message"] and "8000" in err["message"], path
    assert _error(client.post(f"{RAY}/v1/runs", json=SPEC), 404)
    # /ray/ itself is the proxy (this app runs no Ray runtime: the dashboard page says so)
    r = client.get(f"{RAY}/ray/", follow_redirects=False)
    assert r.status_code == 503 and "no Ray runtime" in r.text


def test_a_page_on_the_dashboard_origin_cannot_act_on_the_api(client):
    r = client.post("/v1/runs", json=SPEC, headers={"Origin": RAY, "Host": "testserver:8000"})
    assert _error(r, 403)["code"] == "cross_origin"
    r = client.post("/v1/runs", json=SPEC, headers={"Origin": "http://localhost:8001", "Host": "localhost:8000"})
    assert _error(r, 403)["code"] == "cross_origin"
    # the console's own origin still may (the control)
    ok = client.post("/v1/runs", json=SPEC, headers={"Origin": "http://testserver:8000", "Host": "testserver:8000"})
    assert ok.status_code == 201, ok.text


def test_port_zero_keeps_one_origin(make_client):
    c = make_client(ray_proxy_port=0)
    r = c.get("/ray/", follow_redirects=False)
    assert r.status_code == 503 and "no Ray runtime" in r.text  # served here, not redirected
    ok = c.post("/v1/runs", json=SPEC, headers={"Origin": "http://testserver:8001", "Host": "testserver:8000"})
    assert ok.status_code == 201, ok.text


def test_the_proxy_port_must_differ_from_the_service_port():
    with pytest.raises(ValueError, match="MESHRUN_RAY_PROXY_PORT must differ from MESHRUN_PORT"):
        Settings(port=8100, ray_proxy_port=8100)


def _free(port: int) -> bool:
    with socket.socket() as k:
        try:
            k.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_listen_sockets_picks_a_free_dashboard_port_only_when_none_was_asked(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        # the service's port + 1 is taken: a free one is picked and recorded
        s = Settings(host="127.0.0.1", port=busy - 1, data_dir=tmp_path)
        if _free(busy - 1):
            socks = listen_sockets(s)
            try:
                assert s.ray_proxy_port not in (None, busy) and socks[1].getsockname()[1] == s.ray_proxy_port
            finally:
                for k in socks:
                    k.close()
        # asked for a taken port: an error naming the setting, and the service's socket is released
        s = Settings(host="127.0.0.1", port=free, ray_proxy_port=busy, data_dir=tmp_path)
        with pytest.raises(Exception, match="MESHRUN_RAY_PROXY_PORT.*or 0 to serve"):
            listen_sockets(s)
        with socket.socket() as again:
            again.bind(("127.0.0.1", free))
