"""Every global name a module reads is defined in it (imported, assigned, a def or a class)
or is a builtin, and every name it imports is used: pyflakes' two checks, made with the
standard library's symtable and ast. A moved function can leave a caller's import behind and
only the code path that calls it finds out (issue 39's layering left `ranks/build.py` without
`ModelArgs`: the unit tier passed, a torch trainer rank died with a NameError at start); an
import nothing reads is a dependency the layer check counts for nothing. An intended
re-export says so with `# noqa` on its import.

    pytest tests/unit/test_names.py
"""
from __future__ import annotations

import ast
import builtins
import re
import symtable

from tests.conftest import ROOT

MODULE_NAMES = {"__file__", "__name__", "__doc__", "__spec__", "__builtins__", "__path__", "__loader__",
                "__package__", "__annotations__"}


def undefined_names(source: str, filename: str) -> list[str]:
    """The global names `source` reads anywhere (module level, functions, classes) that it
    never binds at module level and that are not builtins."""
    top = symtable.symtable(source, filename, "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    known = bound | set(dir(builtins)) | MODULE_NAMES
    found: set[str] = set()

    def visit(table: symtable.SymbolTable) -> None:
        local = table.get_type() != "module"
        for s in table.get_symbols():
            if not s.is_referenced() or s.get_name() in known:
                continue
            if local and (s.is_assigned() or s.is_parameter() or s.is_imported() or not s.is_global()):
                continue
            found.add(s.get_name())
        for child in table.get_children():
            visit(child)
    visit(top)
    return sorted(found)


def findings(check) -> dict[str, list[str]]:
    """{file: what `check(source, filename)` found} over the repository's Python files."""
    files = sorted(p for d in ("flexmarl_hpc", "tests", "scripts", "bench") for p in (ROOT / d).rglob("*.py"))
    return {str(p.relative_to(ROOT)): found for p in files
            if (found := check(p.read_text(encoding="utf-8"), str(p)))}


def test_no_module_reads_an_undefined_global_name():
    assert findings(undefined_names) == {}


def test_the_check_sees_a_name_a_move_left_behind():
    src = ("import os\nfrom typing import TYPE_CHECKING\n\n\ndef f(a, *, b=1):\n    c = a + b\n"
           "    return ModelArgs(c, os.sep, [x for x in range(c)])\n\n\nclass A:\n    y = Foo\n"
           "    def g(self):\n        return self.y, lambda q: q, len\n")
    assert undefined_names(src, "x.py") == ["Foo", "ModelArgs"]
    assert undefined_names("ModelArgs = 1\ndef f():\n    return ModelArgs\n", "x.py") == []


def _imports(body: list[ast.stmt]):
    for n in body:
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            yield n
        elif isinstance(n, (ast.If, ast.Try)):
            yield from _imports(n.body + n.orelse + getattr(n, "finalbody", [])
                                + [s for h in getattr(n, "handlers", []) for s in h.body])


def unused_imports(source: str, filename: str) -> list[str]:
    """'line: name' for each module-level import that nothing in the file reads: no name,
    no annotation (a string one too), no `__all__` entry; `# noqa` on the import keeps it."""
    tree = ast.parse(source, filename)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    for n in ast.walk(tree):
        for ann in (getattr(n, "annotation", None), getattr(n, "returns", None)):
            for c in ast.walk(ann) if ann is not None else ():
                if isinstance(c, ast.Constant) and isinstance(c.value, str):
                    used |= set(re.findall(r"[A-Za-z_]\w*", c.value))
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets):
            used |= {e.value for e in getattr(n.value, "elts", []) if isinstance(e, ast.Constant)}
    lines = source.splitlines()
    out = []
    for n in _imports(tree.body):
        if isinstance(n, ast.ImportFrom) and n.module == "__future__" or \
                "noqa" in "\n".join(lines[n.lineno - 1:n.end_lineno]):
            continue
        out += [f"{n.lineno}: {a.asname or a.name}" for a in n.names
                if (a.asname or a.name).split(".")[0] not in used]
    return out


def test_no_module_imports_a_name_it_does_not_use():
    assert findings(unused_imports) == {}


def test_the_unused_import_check_sees_one_and_keeps_the_used_ones():
    src = ("from __future__ import annotations\nimport os\nimport sys\nimport numpy as np  # noqa: F401\n"
           "from typing import Any, Callable\nfrom pathlib import Path\nimport a.b\n\n\n"
           "def f(x: Any) -> \"Path\":\n    return a.b.c(os.sep)\n")
    assert unused_imports(src, "x.py") == ["3: sys", "5: Callable"]
