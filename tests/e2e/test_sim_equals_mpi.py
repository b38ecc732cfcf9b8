"""The simulator runs the real code: a simulated run with in-process workers (real engine
and trainers, SimTransport's clock) and an MPI run of the same tiny config produce the same
trajectories and the same trained weights at staleness 0, and so does the CLI's
`simulate --workers real` (same trajectories, same training statistics per step)."""
from __future__ import annotations

import h5py
import pytest
import torch

import numpy as np

from flexmarl_hpc import simulate as simulate_cli
from flexmarl_hpc.workflows.build import build_task
from flexmarl_hpc.store.checkpoint import load_latest
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.config.plan import resolve
from flexmarl_hpc.orchestrator.loop import Orchestrator
from flexmarl_hpc.sim.inprocess import InProcessWorkers
from flexmarl_hpc.sim.transport import ConstantCost, SimTransport
from flexmarl_hpc.store.tables import StoreFile
from tests.conftest import ROOT, run_training

TINY = ("run.steps=4", "workflow.inputs_per_step=2", "trainer.micro_batch_size=8", "rollout.replicas=2",
        "run.resume=false")


def simulate(out, *overrides):
    cfg = load_config(str(ROOT / "configs/local.yaml"), [f"run.output_dir={out}", *overrides])
    plan = resolve(cfg)
    task, layout = build_task(cfg), plan.layout
    sim = SimTransport(layout, ConstantCost(generate=1.0, train=0.3, sync=0.1), InProcessWorkers(plan, task))
    store = StoreFile(out / f"{cfg.run.name}.h5", cfg.agent_names, {}, clock=sim.clock)
    try:
        assert Orchestrator(plan, task, sim, store, log=lambda line: None, clock=sim.clock).run() == 0
    finally:
        store.close()


def trajectories(path) -> dict:
    """(agent, sample_id) -> (policy version, prompt + response tokens) of every row."""
    out = {}
    with h5py.File(path, "r") as f:
        for agent in f["samples"]:
            rows, toks = f["samples"][agent][()], f["tokens"][agent]["token"]
            for r in rows:
                o, n = int(r["token_offset"]), int(r["prompt_len"] + r["response_len"])
                out[agent, r["sample_id"].decode()] = (int(r["policy_version"]), toks[o:o + n].tolist())
    return out


@pytest.mark.parametrize("mode", ["sync", "flex"])
def test_a_simulated_run_trains_what_the_mpi_run_trains(tmp_path, mpiexec, mode):
    run_training(tmp_path / "mpi", *TINY, f"run.mode={mode}")
    simulate(tmp_path / "sim", *TINY, f"run.mode={mode}")
    real, sim = trajectories(tmp_path / "mpi" / "local.h5"), trajectories(tmp_path / "sim" / "local.h5")
    assert len(real) > 0 and real == sim
    for agent in ("speaker", "listener"):
        a = load_latest(tmp_path / "mpi" / "checkpoints" / agent)
        b = load_latest(tmp_path / "sim" / "checkpoints" / agent)
        assert int(a["version"]) == int(b["version"]) == 4
        model = [k for k in a if k.startswith("model.")]
        assert model and set(a) == set(b)
        for k in model:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=f"{agent} {k}")


def steps(path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        rows = f["steps"]["speaker"][()]
    return rows[rows["superseded"] == 0][["version", "n_samples", "loss", "reward_mean", "grad_norm"]]


@pytest.mark.parametrize("mode", ["sync", "flex"])
def test_simulate_workers_real_trains_what_the_mpi_run_trains(tmp_path, mpiexec, mode, capsys):
    run_training(tmp_path / "mpi", *TINY, f"run.mode={mode}")
    code = simulate_cli.main(["compare", str(ROOT / "configs/local.yaml"), *TINY, "--workers", "real", "--variants", mode,
                              "--steps", "4", "--hardware", "cpu_local", "--out", str(tmp_path / "cli")])
    assert code == 0, capsys.readouterr()
    cli = tmp_path / "cli" / mode / "local.h5"
    with h5py.File(cli, "r") as f:
        assert f.attrs["sim_workers"] == "real" and bool(f.attrs["simulated"])
    real = tmp_path / "mpi" / "local.h5"
    assert trajectories(real) == trajectories(cli)
    a, b = steps(real), steps(cli)
    assert len(a) == 4 and np.all(a["loss"] != 0)           # real training, not the synthetic zeros
    np.testing.assert_array_equal(a[["version", "n_samples"]], b[["version", "n_samples"]])
    for k in ("loss", "reward_mean", "grad_norm"):
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, err_msg=k)
