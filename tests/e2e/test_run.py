"""Real runs: `python -m flexmarl_hpc.run` on real MPI ranks, real HDF5, real training."""
import os
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import torch

from flexmarl_hpc.store.schema import DROPPED
from tests.conftest import ROOT, run_training
from tests.helpers import (SMALL, assert_same_run, check_batches_of_whole_inputs, check_exactly_once,
                           check_group_intervals, final_weights)

def check_groups_differ(path, steps):
    """A GRPO group (the samples of one prompt) must not be copies of one sample: in the first
    steps, while the policies are still random, most groups hold >= 2 distinct responses
    (the same sampling seed for a whole group would make every group identical)."""
    with h5py.File(path, "r") as f:
        for agent in f.attrs["agents"]:
            g = f[f"samples/{agent}"][:]
            off, pl, rl = g["token_offset"], g["prompt_len"], g["response_len"]
            tok = f[f"tokens/{agent}"]["token"]
            groups: dict = {}
            for i, key in enumerate(zip(g["step"], g["input_id"], g["parent_id"])):
                if key[0] in steps:
                    groups.setdefault(key, set()).add(tuple(tok[off[i] + pl[i]:off[i] + pl[i] + rl[i]]))
            assert groups and all(len(v) >= 1 for v in groups.values())
            same = np.mean([len(v) == 1 for v in groups.values()])
            assert same < 0.5, f"{agent}: {same:.0%} of the GRPO groups of steps {steps} are all identical"


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, mpiexec):
    out = tmp_path_factory.mktemp("sync")
    p = run_training(out, *SMALL, "run.mode=sync")
    return out, p


def test_sync_run_trains_every_sample_exactly_once(sync_run):
    out, p = sync_run
    assert "step    6/6" in p.stdout
    check_exactly_once(out / "local.h5", 6)
    check_groups_differ(out / "local.h5", steps=(0, 1))
    assert (out / "config.yaml").is_file() and (out / "train.log").is_file()
    log = (out / "train.log").read_text()            # start-up's two phases, measured on every rank
    assert "start-up: engines and trainers built in " in log and "; run.build_timeout_s bounds it)" in log
    assert "start-up: weight-sync communicators set up in " in log
    with h5py.File(out / "local.h5", "r") as f:
        roles = set(f["intervals"]["role"].tolist())
        assert {b"rollout", b"trainer"} <= roles
        assert len(f["metrics"]) == 6


def test_resume_continues_the_same_run(sync_run, tmp_path):
    ref, _ = sync_run
    run_training(tmp_path, *SMALL, "run.mode=sync", "run.steps=3")
    p = run_training(tmp_path, *SMALL, "run.mode=sync")          # same dir: resumes at step 3
    assert "resumed at versions" in p.stdout
    check_exactly_once(tmp_path / "local.h5", 6)
    for agent in ("speaker", "listener"):
        a, b = final_weights(ref, agent), final_weights(tmp_path, agent)
        for k in a:
            if k.startswith("model.") or k.startswith("optim."):
                assert torch.equal(a[k], b[k]), k
    with h5py.File(ref / "local.h5") as f, h5py.File(tmp_path / "local.h5") as g:
        assert np.array_equal(f["tokens/listener"]["token"], g["tokens/listener"]["token"])


