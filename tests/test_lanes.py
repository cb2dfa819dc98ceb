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
