"""The suite's xdist groups (``python -m pytest -n 2 --dist loadgroup``, tests/conftest.py): every test of the shared
Ray service on one worker, the Ray-driver tests in a group of their own, every other module its own group."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import RAY_DRIVER_GROUP, RAY_GROUP, xdist_group


def _item(*fixtures: str, nodeid: str = "tests/x/test_a.py::test_b[1]") -> SimpleNamespace:
    return SimpleNamespace(fixturenames=list(fixtures), nodeid=nodeid)


def test_the_shared_service_and_cluster_are_one_group() -> None:
    assert xdist_group(_item("live_service", "tmp_path")) == RAY_GROUP
    assert xdist_group(_item("ray_service_url")) == RAY_GROUP
    assert xdist_group(_item("ray_cluster")) == RAY_GROUP
    assert xdist_group(_item("ray_session", "ray_cluster", "live_service")) == RAY_GROUP  # a service: the shared one


def test_ray_driver_tests_are_their_own_group_and_the_rest_go_by_module() -> None:
    assert xdist_group(_item("ray_session", "ray_cluster")) == RAY_DRIVER_GROUP
    assert xdist_group(_item("tmp_path")) == "tests/x/test_a.py"
