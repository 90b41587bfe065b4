"""The docs stay true: docs/layout.md names every module of the package folders and no module that does
not exist; every `tierflow ...` command shown in a code block of README.md or docs/*.md parses with the real
parser; the README starts with the two set-up commands CI runs; no page cites an issue number, and every link
to a local file (and its #anchor) resolves."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_FOLDERS = ["tierflow", "hwprofiles", "planner", "executor"]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# fenced blocks whose bare `tierflow ...` lines are commands; in any other block only `$ tierflow ...` lines
# are (a bare `tierflow run: ...` there is output)
SHELL_LANGS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(\s*)```(\S*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def code_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(info string, lines) of every fenced code block."""
    blocks, lang, lines = [], None, []
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and lang is None:
            lang, lines = m.group(2), []
        elif m:
            blocks.append((lang, lines))
            lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            out.append(line)
    return out


def joined(lines: list[str]) -> list[str]:
    """Lines with trailing-backslash continuations joined."""
    out, cur = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
        else:
            out.append(cur + line)
            cur = ""
    if cur:
        out.append(cur)
    return out


def shown_commands() -> list[tuple[str, str]]:
    """(page, command line) of every `tierflow ...` command in a code block: lines starting with `tierflow `
    or `$ tierflow ` (and the `tierflow ...` parts of an `&&` chain), joined across trailing backslashes."""
    found = []
    for page in PAGES:
        for lang, lines in code_blocks(page.read_text()):
            for line in joined(lines):
                s = line.strip()
                if s.startswith("$ "):
                    s = s[2:]
                elif lang not in SHELL_LANGS:
                    continue
                # `mkdir -p ssd && tierflow run ...`: each part of an && chain that is a tierflow command
                found += [(page_id(page), part.strip()) for part in s.split("&&")
                          if part.strip().startswith("tierflow ")]
    return found


def is_placeholder(cmd: str) -> bool:
    return "..." in cmd or re.search(r"<[\w-]+>", cmd) is not None


# -- (a) docs/layout.md names every module -------------------------------------------------------------------


def layout_names() -> tuple[set[str], set[str]]:
    """(module paths, folder paths) named in backticks in docs/layout.md."""
    text = (ROOT / "docs" / "layout.md").read_text()
    tokens = set(re.findall(r"`([\w./]+)`", text))
    modules = {t for t in tokens if t.endswith(".py")}
    folders = {t.rstrip("/") for t in tokens if t.endswith("/")}
    return modules, folders


def package_modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for folder in PACKAGE_FOLDERS for p in (ROOT / folder).rglob("*.py")
            if "__pycache__" not in p.parts}


def test_layout_names_every_module():
    modules, folders = layout_names()
    missing = sorted(m for m in package_modules() if m not in modules
                     and not (m.endswith("/__init__.py") and m.rsplit("/", 1)[0] in folders))
    assert not missing, f"docs/layout.md does not name these modules (add one line each): {missing}"


def test_layout_names_no_missing_module():
    modules, folders = layout_names()
    ghosts = sorted(m for m in modules if m.split("/")[0] in PACKAGE_FOLDERS and not (ROOT / m).is_file())
    ghosts += sorted(f + "/" for f in folders
                     if f.split("/")[0] in PACKAGE_FOLDERS and not (ROOT / f).is_dir())
    assert not ghosts, f"docs/layout.md names modules or folders that do not exist (remove them): {ghosts}"


# -- (b) every command shown parses --------------------------------------------------------------------------


def build_parser():
    from tierflow.cli import build_parser as build

    return build()


def test_commands_are_found():
    commands = shown_commands()
    assert len(commands) >= 10, commands
    assert any(c.startswith("tierflow run ") for _, c in commands)


@pytest.mark.parametrize("page,cmd", [c for c in shown_commands() if not is_placeholder(c[1])],
                         ids=lambda v: v if "/" in v and " " not in v else None)
def test_shown_command_parses(page, cmd, monkeypatch):
    monkeypatch.chdir(ROOT)  # paths in the examples are relative to the repository root
    argv = shlex.split(cmd, comments=True)[1:]
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{page}: `{cmd}` does not parse (exit {e.code}): fix the example or the parser")


# -- (c) the README starts with the set-up commands CI runs --------------------------------------------------


def test_readme_starts_with_setup_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[0] == "# tierflow"
    assert lines[2] == "```bash", "the README's third line opens the set-up commands' bash block"
    block = lines[3:lines.index("```", 3)]
    assert len(block) == 2 and block[0].startswith("pip install -e . && tierflow simulate"), block
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    verbatim = ci[ci.index(next(x for x in ci if "verbatim" in x)) + 1]
    assert block[1].split("#")[0].strip() == verbatim.strip(), (
        f".ci/run runs `{verbatim}`: the README's second set-up line must be that command")


# -- (d) no issue numbers; local links resolve ---------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_no_issue_numbers(page):
    hits = [line for line in page.read_text().splitlines() if re.search(r"\bissue \d+", line, re.IGNORECASE)]
    assert not hits, f"{page_id(page)} cites issue numbers (say what the thing is instead): {hits}"


def test_no_issue_numbers_in_code():
    """Code, tests, experiments and profiles say what a thing is, not which issue asked for it."""
    files = [f for folder in ("tierflow", "hwprofiles", "planner", "executor", "tests", "experiments")
             for f in (ROOT / folder).rglob("*") if f.suffix in (".py", ".yaml")]
    hits = [f"{f.relative_to(ROOT)}:{i}" for f in files
            for i, line in enumerate(f.read_text().splitlines(), 1)
            if re.search(r"\bissues? #?\d+", line, re.IGNORECASE)]
    assert len(files) > 100
    assert not hits, f"issue numbers in the code (say what the thing is instead): {hits}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(page.read_text()):
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_local_links_resolve(page):
    bad = []
    for line in prose_lines(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not bad, f"{page_id(page)}: broken links: {bad}"
