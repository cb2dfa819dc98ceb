"""The console's HTTP side on SQLite and PostgreSQL: sign-in sessions (cookie, CSRF, revocation, expiry), the
same-origin rule for unsafe requests, offline docs, and pages scoped like the API. The browser itself is tested
in tests/console."""

from __future__ import annotations

import re
from datetime import timedelta

from sqlalchemy import update

from service.security import tokens as auth
from service.security.sessions import SESSION_COOKIE
from service.store.models import ConsoleSession, utcnow
from tests.api.test_security import SPEC, _error

FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def _secret(client, project: str, name: str, **kw) -> str:
    with client.app.state.session_factory.begin() as s:
        return auth.create_token(s, project, name, **kw)


def _sign_in(client, secret: str):
    return client.post("/signin", content=f"token={secret}&next=%2F", headers=FORM, follow_redirects=False)


def _csrf(client) -> str:
    page = client.get("/")
    assert page.status_code == 200, page.text
    return re.search(r'<meta name="csrf-token" content="([^"]+)"', page.text).group(1)


def test_sign_in_opens_a_cookie_session_that_works_like_the_token(make_client):
    c = make_client(auth="on")
    alpha, beta = _secret(c, "alpha", "ann"), _secret(c, "beta", "bob")
    mine = c.post("/v1/runs", json={**SPEC, "name": "mine"}, headers={"Authorization": f"Bearer {alpha}"}).json()
    theirs = c.post("/v1/runs", json={**SPEC, "name": "theirs"}, headers={"Authorization": f"Bearer {beta}"}).json()

    # pages send a stranger to the sign-in form; the API answers 401
    r = c.get(f"/runs/{mine['id']}", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == f"/signin?next=%2Fruns%2F{mine['id']}"
    _error(c.get("/v1/runs"), 401)
    bad = _sign_in(c, "msr_wrong")
    assert bad.status_code == 401 and "not valid" in bad.text and SESSION_COOKIE not in bad.cookies

    ok = _sign_in(c, alpha)
    assert ok.status_code == 303 and ok.headers["location"] == "/"
    cookie = ok.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=lax" in cookie and alpha not in cookie
    # the cookie authenticates pages and the API, scoped to the project
    assert [r["id"] for r in c.get("/v1/runs").json()["items"]] == [mine["id"]]
    _error(c.get(f"/v1/runs/{theirs['id']}"), 404)
    assert "theirs" not in c.get("/").text and "mine" in c.get("/").text
    assert c.get(f"/runs/{theirs['id']}").status_code == 404
    # unsafe requests with the cookie need the page's CSRF token
    err = _error(c.post(f"/v1/runs/{mine['id']}/cancel"), 403)
    assert err["code"] == "csrf_failed" and "X-CSRF-Token" in err["message"]
    _error(c.post(f"/v1/runs/{mine['id']}/cancel", headers={"X-CSRF-Token": "forged"}), 403)
    done = c.post(f"/v1/runs/{mine['id']}/cancel", headers={"X-CSRF-Token": _csrf(c)})
    assert done.status_code == 200 and done.json()["status"] == "CANCELLED"
    # a Bearer header still wins over the cookie (scripts in a signed-in browser session)
    assert [r["id"] for r in c.get("/v1/runs", headers={"Authorization": f"Bearer {beta}"}).json()["items"]] == [
        theirs["id"]]

    # revoking the token ends its sessions; so does expiry; signing out deletes it
    with c.app.state.session_factory.begin() as s:
        auth.revoke_token(s, name="ann", project="alpha")
    _error(c.get("/v1/runs"), 401)
    c.cookies.clear()
    assert _sign_in(c, beta).status_code == 303
    assert c.get("/v1/runs").status_code == 200
    with c.app.state.session_factory.begin() as s:
        s.execute(update(ConsoleSession).values(expires_at=utcnow() - timedelta(seconds=1)))
    _error(c.get("/v1/runs"), 401)
    assert _sign_in(c, beta).status_code == 303
    out = c.post("/signout", follow_redirects=False)
    assert out.status_code == 303 and out.headers["location"] == "/signin"
    c.cookies.clear()
    _error(c.get("/v1/runs"), 401)


def test_sign_in_redirects_only_to_local_paths(make_client):
    c = make_client(auth="on")
    secret = _secret(c, "alpha", "ann")
    for target, expected in (("%2Fcompare", "/compare"), ("https%3A%2F%2Fevil.example%2F", "/"),
                             ("%2F%2Fevil.example", "/"), ("%2F%5Cevil.example", "/")):
        r = c.post("/signin", content=f"token={secret}&next={target}", headers=FORM, follow_redirects=False)
        assert r.headers["location"] == expected


def test_cross_site_unsafe_requests_are_refused(client, make_client):
    run = client.post("/v1/runs", json=SPEC).json()
    err = _error(client.post(f"/v1/runs/{run['id']}/cancel", headers={"Origin": "https://evil.example"}), 403)
    assert err["code"] == "cross_origin"
    _error(client.post("/v1/runs", json=SPEC, headers={"Origin": "null"}), 403)
    # the same origin (the console's own scripts) and no Origin (programs) pass
    assert client.post(f"/v1/runs/{run['id']}/cancel", headers={"Origin": "http://testserver"}).status_code == 200
    # behind a reverse proxy that forwards the public host: only once that host is one of the service's names
    proxied = {"Origin": "https://meshrun.example", "X-Forwarded-Host": "meshrun.example"}
    assert _error(client.post("/v1/runs", json=SPEC, headers=proxied), 403)["code"] == "cross_origin"
    named = make_client(public_url="https://meshrun.example")
    assert named.post("/v1/runs", json=SPEC, headers=proxied).status_code == 201
    # with auth off another site's page is not the local user even for reads (tests/api/test_hosts.py)
    assert _error(client.get("/v1/runs", headers={"Origin": "https://evil.example"}), 403)["code"] == "cross_origin"


def test_docs_and_pages_load_only_local_assets(client):
    for path in ("/docs", "/redoc", "/", "/plan", "/compare", "/sweeps", "/cluster"):
        r = client.get(path)
        assert r.status_code == 200, (path, r.text[:300])
        refs = re.findall(r'(?:src|href)="([^"]+)"', r.text)
        assert refs and all(not u.startswith(("http:", "https:", "//")) for u in refs), (path, refs)
        for u in refs:
            if u.startswith("/static/"):
                assert client.get(u).status_code == 200, u
    assert "validatorUrl" in client.get("/docs").text  # Swagger UI never calls the public validator
    assert "fonts.googleapis" not in client.get("/redoc").text


def test_plan_form_answers_with_ranked_layouts_and_errors(client):
    form = "preset=13b&device=A100-80GB&gpus_per_node=8&nodes=2&global_batch_size=256&precision=bf16&top_k=5"
    r = client.post("/ui/plan", content=form, headers=FORM)
    assert r.status_code == 200 and r.text.count("data-submit-layout") == 5
    tps = [float(x) for x in re.findall(r'data-tps="([0-9.e+]+)"', r.text)]
    assert tps == sorted(tps, reverse=True)
    bad = client.post("/ui/plan", content="preset=nope&device=H100&gpus_per_node=8&nodes=1&global_batch_size=8",
                      headers=FORM)
    assert bad.status_code == 200 and "cannot answer" in bad.text and "nope" in bad.text


def test_plan_form_shows_cost_per_candidate_and_ranks_by_cost(client):
    form = "preset=125m&device=H100&gpus_per_node=8&nodes=1&global_batch_size=64&top_k=3&price=2"
    r = client.post("/ui/plan", content=form, headers=FORM)
    assert r.status_code == 200 and "Cost / 1B tokens" in r.text
    cells = re.findall(r"<td class=\"num mono\" data-cost>(.*?)</td>", r.text, re.S)
    assert len(cells) == 3 and all("8 × $2.00/h" in c for c in cells)
    cheap = client.post("/ui/plan", content=form + "&rank_by=cost", headers=FORM)
    assert cheap.status_code == 200 and "cheapest layouts" in cheap.text
    assert "8 × $2.00/h" not in cheap.text.split("data-cost>", 2)[1].split("</td>", 1)[0]  # fewer GPUs first
    bad = client.post("/ui/plan", content=form.replace("price=2", "price=-1"), headers=FORM)
    assert "cannot answer" in bad.text and "price_per_device_hour" in bad.text
