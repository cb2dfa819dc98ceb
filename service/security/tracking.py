"""The run spec's ``tracking`` section, judged before a run is stored: every tracker it asks for has its client
installed here (checked with ``importlib.util.find_spec``, never imported: the service keeps starting without the
extra), and an MLflow store that is a local file or database is left to callers who may run code."""

from __future__ import annotations

import importlib.util
from urllib.parse import urlsplit

from api.spec import RunSpec
from api.spec.tracking import TRACKER_MODULES, TRACKING_EXTRA
from service.security.paths import PolicyViolation
from service.settings import Settings

REMOTE_SCHEMES = ("http", "https", "databricks")


def client_installed(tracker: str) -> bool:
    """Whether the tracker's client can be imported in this environment (the driver's, for a local cluster)."""
    try:
        return importlib.util.find_spec(TRACKER_MODULES[tracker]) is not None
    except (ImportError, ValueError):
        return False


def check_tracking(spec: RunSpec, *, settings: Settings, restricted: bool) -> None:
    """422 naming the field (``tracking.mlflow``, ...) when its client is missing or its store is not allowed."""
    t = spec.tracking
    if t is None:
        return
    asked = {
        "mlflow": t.mlflow is not None,
        "tensorboard": bool(t.tensorboard),
        "wandb": t.wandb is not None and t.wandb.mode != "disabled",
    }
    for tracker, on in asked.items():
        if on and not client_installed(tracker):
            raise PolicyViolation(
                422,
                "tracker_not_installed",
                f"tracking.{tracker}: the {tracker} client is not installed on the service; install the tracking "
                f"extra ({TRACKING_EXTRA}) where the service and its drivers run, or remove tracking.{tracker}",
                f"tracking.{tracker}",
            )
    uri = t.mlflow.tracking_uri if t.mlflow is not None else None
    if uri is not None:
        try:
            scheme = urlsplit(uri).scheme.lower()
        except ValueError as e:  # e.g. an unbalanced [ in the host
            raise PolicyViolation(
                422,
                "invalid_value",
                f"tracking.mlflow.tracking_uri: not a URL ({e}); give http(s)://host:port of an MLflow server",
                "tracking.mlflow.tracking_uri",
            ) from None
        if scheme not in REMOTE_SCHEMES and restricted:
            raise PolicyViolation(
                422,
                "invalid_path",
                "tracking.mlflow.tracking_uri: a local MLflow store (a path, file: or a database URL) needs a token "
                "that may run code; give the http(s):// URL of an MLflow tracking server",
                "tracking.mlflow.tracking_uri",
            )
        if scheme and scheme not in REMOTE_SCHEMES and scheme not in ("file", "sqlite", "postgresql", "mysql"):
            raise PolicyViolation(
                422,
                "invalid_value",
                f"tracking.mlflow.tracking_uri: scheme {scheme!r} is not supported; use http(s)://host:port of an "
                "MLflow tracking server",
                "tracking.mlflow.tracking_uri",
            )
    if settings.tracking is None and t.mlflow is not None and uri is None:
        raise PolicyViolation(
            422,
            "invalid_value",
            "tracking.mlflow.tracking_uri: no MLflow server given and the service has no default "
            "(MESHRUN_TRACKING); give tracking_uri: http://host:port",
            "tracking.mlflow.tracking_uri",
        )
