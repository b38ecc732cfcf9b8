"""One direction of dependency (issue 39): the package's folders import only downward
(LAYERS), no file-level import cycle, and no test module imports another. What a process
loads (torch, mpi4py) is probed in a child: tests/integration/test_import_probes.py.

    pytest tests/unit/test_imports.py
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT


def import_cycles(package: Path) -> list[list[str]]:
    """The file-level import cycles of `package` (strongly connected sets of modules, sorted)."""
    files = {".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in package.rglob("*.py")}
    graph = {m: all_imports(ast.parse(p.read_text(encoding="utf-8")), set(files)) - {m} for m, p in files.items()}
    reach = {m: set() for m in graph}
    for m in graph:                                  # graph of ~250 files: a search from each is fine
        todo = list(graph[m])
        while todo:
            n = todo.pop()
            if n not in reach[m]:
                reach[m].add(n)
                todo.extend(graph[n])
    cycles = {tuple(sorted(n for n in reach[m] if m in reach[n])) for m in graph if m in reach[m]}
    return sorted(list(c) for c in cycles)


def test_no_file_level_import_cycle():
    """One direction of dependency (issue 39): no module imports, at import time or inside a
    function, one that imports it back."""
    assert import_cycles(ROOT / "flexmarl_hpc") == []


def test_the_cycle_check_sees_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "sub/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("import pkg.c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.e\n"
                              "from pkg import a\n\ndef f():\n    import pkg.d\n")
    (pkg / "d.py").write_text("import pkg.c\n")                  # back through a deferred import: counted
    (pkg / "e.py").write_text("import pkg.c\n")                  # back through TYPE_CHECKING only: not
    assert import_cycles(pkg) == [["pkg.a", "pkg.c", "pkg.d", "pkg.sub.b"]]


LAYERS = [
    ["clock"],
    ["faults"],
    ["config"],
    ["learn"],
    ["tools"],
    ["workflows"],
    ["store"],
    ["runtime"],
    ["rollout", "trainer"],
    ["orchestrator", "analysis", "launch"],
    ["ranks"],                       # a job's rank wiring: rank 0 runs the orchestrator
    ["sim"],
    ["run", "simulate", "analyze", "export", "status"],
    ["submit"],                      # its Slurm task calls run.main
]
"""The package's folders (and top-level modules), lowest first: a module imports only from its
own folder and the layers below (docs/architecture.md draws them). Within a layer the folders
do not import each other."""


def all_imports(tree: ast.AST, mods: set[str] | None = None) -> set[str]:
    """Every `flexmarl_hpc...` module a file names in an import, at module level or inside a
    function (a deferred import is still a dependency), except under `if TYPE_CHECKING`.
    `from pkg import x` names pkg.x where that is one of `mods`, else pkg (both if no `mods`).
    One walk, one filter at the end (a filter at every node made the cycle test 16 s)."""
    found: set[str] = set()
    todo = [tree]
    while todo:
        n = todo.pop()
        if isinstance(n, ast.If) and _type_checking(n.test):
            todo.extend(n.orelse)
            continue
        if isinstance(n, ast.Import):
            found.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
            for a in n.names:
                sub = f"{n.module}.{a.name}"
                found.update([sub, n.module] if mods is None else [sub if sub in mods else n.module])
        todo.extend(ast.iter_child_nodes(n))
    return found & mods if mods is not None else {m for m in found if m.startswith("flexmarl_hpc.")}


def _type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def upward_imports(package: Path, layers: list[list[str]]) -> list[str]:
    """'file: module' for each import of `package` that reaches a layer above its own, or a
    sibling folder of the same layer; also each folder not placed in `layers`."""
    layer = {name: i for i, names in enumerate(layers) for name in names}
    bad = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        if parts == ("__init__",):
            continue
        here = parts[0]
        if here not in layer:
            bad.append(f"{path.relative_to(package.parent)}: folder {here!r} has no layer")
            continue
        for mod in sorted(all_imports(ast.parse(path.read_text(encoding="utf-8")))):
            there = mod.split(".")[1] if "." in mod else ""
            if there in ("", here) or there not in layer and there not in {p.stem for p in package.glob("*.py")}:
                continue
            if there not in layer or layer[there] >= layer[here]:
                bad.append(f"{path.relative_to(package.parent)}: {mod}")
    return sorted(set(bad))


def test_folders_import_only_downward():
    """Issue 39: config -> learn -> tools -> workflows -> store -> runtime parts -> backends ->
    orchestrator -> ranks -> simulator -> CLIs; 0 upward or sideways imports."""
    assert upward_imports(ROOT / "flexmarl_hpc", LAYERS) == []


def test_the_layer_check_sees_an_upward_and_a_sideways_import(tmp_path):
    pkg = tmp_path / "flexmarl_hpc"
    for d in ("config", "runtime", "rollout", "trainer"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "config" / "a.py").write_text("def f():\n    from flexmarl_hpc.runtime import comm\n")
    (pkg / "rollout" / "b.py").write_text("from flexmarl_hpc.trainer.base import x\nfrom flexmarl_hpc.config import a\n")
    (pkg / "trainer" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from flexmarl_hpc.rollout import b\nimport flexmarl_hpc.runtime\n")
    layers = [["config"], ["runtime"], ["rollout", "trainer"]]
    assert upward_imports(pkg, layers) == ["flexmarl_hpc/config/a.py: flexmarl_hpc.runtime",
                                           "flexmarl_hpc/config/a.py: flexmarl_hpc.runtime.comm",
                                           "flexmarl_hpc/rollout/b.py: flexmarl_hpc.trainer.base",
                                           "flexmarl_hpc/rollout/b.py: flexmarl_hpc.trainer.base.x"]


def test_no_test_module_imports_another():
    """tests/README.md: shared code lives in tests/conftest.py (fixtures) and tests/helpers.py;
    a test module importing another runs the other's module-level code and hides what it
    shares (9 such imports were found and moved)."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for mod in _test_imports(path):
            found.append(f"{path.relative_to(ROOT)}: {mod}")
    assert found == []


def _test_imports(path: Path) -> list[str]:
    out = []
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
            [n.module] if isinstance(n, ast.ImportFrom) and n.module else []
        out += [m for m in names if m.startswith("tests.") and m.rsplit(".", 1)[-1].startswith("test_")]
    return out
