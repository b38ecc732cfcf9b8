"""`python -m flexmarl_hpc.simulate`: the CLI's variants and JSON, the simulated HDF5 file
that `analyze` reads unchanged, and a clock that never sleeps (unit: one process, no MPI)."""
from __future__ import annotations

import json
import time

import h5py
import pytest
import yaml

from flexmarl_hpc.config.plan import resolve
from flexmarl_hpc import analyze
from flexmarl_hpc import simulate
from flexmarl_hpc.sim import runs
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.sim.plan_config import merge_fragment
from tests.conftest import ROOT

CONFIG = str(ROOT / "configs/local.yaml")
TINY = ["workflow.inputs_per_step=2", "trainer.micro_batch_size=8"]


def run_cli(capsys, *args) -> tuple[int, str]:
    code = simulate.main(["compare", CONFIG, *TINY, *args])
    return code, capsys.readouterr().out


def test_json_gives_each_variants_step_time_and_ratio(tmp_path, capsys):
    code, out = run_cli(capsys, "--steps", "4", "--variants", "sync,flex,flex-nolb", "--json",
                        "--hardware", "h100_ndr", "--out", str(tmp_path))
    assert code == 0
    res = json.loads(out)["variants"]
    assert list(res) == ["sync", "flex", "flex-nolb"]
    for v, r in res.items():
        assert r["step_s"] > 0 and 0 < r["util"] <= 1, v
        assert r["speedup_vs_sync"] == pytest.approx(res["sync"]["step_s"] / r["step_s"])
    assert res["sync"]["speedup_vs_sync"] == 1.0


def test_the_table_names_every_variant_and_bad_variants_are_refused(tmp_path, capsys):
    code, out = run_cli(capsys, "--steps", "3", "--variants", "sync,flex-nopipe", "--out", str(tmp_path))
    assert code == 0
    assert "sync" in out and "flex-nopipe" in out and "step_s" in out
    code = simulate.main(["compare", CONFIG, "--variants", "sync,fast"])
    assert code == 2 and "fast" in capsys.readouterr().err


@pytest.mark.parametrize("args,says", [
    (["compare", str(ROOT / "configs/paper_5x32b.yaml"), "--workers", "real"], "parameters in all"),
    (["compare", CONFIG, "--workers", "real", "trainer.ranks_per_group=2", "slurm.trainer.ntasks=4"], "trainer.ranks_per_group"),
    (["plan", CONFIG, "--workers", "real", "--nodes", "4"], "unrecognized arguments: --workers"),
    (["compare", CONFIG, "--workers", "fake"], "--workers"),
])
def test_real_workers_refuse_what_they_cannot_run_in_one_line(tmp_path, capsys, args, says):
    """In-process workers build every model here: a 32B config, a multi-rank trainer group or a
    planning sweep is refused before anything runs, naming the flag or field."""
    try:
        code = simulate.main([*args, "--out", str(tmp_path)])
    except SystemExit as e:                                  # argparse's own refusal of a choice
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and says in err, err
    assert not list(tmp_path.rglob("*.h5"))


