"""One GPU, the production megatron path at a mid-size shape, against the memory check.

`build_trainer` on cuda in bf16 (about 0.9 B parameters, one rank), one train step of a
micro-batch of 4 x 2,048 tokens with full recompute, the optimizer step, then the weight
stream a sync sends filled into the sender's two bucket buffers on the device by its own loop
(`weight_sync.fill_stage`; `sync_stream` with the plan's pieces assembles each tensor, or
bucket-sized row range of a larger one, in place: `Destination`). Each phase's device
peak (`torch.cuda.max_memory_allocated`) is compared with `simulate memory`'s fake-tensor
prediction of the same rank (flexmarl_hpc.sim.memory.trainer_rank, run in a forked process
on the CPU first): within 25%. Skipped with "no GPU" elsewhere.

    python tests/gpu/gpu_megatron_memory.py     # on a GPU machine, without pytest
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OVERRIDES = ["trainer.backend=megatron", "trainer.ranks_per_group=1", "trainer.precision=bf16",
             "trainer.recompute=full", "trainer.micro_batch_size=4", "model.hidden_size=2048",
             "model.num_layers=16", "model.num_heads=16", "model.num_kv_heads=8",
             "model.intermediate_size=5632", "model.max_seq_len=2048"]
TOLERANCE = 0.25


FAKE = """
import json, sys, warnings
warnings.filterwarnings("ignore")
from flexmarl_hpc.config.plan import resolve
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.workflows.build import build_task
from flexmarl_hpc.sim.memory import trainer_rank
cfg = load_config(sys.argv[1], sys.argv[2:])
print(json.dumps({p.name: p.device for p in trainer_rank(resolve(cfg), build_task(cfg), 0, 0, None, tokens=cfg.model.max_seq_len)}))
"""


def _predicted() -> dict[str, int]:
    """The memory check's device peaks per phase, in a process that sees no GPU (the fake
    run is the CPU-host code path, as on a login node)."""
    import os
    import subprocess
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-c", FAKE, str(ROOT / "configs/local.yaml"), *OVERRIDES],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure() -> list[dict]:
    """Predicted and measured device peaks per phase (bytes), both on this machine."""
    import torch
    from mpi4py import MPI
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.config.hf_config import model_args
    from flexmarl_hpc.config.plan import resolve
    from flexmarl_hpc.ranks import build
    from flexmarl_hpc.workflows.build import build_task
    from flexmarl_hpc.sim.memory import _micro_batch
    cfg = load_config(ROOT / "configs/local.yaml", OVERRIDES)
    predicted = _predicted()
    task = build_task(cfg)
    agent = cfg.agent_names[0]
    args = model_args(cfg, task, agent)
    mb = _micro_batch(cfg.trainer.micro_batch_size, args.max_seq_len, args.vocab_size)
    torch.cuda.set_device(0)
    measured = {}

    def phase(name):
        torch.cuda.synchronize()
        measured[name] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    tr = build.build_trainer(resolve(cfg), task, agent, MPI.COMM_SELF, "cuda", 0)
    phase("build")
    tr.forward_backward(mb, 1.0 / len(mb), last=True)
    phase("train step")
    tr.optimizer_step()
    phase("optimizer step")
    from flexmarl_hpc.runtime import weight_sync as W     # the sender's loop, as _send_stage runs it
    buckets = W.plan_buckets(tr.sync_layouts()[0], int(cfg.weight_sync.bucket_mb * 2**20), None)
    plan, largest = W.SyncPlan((0,), (buckets,)), max(b.total for b in buckets)
    buffers = [torch.empty(largest, dtype=torch.uint8, device="cuda") for _ in range(2)]
    dest = W.Destination(plan)                  # each range assembled in place in its bucket
    W.fill_stage(buckets, iter(tr.sync_stream(W.row_pieces(plan), dest)), dest, buffers.__getitem__,
                 lambda slot, flat: None, lambda slot: None)      # one rank: no replica to send to
    del buffers
    phase("weight sync (send)")
    print(f"filled {len(buckets)} buckets, {sum(b.total for b in buckets)} bytes", flush=True)
    return [{"phase": k, "predicted": predicted.get(k), "measured": v} for k, v in measured.items()]


def test_device_peaks_match_the_memory_check():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    rows = measure()
    print(json.dumps(rows, indent=1))
    for r in rows:
        if r["predicted"]:
            assert abs(r["measured"] - r["predicted"]) <= TOLERANCE * r["measured"], r


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
