"""Tool calls parsed from a reply, in the model's own tool-call format (pure: no I/O).

    calls, errors = parse_tool_calls(reply_text, "hermes", prefix="solver-0")
    calls[0].name, calls[0].arguments, calls[0].id       # 'calculator', {'expression': '3+4'}, 'solver-0-0'

Hermes, as Qwen2.5 (and Hermes-2/3, Qwen3) write it: each call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, the form their
chat templates ask for when `tools` are rendered. A block that is no such object is a
`ToolCallError` (the model's mistake, reported to it), never an exception. A format this
module does not know is refused by name (`parser_for`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from flexmarl_hpc.config.schema import TOOL_CALL_FORMATS


@dataclass(frozen=True)
class ToolRequest:
    """One tool call a model asked for."""
    name: str
    arguments: dict[str, Any]
    """The call's JSON arguments, as decoded."""
    id: str
    """Unique in the episode ('<agent>-<call>-<k>': the reply's call index and the block's
    position), so a tool message can name the call it answers (`tool_call_id`)."""


@dataclass(frozen=True)
class ToolCallError:
    """A tool-call block that could not be read: the block's text and why."""
    text: str
    error: str
    id: str


HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def parse_hermes(text: str, prefix: str = "call") -> tuple[list[ToolRequest], list[ToolCallError]]:
    """Every `<tool_call>` block of `text`, in order; a block cut by the end of the reply (no
    closing tag) is still read, since a reply cut at max_tokens may end inside one."""
    calls, errors = [], []
    for k, m in enumerate(HERMES_BLOCK.finditer(text)):
        body, cid = m.group(1).strip(), f"{prefix}-{k}"
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(ToolCallError(body, f"invalid JSON: {e}", cid))
            continue
        why = _shape_error(obj)
        if why:
            errors.append(ToolCallError(body, why, cid))
        else:
            calls.append(ToolRequest(obj["name"], dict(obj.get("arguments") or {}), cid))
    return calls, errors


def _shape_error(obj: Any) -> str:
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    if not isinstance(obj.get("name"), str) or not obj["name"]:
        return "expected a string 'name'"
    if not isinstance(obj.get("arguments", {}), (dict, type(None))):
        return f"expected 'arguments' to be an object, got {type(obj['arguments']).__name__}"
    return ""


def hermes_content(text: str) -> str:
    """The reply's text before its first `<tool_call>` block (all of it when there is none),
    as vLLM's hermes parser returns it beside the calls (the OpenAI endpoint's `content`)."""
    return text[:text.find("<tool_call>")] if "<tool_call>" in text else text


def hermes_prefill(name: str | None) -> str:
    """The opening of a call block, as Qwen2.5's template renders an assistant's tool call
    (`<tool_call>\\n{"name": "X", "arguments": ...}`): of function `name`, or of any function
    (None: up to the name's opening quote, so the model writes the name). A reply that starts
    with it is a call of that function unless the model breaks the JSON (nothing constrains
    the rest: OpenAI's tool_choice 'required' or a named function, without a grammar)."""
    head = '<tool_call>\n{"name": '
    return head + '"' if name is None else head + json.dumps(name, ensure_ascii=False) + ', "arguments": '


FORMATS: dict[str, Callable[..., tuple[list[ToolRequest], list[ToolCallError]]]] = {"hermes": parse_hermes}
"""Tool-call formats by name (workflow.tool_formats; the config checks against TOOL_CALL_FORMATS)."""
CONTENT: dict[str, Callable[[str], str]] = {"hermes": hermes_content}
"""The prose of a reply beside its tool calls, by format."""
PREFILL: dict[str, Callable[[str | None], str]] = {"hermes": hermes_prefill}
"""The text that starts a reply forced to call a function (None: any function), by format."""
assert set(FORMATS) == set(CONTENT) == set(PREFILL) == set(TOOL_CALL_FORMATS)


def parser_for(name: str) -> Callable[..., tuple[list[ToolRequest], list[ToolCallError]]]:
    """The parser of a format; ValueError naming the format and the known ones otherwise."""
    if name not in FORMATS:
        raise ValueError(f"tool-call format {name!r}: expected one of {sorted(FORMATS)}")
    return FORMATS[name]


def tool_message(request_id: str, name: str, content: str) -> dict:
    """A result as the `tool` message chat templates render (OpenAI's fields)."""
    return {"role": "tool", "tool_call_id": request_id, "name": name, "content": content}
