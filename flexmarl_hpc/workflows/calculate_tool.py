"""The one function of the tool-using `openai` example (openai_calculator.py): standard
library only, so that a run can execute it in the sandbox as a user tool
(`tools.functions: {calculate: flexmarl_hpc.workflows.calculate_tool:calculate}`,
docs/tools.md), and the program itself can run it against any other server.
"""
import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // % and parentheses) and return its value."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:80]}")   # no names, calls or powers

    try:
        out = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(out) if isinstance(out, float) and out.is_integer() else out)
