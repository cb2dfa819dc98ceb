"""One owner of run state: only ``service/store/controller.py`` changes a run's, an attempt's, a sweep's or a
trial's status (an AST scan of ``service/`` and ``workers/``), and the state diagrams in docs/architecture.md are
the rendering of its transition tables."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from service.store import controller
from service.store.models import Base
from service.sweeps.expansion import TrialDraft

ROOT = Path(__file__).resolve().parents[2]
OWNER = "service/store/controller.py"
# (file, name): ``d`` in the sweep expansion is a ``TrialDraft``, a plain dataclass that exists before any row does
NOT_ORM = {("service/sweeps/expansion.py", "d")}
# state events written outside the controller: only where a run, sweep or trial is created (its first event)
CREATION_EVENTS = {("service/store/runs.py", "create_run"), ("service/sweeps/state.py", "add_trial"),
                   ("service/sweeps/expansion.py", "create_sweep")}
EVENT_TABLES = {"RunEvent", "SweepEvent"}


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out: list[ast.expr] = []
        for t in node.targets:
            out += list(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else [t]
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def _owner_name(expr: ast.expr) -> str:
    return expr.id if isinstance(expr, ast.Name) else ast.unparse(expr)


def state_writes(source: str, rel: str) -> list[str]:
    """Every place in ``source`` (the file ``rel``) that changes a status outside the controller."""
    tree = ast.parse(source)
    found: list[str] = []
    funcs = {id(n): f.name for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        for t in _targets(node):  # x.status = ..., a.status, a.finished_at = ..., x.status += ...
            if isinstance(t, ast.Attribute) and t.attr == "status" and (rel, _owner_name(t.value)) not in NOT_ORM:
                found.append(f"{where}: assigns {ast.unparse(t)}")
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
        kws = {k.arg for k in node.keywords}
        if name == "setattr" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value == "status":
            found.append(f"{where}: setattr(..., 'status', ...)")
        if name == "values" and "status" in kws:  # update(Run).values(status=...)
            found.append(f"{where}: an UPDATE of status")
        if name in EVENT_TABLES and "to_status" in kws and (rel, funcs.get(id(node), "")) not in CREATION_EVENTS:
            found.append(f"{where}: a state event {name}(to_status=...) written by hand")
        if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id == "controller" \
                and fn.attr.startswith("_"):
            found.append(f"{where}: calls the controller's private {fn.attr}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("store.controller"):
            private = [a.name for a in node.names if a.name.startswith("_")]
            if private:
                found.append(f"{rel}:{node.lineno}: imports the controller's private {', '.join(private)}")
    return found


def _sources() -> list[Path]:
    return sorted(p for d in ("service", "workers") for p in (ROOT / d).rglob("*.py"))


def test_only_the_controller_changes_state() -> None:
    files = _sources()
    assert len(files) > 50 and (ROOT / OWNER) in files
    found = [w for p in files if (rel := p.relative_to(ROOT).as_posix()) != OWNER
             for w in state_writes(p.read_text(), rel)]
    why = "status changed outside service/store/controller.py (ask the run controller instead):\n"
    assert not found, why + "\n".join(found)
    # the scan sees the controller's own writes: it would see them anywhere else
    own = state_writes((ROOT / OWNER).read_text(), "service/x.py")
    assert any("assigns run.status" in w for w in own) and any("assigns sweep.status" in w for w in own), own


@pytest.mark.parametrize("snippet, what", [
    ("run.status = 'RUNNING'", "assigns run.status"),
    ("att.status, att.finished_at = 'FAILED', now", "assigns att.status"),
    ("store.get_run(s, run_id=r).status = 'QUEUED'", "assigns store.get_run"),
    ("setattr(trial, 'status', 'RUNNING')", "setattr"),
    ("s.execute(update(Run).where(Run.id == r).values(status='FAILED'))", "an UPDATE of status"),
    ("def f(s):\n    s.add(RunEvent(run_id=r, to_status='FAILED'))", "a state event RunEvent"),
    ("controller._apply(s, run)", "private _apply"),
    ("from service.store.controller import _moves", "private _moves"),
])
def test_the_scan_catches_a_state_change_elsewhere(snippet: str, what: str) -> None:
    found = state_writes(snippet, "service/control/rogue.py")
    assert found and what in found[0], found


def test_the_exemptions_are_what_they_claim() -> None:
    assert not issubclass(TrialDraft, Base)  # ``d.status`` in the expansion writes a draft, not a row
    d = "d.status = 'SKIPPED'"
    assert state_writes(d, "service/sweeps/expansion.py") == [] and state_writes(d, "service/sweeps/trials.py")
    create = "def create_run(s):\n    s.add(RunEvent(run_id=r, to_status='QUEUED'))"
    assert state_writes(create, "service/store/runs.py") == [] and state_writes(create, "service/store/metrics.py")


# ------------------------------------------------------------------------------------------- the diagrams
def test_the_architecture_doc_shows_the_transition_tables() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert controller.with_diagrams(doc) == doc, (
        "docs/architecture.md's state diagrams differ from the transition tables in service/store/controller.py; "
        'regenerate them: python -c "from service.store.controller import write_diagrams; write_diagrams()"')
    for kind in controller.DIAGRAMS:
        assert controller.render_diagram(kind) in doc
    run = controller.render_diagram("run")
    for cur, moves in controller.RUN_TRANSITIONS.items():
        for to in moves:
            assert f"    {cur.value} --> {to.value}\n" in run


def test_a_stale_diagram_is_detected() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    stale = doc.replace("    QUEUED --> STARTING\n", "    QUEUED --> RUNNING\n", 1)
    assert stale != doc and controller.with_diagrams(stale) != stale
    with pytest.raises(ValueError, match="'sweep' state diagram"):
        controller.with_diagrams(doc.replace("state-diagram:sweep begin", "state-diagram:sweep gone"))
