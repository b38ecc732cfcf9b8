"""The documentation's links and commands resolve.

    pytest -q tests/test_docs.py

Every relative link of README.md and docs/*.md points to an existing file (and, with
`#anchor`, to a heading of it), and every `python -m flexmarl_hpc.<cli> [subcommand]` quoted
in them (a fenced code block or a backtick span) answers `--help` with exit code 0.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
CLI = re.compile(r"python -m flexmarl_hpc\.([A-Za-z_][\w.]*)((?:[ \t]+[^\s`#|]+)*)")
SUBCOMMAND = re.compile(r"[a-z][a-z_-]*")


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, blanks -> '-'."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in HEADING.findall(FENCE.sub("", md.read_text(encoding="utf-8"))):
        s = slug(h)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def broken_links(files: list[Path]) -> list[str]:
    """'file: target (why)' for each relative link that does not resolve."""
    bad = []
    for md in files:
        for target in LINK.findall(FENCE.sub("", md.read_text(encoding="utf-8"))):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):        # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                bad.append(f"{md.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{md.name}: {target} (no such heading)")
    return bad


def quoted(text: str) -> list[str]:
    """The text of fenced code blocks and backtick spans."""
    blocks = [m.group(0) for m in FENCE.finditer(text)]
    spans = re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    return blocks + spans


def commands(files: list[Path]) -> set[tuple[str, str]]:
    """Distinct (cli, subcommand) pairs quoted in the docs; subcommand '' when there is none.

    The first word after the module that is not an option is a subcommand only when it looks
    like one (a lower-case word): not a path, a config, a run file, a number or an override."""
    found = set()
    for md in files:
        for chunk in quoted(md.read_text(encoding="utf-8")):
            for cli, rest in CLI.findall(chunk):
                words = [w for w in rest.split() if not w.startswith("-")]
                first = words[0] if words else ""
                sub = first if SUBCOMMAND.fullmatch(first) else ""
                found.add((cli.rstrip("."), sub))
    return found


def help_fails(cli: str, sub: str) -> str | None:
    """None when `python -m flexmarl_hpc.<cli> [sub] --help` works, else why not."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, "-m", f"flexmarl_hpc.{cli}", *([sub] if sub else []), "--help"]
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    if p.returncode != 0:
        return f"rc {p.returncode}: {(p.stderr or p.stdout).strip()[-400:]}"
    usage = p.stdout.split("\n\n", 1)[0]
    if sub and not re.search(rf"flexmarl_hpc\.{re.escape(cli)} {re.escape(sub)}\b", usage):
        # argparse would take an unknown word for a positional argument and still print help
        return f"'{sub}' is not a subcommand ({' '.join(usage.split())[:200]})"
    return None


def test_every_relative_link_resolves():
    assert broken_links(doc_files()) == []


def test_the_link_check_catches_a_missing_file_and_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Top\n\n## A `b` c\n\n[ok](#a-b-c) [ok](docs/x.md#x)\n"
                                        "[gone](docs/nope.md) [no](docs/x.md#nope)\n"
                                        "```\n[in code](ignored.md)\n```\n")
    (tmp_path / "docs" / "x.md").write_text("# X\n\n[up](../README.md#top) [bad](../README.md#missing)\n")
    assert broken_links(doc_files(tmp_path)) == [
        "README.md: docs/nope.md (no such file)", "README.md: docs/x.md#nope (no such heading)",
        "x.md: ../README.md#missing (no such heading)"]


def test_commands_are_parsed_with_and_without_subcommands(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "```bash\n.venv/bin/python -m flexmarl_hpc.run configs/local.yaml trainer.lr=3e-4\n"
        "python -m flexmarl_hpc.simulate plan configs/x.yaml --nodes 48\n"
        "python -m flexmarl_hpc.status 4242 --follow\n```\n"
        "Then `python -m flexmarl_hpc.simulate --json compare CONFIG` and "
        "`python -m flexmarl_hpc.sim.plan --nodes 48`; prose python -m flexmarl_hpc.ignored is not quoted.\n")
    assert commands(doc_files(tmp_path)) == {("run", ""), ("simulate", "plan"), ("status", ""),
                                             ("simulate", "compare"), ("sim.plan", "")}


def test_help_check_fails_for_a_word_that_is_no_subcommand():
    assert help_fails("analyze", "") is None
    assert "not a subcommand" in help_fails("analyze", "nosuchcommand")


@pytest.mark.parametrize("cli,sub", sorted(commands(doc_files())), ids=lambda v: v or "-")
def test_every_quoted_command_answers_help(cli, sub):
    assert help_fails(cli, sub) is None
