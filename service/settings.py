"""Service settings (pydantic-settings). Every field reads a ``MESHRUN_<FIELD>`` environment variable.

With nothing set meshrun runs on embedded defaults: a SQLite file under the data directory and a local Ray
head that the service starts, owns and stops.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from api.spec.tracking import TrackingSpec

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MESHRUN_", env_file=None, extra="ignore")

    data_dir: Path = Field(Path.home() / ".meshrun", description="SQLite file, checkpoints, Ray temp files.")
    database_url: str = Field("", description="SQLAlchemy URL; default (empty) sqlite:///<data_dir>/meshrun.db")
    database_url_file: Path | None = Field(
        None,
        description="A file holding the SQLAlchemy URL, read when MESHRUN_DATABASE_URL is unset: what the service "
        "hands its Ray Job drivers (a 0600 file under <data_dir>/secrets), so no job's runtime_env carries it.",
    )
    credentials_dir: Path | None = Field(
        None,
        description="Where the service writes the 0600 file with the database URL that Ray Job drivers read "
        "(default <data_dir>/secrets). With drivers on other machines or containers, a directory they all mount.",
    )
    ray_address: str | None = Field(
        None,
        description="Existing Ray cluster (e.g. ray://head:10001 or head:6380); unset = start and own a local head.",
    )
    ray_dashboard_url: str | None = Field(
        None, description="Dashboard URL of an existing cluster (default http://<head>:8265)."
    )
    ray_gcs_port: int = Field(6389, ge=1, le=65535, description="GCS port of the local head (not 6379).")
    ray_dashboard_port: int = Field(8265, ge=1, le=65535)
    ray_num_cpus: int | None = Field(None, ge=1, description="CPUs of the local head (default: all).")
    ray_metrics_export_port: int = Field(8090, ge=1, le=65535)
    ray_multi_node: bool = Field(
        False,
        description="Let other machines join the embedded head: its GCS and node services listen on this machine's "
        "address instead of loopback (127.0.0.1) only.",
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    public_url: str | None = Field(None, description="URL the Ray Job drivers use to reach this service.")
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="MESHRUN_ALLOWED_HOSTS: host names (comma-separated) that requests may address in their Host "
        "header besides loopback names, IP addresses, MESHRUN_HOST and MESHRUN_PUBLIC_URL's host; any other Host "
        "is refused with 400 (a web page cannot reach the service by rebinding its own name to this machine). "
        "'*' accepts every host (only behind a proxy that checks Host itself).",
    )
    local_code_rights: bool = Field(
        True,
        description="MESHRUN_LOCAL_CODE_RIGHTS: with auth off, the local user may submit specs that run user code "
        "(custom entrypoints, user models, code.working_dir); false refuses them (403) like a token without "
        "--can-run-code.",
    )
    auth: Literal["auto", "on", "off"] = Field(
        "auto", description="auto = on unless the service listens on loopback only."
    )
    checkpoint_root: Path | None = Field(
        None, description="Default checkpoint storage (default <data_dir>/checkpoints)."
    )
    scheduler_interval_s: float = Field(1.0, gt=0, le=60)
    tracking: TrackingSpec | None = Field(
        None,
        description="MESHRUN_TRACKING: the experiment trackers every run logs to unless its spec says otherwise, JSON: "
        '{"mlflow": {"tracking_uri": "http://mlflow:5000", "experiment": "meshrun"}, "tensorboard": true} '
        "(docs/tracking.md).",
    )
    tracking_flush_timeout_s: float = Field(
        30.0, ge=0, le=3600, description="How long a finished run's driver waits for its trackers to catch up."
    )
    preemption: Literal["off", "project", "any"] = Field(
        "off",
        description="A higher-priority run that cannot be placed preempts lower-priority runs (they checkpoint, go "
        "PREEMPTED then QUEUED and resume later): off; project = only runs of its own project; any.",
    )
    project_max_workers: dict[str, int] = Field(
        default_factory=dict,
        description='Per-project quota of workers at once, JSON: {"team-a": 8, "*": 16} ("*": every other project).',
    )
    device_prices: dict[str, float] = Field(
        default_factory=dict,
        description='MESHRUN_DEVICE_PRICES: US dollars per device-hour by device, JSON: {"H100": 2.5, "cpu": 0.05}; '
        "replaces the planner's dated default table (service.planner.prices) for plans and runs that name no "
        "cluster.price_per_device_hour.",
    )
    max_request_bytes: int = Field(1_048_576, ge=1024)
    rate_limit_per_minute: int = Field(1200, ge=0, description="Requests per token per minute; 0 disables.")
    allowed_path_roots: list[Path] = Field(
        default_factory=list,
        description="With auth on, absolute paths in specs (data.path, checkpoint.storage) "
        "must lie under data_dir, checkpoint_root or one of these.",
    )
    allowed_url_schemes: list[str] = Field(
        default_factory=lambda: ["file", "s3", "gs", "gcs", "az", "abfs", "abfss", "hdfs"],
        description="URL schemes allowed in spec paths (fsspec protocols).",
    )
    allow_faults: bool = Field(
        False,
        description="MESHRUN_ALLOW_FAULTS: accept specs with a faults section (chaos testing) from every token; "
        "otherwise only admin tokens may inject faults.",
    )
    # hardening limits (README "Hardening/limits")
    db_pool_size: int = Field(20, ge=1, le=1000, description="Connections kept open to the run database.")
    db_max_overflow: int = Field(10, ge=0, le=1000, description="Extra connections opened under load.")
    db_pool_timeout_s: float = Field(10.0, gt=0, le=600, description="Wait for a pooled connection, then 503.")
    max_concurrent_requests: int = Field(
        16,
        ge=1,
        le=1000,
        description="API requests served at once (the rest queue on the event loop); keep it at or below "
        "db_pool_size so a request never waits for a connection.",
    )
    max_concurrent_writes: int = Field(
        1,
        ge=1,
        le=1000,
        description="Of those, requests other than GET/HEAD/OPTIONS (submissions, plans, sweeps: the ones whose "
        "parsing, validation and search cost CPU) served at once; the rest queue.",
    )
    read_priority_ms: float = Field(
        50.0,
        ge=0,
        le=10_000,
        description="A write about to start waits up to this long while reads are in progress, so expensive "
        "requests sent back to back cannot slow the console's and the SDK's reads; 0 disables.",
    )
    request_queue_timeout_s: float = Field(
        30.0, gt=0, le=600, description="How long a queued request waits before a 503 with Retry-After."
    )
    calibrate_from_runs: bool = Field(
        False,
        description="MESHRUN_CALIBRATE_FROM_RUNS: refit the planner's factors term by term (compute, TP/PP/DP "
        "communication, bubble, optimizer, overhead) from the measured breakdowns of the latest finished runs, "
        "at most once a minute after a run finished; /v1/plans then names the measured factors and when.",
    )
    warm_workers: int = Field(
        2,
        ge=0,
        le=64,
        description="MESHRUN_WARM_WORKERS: a standing group of this many prestarted one-CPU worker processes (torch "
        "and the engine imported) that CPU runs on one node start in, re-meshed in place, instead of a new Ray Train "
        "worker group (seconds instead of Ray Train's start); idle workers reserve no CPU or GPU, and hold a few "
        "hundred MB each. 0: off.",
    )
    warm_max_idle_groups: int = Field(
        2, ge=1, le=16, description="Idle warm worker groups kept (the memory they hold is bounded by this)."
    )
    warm_idle_s: float = Field(
        600.0,
        ge=0,
        le=86400,
        description="MESHRUN_WARM_IDLE_S: an idle warm worker group unused this long is stopped (checked every 15 s), "
        "except one group of the standing shape: each idle worker holds about 500 MB and about 1 % of a core. "
        "0: idle groups stay until evicted by MESHRUN_WARM_MAX_IDLE_GROUPS.",
    )
    log_json: bool = False
    log_level: str = "INFO"
    start_scheduler: bool = Field(True, description="Run admission/reconcile loops in the API process.")
    webhooks: bool = Field(True, description="Deliver webhooks (docs/webhooks.md) from this service process.")
    webhook_key: str | None = Field(
        None,
        description="MESHRUN_WEBHOOK_KEY: the key that seals webhook secrets in the database (default: a random key "
        "kept in <credentials_dir>/webhook.key, 0600). Service replicas sharing a database need the same key.",
    )
    webhook_poll_s: float = Field(1.0, gt=0, le=60, description="How often new events are turned into deliveries.")
    webhook_timeout_s: float = Field(5.0, gt=0, le=60, description="Per delivery attempt (connect + response).")
    webhook_max_attempts: int = Field(6, ge=1, le=20, description="Attempts per delivery before it is failed.")
    webhook_retry_base_s: float = Field(
        2.0, gt=0, le=600, description="Backoff before the 2nd attempt; doubled per attempt, capped at 10 minutes."
    )
    console_session_hours: float = Field(12.0, gt=0, le=24 * 30, description="Web console sign-in lifetime.")
    ray_proxy_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="MESHRUN_RAY_PROXY_PORT: the port of the Ray dashboard proxy's own origin. The dashboard is a "
        "third-party web app; on an origin of its own its scripts cannot act on the API or read the console with the "
        "viewer's rights. /ray/ on the service's port redirects there. Unset = the service's port + 1; 0 = share "
        "the console's origin (/ray/ on the service's port; not recommended).",
    )
    ray_dashboard_proxy: Literal["admins", "project", "signed-in", "off"] = Field(
        "admins",
        description="Who may open the Ray dashboard through the service at /ray/ (read-only, with the cluster's "
        "token added by the service): admins only; 'project' = every signed-in user, who sees only the job "
        "lists, job details and driver logs of their own project's runs (everything else answers 404, admins "
        "see all); 'signed-in' = every signed-in user sees every project's jobs; 'off' = nobody.",
    )
    metrics_token: str | None = Field(
        None,
        description="MESHRUN_METRICS_TOKEN: a dedicated bearer token for Prometheus scrapes of /metrics "
        "(with auth on, /metrics needs this token or an admin API token; with auth off it is "
        "open).",
    )

    @field_validator("database_url", mode="before")
    @classmethod
    def _check_url(cls, v: object) -> str:
        v = str(v or "").strip()
        if v and "://" not in v:
            raise ValueError(
                "MESHRUN_DATABASE_URL must be a SQLAlchemy URL such as "
                "sqlite:///path/meshrun.db or postgresql+psycopg://user@host/db"
            )
        if v.startswith("sqlite") and (
            v.rstrip("/").endswith(":memory:") or v.rstrip("/") in ("sqlite:", "sqlite+pysqlite:") or "mode=memory" in v
        ):
            raise ValueError(
                "MESHRUN_DATABASE_URL must not be an in-memory SQLite database: migrations and the "
                "service would each see their own empty database; use a file such as "
                "sqlite:////var/lib/meshrun/meshrun.db, or leave MESHRUN_DATABASE_URL unset for "
                "<data_dir>/meshrun.db"
            )
        return v

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, v: object) -> object:
        if isinstance(v, str):
            text = v.strip()
            if text.startswith("["):
                import json

                return json.loads(text)
            return [h for h in (p.strip() for p in text.split(",")) if h]
        return v

    @field_validator("allowed_hosts")
    @classmethod
    def _normal_hosts(cls, v: list[str]) -> list[str]:
        out = []
        for h in v:
            h = h.strip().lower().rstrip(".")
            if "://" in h or "/" in h:
                raise ValueError(f"MESHRUN_ALLOWED_HOSTS entries are host names such as meshrun.example, not {h!r}")
            host, sep, port = h.rpartition(":")
            if sep and port.isdigit() and ":" not in host:  # meshrun.example:8443 -> meshrun.example
                h = host
            out.append(h.strip("[]"))
        return out

    @field_validator("device_prices")
    @classmethod
    def _check_prices(cls, v: dict[str, float]) -> dict[str, float]:
        for device, price in v.items():
            if not math.isfinite(price) or not 0 <= price <= 1e6:
                raise ValueError(f"device_prices[{device!r}] = {price}: use a finite price in [0, 1e6] US dollars/hour")
        return v

    @field_validator("metrics_token")
    @classmethod
    def _blank_is_unset(cls, v: str | None) -> str | None:
        # compose passes ${MESHRUN_METRICS_TOKEN:-} as "": no scrape token (never "the empty token")
        return v.strip() or None if v is not None else None

    @property
    def ray_proxy_listen_port(self) -> int | None:
        """The port the Ray dashboard proxy listens on, or None when it shares the service's origin."""
        if self.ray_proxy_port == 0:
            return None
        return self.ray_proxy_port or self.port + 1

    @model_validator(mode="after")
    def _defaults(self) -> Settings:
        if self.ray_proxy_port == self.port or (self.ray_proxy_port is None and self.port == 65535):
            raise ValueError(
                f"MESHRUN_RAY_PROXY_PORT must differ from MESHRUN_PORT ({self.port}): the Ray dashboard gets an "
                "origin of its own; set another port, or 0 to share the console's origin"
            )
        if not self.database_url and self.database_url_file is not None:
            try:
                self.database_url = self._check_url(self.database_url_file.read_text())
            except OSError as e:
                raise ValueError(f"MESHRUN_DATABASE_URL_FILE {self.database_url_file} cannot be read: {e}") from e
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'meshrun.db'}"
        if self.checkpoint_root is None:
            self.checkpoint_root = self.data_dir / "checkpoints"
        for scheme in ("postgresql://", "postgres://"):  # psycopg 3 is the installed driver
            if self.database_url.startswith(scheme):
                self.database_url = "postgresql+psycopg://" + self.database_url[len(scheme) :]
        return self

    @property
    def listens_on_loopback(self) -> bool:
        """True when ``host`` only accepts connections from this machine."""
        return self.host in LOOPBACK_HOSTS

    @property
    def auth_enabled(self) -> bool:
        if self.auth == "auto":
            return not self.listens_on_loopback
        return self.auth == "on"

    @property
    def embedded_ray(self) -> bool:
        return not self.ray_address


@lru_cache
def get_settings() -> Settings:
    return Settings()
