"""run.loggers: TensorBoard event files and the offline W&B run, read back and compared
with the HDF5 store (the source of truth), across a preemption and a resume."""
import struct
from pathlib import Path

import h5py
import pytest

from tests.conftest import need, run_training

SMALL = ["run.log_every=1", "workflow.inputs_per_step=4", "trainer.micro_batch_size=8",
         "workflow.turns=[{agent: speaker, samples: 4, max_new_tokens: 2}, "
         "{agent: listener, samples: 4, max_new_tokens: 1}]"]
PER_AGENT = ("reward", "loss", "entropy", "kl", "grad_norm", "staleness_max", "staleness_mean",
             "logp_mismatch", "tis_mean", "clip_frac", "ppo_kl")
RUN = ("samples_per_s", "tokens_per_s", "utilization", "staleness_max", "rollout_s", "train_s", "sync_s")


def read_tensorboard(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard itself shows them (its own event reader,
    which applies the purge a resumed writer asked for)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def read_wandb_history(path: Path) -> list[dict]:
    """The `history` records of an offline `.wandb` file: a W&B header, then a LevelDB log
    (32 KiB blocks of CRC/length/type-framed chunks) of wandb_internal_pb2.Record."""
    import json

    from wandb.proto import wandb_internal_pb2 as pb
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B data file"
    pos, block, records, part = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:                                  # block trailer padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + n]
        pos += 7 + n
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):                            # FULL or LAST: a whole record
            rec = pb.Record()
            rec.ParseFromString(part)
            if rec.WhichOneof("record_type") == "history":
                records.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                for i in rec.history.item})
    return records


def store_values(h5: Path):
    with h5py.File(h5, "r") as f:
        cur = lambda tab: tab[tab["superseded"] == 0]          # rows a resume rolled back are not current
        steps = {a: {c: cur(f[f"steps/{a}"][:])[c] for c in ("step", "reward_mean", "loss", "grad_norm")}
                 for a in f.attrs["agents"]}
        metrics = {c: cur(f["metrics"][:])[c] for c in ("step", "utilization", "samples_per_s")}
    return steps, metrics


def test_tensorboard_and_wandb_carry_the_store_across_a_resume(tmp_path, mpiexec, monkeypatch):
    """A run with both sinks is preempted (USR1, as Slurm's --signal) and resumed: the
    TensorBoard events (read back with TensorBoard's reader) and the offline W&B history
    hold every global step once, per agent and run-wide, equal to the HDF5 store."""
    for pkg in ("tensorboard", "wandb"):
        need(__import__("importlib").util.find_spec(pkg) is not None, f"{pkg} (requirements-loggers.txt)")
    steps = 24
    # SIGUSR1 at a fixed point mid-run (reward call 212), sent by the test task itself
    preempt = ["workflow.task=tests.faulty_tasks:PreemptingGame", "workflow.task_args.after=212",
               f"workflow.task_args.marker={tmp_path / 'preempted'}"]
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline must be the sink's own default
    loggers = "run.loggers=[tensorboard, wandb]"
    p = run_training(tmp_path, *SMALL, *preempt, f"run.steps={steps}", loggers, check=False)
    assert p.returncode == 75, p.stdout + p.stderr
    q = run_training(tmp_path, *SMALL, *preempt, f"run.steps={steps}", loggers)
    assert "resumed at versions" in q.stdout
    st, met = store_values(tmp_path / "local.h5")

    tb = read_tensorboard(tmp_path / "tensorboard")
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2   # one per process
    for agent in ("speaker", "listener"):
        for tag in PER_AGENT:
            assert [s for s, _ in tb[f"{agent}/{tag}"]] == list(range(steps)), (agent, tag)
        for tb_tag, col in (("reward", "reward_mean"), ("loss", "loss"), ("grad_norm", "grad_norm")):
            want = {int(s): float(v) for s, v in zip(st[agent]["step"], st[agent][col])}
            got = dict(tb[f"{agent}/{tb_tag}"])
            assert got == pytest.approx(want, rel=1e-6), (agent, tb_tag)
    for tag in RUN:
        assert [s for s, _ in tb[f"run/{tag}"]] == list(range(steps)), tag
    assert dict(tb["run/utilization"]) == pytest.approx(
        {int(s): float(v) for s, v in zip(met["step"], met["utilization"])}, rel=1e-6)
    # held-out evaluation (configs/local.yaml: every 20 steps, and at the start and the end):
    # its own points, the ones the first process logged past the resume point written again
    with h5py.File(tmp_path / "local.h5") as f:
        ev = f["eval"][:]
    for agent in ("speaker", "listener"):
        want = {int(r["step"]): float(r["value"]) for r in ev if r["agent"] == agent.encode()}
        assert sorted(want) == [0, 20, steps]
        assert dict(tb[f"{agent}/eval/reward"]) == pytest.approx(want, rel=1e-6), agent

    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs                       # one folder per process, one run id
    assert len({r.name.split("-", 3)[3] for r in runs}) == 1       # offline-run-<time>-<id>
    hist = [h for r in runs for h in read_wandb_history(next(r.glob("run-*.wandb")))]
    assert {h["global_step"] for h in hist if "listener/eval/reward" in h} == {0, 20, steps}
    hist = [h for h in hist if "run/utilization" in h]          # the per-step records
    by_step = {}
    for h in hist:
        by_step.setdefault(h["global_step"], []).append(h)
    assert sorted(by_step) == list(range(steps))
    for agent in ("speaker", "listener"):
        for s, v in zip(st[agent]["step"], st[agent]["reward_mean"]):
            assert [h[f"{agent}/reward"] for h in by_step[int(s)]] == pytest.approx(
                [float(v)] * len(by_step[int(s)]), rel=1e-6)
        assert all(f"{agent}/{t}" in h for h in hist for t in PER_AGENT)
    assert all(h["run/utilization"] >= 0 for h in hist)
