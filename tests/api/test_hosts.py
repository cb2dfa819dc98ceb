"""DNS rebinding and browser contexts (issue 34): the Host allow-list, origins compared with it, the local user
never being another site's page, code rights of the local user, and the security headers of every response."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from service.store.models import Run
from tests.api.test_security import SPEC, _error


def _payload(marker) -> dict:
    """A spec whose custom data entrypoint runs a shell command (it would create ``marker``)."""
    return {**SPEC, "name": "rebind", "data": {"source": "custom", "entrypoint": "os:system",
                                              "args": {"command": f"touch {marker}"}}}


def _runs(client) -> int:
    with client.app.state.session_factory() as s:
        return s.scalar(select(func.count()).select_from(Run))


REBIND = {"Host": "attacker.example:8000", "Origin": "http://attacker.example:8000"}


def test_dns_rebinding_request_is_refused_before_routing(client, tmp_path):
    marker = tmp_path / "pwned"
    r = client.post("/v1/runs", json=_payload(marker), headers=REBIND)
    err = _error(r, 400)
    assert err["code"] == "host_not_allowed" and err["param"] == "Host"
    assert "MESHRUN_ALLOWED_HOSTS" in err["message"] and "attacker.example" in err["message"]
    assert _runs(client) == 0
    assert not marker.exists()
    # the console, /ray/, the docs, health and reads are refused the same way; without Origin too
    for path in ("/v1/runs", "/", "/ray/", "/ray/api/jobs/", "/docs", "/openapi.json", "/healthz", "/metrics"):
        assert _error(client.get(path, headers={"Host": "attacker.example"}), 400)["code"] == "host_not_allowed"
    assert _error(client.post("/v1/runs", json=_payload(marker), headers={"Host": "attacker.example"}), 400)
    assert _runs(client) == 0 and not marker.exists()


def test_the_same_request_from_an_allowed_name_is_accepted(client, tmp_path):
    """The control: the payload is a real one (the run is stored, and its data entrypoint, once a worker loads
    it, runs the command)."""
    from api.spec import RunSpec
    from workers.data import make_source

    marker = tmp_path / "ran"
    for host in ("127.0.0.1:8000", "localhost", "[::1]:8000", "testserver"):
        r = client.post("/v1/runs", json=_payload(marker), headers={"Host": host, "Origin": f"http://{host}"})
        assert r.status_code == 201, (host, r.text)
    assert _runs(client) == 4
    spec = RunSpec.model_validate(_payload(marker))
    with pytest.raises(Exception, match="not a map-style dataset"):  # os.system returns an int
        make_source(spec.data, seq_len=8, vocab_size=16, seed=0)
    assert marker.exists()


def test_allowed_hosts_setting_public_url_and_ip_literals(make_client):
    c = make_client(allowed_hosts="meshrun.internal, ops.example:8443", public_url="https://meshrun.example/")
    for host in ("meshrun.internal", "MESHRUN.internal:8000", "ops.example", "meshrun.example", "10.1.2.3:8000",
                 "[fe80::1]:8000", "localhost:1234"):
        assert c.get("/v1/runs", headers={"Host": host}).status_code == 200, host
    for host in ("evil.example", "meshrun.internal.evil.example", "localhost.evil.example", "sub.meshrun.example"):
        _error(c.get("/v1/runs", headers={"Host": host}), 400)
    everyone = make_client(allowed_hosts="*")
    assert everyone.get("/v1/runs", headers={"Host": "anything.example"}).status_code == 200


def test_origin_is_compared_with_the_allow_list_not_with_host(make_client):
    c = make_client(allowed_hosts="meshrun.internal")
    # a page of another site is refused even when the request addresses an allowed name
    for origin in ("http://attacker.example:8000", "https://evil.example", "null", "http://203.0.113.5"):
        r = c.post("/v1/runs", json=SPEC, headers={"Host": "meshrun.internal", "Origin": origin})
        assert _error(r, 403)["code"] == "cross_origin", origin
    # the service's own origins pass: a listed name, loopback, the very IP address the console was opened at
    for host, origin in (("meshrun.internal", "http://meshrun.internal"), ("127.0.0.1:8000", "http://127.0.0.1:8000"),
                         ("10.0.0.5:8000", "http://10.0.0.5:8000")):
        assert c.post("/v1/runs", json=SPEC, headers={"Host": host, "Origin": origin}).status_code == 201, origin
    # an IP-literal origin other than the one addressed is another site
    r = c.post("/v1/runs", json=SPEC, headers={"Host": "10.0.0.5:8000", "Origin": "http://10.0.0.6:8000"})
    assert _error(r, 403)["code"] == "cross_origin"


# ------------------------------------------------------------------------------------------- local user
def test_browser_context_of_another_site_is_never_the_local_user(client):
    """Auth off on loopback: reads from another site's page (no CORS needed to send them) are refused too."""
    r = client.get("/v1/runs", headers={"Origin": "https://evil.example"})
    assert _error(r, 403)["code"] == "cross_origin"
    _error(client.get("/v1/runs", headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"}), 403)
    _error(client.get("/", headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}), 403)
    # a top-level link from another site opens the console page (a navigation, read-only)
    nav = client.get("/", headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"})
    assert nav.status_code == 200
    # same-site / same-origin browser requests and programs are the local user
    own = {"Sec-Fetch-Site": "same-origin", "Origin": "http://testserver"}
    assert client.get("/v1/runs", headers=own).status_code == 200
    assert client.get("/v1/runs").status_code == 200


def test_local_code_rights_are_a_setting(make_client, tmp_path):
    custom = {**SPEC, "data": {"source": "custom", "entrypoint": "mypkg.data:build"}}
    assert make_client().post("/v1/runs", json=custom).status_code == 201  # default: the local user may
    c = make_client(local_code_rights=False)
    err = _error(c.post("/v1/runs", json=custom), 403)
    assert err["param"] == "data.entrypoint" and "run user code" in err["message"]
    model = {**SPEC, "model": {"name": "custom", "entrypoint": "mypkg.model:build"}}
    assert _error(c.post("/v1/runs", json=model), 403)["param"] == "model.entrypoint"
    assert c.post("/v1/runs", json=SPEC).status_code == 201  # built-in model and data are fine


# -------------------------------------------------------------------------------------------- headers
def test_security_headers_on_every_response(client):
    pages = ["/", "/plan", "/compare", "/sweeps", "/cluster", "/v1/runs", "/healthz", "/openapi.json",
             "/static/console/console.js", "/v1/runs/run-nope", "/docs", "/redoc"]
    for path in pages:
        r = client.get(path)
        assert r.headers["X-Frame-Options"] == "DENY", path
        assert r.headers["X-Content-Type-Options"] == "nosniff", path
        assert r.headers["Referrer-Policy"] == "same-origin", path
        csp = r.headers["Content-Security-Policy"]
        assert "frame-ancestors 'none'" in csp and "object-src 'none'" in csp, path
        script_src = csp.split("script-src", 1)[1].split(";", 1)[0]
        assert "'unsafe-inline'" not in script_src and "'unsafe-eval'" not in script_src, (path, csp)
    # refusals carry them too
    r = client.get("/", headers={"Host": "attacker.example"})
    assert r.status_code == 400 and r.headers["X-Frame-Options"] == "DENY"
    # the console's page scripts are allowed by hash, not by 'unsafe-inline'
    home = client.get("/").headers["Content-Security-Policy"]
    assert "'sha256-" in home and "style-src 'self';" in home


def test_inline_scripts_of_the_pages_match_the_policy(client):
    """Every inline script a console page sends is allowed by the CSP of that response."""
    import re

    from service.app.middleware import inline_script_hashes

    for path in ("/", "/plan", "/compare", "/sweeps", "/cluster", "/docs", "/redoc"):
        r = client.get(path)
        csp = r.headers["Content-Security-Policy"]
        for h in inline_script_hashes(r.text):
            assert h in csp, (path, h)
        assert not re.search(r"<script>[^<]*\{\{", r.text)
