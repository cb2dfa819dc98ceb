"""meshrun Python SDK. Imports only httpx and pydantic (pyyaml for YAML specs, rich for progress, pandas
for DataFrames, each lazily): never torch or ray."""

from api.spec import (
    CheckpointPublic,
    ClusterPublic,
    EventPublic,
    Layout,
    MetricRow,
    PlanRequest,
    PlanResponse,
    RunPublic,
    RunSpec,
    RunStatus,
    SweepCreate,
    SweepPublic,
)
from api.spec.layout import layout_label as layout_str  # the one layout text: str(ResolvedLayout)

from ._errors import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    MeshrunError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RunFailedError,
    ServerError,
    ValidationError,
    WaitTimeoutError,
)
from ._specs import apply_overrides, load_file, parse_layout, parse_layouts
from .client import Client
from .resources import Run, RunPage, Sweep, SweepPage

__all__ = [
    "Client",
    "Run",
    "RunPage",
    "Sweep",
    "SweepPage",
    "MeshrunError",
    "APIError",
    "APIConnectionError",
    "APITimeoutError",
    "APIStatusError",
    "BadRequestError",
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
    "ConflictError",
    "ValidationError",
    "RateLimitError",
    "ServerError",
    "WaitTimeoutError",
    "RunFailedError",
    "RunSpec",
    "RunPublic",
    "RunStatus",
    "Layout",
    "MetricRow",
    "EventPublic",
    "CheckpointPublic",
    "PlanRequest",
    "PlanResponse",
    "ClusterPublic",
    "SweepCreate",
    "SweepPublic",
    "apply_overrides",
    "layout_str",
    "load_file",
    "parse_layout",
    "parse_layouts",
]
