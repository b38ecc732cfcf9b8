"""mpiexec -n 2N python -m mpi4py tests/mpi/mpi_megatron_move.py TP PP [big] [bf16]

Two megatron trainer groups of N = TP x PP x DP ranks (world ranks [0, N) and [N, 2N)), one
agent moved between them by StateMover, each rank's move measured: the bytes it received
and its peak RSS above its RSS before the move (VmHWM, reset through /proc/self/clear_refs).

1. R0 -> R1, shard to shard: group 0 trains a step, the agent moves to group 1 (a fresh
   build adopts the bytes); its state() is bit-equal to the source's before the move and
   its next step equals a twin's on group 0 that never moved; each rank received exactly
   its own shard's bytes.
2. R1 -> R0 through the fallback (group 0 claims another layout, so group 1 sends state()):
   the old path, measured the same way for comparison; the state is bit-equal.
3. parked on group 0, then P0 -> P1, shard to shard from a shelved trainer into a parked (shelved) arrival, then
   swapped in on group 1: bit-equal again.
Rank 0 prints one `ok ...` line per check; any failure aborts the job.
"""
import re
import sys
import time
import warnings

import torch
from mpi4py import MPI

warnings.filterwarnings("ignore")
import logging  # noqa: E402
logging.disable(logging.WARNING)

from flexmarl_hpc.config.schema import TrainerConfig  # noqa: E402
from flexmarl_hpc.learn.grpo import MicroBatch  # noqa: E402
from flexmarl_hpc.learn.model import ModelArgs  # noqa: E402
from flexmarl_hpc.learn.weights import WeightSource  # noqa: E402
from flexmarl_hpc.runtime import state_swap  # noqa: E402
from flexmarl_hpc.runtime.state_swap import Location, StateMover  # noqa: E402
from flexmarl_hpc.trainer.megatron import MegatronTrainer, init_group_distributed  # noqa: E402

t_start = time.time()
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
torch.set_num_threads(1)
TP, PP = int(sys.argv[1]), int(sys.argv[2])
N = size // 2
G = rank // N                                   # this rank's trainer group
group = world.Split(G, rank)
V = 1000
# `big` (bench/bench_state_move.py): shards of MBs that stand out of the RSS noise; the test's
# model keeps its 4 ranks fast (its byte counts are exact at any size)
ARGS = (ModelArgs(V, 192, 4, 4, 2, 768, 16, rope_theta=5e4, tie_embeddings=True) if "big" in sys.argv
        else ModelArgs(V, 32, 2, 4, 2, 64, 16, rope_theta=5e4, tie_embeddings=True))
CFG = TrainerConfig(backend="megatron", ranks_per_group=N, tensor_parallel=TP, pipeline_parallel=PP,
                    pipeline_microbatches=2 if PP > 1 else 0, lr=1e-2, entropy_coef=0.01, grad_clip=0.5,
                    precision="bf16" if "bf16" in sys.argv else "fp32")   # bf16: separate fp32 main params
init_group_distributed(group, TP, PP)


def log(msg):
    if rank == 0:
        print(msg, flush=True)


def build(agent="a"):
    """Each rank draws only its own shard of the same seeded init (as a run builds)."""
    return MegatronTrainer(ARGS, CFG, group, 1.0, WeightSource(seed=3, std=0.1))


def step(tr, seed, B=4, T=9):
    g = torch.Generator().manual_seed(seed)
    mb = MicroBatch(torch.randint(3, V, (B, T), generator=g), torch.full((B,), 3),
                    torch.randint(1, T - 3, (B,), generator=g), -7 + 0.1 * torch.randn(B, T, generator=g),
                    torch.randn(B, generator=g), torch.zeros(B, dtype=torch.bool), None)
    tr.forward_backward(tr.share(mb), 1.0 / len(mb))
    tr.optimizer_step()


def kib(field):
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1))


received = [0]
for name in ("recv_shards", "recv_state"):            # count what each rank receives
    if not hasattr(state_swap, name):                # (the code before shard moves had no recv_shards)
        continue

    def counting(*a, _f=getattr(state_swap, name), **k):
        out = _f(*a, **k)
        received[0] += out.nbytes if isinstance(out, state_swap.HostBuffers) else \
            sum(v.numel() * v.element_size() for v in out.values())
        return out
    setattr(state_swap, name, counting)


def measured_move(mover, src, dst, what):
    """The move, with this rank's received bytes and RSS peak above its RSS before; rank 0
    prints the max over each group's ranks."""
    received[0] = 0
    world.Barrier()
    open("/proc/self/clear_refs", "w").write("5")      # VmHWM := VmRSS now
    before, t0 = kib("VmRSS"), time.time()
    mover.move("a", src, dst)
    peak = (kib("VmHWM") - before) * 1024
    dt = time.time() - t0
    rows = world.gather((G, received[0], peak, dt), root=0)
    if rank == 0:
        for g in (0, 1):
            mine = [r for r in rows if r[0] == g]
            print(f"   {what}: group {g} received max {max(r[1] for r in mine) / 2**20:.2f} MiB/rank, "
                  f"peak RSS above before max {max(r[2] for r in mine) / 2**20:.2f} MiB/rank, "
                  f"{max(r[3] for r in mine):.2f} s", flush=True)
    return received[0], peak


