"""End to end: an episode workflow (tests/e2e/episodes.py:skewed) trained by the real MPI
job on a tiny random chat model (scripts/make_tiny_chat_model.py): calls per agent vary per
episode, tool calls land in /tools, every call is trained exactly once, and a SIGKILL of
the whole job mid-run followed by the same command trains every example of the stream
exactly once with no episode half-counted."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter

import h5py
import numpy as np
import pytest

from tests.conftest import ROOT, need, run_training
from tests.helpers import check_exactly_once, sigkill_tree, wait_for

STEPS, N_IN, GROUP = 6, 3, 2


@pytest.fixture(scope="module")
def chat_setup(tiny_chat):
    return tiny_chat


def overrides(chat_setup, steps=STEPS):
    model, data = chat_setup
    return ["run.name=ep", "workflow.episode=tests.e2e.episodes:skewed", "workflow.agents=[planner,solver,judge]",
            f"workflow.inputs_per_step={N_IN}", f"workflow.group_size={GROUP}", "workflow.max_new_tokens=12",
            f"workflow.dataset.train={data}", "workflow.dataset.eval=", f"model.checkpoint={model}", "rollout.max_model_len=512",
            f"run.steps={steps}", "run.log_every=1", "trainer.micro_batch_size=4", "trainer.lr=1e-4"]


def check_episodes(path, steps):
    """Every example of steps 0..steps-1 once per episode index, each episode recorded once
    with exactly the calls its agents have rows (all trained)."""
    with h5py.File(path, "r") as f:
        agents = list(f.attrs["agents"])
        ep = f["episodes"][:]
        keys = list(zip(ep["input_id"].tolist(), ep["traj"].tolist()))
        assert len(keys) == len(set(keys)), "an episode was recorded twice"
        assert sorted(keys) == [(i, e) for i in range(steps * N_IN) for e in range(GROUP)]
        for a, agent in enumerate(agents):
            rows = f[f"samples/{agent}"][:]
            per_episode = Counter(zip(rows["input_id"].tolist(), rows["traj"].tolist()))
            assert {k: per_episode.get(k, 0) for k in keys} == dict(zip(keys, ep["calls"][:, a].tolist()))
        return ep, f["tools"][:], agents


@pytest.fixture(scope="module")
def skewed_run(tmp_path_factory, mpiexec, chat_setup):
    """One run of the skewed episode (planner, 1-3 solvers with tools, judge): the store of
    the test below and of the transcripts page's."""
    out = tmp_path_factory.mktemp("skewed_run")
    return out / "ep.h5", run_training(out, *overrides(chat_setup), config="configs/math_team.yaml")


