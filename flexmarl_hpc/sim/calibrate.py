"""Fit a CPU hardware profile from a real run's busy intervals (`simulate --calibrate RUN.h5`).

Pure core: `observe(h5)` reads a run's file into `Observations` (each generate interval with
its batch's prompt and response lengths, each train interval with its micro-batch's tokens
and whether it ran the optimizer, sync durations, the orchestrator's busy seconds per reply);
`fit(obs, base, shape)` returns `base` with the fitted fields replaced. The fit uses the cost
model's own small-model form (sim/costs.py with bytes_per_param=4), which is linear in these
unknowns once compute dominates memory (a model of ~1e5 parameters reads its weights in
microseconds, while its calls take milliseconds):

  generate = call + decode_steps x step_overhead + 2P x (prompt + response tokens) / F_gen
  train    = call + 6P x tokens / F_train + [optimizer step] x 30 bytes x P / hbm
  sync     = bytes / link + buckets x bucket_latency
  orchestrator, per reply it handles: orchestrator_s (its schedule/handle/store/log time)

F_gen becomes peak_bf16_tflops with mfu_prefill = mfu_decode = 1, F_train = peak x mfu_train.
Each group is fitted by non-negative least squares; a term the run cannot separate (e.g. one
micro-batch size: per-call and per-token train costs are collinear) falls back to the base
profile's value for the other term. The result's `name` says it was fitted, from which file.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from .costs import ADAM_BYTES_PER_PARAM, ModelShape, decode_schedule
from .hardware import HardwareProfile, validate_hardware

BUSY = (b"generate", b"train", b"sync", b"checkpoint", b"swap")
"""Worker activities that answer a command (the rest is waiting)."""


@dataclass
class Observations:
    """What one real run measured, as the fit needs it (all seconds)."""
    gen_s: np.ndarray
    """Duration of each generate interval matched to its samples."""
    gen_steps: np.ndarray
    """Decode steps of each (continuous batching on `max_batch` slots)."""
    gen_tokens: np.ndarray
    """Prompt + response tokens of each (what its FLOPs are counted over)."""
    train_s: np.ndarray
    """Duration of each train interval (one micro-batch)."""
    train_tokens: np.ndarray
    """Prompt + response tokens of each micro-batch."""
    train_last: np.ndarray
    """1.0 where the interval ran the optimizer step (a step's last micro-batch)."""
    sync_s: np.ndarray
    """Duration of each weight-sync interval (every member's)."""
    orchestrator_busy_s: float
    """The orchestrator's busy seconds but its step-end log (schedule, handle, store)."""
    replies: int
    """Worker commands answered in that time (busy intervals of worker ranks)."""
    orchestrator_log_s: float
    """The orchestrator's busy seconds in its step-end `log` activity."""
    agent_steps: int
    """Optimizer steps of all agents (each ends with a Stepped reply)."""
    gaps_s: np.ndarray
    """Message gaps: a worker's start after the orchestrator's last busy end before it, and
    the orchestrator's next busy start after a worker's end (one-way latencies, upper bounds)."""


def observe(path: str | Path, max_batch: int, replicas: int, allow_simulated: bool = False) -> Observations:
    """Read a real run's HDF5 file. Rollout rank = 1 + replica index (the run's layout).
    `allow_simulated`: a simulated run too (tests: a run of known figures, read back)."""
    with h5py.File(path, "r") as f:
        if "intervals" not in f or "samples" not in f:
            raise ValueError(f"{path}: not a run file (expected /intervals and /samples)")
        if f.attrs.get("simulated", False) and not allow_simulated:
            raise ValueError(f"{path}: a simulated run; calibrate from a real (MPI) run")
        iv = f["intervals"][:]
        samples = {a: f["samples"][a][:] for a in f["samples"]}
        steps = {a: f["steps"][a][:] for a in f["steps"]}
    gen_s, gen_steps, gen_tokens = _generate_obs(iv, samples, max_batch, replicas)
    train_s, train_tokens, train_last = _train_obs(iv, samples, steps)
    sync = iv[iv["activity"] == b"sync"]
    orch = (iv["rank"] == 0) & (iv["activity"] != b"wait")
    log = orch & (iv["activity"] == b"log")
    workers = (iv["rank"] > 0) & np.isin(iv["activity"], BUSY)
    dur = iv["t1"] - iv["t0"]
    return Observations(gen_s, gen_steps, gen_tokens, train_s, train_tokens, train_last,
                        sync["t1"] - sync["t0"], float(dur[orch & ~log].sum()), int(workers.sum()),
                        float(dur[log].sum()), int(train_last.sum()), message_gaps(iv))


def message_gaps(iv: np.ndarray) -> np.ndarray:
    """Gaps between the orchestrator's busy intervals and the generate/train intervals they
    start or follow (see Observations.gaps_s)."""
    w = iv[(iv["rank"] > 0) & np.isin(iv["activity"], (b"generate", b"train"))]
    o = iv[(iv["rank"] == 0) & (iv["activity"] != b"wait")]
    if not len(w) or not len(o):
        return np.zeros(0)
    starts, ends = np.sort(o["t0"]), np.sort(o["t1"])
    i = np.searchsorted(starts, w["t1"])
    reply = starts[i[i < len(starts)]] - w["t1"][i < len(starts)]
    j = np.searchsorted(ends, w["t0"]) - 1
    command = w["t0"][j >= 0] - ends[j[j >= 0]]
    return np.concatenate([reply, command])


def _generate_obs(iv, samples, max_batch, replicas):
    """Each generate interval with the samples it produced: those of its agent and replica
    the orchestrator received first after the interval ended (t_generated)."""
    out = []
    for agent, s in samples.items():
        for rep in np.unique(s["replica"]):
            if not 0 <= rep < replicas:
                continue
            k = (iv["rank"] == rep + 1) & (iv["activity"] == b"generate") & (iv["agent"] == agent.encode())
            ends, durs = iv["t1"][k], (iv["t1"] - iv["t0"])[k]
            order = np.argsort(ends)
            ends, durs = ends[order], durs[order]
            mine = s[s["replica"] == rep]
            for t in np.unique(mine["t_generated"]):
                i = np.searchsorted(ends, t, side="right") - 1
                if i < 0:
                    continue
                batch = mine[mine["t_generated"] == t]
                lens = batch["response_len"].astype(np.int64)
                active, _ = decode_schedule(lens[lens > 0], float(batch["prompt_len"].mean()), max_batch)
                out.append((durs[i], len(active), int(batch["prompt_len"].sum() + lens.sum())))
    if not out:
        raise ValueError("calibration: no generate interval could be matched to its samples")
    a = np.asarray(out, dtype=np.float64)
    return a[:, 0], a[:, 1], a[:, 2]


def _train_obs(iv, samples, steps):
    """Each agent's train intervals (its trainer leader's, in time order) split into its
    steps' micro-batches (n_micro each, the last one runs the optimizer)."""
    dur, tokens, last = [], [], []
    for agent, st in steps.items():
        st = st[st["superseded"] == 0]
        k = (iv["activity"] == b"train") & (iv["agent"] == agent.encode())
        if not k.any():
            continue
        leader = int(iv["rank"][k].min())
        k &= iv["rank"] == leader
        d = np.sort(np.stack([iv["t0"][k], iv["t1"][k]], 1), axis=0)
        d = d[:, 1] - d[:, 0]
        s = samples[agent]
        per_sample = float(np.mean(s["prompt_len"] + s["response_len"])) if len(s) else 0.0
        flags = np.concatenate([np.r_[np.zeros(max(n - 1, 0)), 1.0] for n in st["n_micro"]]) if len(st) else []
        rows = np.concatenate([np.full(n, ns / max(n, 1)) for ns, n in zip(st["n_samples"], st["n_micro"])]) \
            if len(st) else []
        n = min(len(d), len(flags))
        dur.append(d[:n])
        tokens.append(np.asarray(rows[:n]) * per_sample)
        last.append(np.asarray(flags[:n]))
    if not dur or not sum(len(x) for x in dur):
        raise ValueError("calibration: the run has no train intervals")
    return np.concatenate(dur), np.concatenate(tokens), np.concatenate(last)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 (drop the most negative coefficient, refit; small systems)."""
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0.0
            x[free] = sol
            return x
        free.pop(int(np.argmin(sol)))
    return x


def fit_columns(cols: list[np.ndarray], y: np.ndarray, prior: list[float]) -> np.ndarray:
    """Non-negative least squares of `y` on `cols`, in order; a column the earlier ones
    already span (e.g. a constant token count next to the per-call column) is not fitted:
    it keeps its `prior` coefficient, its contribution taken off `y` first."""
    a = np.stack(cols, 1).astype(np.float64)
    scaled = a / np.maximum(np.abs(a).max(0), 1e-300)
    keep: list[int] = []
    for j in range(a.shape[1]):
        if np.abs(scaled[:, j]).max() > 0 and np.linalg.matrix_rank(scaled[:, keep + [j]], tol=1e-6) > len(keep):
            keep.append(j)
    drop = [j for j in range(a.shape[1]) if j not in keep]
    x = np.asarray(prior, dtype=np.float64).copy()
    rest = y - a[:, drop] @ x[drop] if drop else y
    if keep:
        x[keep] = nnls(a[:, keep], rest)
    return x


def fit(obs: Observations, base: HardwareProfile, shape: ModelShape, source: str) -> HardwareProfile:
    """`base` with peak, mfu_train, hbm_gb_s, call/decode-step/bucket latencies and
    orchestrator_s fitted to `obs` for a model of `shape` (one device per replica and trainer)."""
    p, eff = shape.params, base.efficiency
    # generate: [call, decode step, 2P x tokens] -> call_s, step_s, 1 / F_gen
    g = fit_columns([np.ones_like(obs.gen_s), obs.gen_steps, 2 * p * obs.gen_tokens], obs.gen_s,
                    [eff.call_overhead_s, eff.decode_step_overhead_s, 1 / (base.peak_flops * eff.mfu_prefill)])
    call, step = g[0], g[1]
    f_gen = 1.0 / g[2] if g[2] > 0 else base.peak_flops * eff.mfu_prefill
    # train, the call cost known: [6P x tokens, optimizer step] -> 1 / F_train, Adam seconds
    t = fit_columns([6 * p * obs.train_tokens, obs.train_last], obs.train_s - call,
                    [1 / (base.peak_flops * eff.mfu_train), ADAM_BYTES_PER_PARAM * p / (base.hbm_bandwidth * eff.hbm)])
    f_train = 1.0 / t[0] if t[0] > 0 else base.peak_flops * eff.mfu_train
    hbm = ADAM_BYTES_PER_PARAM * p / t[1] / 1e9 if t[1] > 0 else base.hbm_gb_s
    # sync: one size per agent in these runs; the link keeps the base bandwidth, the rest is latency
    link = base.inter_node_bandwidth_per_device * eff.link
    nbytes = shape.weight_bytes
    bucket = max(float(np.median(obs.sync_s)) - nbytes / link, 0.0) if len(obs.sync_s) else eff.bucket_latency_s
    bucket = float(bucket / max(math.ceil(nbytes / (1024 * 2**20)), 1))
    peak = float(max(f_gen, f_train))
    f_gen, f_train = float(f_gen), float(f_train)
    fitted = dataclasses.replace(
        eff, mfu_prefill=f_gen / peak, mfu_decode=f_gen / peak, mfu_train=f_train / peak, hbm=1.0,
        call_overhead_s=float(call), decode_step_overhead_s=float(step), bucket_latency_s=float(bucket),
        orchestrator_s=float(obs.orchestrator_busy_s / max(obs.replies, 1)),
        orchestrator_step_s=float(obs.orchestrator_log_s / max(obs.agent_steps, 1)),
        message_latency_s=float(np.median(obs.gaps_s)) if len(obs.gaps_s) else eff.message_latency_s)
    hw = dataclasses.replace(base, name=f"{base.name}_fitted", peak_bf16_tflops=peak / 1e12,
                             hbm_gb_s=float(hbm), efficiency=fitted,
                             accelerator=f"{base.accelerator}; fitted by simulate --calibrate {source}")
    return validate_hardware(hw, f"profile fitted from {source}")