def same(a, b, what):
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b))[:5])
    for k in a:
        assert torch.equal(a[k], b[k]), (what, k)


def counterpart_state(state):
    """Group 0 rank i sends `state` to group 1 rank i (and the other way round)."""
    other = rank + N if G == 0 else rank - N
    if G == 0:
        world.send(state, dest=other)
        return world.recv(source=other)
    got = world.recv(source=other)
    world.send(state, dest=other)
    return got


def state_bytes(state):
    return sum(v.numel() * v.element_size() for v in state.values())


mover = StateMover(world, group, G, lambda g: list(range(g * N, (g + 1) * N)), {}, build)
R0, P0, R1, P1 = Location(0, True), Location(0, False), Location(1, True), Location(1, False)
twin = None
if G == 0:
    mover.trainers["a"], twin = build(), build()
    step(mover.trainers["a"], 0)
    step(twin, 0)
    ref = {k: v.clone() for k, v in mover.trainers["a"].state().items()}
    shard = sum(n for _, n in mover.trainers["a"].shard_sizes())
else:
    ref, shard = {}, 0
    if "big" in sys.argv:        # a group's first build also pays one-time set-up (~17 MiB RSS):
        build()                  # done here, so both paths' destinations build warm
full = max(world.allgather(state_bytes(ref)))       # the whole state (weights, both moments)
shard = max(world.allgather(shard))

# 1. resident -> resident, shard to shard
got_bytes, _ = measured_move(mover, R0, R1, "shard R0 -> R1")
if G == 1:
    storages = mover.trainers["a"]._storages()                       # this rank's own storages
    mine = sum(n for name, _, n in storages if not name.startswith("grad."))
    grads = sum(n for name, _, n in storages if name.startswith("grad."))
    assert got_bytes == mine and got_bytes < full and grads > 0, (got_bytes, mine, grads, full)
    moved = mover.trainers["a"]
    same(counterpart_state(moved.state()), moved.state(), "after the shard move")
    step(moved, 1)
    same(counterpart_state(moved.state()), moved.state(), "a step after the shard move == the twin's")
else:
    grads = 0
    assert "a" not in mover.trainers and "a" not in mover.parked
    counterpart_state(ref)
    step(twin, 1)
    counterpart_state(twin.state())
grads = max(world.allgather(grads))
log(f"ok zero gradients not sent: {grads / 2**20:.2f} MiB/rank of grad storages left out of "
    f"{(grads + shard) / 2**20:.2f} MiB/rank of storages ({grads / (grads + shard):.0%})")
log(f"ok shard move TP{TP} x PP{PP} x DP{N // (TP * PP)} {CFG.precision}: state() bit-equal after the move, next step == a twin's that never "
    f"moved; each rank received its shard only (max {shard / 2**20:.2f} MiB of a {full / 2**20:.2f} MiB state)")

# 2. resident -> resident through the fallback: group 0 claims another layout and model
real_key, real_compat = MegatronTrainer.shard_key, MegatronTrainer.reshard_key
if G == 0:          # another layout of another model: neither shards nor resharding
    MegatronTrainer.shard_key = lambda self: ("another layout",)
    MegatronTrainer.reshard_key = lambda self: ("another model",)
before = mover.trainers["a"].state() if G == 1 else None
before = {k: v.clone() for k, v in before.items()} if before else None
old_bytes, _ = measured_move(mover, R1, R0, "state() fallback R1 -> R0")
MegatronTrainer.shard_key, MegatronTrainer.reshard_key = real_key, real_compat
mover.move("a", R0, P0)                             # swapped out on group 0 (a no-op on group 1)
if G == 0:
    assert old_bytes == full, (old_bytes, full)
    same(counterpart_state(mover.parked["a"]), mover.parked["a"], "after the fallback")
else:
    counterpart_state(before)
log(f"ok fallback (other layout): state() sent, {full / 2**20:.2f} MiB received on every rank, bit-equal")

# 3. parked -> parked, shard to shard from a shelf into a shelf, then swapped in
ref = mover.parked["a"] if G == 0 else None
ref = {k: v.clone() for k, v in ref.items()} if ref else None
measured_move(mover, P0, P1, "shard P0 -> P1")
if G == 1:
    assert mover.parked["a"] is not None and "a" in mover.parked.shelf
    mover.move("a", P1, R1)
    same(counterpart_state(mover.trainers["a"].state()), mover.trainers["a"].state(), "after P0 -> P1 -> R1")
else:
    assert "a" not in mover.parked
    counterpart_state(ref)
log("ok shard move from a shelved trainer into a parked arrival, swapped in: bit-equal")
log(f"all megatron move checks passed in {time.time() - t_start:.1f} s")
