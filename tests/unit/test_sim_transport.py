"""The discrete-event transport: the real Orchestrator, scheduler, Experience and workflow
on a simulated clock with synthetic workers (unit tests: one process, no MPI, no sleeping)."""
from __future__ import annotations

import numpy as np
import pytest

from flexmarl_hpc.runtime import messages
from flexmarl_hpc.workflows.build import build_task
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.config.layout import RankLayout
from flexmarl_hpc.config.plan import resolve
from flexmarl_hpc.orchestrator.loop import Orchestrator
from flexmarl_hpc.sim.transport import ConstantCost, SimTransport, SyntheticWorkers
from flexmarl_hpc.runtime.state_swap import Location
from flexmarl_hpc.store.tables import StoreFile
from tests.conftest import ROOT

STEPS = 3


def simulate(tmp_path, cost, *overrides, charge=False):
    cfg = load_config(str(ROOT / "configs/local.yaml"),
                      [f"run.output_dir={tmp_path}", f"run.steps={STEPS}", "run.resume=false",
                       "workflow.inputs_per_step=2", "trainer.micro_batch_size=8", "run.eval_every=0",
                       *overrides])
    plan = resolve(cfg)
    task, layout = build_task(cfg), plan.layout
    sim = SimTransport(layout, cost, SyntheticWorkers(task), charge_orchestrator=charge)
    store = StoreFile(tmp_path / "run.h5", cfg.agent_names, {}, clock=sim.clock)
    orch = Orchestrator(plan, task, sim, store, log=lambda line: None, clock=sim.clock)
    try:
        assert orch.run() == 0
        iv = store.intervals.read()
    finally:
        store.close()
    assert all(s.version == STEPS for s in orch.state.values())
    return sim.now - store.t0, iv


def test_sync_mode_takes_the_generation_time_of_its_barriers(tmp_path):
    """One replica, 1 s per generation batch, the rest free: each sync step is a speaker
    batch then a listener batch (the per-turn barrier), so 3 steps take exactly 6 s."""
    elapsed, _ = simulate(tmp_path, ConstantCost(generate=1.0), "run.mode=sync")
    assert elapsed == pytest.approx(2.0 * STEPS)


def test_flex_overlaps_what_sync_serializes(tmp_path):
    cost = ConstantCost(generate=1.0, train=1.0, sync=0.1)
    small = ("rollout.max_batch=8",)
    t_sync, _ = simulate(tmp_path / "sync", cost, "run.mode=sync", *small)
    t_flex, _ = simulate(tmp_path / "flex", cost, "run.mode=flex", *small)
    assert t_flex < t_sync


def test_zero_cost_workers_leave_only_the_orchestrators_own_time(tmp_path):
    """Free workers: the simulated run takes no time, unless the orchestrator's real
    compute is charged to the clock (how its own limit is measured)."""
    free, iv = simulate(tmp_path / "free", ConstantCost())
    # the orchestrator's own row is on the simulated clock too: no time passed, nothing booked
    assert free == 0.0 and not np.any(iv["rank"] == 0)
    charged, iv = simulate(tmp_path / "charged", ConstantCost(), charge=True)
    rank0 = iv[iv["rank"] == 0]
    assert charged > 0.0 and len(rank0) and rank0["t1"].max() <= charged


def test_every_rank_reports_simulated_intervals_that_never_overlap(tmp_path):
    _, iv = simulate(tmp_path, ConstantCost(generate=1.0, train=0.5, sync=0.25),
                     "trainer.ranks_per_group=2")
    ranks = set(iv["rank"].tolist())
    assert ranks >= {1, 2, 3, 4, 5}, "a trainer group member reported nothing"
    for r in ranks:                    # rank 0's own too: on the simulated clock like the rest
        mine = iv[iv["rank"] == r]
        t0, t1 = np.sort(mine["t0"]), mine["t1"][np.argsort(mine["t0"])]
        assert (t1 >= t0).all() and (t0[1:] >= t1[:-1] - 1e-9).all(), f"rank {r} overlaps itself"
    train = iv[(iv["activity"] == b"train")]
    assert set(train["rank"].tolist()) == {2, 3, 4, 5}


