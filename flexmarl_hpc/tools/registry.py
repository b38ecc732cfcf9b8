"""The bundled tools and a small typed registry of them, built from the config and passed
to whoever calls tools (no global, string-keyed registry).

    tools = Tools.from_config(ToolsConfig())
    call = await tools.calculator("2 ** 10")        # ToolCall(output='1024', outcome='ok', ...)
    call = await tools.python("print(sum(range(10)))")

Every tool is an async callable from the argument text to a ToolCall, and never raises for
bad input: the model gets an error string and the call a defined outcome.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from flexmarl_hpc.config.tools import FunctionSpec, ToolsConfig, read_function
from flexmarl_hpc.tools.calculator import CalculatorError, evaluate
from flexmarl_hpc.tools.functions import function_program
from flexmarl_hpc.tools.sandbox import SandboxResult, run_code


@dataclass(frozen=True)
class ToolCall:
    tool: str
    output: str
    """The text given back to the model (an error string when the call failed)."""
    outcome: str
    """'ok', or why not: sandbox.OUTCOMES, or 'refused' for input a tool will not run."""
    latency_s: float
    sandbox: SandboxResult | None = None
    """The python tool's full result (limits hit, isolation in force)."""


class Calculator:
    """Safe arithmetic (calculator.py), run on a thread so a long one never holds the loop."""

    name = "calculator"

    def __init__(self, cfg: ToolsConfig):
        self.max_digits = cfg.calc_max_digits

    def compute(self, expression: str) -> tuple[str, str]:
        try:
            return str(evaluate(expression, self.max_digits)), "ok"
        except CalculatorError as e:
            return f"error: {e}", "refused"

    async def __call__(self, expression: str) -> ToolCall:
        t0 = time.perf_counter()
        output, outcome = await asyncio.get_running_loop().run_in_executor(None, self.compute, expression)
        return ToolCall(self.name, output, outcome, time.perf_counter() - t0)


class PythonExecutor:
    """Runs the argument as a Python program in the sandbox; the output is its stdout, and
    on failure its stderr and the outcome."""

    name = "python"

    def __init__(self, cfg: ToolsConfig):
        self.cfg = cfg

    async def __call__(self, code: str) -> ToolCall:
        r = await run_code(code, self.cfg)
        output = r.stdout if r.outcome == "ok" else f"{r.stdout}{r.stderr}[{r.outcome}]"
        return ToolCall(self.name, output, r.outcome, r.wall_s, r)


class UserTool:
    """A user's function (tools.functions) run in the sandbox: its argument is the JSON of
    its keyword arguments; its output the return value (tools/functions.py)."""

    def __init__(self, spec: FunctionSpec, cfg: ToolsConfig):
        self.spec, self.cfg, self.name = spec, cfg, spec.name

    async def __call__(self, arguments_json: str) -> ToolCall:
        r = await run_code(function_program(self.spec, arguments_json), self.cfg)
        output = r.stdout if r.outcome == "ok" else f"{r.stderr}[{r.outcome}]"
        return ToolCall(self.name, output, r.outcome, r.wall_s, r)


@dataclass(frozen=True)
class Tools:
    calculator: Calculator
    python: PythonExecutor
    functions: dict[str, UserTool] = field(default_factory=dict)
    """The user's tools by name (tools.functions)."""

    @classmethod
    def from_config(cls, cfg: ToolsConfig) -> "Tools":
        user = {name: UserTool(read_function(name, spec), cfg) for name, spec in cfg.functions.items()}
        return cls(Calculator(cfg), PythonExecutor(cfg), user)

    @property
    def specs(self) -> dict[str, FunctionSpec]:
        return {name: t.spec for name, t in self.functions.items()}

    def get(self, name: str):
        """The tool called `name` (as a model names it in a tool call)."""
        if name in self.functions:
            return self.functions[name]
        if name not in ("calculator", "python"):
            raise KeyError(f"tool {name!r}: expected one of "
                           f"{', '.join(map(repr, ['calculator', 'python', *self.functions]))}")
        return getattr(self, name)
