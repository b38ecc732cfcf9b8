"""End to end: a writer + critic written only against the official `openai` client
(flexmarl_hpc/workflows/openai_writer_critic.py, unchanged) trained by the real MPI job on a
tiny random chat model through the per-episode OpenAI-compatible endpoint (workflow.agent),
SIGKILLed mid-run and resumed by the same command (one test, one pair of runs: the CI
budget): every completion is a sample of the agent named as the model, trained exactly
once across the kill; the text the program got is the decoding of the sampled ids; and a
writer's follow-up request (its draft sent back with the critic's note) reuses its earlier
prompt and sampled ids token for token."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import h5py
import pytest

from tests.conftest import ROOT, run_training
from tests.helpers import check_exactly_once, sigkill_tree

STEPS, N_IN, GROUP = 4, 2, 2


@pytest.fixture(scope="module")
def chat_setup(tiny_chat):
    return tiny_chat


def test_an_unchanged_openai_program_trains_token_exact_once_across_a_kill(tmp_path, mpiexec, chat_setup):
    model, data = chat_setup
    over = ["run.name=oa", f"workflow.inputs_per_step={N_IN}", f"workflow.group_size={GROUP}",
            f"workflow.dataset.train={data}", f"model.checkpoint={model}", f"run.steps={STEPS}",
            "workflow.max_new_tokens=8", "tools.workers=2", "run.checkpoint_every=2"]
    args = [sys.executable, "-m", "flexmarl_hpc.run", "configs/openai_writer_critic.yaml",
            f"run.output_dir={tmp_path}", *over]
    p = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    log, t0 = tmp_path / "train.log", time.time()
    while not log.exists() or f"step    2/{STEPS}" not in log.read_text():
        assert time.time() - t0 < 300 and p.poll() is None, "run did not get to step 2"
        time.sleep(0.05)
    sigkill_tree(p)
    with h5py.File(tmp_path / "oa.h5", "r", swmr=True) as f:
        assert 0 < len(f["episodes"]) < STEPS * N_IN * GROUP
    q = run_training(tmp_path, *over, config="configs/openai_writer_critic.yaml")
    assert "resumed at versions" in q.stdout and f"step    {STEPS}/{STEPS}" in q.stdout, q.stdout[-3000:]
    assert "failed" not in log.read_text(), log.read_text()[-3000:]
    check_exactly_once(tmp_path / "oa.h5", STEPS)
    n_writer, n_critic, grown = check_token_exact(tmp_path / "oa.h5", model, STEPS * N_IN * GROUP)
    assert n_writer >= STEPS * N_IN * GROUP and n_critic >= STEPS * N_IN * GROUP
    assert grown > 0, "no writer follow-up happened: the test checks nothing about reuse"


def check_token_exact(path, model, episodes: int) -> tuple[int, int, int]:
    """The writer + critic samples of a run are token-exact (the checks in the module's
    docstring); returns (writer samples, critic samples, writer follow-ups). Also used on
    the SmolLM2 run of docs/LOG.md."""
    from flexmarl_hpc.workflows.chat import ChatTokenizer
    tok = ChatTokenizer(model)
    with h5py.File(path, "r") as f:
        rows = {a: f[f"samples/{a}"][:] for a in ("writer", "critic")}
        toks = {a: f[f"tokens/{a}"][:]["token"] for a in ("writer", "critic")}
        ep = f["episodes"][:]          # each episode recorded once, none lost to the kill
        keys = sorted(zip(ep["input_id"].tolist(), ep["traj"].tolist()))
        assert len(keys) == episodes and len(set(keys)) == episodes
    ids = lambda a, r, lo, hi: toks[a][r["token_offset"] + lo:r["token_offset"] + hi].tolist()
    prompt = lambda a, r: ids(a, r, 0, r["prompt_len"])
    response = lambda a, r: ids(a, r, r["prompt_len"], r["prompt_len"] + r["response_len"])
    w, c = rows["writer"], rows["critic"]
    for a in rows:        # no history edited, no call forced: every row says so (schema 6)
        assert not rows[a]["retokenized"].any() and not rows[a]["prefill_len"].any()
    grown = 0
    for r in w:
        key = (r["input_id"], r["traj"], r["turn"])
        # the critic's prompt holds the text the program got: the writer's sampled ids, decoded
        critic = c[(c["input_id"] == key[0]) & (c["traj"] == key[1]) & (c["turn"] == key[2])]
        body = [i for i in response("writer", r) if i not in tok.stop_ids]
        assert len(critic) == 1 and f"Answer: {tok.decode(body, skip_special_tokens=False)}\n" in \
            tok.decode(prompt("critic", critic[0]), skip_special_tokens=False)
        if r["turn"] == 0:
            # the first request: exactly the chat template's rendering of the program's messages
            q = tok.decode(prompt("writer", r), skip_special_tokens=False)
            question = q.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
            assert prompt("writer", r) == tok.encode(tok.render(
                [{"role": "system", "content": "Answer with the number only."}, {"role": "user", "content": question}]))
        else:
            # a follow-up extends the earlier call's prompt and sampled ids verbatim
            first = w[(w["input_id"] == key[0]) & (w["traj"] == key[1]) & (w["turn"] == key[2] - 1)][0]
            assert prompt("writer", r)[:first["prompt_len"] + first["response_len"]] == \
                prompt("writer", first) + response("writer", first)
            grown += 1
    return len(w), len(c), grown