def test_an_episode_workflow_trains_every_call_once_with_skewed_calls_and_tools(skewed_run):
    path, p = skewed_run
    assert f"step    {STEPS}/{STEPS}" in p.stdout, p.stdout[-2000:]
    check_exactly_once(path, STEPS)
    ep, tools, agents = check_episodes(path, STEPS)
    solver = ep["calls"][:, agents.index("solver")]
    assert solver.min() >= 1 and solver.max() >= 3 and len(set(solver.tolist())) >= 3    # skewed
    assert (ep["calls"][:, agents.index("planner")] == 1).all()
    # one calculator call before each second solver turn, all answered
    assert 0 < len(tools) <= solver.sum() // 2 and (tools["outcome"] == 0).all()
    assert set(tools["tool"].tolist()) == {b"calculator"}
    # a solver's second turn is its first turn's prompt and sampled response, token for
    # token, then the tool's message: the context grows without re-tokenising
    with h5py.File(path, "r") as f:
        s = f["samples/solver"][:]
        tok = f["tokens/solver"][:]["token"]
        assert all(p.decode().startswith(("planner/", "solver/")) for p in s["parent_id"])
    seq = lambda r, n: tok[r["token_offset"]:r["token_offset"] + n].tolist()
    grown = 0
    for r in s:
        mates = s[(s["input_id"] == r["input_id"]) & (s["traj"] == r["traj"]) & (s["turn"] != r["turn"])]
        full = seq(r, r["prompt_len"])
        if any(m["prompt_len"] + m["response_len"] < r["prompt_len"]
               and seq(m, m["prompt_len"] + m["response_len"]) == full[:m["prompt_len"] + m["response_len"]]
               for m in mates):
            grown += 1
    assert grown == len(tools)          # exactly the second turns
    out = subprocess.run([sys.executable, "-m", "flexmarl_hpc.analyze", str(path)], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "calls/episode solver" in out.stdout, out.stdout + out.stderr


def test_the_transcripts_page_of_a_run_renders_in_headless_chromium(skewed_run, chat_setup, tmp_path):
    """issue 40: `analyze --transcripts --html` on the skewed run's step 0, screenshotted by
    headless Chromium (scripts/transcripts_figure.py): a PNG of the size asked for, with text
    on it (many colours, dark glyph pixels in many rows and many dark runs per text line), and
    a rendered DOM that holds each agent's calls, a reply as the store's ids decode, and each
    call's reward and advantage from the store beside its agent's name."""
    import html
    from PIL import Image
    sys.path.insert(0, str(ROOT / "scripts"))
    from transcripts_figure import chromium, render
    from flexmarl_hpc.analyze import main as analyze
    from flexmarl_hpc.workflows.chat import ChatTokenizer
    need(chromium() is not None, "chromium (bash scripts/setup_chromium.sh)")
    path, _ = skewed_run
    page, png = tmp_path / "t.html", tmp_path / "t.png"
    assert analyze([str(path), "--transcripts", "--step", "0", "--html", str(page)]) == 0
    dom = render(page, png, (900, 1200))
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size == (900, 1200), (im.format, im.size)
        gray = np.asarray(im.convert("L"), dtype=np.int16)
        colors = im.convert("RGB").getcolors(1 << 20)
    assert len(colors) >= 16, len(colors)                          # text is anti-aliased: many shades
    dark = gray < 128
    assert 0.005 < dark.mean() < 0.3, dark.mean()                  # not blank, not a solid block
    assert dark.any(axis=1).sum() > 300, dark.any(axis=1).sum()    # dark pixels over many rows
    runs = (np.diff(dark.astype(np.int8), axis=1) == 1).sum(axis=1)
    assert np.median(runs[runs > 0]) >= 10, runs                   # glyphs: many strokes per row
    tok = ChatTokenizer(chat_setup[0])
    with h5py.File(path, "r") as f:
        agents = list(f.attrs["agents"])
        rows = {a: f[f"samples/{a}"][:] for a in agents}
        toks = {a: f[f"tokens/{a}"][:]["token"] for a in agents}
    for agent in agents:
        mine = rows[agent][rows[agent]["step"] == 0]
        assert len(mine) > 0
        for r in mine:
            assert (f'<b>{agent}</b> call {r["turn"]} <span class="meta">reward {float(r["reward"]):.3f}, '
                    f'advantage {float(r["advantage"]):.3f}, consumed, v{r["policy_version"]}') in dom, (agent, r)
        r = max(mine, key=lambda r: r["response_len"])
        o = r["token_offset"] + r["prompt_len"]
        text = tok.decode(toks[agent][o:o + r["response_len"]].tolist(), skip_special_tokens=False)
        text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\0", "\ufffd")   # as HTML parses it
        assert f"<pre>{html.escape(text, quote=False).replace(chr(0xa0), '&nbsp;')}</pre>" in dom, (agent, text)


def test_sigkill_mid_run_then_the_same_command_trains_every_example_once(tmp_path, mpiexec, chat_setup):
    args = [sys.executable, "-m", "flexmarl_hpc.run", "configs/math_team.yaml", f"run.output_dir={tmp_path}",
            *overrides(chat_setup), "run.checkpoint_every=2"]
    p = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log, t0 = tmp_path / "train.log", time.time()
    while not log.exists() or f"step    3/{STEPS}" not in log.read_text():
        assert time.time() - t0 < 300 and p.poll() is None, "run did not get to step 3"
        time.sleep(0.05)
    sigkill_tree(p)
    with h5py.File(tmp_path / "ep.h5", "r", swmr=True) as f:
        before = len(f["episodes"])
    assert 0 < before < STEPS * N_IN * GROUP
    q = run_training(tmp_path, *overrides(chat_setup), "run.checkpoint_every=2", config="configs/math_team.yaml")
    assert "resumed at versions" in q.stdout, q.stdout[-3000:]
    check_exactly_once(tmp_path / "ep.h5", STEPS)
    check_episodes(tmp_path / "ep.h5", STEPS)


def test_a_step_no_episode_calls_an_agent_moves_its_version_without_samples(tmp_path, mpiexec, chat_setup):
    model, data = chat_setup
    p = run_training(tmp_path, "run.name=ep", "workflow.episode=tests.e2e.episodes:judge_on_even",
                     "workflow.agents=[planner,judge]", "workflow.inputs_per_step=1", "workflow.group_size=2",
                     "workflow.max_new_tokens=8", f"workflow.dataset.train={data}", "workflow.dataset.eval=",
                     "workflow.dataset.shuffle=false", f"model.checkpoint={model}", "rollout.max_model_len=512",
                     "run.steps=4", "run.checkpoint_every=2", "run.log_every=1", config="configs/math_team.yaml")
    assert "step    4/4" in p.stdout and "Warning" not in p.stderr, p.stdout[-2000:] + p.stderr[-2000:]
    check_exactly_once(tmp_path / "ep.h5", 4)
    with h5py.File(tmp_path / "ep.h5", "r") as f:
        judge = f["steps/judge"][:]
        judge = judge[judge["superseded"] == 0]
        assert judge["step"].tolist() == [0, 1, 2, 3] and judge["n_samples"].tolist() == [2, 0, 2, 0]


def tool_overrides(chat_setup, name: str) -> list[str]:
    model, data = chat_setup
    return [f"run.name={name}", "workflow.episode=tests.e2e.episodes:with_tools", "workflow.agents=[solver]",
            "workflow.inputs_per_step=2", "workflow.group_size=2", "workflow.max_new_tokens=4",
            f"workflow.dataset.train={data}", "workflow.dataset.eval=", f"model.checkpoint={model}",
            "rollout.max_model_len=512", "run.steps=2", "run.log_every=1", "trainer.micro_batch_size=4",
            "tools.ranks=1", "tools.workers=2"]


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory, mpiexec, chat_setup):
    """One 2-step run of with_structured_tools on a tool rank (tools.ranks=1): the store of the
    two tests below. pipeline.max_staleness 0: each sample is trained at the version that drew
    it, so the trainer's log-probs of its tokens are the replica's up to float order."""
    out = tmp_path_factory.mktemp("tool_run")
    p = run_training(out, *tool_overrides(chat_setup, "tl"), "workflow.episode=tests.e2e.episodes:with_structured_tools",
                     "rollout.max_model_len=1024", "pipeline.max_staleness=0", config="configs/math_team.yaml")
    return out / "tl.h5", p


