"""`simulate memory`'s prediction against a real CPU run's peak RSS, per rank: a megatron
TP 2 x PP 2 trainer group and 2 torch-engine replicas (the setting of
tests/mpi/test_sync_megatron.py, at a size whose tensors outweigh the imports).

    .venv/bin/python scripts/memory_rss.py            # prints the table of docs/simulator.md

Real: `mpiexec -n 6` of this file's rank job. Every rank imports what a run's rank imports
(torch, mpi4py, megatron, flexmarl_hpc), reads its RSS (/proc/self/statm: the per-process
baseline), then a trainer rank runs the production code once: `build.build_trainer` over its
group, one `forward_backward` of its share of the micro-batch, `optimizer_step`, and a weight
sync through `workers.TrainerRank.sync` to both replicas inside the (trainer group, pool)
group made at start; a replica builds its engine (`build.build_engine`, a TorchEngine), receives the
sync into it and generates rollout.max_batch requests of the longest prompt its turn allows (the
game's own prompts are a few tokens: these exercise the KV cache and prefill the check counts).
Peak RSS: `ru_maxrss`. glibc's
mmap threshold is fixed at 128 KiB so freed tensors leave RSS (as tests/e2e/test_sim_memory_rss.py
does).

Predicted: `sim/memory.trainer_rank` (the production code on fake tensors, the check
`simulate memory` runs) for each of the four trainer ranks: the peak over its phases of
device + host bytes (one RAM on CPU), plus gloo's staging copy of the distributed
optimizer's param all-gather (one fp32 buffer of the rank's parameters: NCCL gathers in
place; tests/e2e/test_sim_memory_rss.py measured it), plus the baseline. Replicas:
`sim/torch_replica.torch_replica` (the check `simulate memory` runs for a torch-engine pool:
the engine's build, the weight receive into it, the generate, on fake tensors) of the one
agent synced, the first replica as the chain's relay (a second bucket buffer: it forwards
each bucket to the second), plus the baseline.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OVERRIDES = ["model.hidden_size=1024", "model.num_layers=8", "model.num_heads=16", "model.num_kv_heads=4",
             "model.intermediate_size=2816", "model.max_seq_len=256", "trainer.micro_batch_size=2",
             "trainer.backend=megatron", "trainer.ranks_per_group=4", "trainer.tensor_parallel=2",
             "trainer.pipeline_parallel=2", "trainer.pipeline_microbatches=2", "trainer.precision=fp32",
             "trainer.recompute=full", "weight_sync.bucket_mb=64", "weight_sync.backend=gloo",
             "rollout.replicas=2", "rollout.max_batch=16"]
TRAINERS, REPLICAS = (0, 1, 2, 3), (4, 5)
ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONWARNINGS": "ignore"}


def _rss_now() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_job(config: str, overrides: list[str]) -> None:
    """One rank of the real run (under mpiexec): prints {rank, base, peak} as JSON."""
    import resource
    import time
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    torch.set_num_threads(1)
    from mpi4py import MPI
    import flexmarl_hpc.trainer.megatron  # noqa: F401  (a trainer rank's imports, on every rank)
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.config.sync_groups import SyncGroup, stage_senders
    from flexmarl_hpc.learn.sampling import SamplingParams
    from flexmarl_hpc.rollout.base import GenRequest
    from flexmarl_hpc.sim.torch_replica import generate_shape
    from flexmarl_hpc.config.hf_config import model_args
    from flexmarl_hpc.config.plan import resolve
    from flexmarl_hpc.ranks import build
    from flexmarl_hpc.workflows.build import build_task
    from flexmarl_hpc.runtime import messages
    from flexmarl_hpc.runtime.state_swap import StateMover
    from flexmarl_hpc.runtime.weight_sync import SyncChannels, receive_weights
    from flexmarl_hpc.ranks.workers import TrainerRank
    from flexmarl_hpc.sim.memory import _micro_batch
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    cfg = load_config(config, overrides)
    task = build_task(cfg)
    agent = cfg.agent_names[0]
    args = model_args(cfg, task, agent)
    group = world.Split(0 if rank in TRAINERS else 1, rank)
    base = _rss_now()
    channels = SyncChannels(world, cfg.weight_sync.backend)
    channels.open([SyncGroup(0, 0, stage_senders(0, len(TRAINERS), 2), REPLICAS)])
    if rank in TRAINERS:
        tr = build.build_trainer(resolve(cfg), task, agent, group, "cpu", 0)
        mb = _micro_batch(cfg.trainer.micro_batch_size, args.max_seq_len, args.vocab_size)
        tr.forward_backward(tr.share(mb), 1.0 / len(mb), last=True)
        tr.optimizer_step()
        mover = StateMover(world, group, 0, lambda g: list(TRAINERS), {agent: tr}, build=None)
        handler = TrainerRank(world, group, mover, Path("/nonexistent"), int(cfg.weight_sync.bucket_mb * 2**20),
                              1, channels, None)
        reply = handler.sync(messages.Sync(agent, tr.version, (0,) + REPLICAS), time.time())
        assert isinstance(reply, messages.TrainerSynced), reply
    else:
        engine = build.build_engine(resolve(cfg), task, "cpu", 0)
        v, _, buckets = receive_weights(channels, (0,) + REPLICAS)
        engine.load_weights(agent, v, buckets)
        turn, _, steps = generate_shape(cfg, task, agent, args.max_seq_len)
        prompt = [0] * (args.max_seq_len - steps)       # the longest the engine takes, as predicted
        engine.generate(agent, [GenRequest(f"s{i}", prompt, i, steps, turn) for i in range(cfg.rollout.max_batch)],
                        SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p))
    channels.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"rank": rank, "base": base, "peak": peak}), flush=True)


def measured(config: str, overrides: list[str]) -> dict[int, dict]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = {**os.environ, "PYTHONPATH": str(ROOT), **ENV}
    p = subprocess.run([str(mpiexec), "-n", str(len(TRAINERS) + len(REPLICAS)), sys.executable, "-m", "mpi4py",
                        __file__, "--rank-job", config, *overrides], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"the real run exited {p.returncode}:\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return {r["rank"]: r for r in rows}


def rank_params(args, pp_rank: int, pp: int, tp: int) -> int:
    """Parameters a TP/PP rank holds: its stage's layers (and the embedding on the first,
    the final norm and LM head on the last), each split over TP (norms are tiny)."""
    from flexmarl_hpc.sim.memory import _hf_shapes
    per = args.num_layers // pp
    mine = range(pp_rank * per, (pp_rank + 1) * per)
    total = 0
    for name, shape in _hf_shapes(args).items():
        n = 1
        for d in shape:
            n *= d
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if (layer is not None and int(layer) in mine) or (name == "model.embed_tokens.weight" and pp_rank == 0) \
                or (name in ("model.norm.weight", "lm_head.weight") and pp_rank == pp - 1):
            total += n
    return total // tp


def predicted(config: str, overrides: list[str]) -> dict[int, dict]:
    """Per trainer rank: the fake run's peak tensor bytes (sim/memory.trainer_rank) and gloo's
    staging copy of the param all-gather; per replica: its fake run's (sim/torch_replica.py)."""
    import torch
    torch.set_num_threads(1)
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.config.hf_config import model_args
    from flexmarl_hpc.workflows.build import build_task
    from flexmarl_hpc.sim.memory import run_jobs
    from flexmarl_hpc.config.plan import resolve
    from flexmarl_hpc.sim.torch_replica import generate_shape, torch_replica
    cfg = load_config(config, overrides)
    task = build_task(cfg)
    agent = cfg.agent_names[0]
    args = model_args(cfg, task, agent)
    prompt = args.max_seq_len - generate_shape(cfg, task, agent, args.max_seq_len)[2]     # as the real run
    tp, pp = cfg.trainer.tensor_parallel, cfg.trainer.pipeline_parallel
    phases = run_jobs([(cfg, 0, r, None, 0, args.max_seq_len) for r in TRAINERS], workers=2)   # the real step's length
    out = {}
    for r in REPLICAS:                # the first forwards the sync to the second (weight_sync.chain)
        ph = {p.name: p.host for p in torch_replica(resolve(cfg), task, 0, None, (agent,), r != REPLICAS[-1], prompt)}
        out[r] = {"phases": ph, "gloo": 0, "tensors": max(ph.values())}
    for r, ph in zip(TRAINERS, phases):
        gloo = 4 * rank_params(args, r // (len(TRAINERS) // pp), pp, tp)     # ranks tp fastest, then pp (DP 1)
        by = {p.name: p.total for p in ph}
        out[r] = {"phases": by, "gloo": gloo,
                  "tensors": max(by.get("build", 0), by.get("train step", 0),
                                 by.get("optimizer step", 0) + gloo, by.get("weight sync (send)", 0))}
    return out


def table(real: dict[int, dict], fake: dict[int, dict]) -> tuple[str, list[float]]:
    """The comparison, and each rank's relative error of the predicted peak RSS (trainers, then replicas)."""
    mib = 2 ** 20
    base = sorted(r["base"] for r in real.values())[len(real) // 2]
    lines = [f"baseline (RSS after the imports, median of {len(real)} ranks): {base / mib:.0f} MiB",
             "rank  role                 measured peak RSS  base   over base | predicted tensors (gloo)  "
             "predicted RSS  error"]
    errors = []
    for r in sorted(real):
        m, f = real[r], fake[r]
        pred = m["base"] + f["tensors"]
        err = (m["peak"] - pred) / pred
        errors.append(err)
        role = f"trainer (pp {r // 2}, tp {r % 2})" if r in TRAINERS else f"replica {r - REPLICAS[0]} (torch)  "
        lines.append(f"{r:>4}  {role}  {m['peak'] / mib:>10.0f} MiB  {m['base'] / mib:>4.0f}  "
                     f"{(m['peak'] - m['base']) / mib:>6.0f} MiB | {f['tensors'] / mib:>8.0f} MiB ({f['gloo'] / mib:.0f})"
                     f"  {pred / mib:>10.0f} MiB  {100 * err:+5.1f}%")
    return "\n".join(lines), errors


def main() -> None:
    if sys.argv[1:2] == ["--rank-job"]:
        rank_job(sys.argv[2], sys.argv[3:])
        return
    config = str(ROOT / "configs" / "local.yaml")
    real = measured(config, OVERRIDES)
    os.environ.update(ENV)
    fake = predicted(config, OVERRIDES)
    text, errors = table(real, fake)
    print(f"$ python scripts/memory_rss.py   (configs/local.yaml {' '.join(OVERRIDES)})")
    print(text)
    for r in REPLICAS:
        print(f"replica rank {r} predicted per phase: " + ", ".join(
            f"{name} {b / 2**20:.0f} MiB" for name, b in fake[r]["phases"].items()))
    print(f"largest error over the {len(errors)} ranks {100 * max(abs(e) for e in errors):.1f}% (bound 20%)")


if __name__ == "__main__":
    main()
