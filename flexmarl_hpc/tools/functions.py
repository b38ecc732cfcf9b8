"""Tool schemas, and a user's Python functions as tools that run in the sandbox.

    tools:
      functions: {lookup: my_pkg.my_tools:lookup}    # tools.functions in the run's config

A user tool is a module-level `def` in a file of the user's (stdlib only: the sandbox runs
`python -I -S`). Its module is never imported by the run: the file is found by name
(importlib's find_spec), the function's signature read with `ast` for its JSON schema, and
each call runs the file's source and then the function, with the model's arguments as
keyword arguments, in a sandbox of its own (tools/sandbox.py), like model-written code.
Its return value is the tool's output: a string as it is, anything else as JSON.
"""
from __future__ import annotations

import json

from flexmarl_hpc.config.tools import BUILTIN_TOOLS, FunctionSpec

BUILTIN_SCHEMAS = {
    "calculator": {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression (numbers, + - * / // % **, "
                                            "parentheses, sqrt, log, ...) and return its value.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    "python": {"type": "function", "function": {
        "name": "python", "description": "Run a Python program (standard library only) and return its stdout.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
}
BUILTIN_ARGUMENT = {"calculator": "expression", "python": "code"}
"""The one argument of each built-in tool: its text is what the tool runs."""
assert set(BUILTIN_SCHEMAS) == set(BUILTIN_ARGUMENT) == set(BUILTIN_TOOLS)   # the config refuses these names
DRIVER = """
import contextlib, json, sys
_ns = {{"__name__": "flexmarl_user_tool", "__file__": {file!r}}}
with contextlib.redirect_stdout(sys.stderr):        # the function's prints are not its output
    exec(compile({source!r}, {file!r}, "exec"), _ns)
    _value = _ns[{function!r}](**json.loads({arguments!r}))
sys.stdout.write(_value if isinstance(_value, str) else json.dumps(_value))
"""


def function_program(fn: FunctionSpec, arguments_json: str) -> str:
    """The sandbox's main.py for one call of a user tool."""
    return DRIVER.format(file=fn.file, source=fn.source, function=fn.function, arguments=arguments_json)


def argument_text(name: str, arguments: dict, user: dict[str, FunctionSpec]) -> str:
    """What a structured call sends to its tool (tools' wire form is one string): a built-in
    tool's one argument, a user tool's arguments as JSON. ValueError when the arguments do
    not fit the tool's schema (the model's mistake; the call is refused)."""
    if name in BUILTIN_ARGUMENT:
        key = BUILTIN_ARGUMENT[name]
        if set(arguments) != {key} or not isinstance(arguments[key], str):
            raise ValueError(f"{name}: expected arguments {{{key!r}: string}}, got {json.dumps(arguments)[:200]}")
        return arguments[key]
    if name not in user:
        raise ValueError(f"unknown tool {name!r}: expected one of {sorted([*BUILTIN_ARGUMENT, *user])}")
    params = user[name].schema["function"]["parameters"]
    unknown = sorted(set(arguments) - set(params["properties"]))
    missing = sorted(set(params["required"]) - set(arguments))
    if unknown or missing:
        raise ValueError(f"{name}: unknown arguments {unknown}, missing {missing}")
    return json.dumps(arguments)


def schema(name: str, user: dict[str, FunctionSpec]) -> dict:
    """A tool's JSON schema for `ctx.chat(tools=...)`, by name."""
    if name in BUILTIN_SCHEMAS:
        return BUILTIN_SCHEMAS[name]
    if name in user:
        return user[name].schema
    raise KeyError(f"tool {name!r}: expected one of {sorted([*BUILTIN_SCHEMAS, *user])}")
