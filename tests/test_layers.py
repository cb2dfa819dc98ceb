"""The architecture is enforced, not described: import contracts (import-linter, configured in pyproject.toml),
no import cycles between files or folders, a pure-Python planner, a clean ruff run, and no file over 600 lines.

The contracts are also shown to bite: a copy of the packages with deliberate wrong imports (one per contract, all in
one copy and one import-linter pass) fails each contract on its own wrong import.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "service", "workers")


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
         "sys.exit(lint_imports_command())"],
        cwd=cwd, capture_output=True, text=True, timeout=600,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd), "HOME": str(cwd), "COLUMNS": "400"},
    )


def test_import_contracts_are_kept() -> None:
    r = _lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


WRONG_IMPORTS = [  # (file, its one wrong import, the contract it must break)
    ("workers/_wrong.py", "from service import store\n", "The torch engine never imports"),
    ("api/spec/_wrong.py", "import torch\n", "The contract and the SDK load without"),
    ("service/planner/_wrong.py", "import sqlalchemy\n", "The planner is pure Python"),
    ("service/store/_wrong.py", "from service.control import runtime\n", "Service layers"),
]


def _broken_sections(report: str) -> dict[str, str]:
    """Contract name -> its section of import-linter's "Broken contracts" report (the imports that broke it)."""
    _, _, broken = report.partition("Broken contracts")
    sections: dict[str, str] = {}
    lines = broken.splitlines()
    for i, ln in enumerate(lines[:-1]):
        if ln.strip() and set(lines[i + 1].strip()) == {"-"} and len(lines[i + 1].strip()) == len(ln.strip()):
            sections[ln.strip()] = ""
            current = ln.strip()
        elif sections:
            sections[current] += ln + "\n"
    return sections


def test_each_wrong_import_breaks_its_contract(tmp_path: Path) -> None:
    """One copy of the packages with every wrong import at once, one import-linter pass: each contract must be
    broken by its own wrong file (named in its section of the report), not merely by another one."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "static", "*.html"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for path, source, _ in WRONG_IMPORTS:
        (tmp_path / path).write_text(source)
    r = _lint_imports(tmp_path)
    assert r.returncode != 0, r.stdout
    sections = _broken_sections(r.stdout)
    for path, _, contract in WRONG_IMPORTS:
        module = path.removesuffix(".py").replace("/", ".")
        names = [name for name in sections if name.startswith(contract)]
        assert names, f"{contract!r} is not broken by {path}:\n{r.stdout}"
        assert f"{module} -> " in sections[names[0]], f"{contract!r} is broken, but not by {path}:\n{r.stdout}"


@functools.cache  # built once for the tests below (they only read it)
def _graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, include_external_packages=True, exclude_type_checking_imports=True)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycles_between_files_or_folders() -> None:
    g = _graph()
    ours = {m for m in g.modules if m.split(".")[0] in PACKAGES}
    files = {m: {x for x in g.find_modules_directly_imported_by(m) if x in ours} for m in ours}
    assert _cycles(files) == [], "import cycles between files"

    packages = {m for m in ours if (ROOT / m.replace(".", "/")).is_dir()}

    def folder(m: str) -> str:
        return m if m in packages else m.rsplit(".", 1)[0]

    folders: dict[str, set[str]] = {}
    for m, targets in files.items():
        src = folder(m)
        folders.setdefault(src, set())
        for t in targets:
            dst = folder(t)
            # a folder may use its own sub-folders and a sub-folder its parent's modules' names; count only
            # edges between folders that do not contain each other
            if dst != src and not dst.startswith(src + ".") and not src.startswith(dst + "."):
                folders[src].add(dst)
    assert _cycles(folders) == [], "import cycles between folders"


def test_the_planner_imports_only_stdlib_pydantic_and_the_spec() -> None:
    g = _graph()
    allowed_external = {"pydantic", "pydantic_core", "typing_extensions"}
    bad = []
    for m in sorted(g.find_descendants("service.planner") | {"service.planner"}):
        for imported in g.find_modules_directly_imported_by(m):
            top = imported.split(".")[0]
            if imported.startswith(("service.planner", "api.spec")) or top in sys.stdlib_module_names:
                continue
            if top in allowed_external:
                continue
            bad.append(f"{m} imports {imported}")
    assert not bad, bad


def test_ruff_lint_and_format_are_clean() -> None:
    for args in (["check", *PACKAGES], ["format", "--check", *PACKAGES]):
        r = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"ruff {' '.join(args)}:\n{r.stdout}{r.stderr}"


MAX_FILE_LINES = 600


def test_no_file_is_over_600_lines() -> None:
    big = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > MAX_FILE_LINES:
                big.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not big, f"split these files (at most {MAX_FILE_LINES} lines each): {big}"


def test_no_machine_paths_in_code_or_docs() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    bad = []
    for name in tracked:
        if not name.endswith((".py", ".md", ".toml", ".yml", ".yaml", ".sh", ".cfg", ".ini")):
            continue
        text = (ROOT / name).read_text(errors="replace")
        for marker in ("/work/", "/root/", "/home/", "../shared"):
            if marker in text and name != "tests/test_layers.py":
                bad.append(f"{name}: {marker}")
    assert not bad, bad