def test_tool_calls_run_on_a_tool_rank_and_a_crash_there_is_a_counted_outcome(tool_run):
    """tools.ranks=1: the job gets a tool rank after the trainers; every tool call and
    ctx.call of the episodes runs there (the reward worker sees that rank's PMI_RANK, so the
    solver's reward includes 0.5), a worker that dies mid-call gives the call `crashed`
    in /tools, and the run ends normally (the tool rank answers the Stop)."""
    path, p = tool_run
    assert "1 tool ranks" in p.stdout and "step    2/2" in p.stdout, p.stdout[-2000:]
    from flexmarl_hpc.store.schema import TOOL_OUTCOMES
    with h5py.File(path, "r") as f:
        tools = f["tools"][:]
        solver = f["samples/solver"][:]
        assert int(f.attrs["world_size"]) == 4            # orchestrator, replica, trainer, tool rank
    outcomes = Counter((t.decode(), TOOL_OUTCOMES[o]) for t, o in zip(tools["tool"], tools["outcome"]))
    assert outcomes == {("calculator", "ok"): 8, ("python", "ok"): 8, ("die", "crashed"): 8, ("where", "ok"): 8}, outcomes
    assert (solver["reward"] >= 0.5).all(), solver["reward"]       # `where` ran on a rank other than 0