@pytest.mark.parametrize("extra", [[], ["pipeline.overprovision=2"]], ids=["plain", "overprovision"])
def test_preempted_run_resumes_with_nothing_lost(tmp_path, mpiexec, extra):
    """SIGUSR1 reaches the orchestrator at a fixed point mid-step (reward call 212, in step 4
    or so: 64-96 leaves a step), by the test task itself, not by a timed kill."""
    preempt = ["workflow.task=tests.faulty_tasks:PreemptingGame", "workflow.task_args.after=212",
               f"workflow.task_args.marker={tmp_path / 'preempted'}"]
    p = run_training(tmp_path, *SMALL, *extra, *preempt, "run.steps=60", check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 75, out
    assert "preemption signal" in out and (tmp_path / "preempted").exists()
    with h5py.File(tmp_path / "local.h5", "r") as f:
        done = len(f["steps/speaker"])
    assert 2 <= done < 60
    q = run_training(tmp_path, *SMALL, *extra, *preempt, "run.steps=60")
    assert "resumed at versions" in q.stdout
    check_exactly_once(tmp_path / "local.h5", 60, dropped_ok=bool(extra))
    if extra:
        check_batches_of_whole_inputs(tmp_path / "local.h5", inputs=4, extra=2)


def test_overprovisioned_steps_train_whole_inputs_once(tmp_path, mpiexec):
    """pipeline.overprovision=2: 6 inputs per step, the first 4 to finish are trained, the
    other 2 dropped whole (status dropped, never trained); the drops really happen."""
    run_training(tmp_path, *SMALL, "pipeline.overprovision=2")
    check_exactly_once(tmp_path / "local.h5", 6, dropped_ok=True)
    check_batches_of_whole_inputs(tmp_path / "local.h5", inputs=4, extra=2)
    with h5py.File(tmp_path / "local.h5", "r") as f:
        assert (f["samples/speaker"]["status"] == DROPPED).any()
        assert f["steps/speaker"]["n_samples"].tolist() == [4 * 4] * 6     # inputs x samples


def test_store_is_readable_while_the_run_writes(tmp_path, mpiexec):
    args = [sys.executable, "-m", "flexmarl_hpc.run", "configs/local.yaml", f"run.output_dir={tmp_path}",
            *SMALL, "run.steps=40"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    path = tmp_path / "local.h5"
    seen = []
    t0 = time.time()
    try:
        while p.poll() is None and time.time() - t0 < 180:
            if path.exists():
                try:
                    with h5py.File(path, "r", swmr=True) as f:   # h5py alone, no flexmarl code
                        ds = f["samples/listener"]
                        ds.refresh()
                        seen.append(len(ds))
                except OSError:
                    pass                                          # not yet switched to SWMR
            time.sleep(0.3)
    finally:
        out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    growing = [n for n in seen if n > 0]
    assert len(set(growing)) >= 2, f"never saw the file grow while live: {seen}"


def test_flex_equals_sync_with_zero_staleness(sync_run, tmp_path):
    """Same seed and config: flex (2 replicas, small batches, micro-batch pipeline) gives the
    same trajectories and the same final weights as the sync barrier baseline (1 replica)."""
    ref, _ = sync_run
    run_training(tmp_path, *SMALL, "run.mode=flex", "rollout.replicas=2", "rollout.max_batch=8")
    check_exactly_once(tmp_path / "local.h5", 6)
    with h5py.File(tmp_path / "local.h5") as f:
        used = set(f["samples/listener"]["replica"].tolist()) | set(f["samples/speaker"]["replica"].tolist())
        assert used == {0, 1}                  # replica 1 did work that replica 0 did in sync
        assert f["steps/listener"]["n_micro"][0] > 1                          # really micro-batched
    assert_same_run(ref, tmp_path)


def test_staleness_one_trains_samples_at_most_one_version_old(tmp_path, mpiexec):
    """max_staleness=1: some samples are one version old, none older; a GRPO group is never
    split over versions; each step's record matches its samples; still exactly once."""
    p = run_training(tmp_path, *SMALL, "pipeline.max_staleness=1")
    lines = [x for x in p.stdout.splitlines() if x.startswith("step ")]
    assert lines and all(x.count("| tis w ") == 1 and "nan" not in x for x in lines), lines
    check_exactly_once(tmp_path / "local.h5", 6)
    check_stale_samples_are_reweighted(tmp_path / "local.h5")
    with h5py.File(tmp_path / "local.h5", "r") as f:
        for agent in f.attrs["agents"]:
            g = f[f"samples/{agent}"]
            step, ver = g["step"][:], g["policy_version"][:]
            assert set((step - ver).tolist()) <= {0, 1}
            groups: dict = {}
            for key in zip(step.tolist(), g["input_id"][:].tolist(), g["parent_id"][:].tolist(), ver.tolist()):
                groups.setdefault(key[:3], set()).add(key[3])
            assert all(len(v) == 1 for v in groups.values()), "a GRPO group mixes policy versions"
            st = f[f"steps/{agent}"]
            rows = f[f"step_rows/{agent}"][:]
            for s, off, n, smax in zip(st["step"][:], st["rows_offset"][:], st["rows_len"][:],
                                       st["staleness_max"][:]):
                assert smax == (s - ver[rows[off:off + n]]).max()
        stale = f["samples/speaker"]["step"] - f["samples/speaker"]["policy_version"]
        assert stale.max() == 1                  # the pipeline really overlapped steps


def check_stale_samples_are_reweighted(path):
    """Every sample gets a truncated importance weight against its behaviour log-probs
    (/steps logp_mismatch, tis_mean): in steps without stale samples the trainer's log-probs
    equal the rollout's (mismatch at rounding level, weight 1); a step with stale samples
    shows a mismatch far above that, so the old policy's log-probs really reach the loss."""
    with h5py.File(path, "r") as f:
        for agent in f.attrs["agents"]:
            st = f[f"steps/{agent}"][:]
            st = st[st["superseded"] == 0]
            fresh, stale = st[st["staleness_max"] == 0], st[st["staleness_max"] > 0]
            assert len(fresh) and len(stale), f"{agent}: need steps with and without stale samples"
            assert np.all(np.abs(fresh["tis_mean"] - 1) < 1e-3), fresh["tis_mean"]
            floor = max(float(fresh["logp_mismatch"].max()), 1e-6)
            assert np.all(stale["logp_mismatch"] > 10 * floor), \
                f"{agent}: stale samples not re-weighted: mismatch {stale['logp_mismatch']} vs fresh {floor}"


@pytest.mark.parametrize("where,rank,expect", [
    ("allowed_tokens", 2, "replica 1 (rank 2): no answer to generate batch "),
    ("reward", 0, "reward function (orchestrator, rank 0): no return from a reward call for ")],
    ids=["replica", "reward"])
def test_hung_worker_ends_the_job_with_the_requeue_code(tmp_path, mpiexec, where, rank, expect):
    """One rank stops answering mid-run (the test task sleeps in a call it makes): the job
    names the rank and what it was asked, and exits 75 within about run.worker_timeout
    instead of waiting for the wall-clock limit; the store stays readable."""
    hang = ["workflow.task=tests.faulty_tasks:HangingGame", f"workflow.task_args.where={where}",
            f"workflow.task_args.rank={rank}", "workflow.task_args.after=150"]
    t0 = time.time()
    p = run_training(tmp_path, *SMALL, *hang, "run.steps=40", "rollout.replicas=2",
                     "run.worker_timeout=20", check=False, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 75, out
    assert expect in out, out
    if rank == 0:                        # the orchestrator's own log keeps it too
        assert expect in (tmp_path / "train.log").read_text()
    assert time.time() - t0 < 200, "the hang was not bounded by run.worker_timeout"
    with h5py.File(tmp_path / "local.h5", "r", swmr=True) as f:   # flushed, readable by h5py alone
        assert len(f["steps/speaker"]) < 40
        assert b"orchestrator" in set(f["intervals"]["role"].tolist())


def test_a_sync_member_that_never_joins_ends_the_job_at_weight_sync_timeout(tmp_path, mpiexec, monkeypatch):
    """Replica 1 (rank 2) stalls when given its third weight sync (a test-only fault: asleep,
    its process alive, so no liveness socket closes). The sync's other members give up after
    weight_sync.timeout_s and say so; the job checkpoints every agent, the one whose sync
    hung included (its leader answers again), and exits 75, long before run.worker_timeout
    (1800 s); run again, it resumes with every sample trained once."""
    monkeypatch.setenv("FLEXMARL_FAULT", "sync_join:3:2:stall")
    t0 = time.time()
    p = run_training(tmp_path, *SMALL, "run.steps=40", "rollout.replicas=2", "weight_sync.timeout_s=8",
                     check=False, timeout=240)
    monkeypatch.delenv("FLEXMARL_FAULT")
    out = p.stdout + p.stderr
    assert p.returncode == 75, out
    gave_up = [ln for ln in out.splitlines() if "gave up on the weight sync of agent" in ln]
    assert gave_up and "(weight_sync.timeout_s=8)" in gave_up[0], out
    assert "weight sync over ranks" in out and "not done" in out, out     # the member's own line
    assert "checkpointing listener, speaker, flushing the store, exiting 75" in out or \
        "checkpointing speaker, listener, flushing the store, exiting 75" in out, out
    for agent in ("speaker", "listener"):
        assert list((tmp_path / "checkpoints" / agent).glob("v*")), agent
    assert time.time() - t0 < 150, "the hang was not bounded by weight_sync.timeout_s"
    # what the requeue does: the same command resumes from those checkpoints, nothing lost
    run_training(tmp_path, *SMALL, "run.steps=5", "rollout.replicas=2", "weight_sync.timeout_s=8", timeout=240)
    check_exactly_once(tmp_path / "local.h5", 5)


def test_fewer_trainer_groups_than_agents_swaps_states_losslessly(sync_run, tmp_path):
    """One trainer group for two agents: states are parked and swapped in on demand; the
    result is the same run as with one group per agent."""
    ref, _ = sync_run
    run_training(tmp_path, *SMALL, "run.mode=sync", "trainer.groups=1", "pipeline.swap_states=true")
    check_exactly_once(tmp_path / "local.h5", 6)
    with h5py.File(tmp_path / "local.h5") as f:
        acts = f["intervals"]["activity"].tolist()
        assert acts.count(b"swap") >= 10                   # every step parks one agent, loads the other
    for agent in ("speaker", "listener"):
        a, b = final_weights(ref, agent), final_weights(tmp_path, agent)
        for k in a:
            if k.startswith("model.") or k.startswith("optim."):
                assert torch.equal(a[k], b[k]), (agent, k)


def test_waiting_by_polling_gives_the_same_run_as_the_doorbell(sync_run, tmp_path):
    """How idle ranks wait (run.idle_wait) changes when they wake, never what they compute:
    the default run slept in doorbells (their star opened: no fallback notice), this one
    polls, and both have the same trajectories and weights."""
    ref, p_ref = sync_run
    assert "wake-up sockets could not be opened" not in p_ref.stderr
    run_training(tmp_path, *SMALL, "run.mode=sync", "run.idle_wait=poll")
    check_exactly_once(tmp_path / "local.h5", 6)
    assert_same_run(ref, tmp_path)


def test_data_parallel_trainer_groups_match_single_rank(sync_run, tmp_path):
    """Two ranks per trainer group (6 ranks): each trains half of every micro-batch and the
    gradients are all-reduced, so the weights match the one-rank groups."""
    ref, _ = sync_run
    p = run_training(tmp_path, *SMALL, "run.mode=sync", "trainer.ranks_per_group=2")
    assert "6 ranks" in p.stdout
    check_exactly_once(tmp_path / "local.h5", 6)
    assert_same_run(ref, tmp_path)
    check_intervals_cover_every_rank(tmp_path / "local.h5", world=6, trainer_ranks=range(2, 6))


def check_intervals_cover_every_rank(path, world, trainer_ranks):
    """Every rank (the orchestrator and data-parallel members too) records its time: intervals
    that do not overlap and leave under 5% of the rank's span unaccounted for (not busy, not wait)."""
    with h5py.File(path, "r") as f:
        iv = f["intervals"]
        rank, act, t0, t1 = iv["rank"][:], iv["activity"][:], iv["t0"][:], iv["t1"][:]
    assert set(rank.tolist()) == set(range(world))              # the orchestrator is rank 0
    assert {b"schedule", b"handle", b"store"} <= set(act[rank == 0].tolist())
    for r in range(world):
        m = rank == r
        order = np.argsort(t0[m])
        a, b = t0[m][order], t1[m][order]
        assert (a[1:] >= b[:-1] - 1e-6).all(), f"rank {r}: overlapping intervals"
        unaccounted = (b.max() - a.min()) - (b - a).sum()
        assert unaccounted < 0.05 * (b.max() - a.min()), f"rank {r}: {unaccounted:.3f} s unaccounted"
        if r in trainer_ranks:                              # leaders and members alike
            assert b"train" in set(act[m].tolist()), f"rank {r} records no training"


def test_resume_into_a_different_run_is_refused(sync_run):
    out, _ = sync_run
    before = (out / "local.h5").stat().st_size
    p = run_training(out, *SMALL, "run.mode=sync", "workflow.inputs_per_step=8", check=False)
    assert p.returncode == 2
    assert "holds a run with different workflow" in p.stderr and "launching" not in p.stdout
    assert (out / "local.h5").stat().st_size == before          # nothing written was touched


@pytest.mark.megatron
def test_megatron_trainer_backend_gives_the_same_run(sync_run, tmp_path):
    """The whole job with megatron-core trainer groups (GPTModel, DDP, DistributedOptimizer
    over gloo) instead of the torch trainer: same trajectories, same final weights (in the
    portable checkpoint format), every sample trained exactly once."""
    ref, _ = sync_run
    run_training(tmp_path, *SMALL, "run.mode=sync", "trainer.backend=megatron")
    check_exactly_once(tmp_path / "local.h5", 6)
    assert_same_run(ref, tmp_path, rel_tol=1e-4)


def test_hetero_cpu_runs_locally(tmp_path, mpiexec):
    """configs/hetero_cpu.yaml under mpiexec: 8 ranks, 2 pools, a megatron TP 2 group and two
    torch groups; every sample trained exactly once, each group's ranks (both TP ranks)
    train its agent, each replica generates only for its pool's agents."""
    from flexmarl_hpc.config.load import load_config
    run_training(tmp_path, "run.steps=4", config="configs/hetero_cpu.yaml", timeout=900)
    check_exactly_once(tmp_path / "hetero_cpu.h5", 4)
    check_group_intervals(tmp_path / "hetero_cpu.h5", load_config(ROOT / "configs/hetero_cpu.yaml"))
