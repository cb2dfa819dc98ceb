"""The suite's xdist groups (``python -m pytest -n 2 --dist loadgroup``, tests/conftest.py): every test of the shared
Ray cluster or service on one worker, every other module its own group."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import RAY_GROUP, xdist_group


def _item(*fixtures: str, nodeid: str = "tests/x/test_a.py::test_b[1]") -> SimpleNamespace:
    return SimpleNamespace(fixturenames=list(fixtures), nodeid=nodeid)


def test_the_shared_cluster_and_service_are_one_group_and_the_rest_go_by_module() -> None:
    assert xdist_group(_item("live_service", "tmp_path")) == RAY_GROUP
    assert xdist_group(_item("ray_service_url")) == RAY_GROUP
    assert xdist_group(_item("ray_session", "ray_cluster")) == RAY_GROUP  # a Ray driver on the shared cluster
    assert xdist_group(_item("tmp_path")) == "tests/x/test_a.py"


NESTED_CONFTEST = '''
import pytest
from tests.conftest import _EarlyTeardown, _XdistGroups

LOG = []

def pytest_configure(config):
    config.pluginmanager.register(_XdistGroups(), "groups")
    config.pluginmanager.register(_EarlyTeardown(), "early")

def _fixture(name):
    def f():
        print(f"\\nup {name}", flush=True)
        yield name
        print(f"\\ndown {name}", flush=True)
    return f

ray_cluster = pytest.fixture(scope="session", name="ray_cluster")(_fixture("ray_cluster"))

@pytest.fixture(scope="session")
def live_service(ray_cluster):
    print("\\nup live_service", flush=True)
    yield "svc"
    print("\\ndown live_service", flush=True)

@pytest.fixture(scope="session")
def ray_service_url(request):
    return request.getfixturevalue("live_service")

browser = pytest.fixture(scope="session", name="browser")(_fixture("browser"))
'''

NESTED_TESTS = '''
def test_a_page(browser):
    print("\\nrun test_a_page", flush=True)

def test_b_ray(live_service):
    print("\\nrun test_b_ray", flush=True)

def test_c_page(browser):
    print("\\nrun test_c_page", flush=True)

def test_d_sdk(ray_service_url):
    print("\\nrun test_d_sdk", flush=True)

def test_e_plain():
    print("\\nrun test_e_plain", flush=True)
'''


def test_a_serial_run_puts_the_shared_cluster_first_and_tears_each_session_fixture_down_after_its_last_test(
        tmp_path) -> None:
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    (tmp_path / "conftest.py").write_text(NESTED_CONFTEST)
    (tmp_path / "test_nested.py").write_text(NESTED_TESTS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "--rootdir", str(tmp_path), str(tmp_path)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(("up ", "down ", "run "))]
    assert lines == [
        # the shared cluster's tests first (ray_service_url takes live_service at run time: still one of them)
        "up ray_cluster", "up live_service", "run test_b_ray", "run test_d_sdk",
        "down live_service", "down ray_cluster",  # right after the last of them, its dependent first
        "up browser", "run test_a_page", "run test_c_page", "down browser",
        "run test_e_plain",
    ], lines


EXIT_PROBE = '''
import atexit
import ctypes
import sys
import threading

from tests import conftest

named = threading.Event()

def ray_like(name):
    ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: the thread's name in /proc, as Ray's C++ sets it
    named.set()
    threading.Event().wait()

conftest._session["exitstatus"] = 3  # the session's (pytest_sessionfinish)
if sys.argv[1] == "ray":
    threading.Thread(target=ray_like, args=("gcs_client_io_s",), daemon=True).start()
    named.wait(30)
atexit.register(conftest._at_exit)
sys.exit(0)
'''


def test_the_last_exit_handler_ends_a_process_with_ray_s_threads_with_the_session_s_status() -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    def run(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", EXIT_PROBE, mode], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)

    with_ray = run("ray")
    assert with_ray.returncode == 3, with_ray.stderr  # the session's status, not the interpreter's 0
    assert "native threads: " in with_ray.stderr and "gcs_client_io_s" in with_ray.stderr
    assert "exiting with status 3 without the interpreter's teardown" in with_ray.stderr
    without = run("plain")
    assert without.returncode == 0, without.stderr  # no Ray thread: the interpreter's own exit
    assert "without the interpreter's teardown" not in without.stderr


# ------------------------------------------------------------------------------------------- background checks
import os  # noqa: E402
import sys  # noqa: E402

from tests import background  # noqa: E402


def test_a_background_check_starts_at_the_lowest_priority_and_its_test_gets_its_result(monkeypatch) -> None:
    probe = "import os, sys; print(os.nice(0)); sys.stderr.write('to stderr'); sys.exit(3)"
    monkeypatch.setitem(background.COMMANDS, "probe", background.Command((sys.executable, "-c", probe), "tests/x.py::y"))
    other = SimpleNamespace(items=[SimpleNamespace(nodeid="tests/x.py::z")])
    background.BackgroundChecks().pytest_collection_finish(other)  # type: ignore[arg-type]
    assert "probe" not in background._started  # its test is not in the session
    session = SimpleNamespace(items=[*other.items, SimpleNamespace(nodeid="tests/x.py::y")])
    background.BackgroundChecks().pytest_collection_finish(session)  # type: ignore[arg-type]
    assert "probe" in background._started
    r = background.result("probe")
    assert (r.returncode, r.stdout.strip(), r.stderr) == (3, "19", "to stderr")  # nice 19: the lowest priority
    # collected once; asked again (or never started: xdist, the test alone) the test runs it itself, at its priority
    r = background.result("probe")
    assert (r.returncode, r.stdout.strip()) == (3, str(os.nice(0)))