def test_the_simulated_file_is_marked_and_analyze_reads_it(tmp_path, capsys, monkeypatch):
    assert run_cli(capsys, "--steps", "4", "--variants", "flex", "--out", str(tmp_path))[0] == 0
    h5 = tmp_path / "flex" / "local.h5"
    with h5py.File(h5, "r") as f:
        assert bool(f.attrs["simulated"]) and f.attrs["hardware"] == "npu64_a3"
        assert len(f["metrics"]) == 4
    assert analyze.main([str(h5), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary                                           # the same summary as a real run's
    # a large run's timeline: one row per role and pool/group (forced here on a small run)
    monkeypatch.setattr(analyze, "MAX_TIMELINE_RANKS", 2)
    assert analyze.main([str(h5), "--out", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "timeline.png").stat().st_size > 0
    run = analyze.load_run(h5)
    rows = analyze._rows(run)
    assert [label.split(" (")[0] for label, _ in rows][:2] == ["orchestrator", "pool rollout"]
    assert sum(len(r) for _, r in rows) == int(run.attrs["world_size"])


def test_the_clock_never_sleeps_and_runs_far_ahead_of_the_wall(tmp_path, monkeypatch):
    def no_sleep(s):
        raise AssertionError(f"slept {s} s")
    monkeypatch.setattr(time, "sleep", no_sleep)
    wall = time.perf_counter()
    res = runs.run_variants(CONFIG, ["sync", "flex"], "npu64_a3", 4, tmp_path, TINY)
    wall = time.perf_counter() - wall
    simulated = sum(r["sim_s"] for r in res.values())
    assert simulated > 2 * wall, (simulated, wall)


def test_staleness_one_with_rebound_replicas_does_not_deadlock(tmp_path, capsys):
    """Found by the simulator on the paper shapes: mid-step, a re-bound replica lacked the
    agent's current version and push_weights waited for the step to end, which needed that
    replica's sample: the orchestrator waited with nothing in flight. The real orchestrator
    code runs here, so the same fix holds for MPI jobs."""
    code = simulate.main(["compare", str(ROOT / "configs/paper_5x32b.yaml"), "--steps", "6", "--variants",
                          "flex-stale1", "--json", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert json.loads(out)["variants"]["flex-stale1"]["step_s"] > 0


PAPER = ROOT / "configs/paper_3x32b_7x14b.yaml"


def test_plan_prints_closed_form_and_simulated_rows_and_writes_a_fragment_that_validates(tmp_path, capsys):
    frag_path = tmp_path / "plan.yaml"
    code = simulate.main(["plan", str(PAPER), "--nodes", "48", "--top", "2", "--steps", "3",
                          "--write", str(frag_path), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("plan "))
    assert "closed-form step_s" in lines[head] and "simulated step_s" in lines[head]
    rows = [line.split() for line in lines[head + 1:] if line.startswith("#") and not line.startswith("# ")]
    assert sorted(r[0] for r in rows) == ["#1", "#2"]
    sim = [float(r[3]) for r in rows]
    assert all(float(r[1]) > 0 and s > 0 for r, s in zip(rows, sim)) and sim == sorted(sim)  # best simulated first
    assert all(int(r[5]) == 47 for r in rows)                          # + the orchestrator's node = 48
    written = frag_path.read_text()
    assert written in out and written.startswith("# simulate --plan")  # the printed fragment is the file
    assert f"predicted flex step {sim[0]:.1f} s simulated" in written
    frag = yaml.safe_load(written)
    assert {a for p in frag["rollout"]["pools"] for a in p["agents"]} == {
        *(f"shop32_{i}" for i in range(3)), *(f"shop14_{i}" for i in range(7))}
    merged = tmp_path / "merged.yaml"
    merged.write_text(yaml.safe_dump(merge_fragment(yaml.safe_load(PAPER.read_text()), frag)))
    cfg = load_config(merged)                                         # the pasted config validates
    assert sum(c.slurm.nodes for c in resolve(cfg).components) == 48
    assert not list(tmp_path.glob(".*.tmp"))
    for i in (1, 2):                                                 # each plan ran the real orchestrator
        with h5py.File(next((tmp_path / "out" / f"plan{i}" / "flex").glob("*.h5")), "r") as f:
            assert bool(f.attrs["simulated"]) and len(f["metrics"]) == 3


def test_plan_json_gives_both_estimates_per_plan_and_the_configs_own_allocation(tmp_path, capsys):
    code = simulate.main(["plan", CONFIG, *TINY, "--nodes", "3", "--top", "1", "--steps", "3", "--json",
                          "--hardware", "h100_ndr", "--baseline", "--out", str(tmp_path)])
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res["nodes"] == 3 and res["hardware"] == "h100_ndr"
    (p,) = res["plans"]
    assert p["closed_form_step_s"] > 0 and p["simulated"]["step_s"] > 0 and 0 < p["simulated"]["util"] <= 1
    assert p["fragment"]["rollout"]["pools"][0]["agents"] == ["speaker", "listener"]
    own = res["config_allocation"]                    # local.yaml as written: slurm.rollout + slurm.trainer
    assert own["nodes"] == 2 and own["sim"]["step_s"] > 0
    assert (tmp_path / "config" / "flex" / "local.h5").is_file()


@pytest.mark.parametrize("args, flag", [
    ([], "--nodes: required"),
    (["--nodes", "3"], "--nodes: expected >= "),
    (["--nodes", "48", "--hardware", "nope"], "--hardware: "),
    (["--nodes", "48", "--top", "0"], "--top: expected >= 1"),
    (["--nodes", "48", "--write", "/no/such/dir/plan.yaml"], "--write: folder"),
])
def test_plan_refuses_bad_flags_in_one_line_and_keeps_the_old_file(tmp_path, capsys, args, flag):
    old = tmp_path / "plan.yaml"
    old.write_text("old\n")
    write = [] if "--write" in args else ["--write", str(old)]
    code = simulate.main(["plan", str(PAPER), *args, *write, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and flag in err and len(err.strip().splitlines()) == 1, err
    assert old.read_text() == "old\n"


def test_plan_exits_1_and_writes_nothing_when_every_simulated_plan_fails(tmp_path, capsys, monkeypatch):
    """E.g. a plan whose run stalls (the orchestrator waits with nothing in flight): the table
    says so and no fragment is recommended or written."""
    monkeypatch.setattr(runs, "run_variants",
                        lambda *a, **k: {"flex": {"error": "waits with nothing in flight", "wall_s": 0.0}})
    frag = tmp_path / "plan.yaml"
    code = simulate.main(["plan", str(PAPER), "--nodes", "48", "--top", "2", "--write", str(frag),
                          "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code == 1 and "every simulated plan failed" in captured.err
    assert captured.out.count("failed: waits with nothing in flight") == 2 and "rollout:" not in captured.out
    assert not frag.exists()


# ---------------------------------------------------------------------------------------
# subcommands, and the flag forms before them


@pytest.mark.parametrize("old", [["--compare", "sync,flex"], [], ["--plan", "--nodes", "48"], ["--capacity"]])
def test_the_removed_flag_forms_are_one_line_naming_the_subcommands(capsys, old):
    """`simulate CONFIG --plan` and the other forms before subcommands are gone: exit 2 and
    one line that names the subcommands, nothing run."""
    assert simulate.main([CONFIG, "a.b=1", *old]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected a subcommand (compare," in err[0] and f"'simulate compare {CONFIG} ...'" in err[0], err


@pytest.mark.parametrize("argv", [["--help"], *([s, "--help"] for s in simulate.COMMANDS)])
def test_help_of_the_cli_and_of_each_subcommand(capsys, argv):
    with pytest.raises(SystemExit) as e:
        simulate.main(argv)
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: python -m flexmarl_hpc.simulate")
    # `paper` takes no CONFIG: its tasks name their own (sim/workload.py)
    assert all(s in out for s in simulate.COMMANDS) if len(argv) == 1 else (
        "--fit" in out if argv[0] == "paper" else "config" in out)


@pytest.mark.parametrize("argv, says", [
    (["scale", CONFIG, "--counts", "0"], "--counts: expected"),
    (["calibrate", CONFIG, "--run", "/no/such.h5"], "--run: no such file"),
    (["compare", CONFIG, "--steps", "2"], "--steps: expected >= 3"),
])
def test_subcommands_refuse_bad_flags_in_one_line_naming_their_own_flag(capsys, argv, says):
    assert simulate.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_compare_jitter_is_seeded_and_a_failure_costs_the_lost_steps(tmp_path, capsys):
    """The same seed gives the same run, another seed another; a failure at 0 s restarts
    from scratch: the steps end `restart + checkpoint read` later."""
    def step(*extra):
        assert simulate.main(["compare", CONFIG, *TINY, "--hardware", "h100_ndr", "--steps", "3", "--variants",
                              "flex", "--json", "--out", str(tmp_path), *extra]) == 0
        return json.loads(capsys.readouterr().out)["variants"]["flex"]
    plain = step()
    a, b = step("--jitter", "0.5", "--seed", "1"), step("--jitter", "0.5", "--seed", "1")
    assert a["step_s"] == b["step_s"] != plain["step_s"]
    assert step("--jitter", "0.5", "--seed", "2")["step_s"] != a["step_s"]
    # failing at 0 s, nothing checkpointed, a file system fast enough to read it at once: every
    # step ends exactly the restart's 100 s later
    failed = step("--fail-at", "0", "--restart-s", "100", "--checkpoint-every", "0", "--fs-gb-s", "1e9")
    assert failed["done_with_failure_s"] == pytest.approx(failed["done_s"] + 100, abs=1e-3)