def test_a_tool_using_episode_trains_exactly_the_sampled_ids(tool_run, chat_setup):
    """Structured tool calls on the tiny model, token-exact (issue 40), from the store of a
    real run: the solver's second turn is its first turn's prompt and sampled ids verbatim,
    then the calculator's `tool` message as the template renders it (the result the tool
    rank computed) and the next assistant header; the loss mask rank 0 packs from the stored
    row covers the second turn's sampled ids and nothing of the tool message; and the
    trainer's own log-probs of the tokens it trained are the replica's (/steps logp_mismatch,
    per sample the mean |trainer - sampler| log-prob over its masked tokens: a token trained
    that was not the one sampled at its place, or a tool token in the mask, puts it near 1)."""
    import re
    from types import SimpleNamespace
    from flexmarl_hpc.runtime.microbatch import microbatch_from_arrays, pack_microbatch
    from flexmarl_hpc.workflows.chat import ChatTokenizer
    path, _ = tool_run
    tok = ChatTokenizer(chat_setup[0])
    check_exactly_once(path, 2)
    with h5py.File(path, "r") as f:
        s, toks, steps = f["samples/solver"][:], f["tokens/solver"][:]["token"], f["steps/solver"][:]
    seq = lambda r: toks[r["token_offset"]:r["token_offset"] + r["prompt_len"] + r["response_len"]].tolist()
    episodes = sorted(set(zip(s["input_id"].tolist(), s["traj"].tolist())))
    assert len(episodes) == 8 and len(s) == 16
    task = SimpleNamespace(vocab=SimpleNamespace(pad_id=tok.pad_id), allowed_tokens=lambda turn: None)
    for key in episodes:
        r0, r1 = sorted(s[(s["input_id"] == key[0]) & (s["traj"] == key[1])], key=lambda r: r["turn"])
        first, second = seq(r0), seq(r1)
        p1, resp1 = second[:r1["prompt_len"]], second[r1["prompt_len"]:]
        assert p1[:len(first)] == first, key                  # the sampled ids verbatim, not re-encoded
        a, b = map(int, re.search(r"What is (\d+) \+ (\d+)\?", tok.decode(first, skip_special_tokens=False)).groups())
        # a reply cut at max_tokens gets the template's end of turn after it (not trained)
        closed = "" if first[-1] == tok.eos_id else "<|im_end|>"
        assert tok.decode(p1[len(first):], skip_special_tokens=False) == \
            f"{closed}\n<|im_start|>user\n<tool_response>\n{2 * (a + b)}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        node = SimpleNamespace(prompt=p1, response=resp1, logprobs=[0.0] * len(resp1), turn=1,
                               advantage=1.0, version=0, step=0)
        mb = microbatch_from_arrays(pack_microbatch([node], task))
        mask = mb.response_mask()[0]
        assert mb.input_ids[0][mask].tolist() == resp1 and not mask[:len(p1)].any()
    live = steps[steps["superseded"] == 0]
    assert live["step"].tolist() == [0, 1] and live["n_samples"].tolist() == [8, 8]
    assert (live["logp_mismatch"] < 1e-3).all(), live["logp_mismatch"]


