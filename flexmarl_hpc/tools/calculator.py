"""Safe arithmetic for the calculator tool: the expression is parsed with `ast` and only a
whitelisted subset is evaluated (never eval): numbers, + - * / // % **, unary +/-,
parentheses, and a few math functions by name. Sizes are bounded before they are computed,
so `9**9**9` is refused in microseconds instead of running for hours.

    evaluate("2 * (3 + 4) ** 2")        # 98
"""
from __future__ import annotations

import ast
import math
import operator

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil,
             "log": math.log, "exp": math.exp, "sin": math.sin, "cos": math.cos, "tan": math.tan}
CONSTANTS = {"pi": math.pi, "e": math.e}
MAX_CHARS = 1000


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message says why."""


def _digits(x: int) -> int:
    return 1 if x == 0 else int(abs(x).bit_length() * 0.30103) + 1


def _power(base, exp, max_digits: int):
    """base ** exp, refused when the result would have more than max_digits digits."""
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
        if exp * math.log10(abs(base)) > max_digits:
            raise CalculatorError(f"power too large: about {exp * math.log10(abs(base)):.3g} digits "
                                  f"(at most {max_digits})")
    try:
        value = base ** exp
    except (OverflowError, ZeroDivisionError) as e:
        raise CalculatorError(f"{type(e).__name__}: {e}") from None
    if isinstance(value, complex):                  # (-8) ** (1/3)
        raise CalculatorError("the result is not a real number")
    return value


def _eval(node: ast.AST, max_digits: int):
    if isinstance(node, ast.Expression):
        return _eval(node.body, max_digits)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in CONSTANTS:
        return CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_eval(node.operand, max_digits))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _eval(node.left, max_digits), _eval(node.right, max_digits)
        if isinstance(node.op, ast.Pow):
            return _power(left, right, max_digits)
        try:
            value = BINARY[type(node.op)](left, right)
        except (ArithmeticError, ValueError) as e:
            raise CalculatorError(f"{type(e).__name__}: {e}") from None
        if isinstance(value, int) and _digits(value) > max_digits:
            raise CalculatorError(f"result too large (more than {max_digits} digits)")
        return value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
            and not node.keywords and len(node.args) <= 2):
        args = [_eval(a, max_digits) for a in node.args]
        if node.func.id == "round" and len(args) == 2 and not (isinstance(args[1], int) and abs(args[1]) <= 100):
            # int.__round__ computes 10 ** -ndigits: round(5, -10**9) would run for hours
            raise CalculatorError(f"round: ndigits must be an integer in [-100, 100], got {args[1]!r}")
        try:
            return FUNCTIONS[node.func.id](*args)
        except (ArithmeticError, ValueError, TypeError) as e:
            raise CalculatorError(f"{node.func.id}: {e}") from None
    raise CalculatorError(f"not allowed: {ast.dump(node)[:80]}")


def evaluate(expression: str, max_digits: int = 1000) -> int | float:
    """The value of an arithmetic expression; CalculatorError for anything else."""
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression too long: {len(expression)} characters (at most {MAX_CHARS})")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an expression: {e.msg}") from None
    return _eval(tree, max_digits)
