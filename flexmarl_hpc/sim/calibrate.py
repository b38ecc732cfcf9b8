"""Fit a CPU hardware profile from a real run's busy intervals (`simulate calibrate CONFIG --run RUN.h5`).

Pure core: `observe(h5)` reads a run's file into `Observations` (each generate interval with
its batch's prompt and response lengths, each train interval with its micro-batch's tokens
and whether it ran the optimizer, sync durations, the orchestrator's busy seconds per reply);
`fit(obs, base, shape)` returns `base` with the fitted fields replaced. The fit prices each
observed interval with the cost model's own functions (sim/costs.py, one device per replica,
bytes_per_param=4), so a fitted profile reproduces the intervals it was fitted on:

  generate = call + decode_steps x step_overhead + prefill(F_gen, B)
             + sum over decode steps of max(KV and weight bytes read / B, 2P x batch / F_gen)
  train    = call + 6P x tokens / F_train + [optimizer step] x (30 bytes x P / B + opt_overhead)
  sync     = bytes / link + buckets x bucket_latency
  orchestrator, per reply it handles: orchestrator_s (its schedule/handle/store/log time)

For each memory bandwidth B of a grid and each generate rate F_gen (a golden-section search
in log F), call and step_overhead are a non-negative least-squares fit; the (B, F_gen) of
least squared error wins. On a small model the memory term is mostly below the compute term
(reads hit the cache), B is then not identified: the largest B of equal error is kept, so
the fitted profile never prices a memory term the run did not show (the bug of a B taken
from the optimizer: the KV reads of a decode step at Adam's "bandwidth" doubled a step).
F_gen becomes peak_bf16_tflops with mfu_prefill = mfu_decode = 1, F_train = peak x mfu_train;
the optimizer's time beyond its memory-bound update at B is `optimizer_overhead_s` (torch's
per-tensor dispatch on CPU). A term the run cannot separate (e.g. one micro-batch size: per-call
and per-token train costs are collinear) falls back to the base profile's value for the
other term. The result's `name` says it was fitted, from which file.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from flexmarl_hpc.sim.cores import work_at_rate
from flexmarl_hpc.sim.costs import ADAM_BYTES_PER_PARAM, ModelShape, decode_schedule, decode_step_s, prefill_s
from flexmarl_hpc.sim.hardware import HardwareProfile, validate_hardware

BUSY = (b"generate", b"train", b"sync", b"checkpoint", b"swap")
"""Worker activities that answer a command (the rest is waiting)."""


@dataclass
class Observations:
    """What one real run measured, as the fit needs it (all seconds)."""
    gen_s: np.ndarray
    """Seconds at a whole core of each generate interval matched to its samples (its
    duration unless the ranks shared cores, see observe)."""
    gen_batches: list[tuple[int, float, np.ndarray]]
    """Per generate interval: its prompt tokens in all, the mean prompt, the response lengths."""
    slots: int
    """Sequences a replica decodes at once (rollout.max_batch)."""
    train_s: np.ndarray
    """Seconds at a whole core of each train interval (one micro-batch), likewise."""
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


def observe(path: str | Path, max_batch: int, replicas: int, allow_simulated: bool = False,
            shared_cores: float = 0, waiting_share: float = 0.0, workers_poll: bool = True) -> Observations:
    """Read a real run's HDF5 file. Rollout rank = 1 + replica index (the run's layout).
    `allow_simulated`: a simulated run too (tests: a run of known figures, read back).
    `shared_cores` > 0: the ranks shared that many cores, so each generate and train interval,
    and each of the orchestrator's busy ones, counts the seconds it would take at a whole
    core (sim.cores.work_at_rate, the model the simulator runs them under, `workers_poll` as
    the run's idle_wait), not its wall time."""
    with h5py.File(path, "r") as f:
        if "intervals" not in f or "samples" not in f:
            raise ValueError(f"{path}: not a run file (expected /intervals and /samples)")
        if f.attrs.get("simulated", False) and not allow_simulated:
            raise ValueError(f"{path}: a simulated run; calibrate from a real (MPI) run")
        iv = f["intervals"][:]
        ranks = int(f.attrs.get("world_size", iv["rank"].max() + 1))
        samples = {a: f["samples"][a][:] for a in f["samples"]}
        steps = {a: f["steps"][a][:] for a in f["steps"]}
    work = iv["t1"] - iv["t0"]
    orch = (iv["rank"] == 0) & (iv["activity"] != b"wait")
    if shared_cores:                   # the orchestrator computes on the same cores
        k = ((iv["rank"] > 0) & np.isin(iv["activity"], (b"generate", b"train"))) | orch
        work[k] = work_at_rate(iv["t0"][k], iv["t1"][k], shared_cores, ranks, waiting_share, workers_poll)
    gen_s, gen_batches = _generate_obs(iv, work, samples, max_batch, replicas)
    train_s, train_tokens, train_last = _train_obs(iv, work, samples, steps)
    sync = iv[iv["activity"] == b"sync"]
    log = orch & (iv["activity"] == b"log")
    workers = (iv["rank"] > 0) & np.isin(iv["activity"], BUSY)
    return Observations(gen_s, gen_batches, max_batch, train_s, train_tokens, train_last,
                        sync["t1"] - sync["t0"], float(work[orch & ~log].sum()), int(workers.sum()),
                        float(work[log].sum()), int(train_last.sum()), message_gaps(iv))


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


def _generate_obs(iv, work, samples, max_batch, replicas):
    """Each generate interval with the samples it produced: those of its agent and replica
    the orchestrator received first after the interval ended (t_generated)."""
    out = []
    for agent, s in samples.items():
        for rep in np.unique(s["replica"]):
            if not 0 <= rep < replicas:
                continue
            k = (iv["rank"] == rep + 1) & (iv["activity"] == b"generate") & (iv["agent"] == agent.encode())
            ends, durs = iv["t1"][k], work[k]
            order = np.argsort(ends)
            ends, durs = ends[order], durs[order]
            mine = s[s["replica"] == rep]
            for t in np.unique(mine["t_generated"]):
                i = np.searchsorted(ends, t, side="right") - 1
                if i < 0:
                    continue
                batch = mine[mine["t_generated"] == t]
                out.append((float(durs[i]), (int(batch["prompt_len"].sum()), float(batch["prompt_len"].mean()),
                                             batch["response_len"].astype(np.int64))))
    if not out:
        raise ValueError("calibration: no generate interval could be matched to its samples")
    return np.array([d for d, _ in out]), [b for _, b in out]


def _train_obs(iv, work, samples, steps):
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
        d = work[k][np.argsort(iv["t0"][k], kind="stable")]
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


B_GRID = np.geomspace(1e6, 1e14, 33)
"""Memory bandwidths (bytes/s) the generate fit starts from: 1 MB/s to 100 TB/s (where no
term of a small model's decode is left), then refined around the best."""
F_RANGE = (1e6, 1e14)
"""Generate FLOP rates (FLOP/s) the golden-section search spans."""


def golden(fn, lo: float, hi: float, iters: int) -> float:
    """argmin of `fn` over [lo, hi] (golden-section search; unimodal in practice here)."""
    g = (np.sqrt(5) - 1) / 2
    for _ in range(iters):
        m1, m2 = hi - g * (hi - lo), lo + g * (hi - lo)
        if fn(m1) <= fn(m2):
            hi = m2
        else:
            lo = m1
    return (lo + hi) / 2


def fit_generate(obs: Observations, base: HardwareProfile, shape: ModelShape) -> tuple[float, float, float, float]:
    """(call_s, step_overhead_s, F_gen, B) of least squared error on the generate intervals,
    each priced by sim.costs.prefill_s and decode_step_s on one device."""
    n, eff = len(obs.gen_s), base.efficiency
    idx, active, held = [], [], []
    for i, (_, prompt, lens) in enumerate(obs.gen_batches):
        lens = lens[lens > 0]
        if len(lens):
            a, h = decode_schedule(lens, prompt, obs.slots)
            idx.append(np.full(len(a), i))
            active.append(a)
            held.append(h)
    idx = np.concatenate(idx) if idx else np.zeros(0, np.int64)
    active = np.concatenate(active) if active else np.zeros(0)
    held = np.concatenate(held) if held else np.zeros(0)
    prefill = np.array([b[0] for b in obs.gen_batches], dtype=np.float64)
    steps = np.bincount(idx, minlength=n).astype(np.float64)
    bare = dataclasses.replace(eff, mfu_prefill=1.0, mfu_decode=1.0, hbm=1.0, call_overhead_s=0.0,
                               decode_step_overhead_s=0.0)

    def solve(log_f: float, log_b: float) -> tuple[float, np.ndarray]:
        hw = dataclasses.replace(base, peak_bf16_tflops=np.exp(log_f) / 1e12, hbm_gb_s=np.exp(log_b) / 1e9,
                                 efficiency=bare)
        rest = obs.gen_s - np.bincount(idx, weights=decode_step_s(hw, shape, active, held), minlength=n) \
            - prefill_s(hw, shape, prefill)
        x = fit_columns([np.ones(n), steps], rest, [eff.call_overhead_s, eff.decode_step_overhead_s])
        r = rest - x[0] - x[1] * steps
        return float(r @ r), x

    def best_f(log_b: float) -> float:
        return golden(lambda lf: solve(lf, log_b)[0], *np.log(F_RANGE), 45)

    def sse(log_b: float) -> float:
        return solve(best_f(log_b), log_b)[0]

    grid = np.log(B_GRID)
    errors = [sse(lb) for lb in grid]
    # of equal errors the largest B wins: a memory term the run did not show is not priced.
    # "Equal" relative to the data too: on intervals the model explains exactly every error
    # is round-off, and the least of them picks a B at random (and prices Adam's reads at it)
    tie = min(errors) * (1 + 1e-6) + 1e-12 * float(obs.gen_s @ obs.gen_s)
    i = max(k for k in range(len(grid)) if errors[k] <= tie)
    log_b = grid[i] if i == len(grid) - 1 else golden(sse, grid[max(i - 1, 0)], grid[i + 1], 30)
    log_f = best_f(log_b)
    x = solve(log_f, log_b)[1]
    return float(x[0]), float(x[1]), float(np.exp(log_f)), float(np.exp(log_b))


def fit(obs: Observations, base: HardwareProfile, shape: ModelShape, source: str) -> HardwareProfile:
    """`base` with peak, mfu_train, memory bandwidth, the optimizer's overhead, call/decode-step/
    bucket latencies and the orchestrator's costs fitted to `obs` for a model of `shape`
    (one device per replica and trainer)."""
    p, eff = shape.params, base.efficiency
    call, step, f_gen, bandwidth = fit_generate(obs, base, shape)
    # train, the call cost known: [6P x tokens, optimizer step] -> 1 / F_train, optimizer seconds
    adam = ADAM_BYTES_PER_PARAM * p / bandwidth
    t = fit_columns([6 * p * obs.train_tokens, obs.train_last], obs.train_s - call,
                    [1 / (base.peak_flops * eff.mfu_train), adam + eff.optimizer_overhead_s])
    f_train = 1.0 / t[0] if t[0] > 0 else base.peak_flops * eff.mfu_train
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
        optimizer_overhead_s=float(max(t[1] - adam, 0.0)),
        orchestrator_s=float(obs.orchestrator_busy_s / max(obs.replies, 1)),
        orchestrator_step_s=float(obs.orchestrator_log_s / max(obs.agent_steps, 1)),
        message_latency_s=float(np.median(obs.gaps_s)) if len(obs.gaps_s) else eff.message_latency_s)
    hw = dataclasses.replace(base, name=f"{base.name}_fitted", peak_bf16_tflops=peak / 1e12,
                             hbm_gb_s=bandwidth / 1e9, efficiency=fitted,
                             accelerator=f"{base.accelerator}; fitted by simulate --calibrate {source}")
    return validate_hardware(hw, f"profile fitted from {source}")
