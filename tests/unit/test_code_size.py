"""The size rule of flexmarl_hpc/: no function over 60 lines, no class over 400, counted from
the `def`/`class` line to its last line (docstring included). A long function is a sign that
a pure core and its thin shell were not split.

    pytest tests/unit/test_code_size.py
"""
from __future__ import annotations

import ast

from tests.conftest import ROOT

PACKAGE = ROOT / "flexmarl_hpc"
MAX_FUNCTION, MAX_CLASS = 60, 400


def oversized(path) -> list[str]:
    return oversized_under(path, ROOT)


def oversized_under(path, root) -> list[str]:
    """`file: name (n lines)` for each function or class of the file over its limit; methods
    and nested functions are named by their dotted path."""
    rel = path.relative_to(root)
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                limit = MAX_CLASS if isinstance(child, ast.ClassDef) else MAX_FUNCTION
                lines = child.end_lineno - child.lineno + 1
                if lines > limit:
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    found.append(f"{rel}: {kind} {name} ({lines} lines > {limit})")
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), filename=str(path)), "")
    return found


def test_no_function_over_60_lines_and_no_class_over_400():
    over = [line for path in sorted(PACKAGE.rglob("*.py")) for line in oversized(path)]
    assert not over, "too long (split into a pure core and a thin shell):\n" + "\n".join(over)


def test_the_rule_sees_a_long_method_and_a_long_class(tmp_path):
    src = tmp_path / "flexmarl_hpc" / "m.py"
    src.parent.mkdir()
    body = "".join(f"        x{i} = {i}\n" for i in range(60))
    src.write_text("class Big:\n    def long(self):\n" + body + "".join(f"    y{i} = {i}\n" for i in range(340)))
    found = oversized_under(src, tmp_path)
    assert found == ["flexmarl_hpc/m.py: class Big (402 lines > 400)",
                     "flexmarl_hpc/m.py: function Big.long (61 lines > 60)"]
