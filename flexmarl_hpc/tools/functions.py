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

import ast
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

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
JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array",
              "dict": "object"}


@dataclass(frozen=True)
class FunctionSpec:
    """A user tool as read from its file (nothing of it run here)."""
    name: str
    """The tool's name, as the model calls it (the key of tools.functions)."""
    file: str
    function: str
    source: str
    schema: dict


def read_function(name: str, spec: str) -> FunctionSpec:
    """`module:function` read from its file; ValueError saying what is wrong (config load)."""
    where = f"tools.functions.{name}"
    mod, _, fn = spec.partition(":")
    if not mod or not fn.isidentifier():
        raise ValueError(f"{where}: expected 'module:function', got {spec!r}")
    try:
        found = importlib.util.find_spec(mod)
    except (ImportError, ValueError) as e:
        raise ValueError(f"{where}: cannot find module {mod!r}: {e}") from None
    if found is None or not found.origin or not found.origin.endswith(".py"):
        raise ValueError(f"{where}: no Python file for module {mod!r}")
    source = Path(found.origin).read_text(encoding="utf-8")
    try:
        tree = ast.parse(source, found.origin)
    except SyntaxError as e:
        raise ValueError(f"{where}: {found.origin}:{e.lineno}: {e.msg}") from None
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == fn]
    if not defs:
        raise ValueError(f"{where}: {found.origin} has no module-level `def {fn}`")
    return FunctionSpec(name, found.origin, fn, source, _schema(name, defs[-1]))


def _schema(name: str, node: ast.FunctionDef) -> dict:
    """The OpenAI function schema of a def: its docstring's first paragraph, its arguments
    with their annotated types (plain names only; others are left untyped)."""
    args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
    n_defaults = len(node.args.defaults)
    plain = node.args.posonlyargs + node.args.args
    required = [a.arg for a in plain[:len(plain) - n_defaults]]
    required += [a.arg for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is None]
    props = {}
    for a in args:
        t = JSON_TYPES.get(a.annotation.id) if isinstance(a.annotation, ast.Name) else None
        props[a.arg] = {"type": t} if t else {}
    doc = (ast.get_docstring(node) or "").split("\n\n")[0].strip()
    return {"type": "function", "function": {"name": name, "description": doc, "parameters": {
        "type": "object", "properties": props, "required": required}}}


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