def test_a_broadcast_starts_when_its_last_member_is_free(tmp_path):
    layout = RankLayout(replicas=1, groups=1, ranks_per_group=1)      # ranks: 0, replica 1, leader 2
    cfg = load_config(str(ROOT / "configs/local.yaml"), [])
    sim = SimTransport(layout, ConstantCost(generate=2.0, sync=0.5, swap=3.0), SyntheticWorkers(build_task(cfg)),
                       t0=0.0)
    sim.send(1, messages.Generate(1, "speaker", 0, [("s0", [1], 7, 2, 0)]))
    sim.send(2, messages.Sync("speaker", 1, (2, 1)))
    sim.send(1, messages.Sync("speaker", 1, (2, 1)))
    got = [sim.receive() for _ in range(3)]
    assert [(src, type(m).__name__, m.intervals[0][2:]) for src, m in got] == [
        (1, "Generated", (0.0, 2.0)), (2, "TrainerSynced", (2.0, 2.5)), (1, "Synced", (2.0, 2.5))]
    assert sim.now == 2.5 and sim.poll() is None
    sim.send(2, messages.Move("speaker", Location(0, True), Location(0, False)))   # one group: no wait
    assert sim.receive()[1].intervals == [("swap", "speaker", 2.5, 5.5)]
    with pytest.raises(RuntimeError, match="no command is in flight"):
        sim.receive()


def test_a_steps_last_micro_batch_pays_the_optimizer_and_members_report_it_too():
    layout = RankLayout(replicas=1, groups=1, ranks_per_group=2)      # group ranks 2, 3
    cfg = load_config(str(ROOT / "configs/local.yaml"), [])
    sim = SimTransport(layout, ConstantCost(train=0.5, optimizer=1.0), SyntheticWorkers(build_task(cfg)), t0=0.0)
    arrays = {"prompt_lens": np.array([3, 3]), "response_lens": np.array([2, 2])}
    sim.send(2, messages.Train("speaker", 0, arrays, 0.5, False))
    sim.send(2, messages.Train("speaker", 0, arrays, 0.5, True))
    got = [sim.receive() for _ in range(4)]
    assert [(src, m.kind, m.intervals[0][2:]) for src, m in got] == [
        (2, "trained", (0.0, 0.5)), (3, "intervals", (0.0, 0.5)),
        (2, "stepped", (0.5, 2.0)), (3, "intervals", (0.5, 2.0))]
    assert got[2][1].version == 1


def test_the_cost_models_of_sim_costs_drive_the_transport(tmp_path):
    """SimTransport's CostModel protocol is what sim.costs.CostModel implements: the tiny
    run on the CPU profile, every message priced by it (a swap too: 2 agents, 1 group)."""
    from flexmarl_hpc.config.hf_config import model_args
    from flexmarl_hpc.sim.costs import AgentLayout, CostModel, shape_from_model_args
    from flexmarl_hpc.sim.hardware import load_hardware
    cfg = load_config(str(ROOT / "configs/local.yaml"), [])
    task = build_task(cfg)
    shape = {a: shape_from_model_args(model_args(cfg, task, a), a, 4) for a in cfg.agent_names}
    cost = CostModel(load_hardware("cpu_local"), {a: AgentLayout(s, trainer_devices=1) for a, s in shape.items()})
    elapsed, iv = simulate(tmp_path, cost, "trainer.groups=1", "pipeline.swap_states=true")
    assert elapsed > 0
    assert {b"generate", b"train", b"sync", b"swap"} <= set(iv["activity"].tolist())


class _Weights(ConstantCost):
    """Constant costs, and 20 bytes of weights per sync."""

    def weight_bytes(self, agent) -> int:
        return 20


