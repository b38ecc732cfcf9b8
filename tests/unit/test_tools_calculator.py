"""The calculator evaluates arithmetic and refuses everything else, including code and
results too large to compute; the tool registry and its config name bad input.

    pytest tests/unit/test_tools_calculator.py
"""
from __future__ import annotations

import asyncio
import math

import pytest

from flexmarl_hpc.tools.calculator import CalculatorError, evaluate
from flexmarl_hpc.config.tools import ToolsConfig
from flexmarl_hpc.config.validate import check_bounds
from flexmarl_hpc.tools.registry import Tools


@pytest.mark.parametrize("expr,value", [("2 * (3 + 4) ** 2", 98), ("-7 // 2", -4), ("7 % 3", 1), ("1 / 4", 0.25),
                                        ("2 ** -2", 0.25), ("sqrt(16) + abs(-1)", 5.0), ("round(2.567, 2)", 2.57),
                                        ("2 * pi", 2 * math.pi), ("10 ** 999", 10 ** 999)])
def test_arithmetic(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr,why", [
    ("__import__('os').system('touch /tmp/pwned')", "not allowed"), ("(1).__class__.__bases__", "not allowed"),
    ("open('/etc/passwd')", "not allowed"), ("[x for x in range(10)]", "not allowed"), ("lambda: 1", "not allowed"),
    ("'a' * 10", "not allowed"), ("x = 1", "not an expression"), ("sqrt(-1)", "sqrt"),
    ("1 / 0", "ZeroDivisionError"), ("9 ** 9 ** 9", "power too large"), ("(10 ** 999) ** 2", "power too large"),
    ("10 ** 600 * 10 ** 600", "too large"), ("2 ** 1e10", "OverflowError"), ("round(5, -10 ** 9)", "ndigits"),
    ("(-8) ** (1 / 3)", "not a real number"), ("1" + " + 1" * 600, "too long")])
def test_refused(expr, why):
    with pytest.raises(CalculatorError, match=why):
        evaluate(expr)


def test_the_digit_bound_is_the_configured_one():
    assert evaluate("10 ** 20", max_digits=25) == 10 ** 20
    with pytest.raises(CalculatorError, match="at most 10"):
        evaluate("10 ** 20", max_digits=10)


def test_the_calculator_tool_gives_an_error_string_never_an_exception():
    tools = Tools.from_config(ToolsConfig())
    ok, bad = asyncio.run(tools.calculator("6 * 7")), asyncio.run(tools.calculator("9 ** 9 ** 9"))
    assert (ok.tool, ok.output, ok.outcome) == ("calculator", "42", "ok")
    assert bad.outcome == "refused" and bad.output.startswith("error: power too large")


def test_unknown_tools_and_bad_config_fields_are_named():
    with pytest.raises(KeyError, match="tool 'shell': expected one of 'calculator', 'python'"):
        Tools.from_config(ToolsConfig()).get("shell")
    with pytest.raises(ValueError, match=r"^tools.cpu_s: expected >= 1, got 0$"):    # its bound
        check_bounds(ToolsConfig(cpu_s=0), "tools")
    with pytest.raises(ValueError, match="tools.python: expected an executable interpreter"):
        ToolsConfig(python="/nonexistent/python")
