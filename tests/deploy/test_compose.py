"""Static validation of the deployment: docker-compose.yml, Dockerfile, Prometheus and Grafana provisioning.

Docker builds cannot run here (no network beyond PyPI), so this checks that the pieces agree with each other
and with the code: service names, ports, health checks, dependencies, MESHRUN_* settings, and the metric
names the Grafana dashboard queries.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from service.app import observability as obs
from service.settings import Settings
from workers import ray_metrics

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
GPU_OVERRIDE = ROOT / "deploy" / "compose.gpu.yml"
DOCKERFILE = ROOT / "Dockerfile"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA_PROV = ROOT / "deploy" / "grafana" / "provisioning"
MESHRUN_DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "meshrun.json"
RAY_DASHBOARD_METRIC_PORT = 44227  # ray.dashboard.consts.DASHBOARD_METRIC_PORT


# ------------------------------------------------------------------------------------------------ helpers
@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict[str, dict[str, Any]]:
    return compose["services"]


def _argv(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command")
    if cmd is None:
        return []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _interpolate_default(value: str) -> str:
    """Resolve compose ``${VAR:-default}`` to its default (the value used when the variable is unset)."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", str(value))


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: _interpolate_default(v) for k, v in env.items()}


def _published(port: str | int) -> tuple[str, int, int]:
    """(host ip, host port, container port) of a short-syntax port mapping."""
    parts = str(port).split(":")
    if len(parts) == 3:
        return parts[0], int(parts[1]), int(parts[2])
    if len(parts) == 2:
        return "0.0.0.0", int(parts[0]), int(parts[1])
    raise AssertionError(f"port mapping {port!r} must publish an explicit host port")


