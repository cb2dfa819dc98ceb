"""One error base for the service (``service.errors.ServiceError``), mapped to HTTP by one handler of the app.

The bodies themselves are checked where each error is raised (tests/api); here: every error class the service
raises on purpose derives from the one base, the app registers one handler for all of them, and a route raising
any of them gets that handler's status, headers and body.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from service import errors
from service.app.errors import ApiError, install_error_handlers
from service.security.paths import PolicyViolation


def test_every_error_raised_on_purpose_derives_from_the_one_base() -> None:
    classes = [
        errors.NotFound,
        errors.Conflict,
        errors.Forbidden,
        errors.InvalidRequest,
        errors.Unavailable,
        ApiError,
        PolicyViolation,
    ]
    assert [c for c in classes if not issubclass(c, errors.ServiceError)] == []
    assert not hasattr(errors, "MeshrunError"), "the service's base must not share the SDK's error name"


def test_one_handler_maps_every_service_error_to_its_status_headers_and_body() -> None:
    app = FastAPI()
    install_error_handlers(app)
    handled = [c for c in app.exception_handlers if isinstance(c, type) and issubclass(c, errors.ServiceError)]
    assert handled == [errors.ServiceError]

    @app.get("/missing")
    def missing() -> None:
        raise errors.NotFound("no run 'x'; list runs with GET /v1/runs", param="run_id")

    @app.get("/limited")
    def limited() -> None:
        raise ApiError(429, "too many requests; retry after 3 s", headers={"Retry-After": "3"})

    @app.get("/refused")
    def refused() -> None:
        raise PolicyViolation(403, "forbidden", "this token may not run user code", "code.working_dir")

    with TestClient(app) as c:
        r = c.get("/missing")
        assert r.status_code == 404
        assert r.json() == {
            "error": {"code": "not_found", "message": "no run 'x'; list runs with GET /v1/runs", "param": "run_id"}
        }
        r = c.get("/limited")
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        assert r.json() == {
            "error": {"code": "rate_limited", "message": "too many requests; retry after 3 s", "param": None}
        }
        r = c.get("/refused")
        assert r.status_code == 403
        assert r.json()["error"] == {
            "code": "forbidden",
            "message": "this token may not run user code",
            "param": "code.working_dir",
        }
