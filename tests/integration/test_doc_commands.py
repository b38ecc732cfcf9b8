"""Every `python -m flexmarl_hpc.<cli> [subcommand]` quoted in README.md and docs/*.md (a fenced
code block or a backtick span; tests/helpers.py commands) answers `--help` with exit code 0,
each in a fresh python. The docs' links and paths: tests/unit/test_docs.py.

    pytest -q tests/integration/test_doc_commands.py
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.helpers import commands, doc_files


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


def test_help_check_fails_for_a_word_that_is_no_subcommand():
    assert help_fails("analyze", "") is None
    assert "not a subcommand" in help_fails("analyze", "nosuchcommand")


@pytest.mark.parametrize("cli,sub", sorted(commands(doc_files())), ids=lambda v: v or "-")
def test_every_quoted_command_answers_help(cli, sub):
    assert help_fails(cli, sub) is None
