"""A tool-using agent written only against the official `openai` client (workflow.agent).

A solver is given one function, `calculate`, as OpenAI `tools=`; its first request forces
a call of it (tool_choice naming `calculate`: a small model never starts a call by itself, and
with `required` SmolLM2-135M named functions after the problem's people, docs/LOG.md), later
ones leave the choice to it; when a reply calls the tool, the program runs the call and asks
again with the result, as any OpenAI tool loop does:

    python -m flexmarl_hpc.workflows.openai_calculator http://localhost:8000/v1 "What is 12 * 30?" --answer 360

Trained (`workflow.agent: flexmarl_hpc.workflows.openai_calculator:main`, with
`tools.functions: {calculate: flexmarl_hpc.workflows.calculate_tool:calculate}`), the
endpoint returns the model's tool calls as OpenAI `tool_calls`, and `run_tools` has the
run execute them in its sandbox (`POST {base_url}/run_tools`, docs/episodes.md); against
any other server that route is missing and the function runs here. Nothing else of ours is
imported: the function's own file is standard library only.
"""
from __future__ import annotations

import argparse
import json
import re

import openai

from flexmarl_hpc.workflows.calculate_tool import calculate

TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression (numbers, + - * / // % and "
                                        "parentheses) and return its value.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
FORCE = {"type": "function", "function": {"name": "calculate"}}
ROUNDS = 2
"""Most tool round trips per example."""


def run_tools(client: openai.OpenAI, calls) -> list[dict]:
    """The `tool` messages answering `calls`: executed by the run's sandbox when the server
    offers it (the training endpoint's /run_tools), else here."""
    try:
        out = client.post("/run_tools", body={"tool_calls": [c.model_dump() for c in calls]}, cast_to=object)
        return out["messages"]
    except openai.NotFoundError:
        return [{"role": "tool", "tool_call_id": c.id, "content": _local(c)} for c in calls]


def _local(call) -> str:
    try:
        return calculate(**json.loads(call.function.arguments))
    except (TypeError, ValueError) as e:
        return f"error: {e}"


def main(base_url: str, example: dict) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Use the calculate tool, then answer with the number only."},
                {"role": "user", "content": example["question"]}]
    for i in range(ROUNDS):
        try:
            reply = client.chat.completions.create(model="solver", messages=messages, tools=TOOLS,
                                                   tool_choice=FORCE if i == 0 else "auto")
        except openai.UnprocessableEntityError:   # the forced call's arguments did not parse
            return {"solver": 0.0}
        message = reply.choices[0].message
        if not message.tool_calls:
            break
        messages += [message.model_dump(exclude_none=True), *run_tools(client, message.tool_calls)]
    else:
        reply = client.chat.completions.create(model="solver", messages=messages, tools=TOOLS)
    text = reply.choices[0].message.content or ""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    right = bool(numbers) and "answer" in example and float(numbers[-1]) == float(example["answer"])
    return {"solver": 1.0 if right else 0.0}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base_url")
    ap.add_argument("question")
    ap.add_argument("--answer", type=float)
    a = ap.parse_args()
    print(main(a.base_url, {"question": a.question, **({"answer": a.answer} if a.answer is not None else {})}))