def test_a_dead_tool_rank_is_a_dead_worker_the_run_checkpoints_and_exits_75(tmp_path, mpiexec, chat_setup):
    """The tool rank (world rank 3) SIGKILLs itself at its 3rd call (FLEXMARL_FAULT). Each
    rank runs under a shell that outlives it, so mpiexec does not end the job for us (as
    Slurm's het step without --kill-on-bad-exit, tests/mpi/test_dead_rank.py): the
    orchestrator must notice the death itself (the liveness star), say which rank, checkpoint
    and end the job with 75 to requeue (MPI_Abort, which takes every rank with it)."""
    import shlex
    import signal
    ov = [*tool_overrides(chat_setup, "td"), "run.steps=50", f"run.output_dir={tmp_path}"]
    rank = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "flexmarl_hpc.run", "configs/math_team.yaml", *ov])
    cmd = [mpiexec, "-n", "4", "bash", "-c", f'{rank}; echo "rank $PMI_RANK exited $?" >&2; sleep 60']
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLEXMARL_FAULT": "tool_call:3:3"}
    errs = tmp_path / "ranks.err"
    with open(errs, "w") as err_file:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err_file,
                             start_new_session=True)
        try:
            # mpiexec's own exit code: MPI_Abort's message on stderr was lost in hydra's
            # teardown in 2 of 15 trials (the job had ended with 75, the test waited 240 s)
            wait_for(lambda: p.poll() is not None, 240, "the job to end (rank 0's MPI_Abort(75))")
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)        # what is left of it, if anything
            except ProcessLookupError:
                pass
            p.wait(timeout=60)
    err, log = errs.read_text(), (tmp_path / "train.log").read_text()
    assert p.returncode == 75, (p.returncode, err[-3000:])  # MPI_Abort(75): mpiexec exits with its code
    assert "tool rank 0 (rank 3): its process has ended (liveness socket closed)" in log, (log[-2000:], err[-3000:])
    assert "exiting 75 to requeue" in log, log[-2000:]
    assert "rank 3 exited 137" in err, err[-3000:]          # the SIGKILL, not a clean exit


