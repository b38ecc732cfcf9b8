"""A writer and a critic written only against the official `openai` client (workflow.agent).

Nothing here knows about training: it runs unchanged against any OpenAI-compatible server
that serves models named `writer` and `critic` (vLLM, a hosted API behind a gateway):

    python -m flexmarl_hpc.workflows.openai_writer_critic http://localhost:8000/v1 "What is 2 + 3?" --answer 5

and trains with `workflow.agent: flexmarl_hpc.workflows.openai_writer_critic:main`
(configs/openai_writer_critic.yaml, docs/episodes.md#agents-written-against-openai). The
routing is dynamic: the critic either accepts the draft or sends it back with a note, and
the writer then revises it in its own growing conversation (so the follow-up request
extends the earlier one and its sampled ids are reused), up to ROUNDS drafts.
"""
from __future__ import annotations

import argparse
import re

from openai import OpenAI

ROUNDS = 2
"""Most drafts of the writer per example."""


def main(base_url: str, example: dict) -> dict:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    question = example["question"]
    messages = [{"role": "system", "content": "Answer with the number only."},
                {"role": "user", "content": question}]
    reviews = []                  # (the critic accepted, the draft was right)
    for _ in range(ROUNDS):
        draft = client.chat.completions.create(model="writer", messages=messages, max_tokens=8)
        answer = draft.choices[0].message.content
        review = client.chat.completions.create(model="critic", max_tokens=8, messages=[
            {"role": "user", "content": f"Question: {question}\nAnswer: {answer}\nReply OK if it is right, "
                                        "else say what is wrong."}])
        note = review.choices[0].message.content
        reviews.append(("ok" in note.lower(), _number(answer) == str(example.get("answer"))))
        if reviews[-1][0]:
            break
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"A reviewer says: {note}\nTry again."}]
    # the writer is rewarded for its last draft; the critic per review, for judging its draft right
    return {"writer": float(reviews[-1][1]), "critic": [float(ok == right) for ok, right in reviews]}


def _number(text: str) -> str:
    m = re.search(r"-?\d+", text)
    return m.group(0) if m else ""


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="One episode against an OpenAI-compatible server; prints the rewards.")
    ap.add_argument("base_url", help="e.g. http://localhost:8000/v1 (serving models 'writer' and 'critic')")
    ap.add_argument("question")
    ap.add_argument("--answer", default=None, help="the right answer (the rewards compare with it)")
    a = ap.parse_args()
    print(main(a.base_url, {"question": a.question, "answer": a.answer}))