def _healthcheck_argv(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    if isinstance(test, str):
        return shlex.split(test)
    assert test[0] in ("CMD", "CMD-SHELL"), test
    return shlex.split(test[1]) if test[0] == "CMD-SHELL" else list(test[1:])


def _listen_ports(name: str, service: dict[str, Any]) -> set[int]:
    """Ports a compose service listens on, read from its command (and well-known image defaults)."""
    argv = _argv(service)
    ports: set[int] = set()
    for flag in ("--port", "--dashboard-port", "--metrics-export-port"):
        if (v := _flag(argv, flag)) is not None:
            ports.add(int(v))
    if argv[:2] == ["meshrun", "serve"]:
        env = _env(service)
        port = int(env.get("MESHRUN_PORT", Settings.model_fields["port"].default))
        proxy = env.get("MESHRUN_RAY_PROXY_PORT")  # the Ray dashboard's own origin (service.app.ray_origin)
        ports |= {port} | ({int(proxy) if proxy else port + 1} - {0})
    if argv[:3] == ["ray", "start", "--head"]:
        ports.add(RAY_DASHBOARD_METRIC_PORT)
    image = str(service.get("image", ""))
    ports |= {"postgres": {5432}, "prom/prometheus": {9090}, "grafana/grafana": {3000}}.get(image.split(":")[0],
                                                                                              set())
    return ports


def _ray_head(services) -> tuple[str, dict[str, Any]]:
    heads = [(n, s) for n, s in services.items() if _argv(s)[:3] == ["ray", "start", "--head"]]
    assert len(heads) == 1, f"expected exactly one `ray start --head` service, got {[n for n, _ in heads]}"
    return heads[0]


# ------------------------------------------------------------------------------------------- compose file
def test_services_exist_and_each_has_an_image_or_build(services):
    assert {"postgres", "ray-head", "ray-worker", "meshrun", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        assert svc.get("image") or svc.get("build"), f"service {name} has neither image nor build"
        if "build" in svc:
            ctx = ROOT / svc["build"].get("context", ".")
            assert (ctx / svc["build"].get("dockerfile", "Dockerfile")).is_file(), name


def test_ray_nodes_and_service_share_one_image_built_from_the_dockerfile(services):
    images = {services[n]["image"] for n in ("ray-head", "ray-worker", "meshrun")}
    assert len(images) == 1, f"Ray nodes and the service must run the same image, got {images}"
    for n in ("ray-head", "ray-worker", "meshrun"):
        assert services[n]["build"]["context"] == "."


def test_depends_on_targets_exist_and_health_conditions_have_healthchecks(services):
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {d: {"condition": "service_started"} for d in deps}
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert dep != name
            if spec.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} healthy but {dep} has no healthcheck"
    assert services["meshrun"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["meshrun"]["depends_on"]["ray-head"]["condition"] == "service_healthy"
    assert services["ray-worker"]["depends_on"]["ray-head"]["condition"] == "service_healthy"


def test_published_host_ports_are_unique_and_target_listening_ports(services):
    seen: dict[tuple[str, int], str] = {}
    for name, svc in services.items():
        for port in svc.get("ports") or []:
            ip, host, container = _published(port)
            for other_ip in (ip, "0.0.0.0"):
                assert (other_ip, host) not in seen or seen[(other_ip, host)] == name, \
                    f"host port {host} published by {name} and {seen[(other_ip, host)]}"
            seen[(ip, host)] = name
            assert container in _listen_ports(name, svc), f"{name} publishes {container} but does not listen on it"


def test_scalable_ray_worker(services):
    worker = services["ray-worker"]
    assert "container_name" not in worker, "a fixed container_name breaks --scale ray-worker=N"
    assert not worker.get("ports"), "published ports on ray-worker clash when scaled"
    for n in ("ray-head", "ray-worker"):
        size = str(services[n].get("shm_size", ""))
        assert size.endswith(("gb", "g")) and float(re.sub(r"[a-z]+$", "", size)) >= 1, \
            f"{n} needs a large shm_size for Ray's object store"
        assert _argv(services[n])[-1] == "--block", f"{n}: `ray start` must --block to keep the container up"


def test_ray_worker_address_and_meshrun_ray_address_match_the_head(services):
    head_name, head = _ray_head(services)
    argv = _argv(head)
    gcs_port = int(_flag(argv, "--port"))
    assert gcs_port != 6379, "6379 is Redis' port on many hosts; give the Ray head another GCS port"
    assert _flag(argv, "--dashboard-host") == "0.0.0.0"
    assert _flag(argv, "--metrics-export-port") is not None
    assert _flag(argv, "--num-cpus") is not None
    worker_argv = _argv(services["ray-worker"])
    assert worker_argv[:2] == ["ray", "start"] and "--head" not in worker_argv
    assert _flag(worker_argv, "--address") == f"{head_name}:{gcs_port}"
    assert _flag(worker_argv, "--metrics-export-port") is not None, "workers need a fixed metrics port to scrape"
    env = _env(services["meshrun"])
    assert env["MESHRUN_RAY_ADDRESS"] == f"{head_name}:{gcs_port}"
    dash = urlsplit(env["MESHRUN_RAY_DASHBOARD_URL"])
    assert (dash.hostname, dash.port) == (head_name, int(_flag(argv, "--dashboard-port")))


def test_healthchecks_probe_the_ports_the_services_listen_on(services):
    head_name, head = _ray_head(services)
    url = next(a for a in _healthcheck_argv(head) if a.startswith("http"))
    assert urlsplit(url).port == int(_flag(_argv(head), "--dashboard-port"))
    meshrun = services["meshrun"]
    url = next(a for a in _healthcheck_argv(meshrun) if a.startswith("http"))
    assert urlsplit(url).path == "/healthz"
    assert urlsplit(url).port == int(_env(meshrun)["MESHRUN_PORT"])
    worker = services["ray-worker"]
    url = next(a for a in _healthcheck_argv(worker) if a.startswith("http"))
    assert urlsplit(url).path == "/api/local_raylet_healthz"
    assert urlsplit(url).port == int(_flag(_argv(worker), "--dashboard-agent-listen-port"))
    pg = " ".join(_healthcheck_argv(services["postgres"]))
    assert "pg_isready" in pg and _env(services["postgres"])["POSTGRES_USER"] in pg


def test_meshrun_command_serves_on_all_interfaces_with_auth(services):
    svc = services["meshrun"]
    argv = _argv(svc)
    assert argv[:2] == ["meshrun", "serve"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, attr = scripts["meshrun"].split(":")
    import importlib

    from typer.main import get_command

    group = get_command(getattr(importlib.import_module(module), attr))
    assert "serve" in group.commands, "the meshrun CLI has no `serve` command"  # type: ignore[attr-defined]
    server = (ROOT / "service" / "app" / "server.py").read_text()
    assert "def create_app" in server and "instrument_app(app" in server and "configure_logging(settings)" in server
    env = _env(svc)
    settings = Settings(**{k.removeprefix("MESHRUN_").lower(): v for k, v in env.items() if k.startswith("MESHRUN_")})
    assert settings.auth_enabled and settings.host == "0.0.0.0"
    assert not settings.embedded_ray and settings.start_scheduler
    assert settings.database_url.startswith("postgresql+psycopg://")
    assert settings.log_json


def test_every_meshrun_env_var_is_a_settings_field(services):
    fields = {f"MESHRUN_{name.upper()}" for name in Settings.model_fields}
    used: dict[str, str] = {}
    for name, svc in services.items():
        for key in _env(svc):
            if key.startswith("MESHRUN_"):
                used[key] = name
    for line in DOCKERFILE.read_text().splitlines():
        used.update({m: "Dockerfile" for m in re.findall(r"\b(MESHRUN_[A-Z0-9_]+)=", line)})
    unknown = {k: v for k, v in used.items() if k not in fields}
    assert not unknown, f"MESHRUN_* variables that service.settings.Settings does not read: {unknown}"
    assert {"MESHRUN_DATABASE_URL", "MESHRUN_RAY_ADDRESS", "MESHRUN_HOST"} <= set(used)


def test_database_url_points_at_the_postgres_service(services):
    url = urlsplit(_env(services["meshrun"])["MESHRUN_DATABASE_URL"])
    pg = _env(services["postgres"])
    assert url.scheme == "postgresql+psycopg"
    assert url.hostname in services and "postgres" in services[url.hostname]["image"]
    assert url.port in _listen_ports(url.hostname, services[url.hostname])
    assert url.username == pg["POSTGRES_USER"] and url.password == pg["POSTGRES_PASSWORD"]
    assert url.path.lstrip("/") == pg["POSTGRES_DB"]
    assert any(str(v).endswith(":/var/lib/postgresql/data") for v in services["postgres"]["volumes"])


def test_volumes_are_declared_and_bind_mounts_exist(compose, services):
    declared = set(compose.get("volumes") or {})
    for name, svc in services.items():
        for vol in svc.get("volumes") or []:
            source = str(vol).split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name} mounts missing path {source}"
            else:
                assert source in declared, f"{name} uses undeclared volume {source}"
    # checkpoints must be shared storage between the service and every Ray node
    for n in ("ray-head", "ray-worker", "meshrun"):
        assert any(str(v).startswith("checkpoints:") for v in services[n]["volumes"]), n
    ckpt = _env(services["meshrun"])["MESHRUN_CHECKPOINT_ROOT"]
    assert any(str(v) == f"checkpoints:{ckpt}" for v in services["ray-worker"]["volumes"])


def test_ray_head_embeds_grafana_and_prometheus_by_service_name(services):
    _, head = _ray_head(services)
    env = _env(head)
    for var, svc in (("RAY_GRAFANA_HOST", "grafana"), ("RAY_PROMETHEUS_HOST", "prometheus")):
        u = urlsplit(env[var])
        assert u.hostname == svc and u.port in _listen_ports(svc, services[svc]), var
    iframe = urlsplit(env["RAY_GRAFANA_IFRAME_HOST"])
    grafana_published = {_published(p)[1] for p in services["grafana"]["ports"]}
    assert iframe.port in grafana_published, "the browser loads Grafana from a published port"
    ds = yaml.safe_load((GRAFANA_PROV / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert env["RAY_PROMETHEUS_NAME"] in {d["name"] for d in ds}
    genv = _env(services["grafana"])
    assert genv["GF_SECURITY_ALLOW_EMBEDDING"] == "true" and genv["GF_AUTH_ANONYMOUS_ENABLED"] == "true"


# --------------------------------------------------------------------------------------------- Dockerfile
def test_dockerfile_installs_cpu_torch_then_the_project():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\}", text, re.M)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert re.search(r'pip install --index-url "\$\{TORCH_INDEX_URL\}" "torch==\$\{TORCH_VERSION\}"', text)
    torch_at = text.index("torch==")
    project_at = text.index("pip install --no-deps .")
    assert torch_at < project_at, "torch must come from the PyTorch index before the project's dependencies"
    lock_at = text.index("pip install --require-hashes -r requirements/runtime.lock")  # the versions CI tested
    assert torch_at < lock_at < project_at
    # every package pyproject ships is copied into the image, and every COPY source exists
    includes = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    copied = re.findall(r"^COPY\s+(\S+)\s+\S+$", text, re.M)
    for pattern in includes["include"]:
        pkg = pattern.rstrip("*")
        assert pkg in copied, f"Dockerfile does not copy package {pkg}"
    for src in copied:
        assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist in the repository"
    assert "README.md" in copied  # pyproject's readme: setuptools needs it to build the wheel
    assert re.search(r'^CMD \["meshrun", "serve"\]', text, re.M)


def test_dockerignore_keeps_copied_sources_in_the_context():
    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    copied = re.findall(r"^COPY\s+(\S+)\s+\S+$", DOCKERFILE.read_text(), re.M)
    for src in copied:
        assert src not in ignored, f".dockerignore excludes {src}, which the Dockerfile copies"
    assert ".git" in ignored and "tests" in ignored


def test_gpu_override_reserves_nvidia_devices_for_existing_services(services):
    gpu = yaml.safe_load(GPU_OVERRIDE.read_text())
    for name, svc in gpu["services"].items():
        assert name in services
    devices = gpu["services"]["ray-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "${TORCH_VARIANT:-cpu}" in services["ray-worker"]["image"]
    assert services["ray-worker"]["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/${TORCH_VARIANT:-cpu}")


# ------------------------------------------------------------------------------------- Prometheus/Grafana
def test_prometheus_targets_name_real_services_and_ports(services):
    prom = yaml.safe_load(PROMETHEUS.read_text())
    mounted = [v for v in services["prometheus"]["volumes"] if str(v).startswith("./deploy/prometheus/")]
    assert mounted and _flag(_argv(services["prometheus"]), "--config.file") == mounted[0].split(":")[1]
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    targets: list[tuple[str, str, int]] = []
    for job in jobs.values():
        for sc in job.get("static_configs", []):
            for t in sc["targets"]:
                host, port = t.rsplit(":", 1)
                targets.append((job["job_name"], host, int(port)))
        for dns in job.get("dns_sd_configs", []):
            for host in dns["names"]:
                targets.append((job["job_name"], host, int(dns["port"])))
    assert targets
    for job, host, port in targets:
        assert host in services, f"job {job} scrapes unknown service {host}"
        assert port in _listen_ports(host, services[host]), f"job {job}: {host} does not listen on {port}"
    scraped = {(h, p) for _, h, p in targets}
    head_name, head = _ray_head(services)
    assert (head_name, int(_flag(_argv(head), "--metrics-export-port"))) in scraped
    assert ("ray-worker", int(_flag(_argv(services["ray-worker"]), "--metrics-export-port"))) in scraped
    assert ("meshrun", int(_env(services["meshrun"])["MESHRUN_PORT"])) in scraped
    assert jobs["meshrun"].get("metrics_path", "/metrics") == "/metrics"


def _grafana_container_paths(services) -> dict[str, str]:
    """container path -> host path (bind) or volume name, for the grafana service."""
    out = {}
    for v in services["grafana"]["volumes"]:
        src, dst = str(v).split(":")[:2]
        out[dst] = src
    return out


def test_grafana_provisioning_parses_and_dashboards_are_mounted(services):
    mounts = _grafana_container_paths(services)
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    ds = yaml.safe_load((GRAFANA_PROV / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert len(ds) == 1 and ds[0]["type"] == "prometheus" and ds[0]["isDefault"] is True
    u = urlsplit(ds[0]["url"])
    assert u.hostname == "prometheus" and u.port in _listen_ports("prometheus", services["prometheus"])
    providers = yaml.safe_load((GRAFANA_PROV / "dashboards" / "dashboards.yml").read_text())["providers"]
    by_name = {p["name"]: p["options"]["path"] for p in providers}
    # meshrun's dashboard: a bind mount of deploy/grafana/dashboards that holds meshrun.json
    mesh_path = by_name["meshrun"]
    assert (ROOT / mounts[mesh_path] / "meshrun.json").resolve() == MESHRUN_DASHBOARD.resolve()
    # Ray's dashboards: generated on the head under its /tmp/ray, shared with Grafana through one volume
    ray_path = by_name["Ray"]
    assert ray_path == "/tmp/ray/session_latest/metrics/grafana/dashboards"
    head_name, head = _ray_head(services)
    head_mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in head["volumes"]}
    assert mounts["/tmp/ray"] == head_mounts["/tmp/ray"], "Grafana must mount the head's /tmp/ray volume"
    assert str(next(v for v in services["grafana"]["volumes"] if ":/tmp/ray" in str(v))).endswith(":ro")


def _dashboard() -> dict[str, Any]:
    return json.loads(MESHRUN_DASHBOARD.read_text())


def _exprs(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if isinstance(q, dict):
            exprs.append(q["query"])
    return exprs


def test_dashboard_datasources_resolve_to_the_provisioned_prometheus():
    ds = yaml.safe_load((GRAFANA_PROV / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    dash = _dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    dsvar = variables["datasource"]
    assert dsvar["type"] == "datasource" and dsvar["query"] == ds["type"]
    assert dsvar["current"]["value"] == ds["uid"]
    refs = [p["datasource"] for p in dash["panels"] if "datasource" in p]
    refs += [t["datasource"] for p in dash["panels"] for t in p.get("targets", []) if "datasource" in t]
    assert refs
    for ref in refs:
        assert ref["type"] == "prometheus" and ref["uid"] in ("${datasource}", ds["uid"]), ref
    assert dash["uid"] and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def _exposed_service_names(tmp_path) -> set[str]:
    """Sample names a real instrumented app exposes on /metrics with one running run that has metrics."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from service import store
    from service.store.db import make_engine, make_sessionmaker, session_scope
    from service.store.models import Base

    engine = make_engine(f"sqlite:///{tmp_path / 'dash.db'}")
    Base.metadata.create_all(engine)
    factory = make_sessionmaker(engine)
    with session_scope(factory) as s:
        run, _ = store.create_run(s, spec={"name": "d"}, plan=None, name="d")
    with session_scope(factory) as s:
        store.transition(s, run_id=run.id, to="STARTING")
        store.transition(s, run_id=run.id, to="RUNNING")
        store.add_metrics(s, run_id=run.id, attempt=1, rows=[{
            "step": 1, "loss": 1.0, "tokens_per_s": 1.0, "mfu": 0.1, "step_time_s": 1.0, "peak_memory_bytes": 1}])
    app = FastAPI()

    @app.get("/x/{y}")
    def x(y: str) -> dict:
        if y == "boom":
            raise RuntimeError("boom")
        return {}

    obs.instrument_app(app)
    app.state.session_factory = factory
    client = TestClient(app, raise_server_exceptions=False)
    client.get("/x/1")
    client.get("/x/boom")  # labelled error counters appear once they have a sample
    text = client.get("/metrics").text
    engine.dispose()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_dashboard_queries_only_metrics_the_code_defines(tmp_path):
    exposed = _exposed_service_names(tmp_path)
    ray_names = set(ray_metrics.PROMETHEUS_NAMES.values())
    used = {m for e in _exprs(_dashboard()) for m in re.findall(r"\b((?:ray_)?meshrun_[a-z0-9_]+)\b", e)}
    assert used
    unknown = used - exposed - ray_names
    assert not unknown, f"dashboard queries metrics nobody defines: {sorted(unknown)}"
    # what the issue asks the dashboard to show
    joined = "\n".join(_exprs(_dashboard()))
    for needed in (obs.RUNS, obs.QUEUE_LENGTH, ray_metrics.PROMETHEUS_NAMES["tokens_per_s"],
                   ray_metrics.PROMETHEUS_NAMES["mfu"], ray_metrics.PROMETHEUS_NAMES["loss"]):
        assert needed in joined, f"the meshrun dashboard has no panel on {needed}"
    # per-run training panels group by the run tags workers/ray_metrics.py sets
    for e in _exprs(_dashboard()):
        if "ray_meshrun_train_" in e:
            assert "run_name" in e or "run_id" in e, e
    assert set(ray_metrics.TAG_KEYS) >= {"run_id", "run_name"}


# ------------------------------------------------------------------------------------ docker compose config
def _compose_command() -> list[str]:
    """Docker's compose plugin, or Debian's ``docker-compose`` (1.29, which the test command installs): both read the
    Compose Specification and refuse an unknown key or a wrong type."""
    if shutil.which("docker") is not None:
        try:
            if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=20).returncode == 0:
                return ["docker", "compose"]
        except (OSError, subprocess.TimeoutExpired):
            pass
    if shutil.which("docker-compose") is not None:
        return ["docker-compose"]
    pytest.fail("neither `docker compose` nor `docker-compose` is installed: apt-get install -y docker-compose "
                "(the README's test command does)", pytrace=False)


def test_docker_compose_config_accepts_the_files():
    compose = _compose_command()
    for files in (["-f", "docker-compose.yml"], ["-f", "docker-compose.yml", "-f", "deploy/compose.gpu.yml"]):
        out = subprocess.run([*compose, *files, "config", "--quiet"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
