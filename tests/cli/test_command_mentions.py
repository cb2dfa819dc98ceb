"""Every ``meshrun ...`` command that the console, the service's messages and the docs tell a user to type is a
real command of the CLI: it parses with the real typer app (the command and its options exist, values have the
right type), and a file argument is either a file of this repository or an upper-case placeholder (``FILE``).

No service runs: this parses only (``make_context``), so it is fast and needs nothing but the app."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.exceptions import TyperException

from api.cli import app

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "service" / "app" / "console" / "templates"

# <code>meshrun ...</code> in templates; `meshrun ...` in Markdown and in Python strings (error messages, fixes)
_HTML_CODE = re.compile(r"<code>(meshrun [^<]+)</code>")
_BACKTICKED = re.compile(r"`(meshrun [^`\n]+)`")
_SHELL_LINE = re.compile(r"^\s*(meshrun [a-z][^#\n]*)", re.M)


def _fenced_blocks(text: str) -> list[str]:
    """The shell blocks of a Markdown text: fences are paired in order (an opening fence, then its closing one),
    so the prose between two blocks is never read as one."""
    blocks: list[str] = []
    lang: str | None = None  # None: outside a fence
    body: list[str] = []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if lang is None:
                lang, body = line.strip()[3:].strip(), []
            else:
                if lang in ("", "bash", "sh", "console", "shell"):
                    blocks.append("\n".join(body) + "\n")
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def mentions() -> list[tuple[str, str]]:
    """(where, command line) for every meshrun command mentioned to users."""
    found: list[tuple[str, str]] = []
    for f in sorted(TEMPLATES.glob("*.html")):
        found += [(f.name, m) for m in _HTML_CODE.findall(f.read_text())]
    for f in sorted((ROOT / "service").rglob("*.py")) + sorted((ROOT / "api").rglob("*.py")):
        found += [(str(f.relative_to(ROOT)), m) for m in _BACKTICKED.findall(f.read_text())]
    for f in [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = f.read_text()
        found += [(f.name, m) for m in _BACKTICKED.findall(text)]
        for block in _fenced_blocks(text):
            found += [(f.name, m) for m in _SHELL_LINE.findall(block)]
    return found


def _is_placeholder(word: str) -> bool:
    """FILE, RUN_ID, SPEC.yaml, {run_id}, examples/<spec>.yaml: what the reader substitutes."""
    stem = word.split(".", 1)[0]
    return bool(re.fullmatch(r"[A-Z][A-Z0-9_]*", stem) or re.search(r"\{\w+\}|<[\w-]+>", word))


def _words(line: str) -> list[str]:
    """The arguments of the first command of a shell line (up to ; && | & or a # comment)."""
    line = line.replace("...", "")
    line = re.sub(r"\[(--[^\]]+)\]", r"\1", line)  # "[--admin]": an optional flag, still a real one
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    words: list[str] = []
    for w in lexer:
        if w and set(w) <= set(";&|"):
            break
        words.append(w)
    return words[1:]


def check(line: str) -> str | None:
    """None when ``line`` parses with the real app; else why not."""
    cmd = typer.main.get_command(app)
    words, depth = _words(line), 0
    try:
        ctx = cmd.make_context("meshrun", list(words))
        while hasattr(cmd, "commands"):  # a group (the app, ``sweeps``, ``db``, ``token``): descend
            args = [*ctx._protected_args, *ctx.args]  # a group keeps its subcommand's name apart
            if not args:
                return None  # "meshrun sweeps": the group's help
            name, *rest = args
            sub = cmd.commands.get(name)
            if sub is None:
                return f"no command {name!r}"
            depth += 1
            ctx = sub.make_context(name, rest, parent=ctx)
            cmd = sub
    except TyperException as e:  # typer's (vendored click's) UsageError: no such option, bad value, missing arg
        if "Missing" in str(e) and len(words) == depth:
            return None  # the command named in prose ("`meshrun validate` uses ..."), no arguments given
        return str(e)
    for p in cmd.params:
        if p.param_type_name == "argument" and p.type_descriptor.annotation is Path:
            v = ctx.params.get(p.name or "")
            if v is not None and not (_is_placeholder(str(v)) or (ROOT / v).exists()):
                return f"{p.name} {str(v)!r} is neither a file of the repository nor a FILE-style placeholder"
    return None


ALL = mentions()


def test_mentions_are_found() -> None:
    """The extractor sees the console's hints (a test that silently checks nothing would pass forever)."""
    where = {w for w, _ in ALL}
    assert "sweeps.html" in where and "_runs_table.html" in where and "README.md" in where
    assert len(ALL) > 20


@pytest.mark.parametrize("where,line", ALL, ids=[f"{w}:{line}" for w, line in ALL])
def test_mentioned_command_parses(where: str, line: str) -> None:
    problem = check(line)
    assert problem is None, f"{where}: `{line}`: {problem}"


def test_checker_rejects_wrong_forms() -> None:
    assert check("meshrun sweep create") is not None  # the Sweeps page's old hint: "create" is no spec file
    assert check("meshrun sweeps create") is not None  # no such subcommand
    assert check("meshrun submit examples/dp.yaml --no-such-flag") is not None
    assert check("meshrun sweep examples/sweep.yaml --wait") is None
    assert check("meshrun sweep FILE") is None
