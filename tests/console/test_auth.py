"""The console with tokens required, in a real Chromium: sign-in first, a session cookie that scripts cannot read,
a project sees only its own runs, actions need the session's CSRF token, and the token never appears in a URL."""

from __future__ import annotations

import httpx
import pytest

from tests.console.conftest import start_plain_service, stop_plain_service

SPEC = {"name": "alpha-run", "model": {"name": "gpt", "preset": "tiny"}, "layout": {"dp": 1},
        "batch": {"global_batch_size": 4, "micro_batch_size": 2}, "train": {"steps": 5},
        "resources": {"device": "cpu", "cpus_per_worker": 1}}


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    svc = start_plain_service(tmp_path_factory.mktemp("console-auth"), auth="on")
    from service.security.tokens import create_token
    from service.store.db import session_scope

    with session_scope(svc.app.state.session_factory) as s:
        tokens = {p: create_token(s, p, f"{p}-user") for p in ("alpha", "beta")}
    runs = {}
    for project, name in (("alpha", "alpha-run"), ("beta", "beta-secret-run")):
        r = httpx.post(f"{svc.url}/v1/runs", json={**SPEC, "name": name},
                       headers={"Authorization": f"Bearer {tokens[project]}"}, timeout=30)
        assert r.status_code == 201, r.text
        runs[project] = r.json()
    try:
        yield svc, tokens, runs
    finally:
        stop_plain_service(svc)


def test_sign_in_is_required_and_projects_see_only_their_runs(secured, console):
    svc, tokens, runs = secured
    page, reqs = console(svc.url)

    # not signed in: every page sends the browser to the sign-in form, which comes back afterwards
    page.goto(f"{svc.url}/runs/{runs['alpha']['id']}")
    assert page.url.startswith(f"{svc.url}/signin?next=")
    assert page.locator("input[name=token]").get_attribute("type") == "password"
    page.shot("signin")
    page.fill("input[name=token]", "msr_not-a-real-token")
    page.click("#signin-form button[type=submit]")
    assert "not valid" in page.inner_text("#signin-error")

    page.fill("input[name=token]", tokens["alpha"])
    page.click("#signin-form button[type=submit]")
    page.wait_for_url(f"{svc.url}/runs/{runs['alpha']['id']}")
    assert page.inner_text("h1").startswith("alpha-run")

    # the session cookie: HttpOnly, SameSite=Lax, invisible to scripts; the token is in no URL
    cookies = {c["name"]: c for c in page.context.cookies()}
    session = cookies["meshrun_session"]
    assert session["httpOnly"] and session["sameSite"] == "Lax" and session["value"] != tokens["alpha"]
    assert "meshrun_session" not in page.evaluate("document.cookie")
    assert not [u for u, _ in reqs.seen if tokens["alpha"] in u or tokens["alpha"][4:20] in u]

    # the runs table lists alpha's run, never beta's
    page.goto(svc.url + "/")
    page.wait_for_selector(f"tr[data-run-id='{runs['alpha']['id']}']")
    assert page.locator(f"tr[data-run-id='{runs['beta']['id']}']").count() == 0
    assert "beta-secret-run" not in page.content()
    assert page.inner_text(".who").startswith("alpha")
    page.shot("runs-signed-in")
    # nor its page, nor through the API with the cookie
    page.goto(f"{svc.url}/runs/{runs['beta']['id']}")
    assert "There is no run" in page.inner_text("main")
    listed = page.evaluate("fetch('/v1/runs', {credentials: 'same-origin'}).then(r => r.json())")
    assert [r["id"] for r in listed["items"]] == [runs["alpha"]["id"]]
    status = page.evaluate(f"fetch('/v1/runs/{runs['beta']['id']}').then(r => r.status)")
    assert status == 404

    # an unsafe request with the cookie but without the page's CSRF token is refused
    page.goto(svc.url + "/")
    refused = page.evaluate(f"fetch('/v1/runs/{runs['alpha']['id']}/cancel', {{method: 'POST'}})"
                            ".then(async r => [r.status, (await r.json()).error.code])")
    assert refused == [403, "csrf_failed"]
    # the page's own cancel button sends it
    page.on("dialog", lambda d: d.accept())
    page.click(f"tr[data-run-id='{runs['alpha']['id']}'] [data-cancel]")
    page.wait_for_selector(f"tr[data-run-id='{runs['alpha']['id']}'] .badge.st-cancelled")
    got = httpx.get(f"{svc.url}/v1/runs/{runs['alpha']['id']}",
                    headers={"Authorization": f"Bearer {tokens['alpha']}"}).json()
    assert got["status"] == "CANCELLED"

    # signing out ends the session
    page.click("form[action='/signout'] button")
    page.wait_for_url(f"{svc.url}/signin*")
    page.goto(svc.url + "/")
    assert page.url.startswith(f"{svc.url}/signin")
    assert reqs.outside() == [], reqs.outside()
    assert page.js_errors == []
