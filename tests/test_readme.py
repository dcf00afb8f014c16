"""The README is the front door: its marked command blocks are what CI runs, its quick start works
as written, and every relative link in README.md and docs/*.md leads somewhere."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
CI_RUN = REPO / ".ci" / "run"
MAX_README_LINES = 250
NOT_RUN_BY_TESTS = "# not run by tests"


def _block(name: str, text: str | None = None) -> list[str]:
    """The lines of the fenced block right after `<!-- ci:NAME -->` (as .ci/run reads it)."""
    lines = (README.read_text(encoding="utf-8") if text is None else text).splitlines()
    marker = f"<!-- ci:{name} -->"
    at = [i for i, line in enumerate(lines) if line.strip() == marker]
    assert len(at) == 1, f"README.md: {len(at)} lines {marker!r}, want exactly 1"
    fence = at[0] + 1
    assert fence < len(lines) and lines[fence].startswith("```"), f"no fence after {marker!r}"
    body = []
    for line in lines[fence + 1 :]:
        if line.startswith("```"):
            return body
        body.append(line)
    raise AssertionError(f"the block after {marker!r} is never closed")


def _commands(name: str, text: str | None = None) -> list[str]:
    """The block's commands: continuation lines joined, blank and comment-only lines dropped."""
    commands, pending = [], ""
    for line in _block(name, text):
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.strip() and not line.lstrip().startswith("#"):
            commands.append(line.strip())
    return commands


# --- the marked blocks and CI ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["install", "quickstart", "test"])
def test_each_marked_block_exists_and_holds_commands(name: str) -> None:
    assert _commands(name), f"README.md: the ci:{name} block holds no command"


def test_the_blocks_hold_the_install_lint_and_test_commands() -> None:
    install = "\n".join(_commands("install"))
    for command in (
        "python3 -m venv .venv",
        ". .venv/bin/activate",
        "pip install torch==",
        "pip install -e",
    ):
        assert command in install, f"ci:install lacks {command!r}"
    test = "\n".join(_commands("test"))
    for command in ("ruff check .", "ruff format --check .", "python -m pytest"):
        assert command in test, f"ci:test lacks {command!r}"


def test_ci_runs_the_readmes_own_install_and_test_blocks() -> None:
    ci = CI_RUN.read_text(encoding="utf-8")
    assert "ci:install" in ci and "ci:test" in ci
    assert "README.md" in ci
    # The commands live in the README only: CI does not repeat them (its comments may name them).
    code = "\n".join(line for line in ci.splitlines() if not line.lstrip().startswith("#"))
    assert "pip install -e" not in code and "pytest" not in code


def test_readme_is_a_front_door() -> None:
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move reference text into docs/"


# --- links ----------------------------------------------------------------------------------------

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The text without fenced blocks and code spans (their brackets are not links)."""
    return _CODE.sub("", _FENCE.sub("", text))


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file (duplicates get -1, -2, ...)."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _links(page: Path) -> list[tuple[Path, str]]:
    """(target file, anchor) of every relative link of a page."""
    links = []
    for target in _LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file, _, anchor = target.partition("#")
        links.append(((page.parent / file).resolve() if file else page.resolve(), anchor))
    return links


def test_every_relative_link_points_at_a_file_and_heading_that_exist() -> None:
    broken = []
    for page in _pages():
        for target, anchor in _links(page):
            where = f"{page.relative_to(REPO)} -> {target}#{anchor}"
            if not target.exists():
                broken.append(f"{where}: no such file")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{where}: no such heading")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    reached, todo = {README.resolve()}, [README.resolve()]
    while todo:
        page = todo.pop()
        for target, _ in _links(page):
            if target.suffix == ".md" and target.exists() and target not in reached:
                reached.add(target)
                todo.append(target)
    orphans = [p.name for p in DOCS.glob("*.md") if p.resolve() not in reached]
    assert not orphans, f"docs pages no link from README.md leads to: {orphans}"


# --- the quick start, run as written ------------------------------------------------------------


def _shown_result_rows() -> tuple[str, list[str]]:
    """The title and the row names of the result table the README's quick start shows."""
    text = README.read_text(encoding="utf-8")
    after = text[text.index("<!-- ci:quickstart -->") :]
    shown = re.search(r"^```text\n(.*?)^```", after, re.S | re.M)
    assert shown, "README.md: no ```text block of output after the quick start"
    output = shown.group(1)
    title = next(line.strip() for line in output.splitlines() if line.strip())
    rows = re.findall(r"^│ (\S[^│]*?)\s+│", output, re.M)
    assert title and rows, "README.md: the quick start's output block shows no result table"
    return title, rows


def _expected_output(command: str) -> list[str]:
    """What the README says a quick-start command prints."""
    if "gpuopt.env" in command:
        return ["Devices gpuopt sees", "Environment fingerprint"]
    if "gpuopt.run" in command:
        title, rows = _shown_result_rows()
        return [title, *rows, "result:"]
    return []


@pytest.mark.slow
def test_the_quick_start_runs_as_written_and_prints_what_the_readme_shows(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("GPUOPT_OUTPUT_DIR", None)  # outputs/ of the fresh directory, as for a new user
    env["GPUOPT_CACHE_DIR"] = str(tmp_path / "cache")
    env["COLUMNS"] = "160"  # rich's width without a terminal: keep the table's rows whole
    env["PYTHONIOENCODING"] = "utf-8"
    env.pop("FORCE_COLOR", None)  # plain text: no colour codes inside "gpuopt trial: ok"
    commands = [c for c in _commands("quickstart") if NOT_RUN_BY_TESTS not in c]
    assert commands
    for command in commands:
        done = subprocess.run(
            command,
            shell=True,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{output[-4000:]}"
        missing = [s for s in _expected_output(command) if s not in output]
        assert not missing, f"{command!r} did not print {missing}:\n{output[-4000:]}"
    results = sorted(tmp_path.glob("outputs/runs/*/*/result.json"))
    assert results, "the quick start's measured run wrote no result.json under outputs/runs/"
    result = json.loads(results[-1].read_text())
    assert result["status"] == "ok"
    assert result["metrics"]["throughput"] > 0