def _two_syncs(tmp_path, where, *, together: bool):
    """Leaders 3 and 4 broadcast 20 bytes to replicas 1 and 2 on a fabric of 10 B/s NICs."""
    from flexmarl_hpc.sim.network import Fabric
    from flexmarl_hpc.sim.placement import SyncNetwork
    layout = RankLayout(replicas=2, groups=2, ranks_per_group=1)
    cfg = load_config(str(ROOT / "configs/local.yaml"), [])
    net = SyncNetwork(Fabric(node_nic=10.0, device_nic=10.0, intra=100.0, hop_latency_s=0.0), where,
                      bucket_latency_s=0.0)
    sim = SimTransport(layout, _Weights(generate=2.0), SyntheticWorkers(build_task(cfg)), t0=0.0, network=net)
    if not together:                       # replica 2 generates first: its sync waits for it
        sim.send(2, messages.Generate(1, "speaker", 0, [("s0", [1], 7, 2, 0)]))
    for leader, replica in ((3, 1), (4, 2)):
        sim.send(leader, messages.Sync("speaker", 1, (leader, replica)))
        sim.send(replica, messages.Sync("speaker", 1, (leader, replica)))
    got = [sim.receive() for _ in range(4 if together else 5)]
    return {(src, m.kind): m.intervals[0][2:] for src, m in got}


def test_concurrent_syncs_share_the_nics_they_cross(tmp_path):
    """Both broadcasts leave node 0 and enter node 1 (10 B/s each way): together each gets
    5 B/s, 20 bytes take 4 s; when the second starts at 2 s (its replica generates first),
    the first has had the link alone (20 B at 10 B/s: done at 2 s) and the second too (2..4 s).
    On distinct nodes they never meet: 2 s each."""
    same = {1: (1, 16), 2: (1, 17), 3: (0, 0), 4: (0, 1)}
    got = _two_syncs(tmp_path, same, together=True)
    assert got[(1, "synced")] == pytest.approx((0.0, 4.0)) and got[(4, "tsynced")] == pytest.approx((0.0, 4.0))
    got = _two_syncs(tmp_path, same, together=False)
    assert got[(1, "synced")] == pytest.approx((0.0, 2.0)) and got[(2, "synced")] == pytest.approx((2.0, 4.0))
    apart = {1: (1, 16), 2: (3, 48), 3: (0, 0), 4: (2, 32)}
    got = _two_syncs(tmp_path, apart, together=True)
    assert got[(1, "synced")] == pytest.approx((0.0, 2.0)) and got[(2, "synced")] == pytest.approx((0.0, 2.0))


def test_stragglers_stretch_a_command_and_bytes_cost_the_orchestrator(tmp_path):
    """A straggler of factor 3 makes a 2 s generate 6 s. At 1 ms per byte the orchestrator
    spends 8 x 1 + 64 = 72 ms sending a 1-token prompt and 12 x 2 + 64 = 88 ms reading the
    2-token reply: it ends at 0.072 + 2 and is handled by 2.16."""
    from flexmarl_hpc.sim.perturb import Perturbation, Perturber
    layout = RankLayout(replicas=1, groups=1, ranks_per_group=1)
    task = build_task(load_config(str(ROOT / "configs/local.yaml"), []))
    req = [("s0", [1], 7, 2, 0)]
    slow = SimTransport(layout, ConstantCost(generate=2.0), SyntheticWorkers(task), t0=0.0,
                        perturb=Perturber(Perturbation(straggler_prob=1.0, straggler_factor=3.0), 3))
    slow.send(1, messages.Generate(1, "speaker", 0, req))
    assert slow.receive()[1].intervals[0][2:] == (0.0, 6.0)
    sim = SimTransport(layout, ConstantCost(generate=2.0), SyntheticWorkers(task), t0=0.0, orchestrator_byte_s=1e-3)
    sim.send(1, messages.Generate(1, "speaker", 0, req))
    assert sim.now == pytest.approx(0.072)
    assert sim.receive()[1].intervals[0][2:] == pytest.approx((0.072, 2.072))
    assert sim.now == pytest.approx(2.16)
