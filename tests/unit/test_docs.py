"""The documentation's links and commands resolve.

    pytest -q tests/unit/test_docs.py

Every relative link of README.md and docs/*.md points to an existing file (and, with
`#anchor`, to a heading of it), and every `python -m flexmarl_hpc.<cli> [subcommand]` quoted
in them (a fenced code block or a backtick span) is found (that each answers `--help`, in a
child process: tests/integration/test_doc_commands.py).

Every repository path written anywhere (`flexmarl_hpc/run.py`, tests/unit/test_docs.py,
`configs/*.yaml`, and package-relative ones like `sim/driver.py`) in the docs, every docstring
(module, class, function), every comment, the config help texts, the CLIs' argparse help and
the configs' comments exists, or is a run's output; a
bare markdown name (LOG.md) is one of the root's, docs/ or tests/ (the design brief is not in the
repository, so it is not cited).
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from tests.conftest import ROOT
from tests.helpers import FENCE, commands, doc_files

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


TOP = ("flexmarl_hpc", "tests", "scripts", "docs", "configs", "bench", "slurm", "data", "runs")
# a path ends on a word character or a glob star, so "docs/LOG.md." and "`runs/{name}`" cut cleanly
REPO_PATH = re.compile(rf"(?<![\w./-])(?:{'|'.join(TOP)})/[\w./*-]*[\w*]")
BARE_MD = re.compile(r"(?<![\w./-])[\w-]+\.md\b")
# What docs quote as examples but a run or a script writes (both git-ignored), not the repository.
OUTPUTS = ("runs",              # run folders (run.out_dir) that every run writes
           "data/math_team")    # scripts/make_math_team_data.py writes it


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


def python_prose(py: Path, where: str) -> list[tuple[str, str]]:
    """(where:line, text) of a Python file's docstrings (module, class, function; a config
    field's attribute docstring), argparse `help=` strings and comments."""
    src = py.read_text(encoding="utf-8")
    tree = ast.parse(src)
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str):
            out.append((f"{where}:{n.lineno}", n.value.value))       # every docstring, attribute ones too
        elif isinstance(n, ast.keyword) and n.arg == "help" and isinstance(n.value, ast.Constant):
            out.append((f"{where}:{n.value.lineno}", str(n.value.value)))
    out += [(f"{where}:{t.start[0]}", t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
            if t.type == tokenize.COMMENT]
    return out


def prose(root: Path = ROOT) -> list[tuple[str, str]]:
    """(where, text) of every place that names repository paths: the docs, the Python files'
    docstrings, help texts and comments (python_prose), and the configs."""
    mds = [*doc_files(root), root / "tests" / "README.md"]
    out = [(str(md.relative_to(root)), md.read_text(encoding="utf-8")) for md in mds if md.exists()]
    for py in sorted(p for d in ("flexmarl_hpc", "tests", "scripts", "bench") for p in (root / d).rglob("*.py")):
        out += python_prose(py, str(py.relative_to(root)))
    yamls = [*sorted((root / "configs").rglob("*.yaml")), root / "environment.yml"]
    return out + [(str(y.relative_to(root)), y.read_text(encoding="utf-8")) for y in yamls if y.exists()]


def package_dirs(root: Path) -> list[str]:
    pkg = root / "flexmarl_hpc"
    return sorted(p.name for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()) if pkg.exists() else []


def missing_paths(texts: list[tuple[str, str]], root: Path = ROOT) -> list[str]:
    """'where: path' for each repository path named in `texts` that is not there (a glob:
    that matches nothing); `sim/driver.py` is looked up under flexmarl_hpc/."""
    def there(path: str) -> bool:
        return any(root.glob(path)) if "*" in path else (root / path).exists()
    sub = package_dirs(root)
    relative = re.compile(rf"(?<![\w./-])(?:{'|'.join(sub)})/[\w./*-]*\.(?:py|yaml)\b") if sub else None
    bad = []
    for where, text in texts:
        for path in dict.fromkeys(REPO_PATH.findall(text)):
            if not there(path) and not any(path == o or path.startswith(o + "/") for o in OUTPUTS):
                bad.append(f"{where}: {path}")
        for path in dict.fromkeys(relative.findall(text) if relative else []):
            if not there(f"flexmarl_hpc/{path}") and not there(path):
                bad.append(f"{where}: {path}")
        for name in dict.fromkeys(BARE_MD.findall(text)):      # "LOG.md" for docs/LOG.md
            if not any(there(f"{d}/{name}") for d in (".", "docs", "tests")):
                bad.append(f"{where}: {name}")
    return bad


def test_every_repository_path_named_exists():
    assert missing_paths(prose()) == []


def test_the_path_check_catches_a_moved_file(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "flexmarl_hpc" / "sim").mkdir(parents=True)
    for f in ("docs/x.md", "flexmarl_hpc/sim/__init__.py", "flexmarl_hpc/sim/driver.py", "flexmarl_hpc/run.py"):
        (tmp_path / f).write_text("")
    (tmp_path / "README.md").write_text(
        "`flexmarl_hpc/run.py`, docs/x.md. `sim/driver.py`, `docs/*.md`, `runs/{name}`, runs/local/local.h5\n"
        "Old: tests/test_docs.py, `sim/gone.py`, `configs/*.yaml`, scripts/eval_episodes.py, x.md, DESIGN.md.\n")
    (tmp_path / "flexmarl_hpc" / "run.py").write_text(
        '"""See bench/bench_sync_deadline.py."""\nimport argparse\n\n\ndef f():\n'
        '    """Reads sim/build.py."""\n    argparse.ArgumentParser().add_argument("-x", help="as in sim/faults.py")\n'
        '    return 1  # like sim/workers.py\n')
    assert missing_paths(prose(tmp_path), tmp_path) == [
        "README.md: tests/test_docs.py", "README.md: configs/*.yaml", "README.md: scripts/eval_episodes.py",
        "README.md: sim/gone.py", "README.md: DESIGN.md", "flexmarl_hpc/run.py:1: bench/bench_sync_deadline.py",
        "flexmarl_hpc/run.py:6: sim/build.py", "flexmarl_hpc/run.py:7: sim/faults.py", "flexmarl_hpc/run.py:8: sim/workers.py"]


def test_the_docs_list_every_message():
    """architecture.md names every command and reply of runtime/messages.py."""
    from flexmarl_hpc.runtime.messages import COMMANDS, REPLIES
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert [c.__name__ for c in COMMANDS + REPLIES if f"`{c.__name__}`" not in text] == []


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
