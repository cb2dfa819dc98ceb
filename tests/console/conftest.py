"""Browser fixtures: Debian's headless Chromium driven by Playwright, a recorder of every request a page makes, and
a folder of screenshots (``MESHRUN_CONSOLE_SHOTS``, else a temporary folder; its path is printed at the end).

Chromium comes from the system package (``apt-get install chromium``): ``playwright install`` downloads browsers,
which an air-gapped machine cannot. A missing Chromium fails the tests with that instruction (it is part of the
required suite, not an optional extra).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("MESHRUN_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/console/" in str(item.fspath):
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: install it with `apt-get install -y chromium` "
                    "(the README's test command does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="session")
def shots(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    d = Path(os.environ["MESHRUN_CONSOLE_SHOTS"]) if os.environ.get("MESHRUN_CONSOLE_SHOTS") else \
        tmp_path_factory.mktemp("console-shots")
    d.mkdir(parents=True, exist_ok=True)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    yield d
    if reporter is not None:
        reporter.write_line(f"console screenshots: {d}")


@dataclass
class Requests:
    """Every request the pages of one browser context made (URL, resource type)."""

    base: str
    seen: list[tuple[str, str]] = field(default_factory=list)

    def outside(self) -> list[str]:
        """Requests that left the service's origin (``blob:`` URLs of the page's own origin stay inside)."""
        ok = (self.base + "/", f"blob:{self.base}/", "data:")
        return [u for u, _ in self.seen if not u.startswith(ok) and u != self.base]


@pytest.fixture
def console(browser: Any, shots: Path) -> Iterator[Any]:
    """``console(base_url) -> (page, requests)``: a fresh browser context (no cookies) recording its requests.
    ``page.shot(name)`` saves a screenshot into ``shots``."""
    contexts = []

    def open_console(base: str, *, color_scheme: str = "light") -> tuple[Any, Requests]:
        ctx = browser.new_context(viewport={"width": 1400, "height": 900}, color_scheme=color_scheme)
        contexts.append(ctx)
        reqs = Requests(base=base.rstrip("/"))
        ctx.on("request", lambda r: reqs.seen.append((r.url, r.resource_type)))
        page = ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.js_errors = errors
        # the service's Content-Security-Policy must not block anything the console's own pages do
        page.on("console", lambda m: "Content Security Policy" in m.text and violations.append((page.url, m.text)))
        page.csp_violations = violations  # a test that provokes one on purpose takes it out again
        # a string predicate is eval'd in the page (which the CSP forbids): hand it over as a function instead
        wait = page.wait_for_function
        page.wait_for_function = lambda expr, **kw: wait(
            expr if expr.lstrip().startswith(("()", "function")) else f"() => ({expr})", **kw
        )

        def shot(name: str, *, full_page: bool = True) -> Path:
            path = shots / f"{name}.png"
            page.screenshot(path=str(path), full_page=full_page, animations="disabled", timeout=90_000)
            return path

        page.shot = shot
        page.set_default_timeout(60_000)
        return page, reqs

    violations: list[tuple[str, str]] = []
    yield open_console
    for ctx in contexts:
        ctx.close()
    assert violations == [], violations


# ------------------------------------------------------------------------------- a service without Ray
@dataclass
class PlainService:
    url: str
    app: Any
    server: Any
    thread: threading.Thread


def start_plain_service(data_dir: Path, **overrides: Any) -> PlainService:
    """The service on a free loopback port without the scheduler (runs stay QUEUED): for auth tests."""
    import uvicorn

    from service.app.server import create_app
    from service.cluster.head import free_port
    from service.settings import Settings

    port = free_port(None)
    settings = Settings(data_dir=data_dir, database_url=f"sqlite:///{data_dir / 'meshrun.db'}", host="127.0.0.1",
                        port=port, start_scheduler=False, rate_limit_per_minute=0, **overrides)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the service did not start")
        time.sleep(0.05)
    return PlainService(url=f"http://127.0.0.1:{port}", app=app, server=server, thread=thread)


def stop_plain_service(svc: PlainService) -> None:
    svc.server.should_exit = True
    svc.thread.join(timeout=30)