def test_periodic_evaluation_of_an_episode_workflow_writes_its_metrics_and_changes_no_training(
        tmp_path, mpiexec, chat_setup):
    """run.eval_every=1: at versions 0, 1 and 2 one greedy episode per held-out example,
    ctx.metrics averaged into /eval (analyze draws eval.png); the training samples are
    those of the same run without evaluation, token for token (pipeline.max_staleness 0:
    with 1, which version a sample is drawn at depends on timing, with or without
    evaluation). With max_staleness 1 (math_team's) the evaluated run ends too: 3 agents
    time-sharing one replica deadlocked there before (docs/LOG.md)."""
    model, data = chat_setup
    runs = {}
    evaluated = ["run.eval_every=1", "run.eval_inputs=3", f"workflow.dataset.eval={data}"]
    for name, extra in (("ev", [*evaluated, "pipeline.max_staleness=0"]), ("ne", ["pipeline.max_staleness=0"]),
                        ("s1", [*evaluated, "pipeline.max_staleness=1"])):
        out = tmp_path / name
        run_training(out, *overrides(chat_setup, steps=2), f"run.name={name}", *extra, config="configs/math_team.yaml")
        runs[name] = out / f"{name}.h5"
    with h5py.File(runs["s1"], "r") as f:
        assert sorted(set(f["eval"][:]["step"].tolist())) == [0, 1, 2]
    with h5py.File(runs["ev"], "r") as f:
        ev = f["eval"][:]
        assert sorted(set(ev["step"].tolist())) == [0, 1, 2]
        assert {m.decode() for m in ev["metric"]} == {"k", "episodes_failed"} and set(ev["agent"]) == {b""}
        assert (ev["n_inputs"] == 3).all() and (ev["version"] == ev["step"]).all()
        k = ev[ev["metric"] == b"k"]["value"]
        assert ((k >= 1) & (k <= 3)).all()                     # the skewed episode's solver count
        train = {a: f[f"samples/{a}"][:] for a in f.attrs["agents"]}
        tok_ev = {a: f[f"tokens/{a}"][:]["token"] for a in f.attrs["agents"]}
        assert "eval at step    0 | task/" in (tmp_path / "ev" / "train.log").read_text()
    with h5py.File(runs["ne"], "r") as f:
        for a, rows in train.items():
            other = f[f"samples/{a}"][:]
            key = lambda r: (r["input_id"], r["traj"], r["turn"])
            mine, theirs = sorted(rows, key=key), sorted(other, key=key)
            assert [key(r) for r in mine] == [key(r) for r in theirs], a
            seq = lambda toks, r: toks[r["token_offset"]:r["token_offset"] + r["prompt_len"] + r["response_len"]].tolist()
            tok_ne = f[f"tokens/{a}"][:]["token"]
            assert [seq(tok_ev[a], r) for r in mine] == [seq(tok_ne, r) for r in theirs], a
    out = subprocess.run([sys.executable, "-m", "flexmarl_hpc.analyze", str(runs["ev"]), "--out", str(tmp_path / "figs")],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and (tmp_path / "figs" / "eval.png").exists(), out.stdout + out.stderr


def test_a_killed_tool_rank_leaves_no_process_behind(tmp_path, mpiexec, chat_setup):
    """No process outlives its job (issue 35): SIGKILL the tool rank once it has its reward
    pool (multiprocessing's forkserver, resource tracker and workers) and a sandbox mid-call;
    5 s after every rank has ended no process of the job is left: none carrying its tag
    (mpiexec included, which waits for the output its ranks' children hold open), none that
    was below the tool rank (the sandbox's launcher has a minimal environment).
    The tool rank runs in a session of its own (setsid), as under Slurm where nothing kills
    a dead task's process group for it; mpiexec kills that of each process it started.
    Before flexmarl_hpc/tools/lifeline.py the forkserver, the tracker and a worker lived on
    under PID 1, the launcher until its call ended, and mpiexec with them. The Slurm form: tests/slurm/test_orphans_slurm.py."""
    import signal
    import uuid

    import psutil
    sys.path.insert(0, str(ROOT / "scripts"))
    import faults
    from tests.helpers import left_behind
    tag = uuid.uuid4().hex
    ov = [*tool_overrides(chat_setup, "or"), "workflow.episode=tests.e2e.episodes:slow_tools", "tools.wall_s=60",
          f"run.output_dir={tmp_path}"]
    own_session = 'if [ "$PMI_RANK" = 3 ]; then exec setsid -w "$@"; else exec "$@"; fi'
    cmd = [mpiexec, "-n", "4", "bash", "-c", own_session, "rank",
           sys.executable, "-m", "flexmarl_hpc.run", "configs/math_team.yaml", *ov]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLEXMARL_FAULT_TAG": tag}

    def pool_started():
        """(the tool rank's pid, the processes below it) once a sandbox and a reward worker
        are mid-call there (tests/e2e/episodes.py:slow_tools)."""
        tool = faults.rank_pids(tag, "flexmarl_hpc.run").get(3)
        try:
            below = psutil.Process(tool).children(recursive=True) if tool else []
            cmds = [" ".join(q.cmdline()) for q in below]
            # the server and a worker (forked from it: the same command line)
            served = sum("multiprocessing.forkserver" in c for c in cmds)
            return served >= 2 and any("tools/launcher.py" in c for c in cmds) and (tool, below)
        except psutil.Error:                         # one ended while we looked
            return False

    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    left, below = {}, []
    try:
        tool, below = wait_for(pool_started, 240, "the tool rank's reward pool")
        os.kill(tool, signal.SIGKILL)
        wait_for(lambda: not faults.rank_pids(tag, "flexmarl_hpc.run"), 120, "every rank to end")
        time.sleep(5.0)
        left = left_behind(tag, below)
        print(f"killed tool rank {tool} with {len(below)} processes below it; 5 s after the last rank: {left}")
    finally:
        for pid in left_behind(tag, below):          # a failing test leaves nothing either
            os.kill(pid, signal.SIGKILL)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
    assert not left, f"5 s after the job ended these were left: {left}"
