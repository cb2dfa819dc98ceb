"""The run spec's ``tracking`` section: experiment trackers the run's driver logs to (docs/tracking.md).

Each tracker's client is an optional extra (``pip install meshrun[tracking]``); the service refuses (422) a spec
naming a tracker whose client it cannot import. A field left unset takes the service-wide default
(``MESHRUN_TRACKING``), unless ``defaults: false``.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from api.spec._base import _Spec

TRACKER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._/-]{0,127}$")
# tracker -> the module its client provides (the service checks it with importlib.util.find_spec)
TRACKER_MODULES = {"mlflow": "mlflow", "tensorboard": "tensorboard", "wandb": "wandb"}
TRACKING_EXTRA = "pip install meshrun[tracking]"


def _name(v: str | None, what: str) -> str | None:
    if v is not None and not TRACKER_NAME_RE.fullmatch(v):
        raise ValueError(f"{what} must be 1-128 characters of letters, digits, space, '.', '_', '/' or '-'")
    return v


class MlflowTracking(_Spec):
    tracking_uri: str | None = Field(
        None,
        max_length=2048,
        description="MLflow tracking server (http(s)://host:port) or store; default: the service's default.",
    )
    experiment: str | None = Field(None, description="Experiment name (created if missing); default 'meshrun'.")

    @field_validator("experiment")
    @classmethod
    def _experiment(cls, v: str | None) -> str | None:
        return _name(v, "experiment")


class WandbTracking(_Spec):
    project: str | None = Field(None, description="W&B project; default 'meshrun'.")
    entity: str | None = Field(None, description="W&B entity (user or team); default: the API key's.")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="online (needs WANDB_API_KEY on the service), offline (files under the run's data dir)."
    )

    @field_validator("project", "entity")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        return _name(v, "project and entity")


class TrackingSpec(_Spec):
    """Where the run's driver logs the spec, plan, metrics, events, checkpoints and final state."""

    mlflow: MlflowTracking | None = Field(None, description="Log to MLflow; null = the service default (if any).")
    tensorboard: bool | None = Field(
        None, description="Write TensorBoard event files under the run's data dir; null = the service default."
    )
    wandb: WandbTracking | None = Field(None, description="Log to Weights & Biases; null = the service default.")
    defaults: bool = Field(True, description="Merge the service-wide defaults (MESHRUN_TRACKING) into unset fields.")


def merge_tracking(spec: TrackingSpec | None, defaults: TrackingSpec | None) -> TrackingSpec:
    """The trackers a run logs to: the spec's, each unset field (and sub-field) taken from ``defaults``."""
    own = spec or TrackingSpec()
    if defaults is None or not own.defaults:
        return own

    def sub(mine: _Spec | None, theirs: _Spec | None) -> _Spec | None:
        if mine is None or theirs is None:
            return mine if mine is not None else theirs
        merged = theirs.model_dump(exclude_none=True) | mine.model_dump(exclude_none=True)
        return type(mine).model_validate(merged)

    return TrackingSpec(
        mlflow=sub(own.mlflow, defaults.mlflow),
        tensorboard=own.tensorboard if own.tensorboard is not None else defaults.tensorboard,
        wandb=sub(own.wandb, defaults.wandb),
    )


def enabled_trackers(tracking: TrackingSpec) -> list[str]:
    """The trackers ``tracking`` turns on, in a fixed order."""
    out = []
    if tracking.mlflow is not None:
        out.append("mlflow")
    if tracking.tensorboard:
        out.append("tensorboard")
    if tracking.wandb is not None and tracking.wandb.mode != "disabled":
        out.append("wandb")
    return out
