"""mpiexec -n 4 python -m mpi4py tests/mpi/mpi_megatron_reshard.py [2x1 1x2] [big]

Two megatron trainer groups of N ranks of other layouts (TPxPP each; default TP2 x PP1 and TP1
x PP2 on 2 ranks), bf16 (fp32 main params apart from the bf16 weights). `big`
(bench/bench_state_move.py): shards of MBs that stand out of the RSS noise, and the move's
bytes received and peak RSS per rank printed. One trained agent moves by StateMover:

1. R0 -> R1, resharded (runtime/reshard.py's plan): state() on group 1 (fp32 weights, both Adam
   moments, step, version, RNG) bit-equal to group 0's before the move; each rank received
   exactly its own shard's bytes (the plan's blocks: its parameters, main params and moments),
   never the whole state; the next step on group 1 equals a twin's on group 0 that never moved
   within 3 x lr (another TP/PP sums in another order; Adam's early steps are ~lr per weight
   whatever the gradient's size), and bit-equal to a TP1 x PP2 twin loaded by load_state(state()).
2. R1 -> P0, resharded back into a parked (shelved) arrival, then swapped in: bit-equal; the
   host buffers kept while resident are its storages' bytes (docs/backends.md); a move with
   non-zero gradients (after forward_backward, before the step) is refused.
Rank 0 prints one `ok ...` line per check; any failure aborts the job.
"""
import gc
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
from flexmarl_hpc.runtime import reshard, state_swap  # noqa: E402
from flexmarl_hpc.runtime.state_swap import Location, StateMover  # noqa: E402
from flexmarl_hpc.trainer.megatron import MegatronTrainer, init_group_distributed  # noqa: E402

t_start = time.time()
world = MPI.COMM_WORLD
rank = world.Get_rank()
torch.set_num_threads(1)
N = world.Get_size() // 2
G = rank // N
group = world.Split(G, rank)
LAYOUTS = [tuple(map(int, a.split("x"))) for a in sys.argv[1:] if re.fullmatch(r"\d+x\d+", a)] or [(2, 1), (1, 2)]
TP, PP = LAYOUTS[G]
NAMES = [f"TP{t} x PP{p}" for t, p in LAYOUTS]
V = 1000
ARGS = (ModelArgs(V, 192, 4, 4, 2, 768, 16, rope_theta=5e4, tie_embeddings=True) if "big" in sys.argv
        else ModelArgs(V, 32, 2, 4, 2, 64, 16, rope_theta=5e4, tie_embeddings=True))
CFG = TrainerConfig(backend="megatron", ranks_per_group=N, tensor_parallel=TP, pipeline_parallel=PP,
                    pipeline_microbatches=2 if PP > 1 else 0, lr=1e-2, entropy_coef=0.01, grad_clip=0.5,
                    precision="bf16")
init_group_distributed(group, TP, PP)


def log(msg):
    if rank == 0:
        print(msg, flush=True)


def build(agent="a"):
    return MegatronTrainer(ARGS, CFG, group, 1.0, WeightSource(seed=3, std=0.1))


def step(tr, seed, B=4, T=9):
    g = torch.Generator().manual_seed(seed)
    mb = MicroBatch(torch.randint(3, V, (B, T), generator=g), torch.full((B,), 3),
                    torch.randint(1, T - 3, (B,), generator=g), -7 + 0.1 * torch.randn(B, T, generator=g),
                    torch.randn(B, generator=g), torch.zeros(B, dtype=torch.bool), None)
    tr.forward_backward(tr.share(mb), 1.0 / len(mb))
    tr.optimizer_step()


received = [0]
_recv = state_swap.recv_pieces if hasattr(state_swap, "recv_pieces") else None
for name in ("recv_pieces", "recv_shards", "recv_state"):     # count what each rank receives
    if not hasattr(state_swap, name):                          # (the code before resharding had no recv_pieces)
        continue

    def counting(*a, _f=getattr(state_swap, name), **k):
        out = _f(*a, **k)
        received[0] += out if isinstance(out, int) else out.nbytes if isinstance(out, state_swap.HostBuffers) \
            else sum(v.numel() * v.element_size() for v in out.values())
        return out
    setattr(state_swap, name, counting)


def counterpart(obj):
    """Group 0 rank i sends `obj` to group 1 rank i and gets group 1's back."""
    other = rank + N if G == 0 else rank - N
    if G == 0:
        world.send(obj, dest=other)
        return world.recv(source=other)
    got = world.recv(source=other)
    world.send(obj, dest=other)
    return got


def same(a, b, what):
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b))[:5])
    for k in a:
        assert torch.equal(a[k], b[k]), (what, k, (a[k].float() - b[k].float()).abs().max())


def state_bytes(state):
    return sum(v.numel() * v.element_size() for v in state.values())


mover = StateMover(world, group, G, lambda g: list(range(g * N, (g + 1) * N)), {}, build)
R0, P0, R1 = Location(0, True), Location(0, False), Location(1, True)
twin = None
if G == 0:
    mover.trainers["a"], twin = build(), build()
    step(mover.trainers["a"], 0)
    step(twin, 0)
    ref = {k: v.clone() for k, v in mover.trainers["a"].state().items()}
else:
    ref = {}
full = max(world.allgather(state_bytes(ref)))      # what the state() fallback sends every rank

if G == 1 and "big" in sys.argv:     # a group's first build pays one-time set-up: done before
    build()                          # the measured move, so its destination builds warm


def kib(field):
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1))


# 1. R0 -> R1, resharded: this rank's received bytes and RSS peak above its RSS before
received[0] = 0
gc.collect()             # the warm build's cycles freed now, not reused by the move unseen
world.Barrier()
open("/proc/self/clear_refs", "w").write("5")      # VmHWM := VmRSS now
before, t0 = kib("VmRSS"), time.time()
mover.move("a", R0, R1)
peak, dt = (kib("VmHWM") - before) * 1024, time.time() - t0
got = received[0]
for g, rows in enumerate(zip(*[iter(world.gather((got, peak, dt), root=0) or [])] * N)):
    print(f"   resharded {NAMES[0]} -> {NAMES[1]}: group {g} received max {max(r[0] for r in rows) / 2**20:.2f} "
          f"MiB/rank, peak RSS above before max {max(r[1] for r in rows) / 2**20:.2f} MiB/rank, "
          f"{max(r[2] for r in rows):.2f} s", flush=True)
if G == 1:
    moved = mover.trainers["a"]
    shard = reshard.held_bytes(moved.reshard_layout()[0])        # its params, main params, moments
    assert got == shard and got < full, (got, shard, full)
    src_state = counterpart(moved.state())
    same(src_state, moved.state(), "after the resharding move")
    loaded = build()                      # this layout's twin, loaded through state() (the fallback's way)
    loaded.load_state(src_state)
    step(moved, 1)
    step(loaded, 1)
    mine = moved.state()
    same(mine, loaded.state(), "a step after the resharding move == a step after load_state")
    theirs = counterpart(mine)
else:
    shard = 0
    assert "a" not in mover.trainers and "a" not in mover.parked
    counterpart(ref)
    step(twin, 1)
    theirs = counterpart(twin.state())
    mine = twin.state()
diff = max((mine[k].float() - theirs[k].float()).abs().max().item() for k in mine if k != "rng")
rows = world.gather((G, got, shard), root=0)
worst = world.allreduce(diff, op=MPI.MAX)
assert worst < 3 * CFG.lr, worst
if rank == 0:
    log(f"ok resharded move {NAMES[0]} -> {NAMES[1]} bf16: state() bit-equal after the move; each rank received "
        f"its shard only ({', '.join(f'{r[1] / 2**10:.1f}' for r in rows if r[0] == 1)} KiB of a "
        f"{full / 2**10:.1f} KiB state the fallback sends every rank), {dt:.2f} s")
log(f"ok the next step: bit-equal to a {NAMES[1]} twin loaded by load_state(state()), and within 3 x lr of "
    f"the {NAMES[0]} twin that never moved (max |diff| {worst:.2e}, lr {CFG.lr}: {NAMES[1]} sums the bf16 matmuls in "
    f"another order, and Adam's first steps move each weight by up to ~lr whatever the gradient's size)")

# 2. R1 -> P0, resharded back into a parked arrival, then swapped in
before = mover.trainers["a"].state() if G == 1 else None
before = {k: v.clone() for k, v in before.items()} if before else None
mover.move("a", R1, P0)
kept = 0
if G == 0:
    assert "a" in mover.parked.shelf
    mover.move("a", P0, R0)
    tr = mover.trainers["a"]
    same(counterpart(tr.state()), tr.state(), "after R1 -> P0 -> R0")
    # what stays on the host while it is resident: its parked copy, kept for the next swap-out
    kept = mover.parked.hosts["a"].nbytes
    assert kept == sum(n for _, _, n in tr._storages()), kept
    # gradients are checked, not assumed zero: a move between forward_backward and the step is refused
    g = torch.Generator().manual_seed(5)
    tr.forward_backward(tr.share(MicroBatch(torch.randint(3, V, (4, 9), generator=g), torch.full((4,), 3),
                                            torch.full((4,), 4), torch.zeros(4, 9), torch.ones(4),
                                            torch.zeros(4, dtype=torch.bool), None)), 0.25)
    try:
        tr.reshard_out("a")
        raise AssertionError("a move with non-zero gradients was not refused")
    except ValueError as e:
        assert "agent 'a': gradients are not zero" in str(e), e
else:
    assert "a" not in mover.trainers
    counterpart(before)
kept = max(world.allgather(kept))
log(f"ok resharded back {NAMES[1]} -> {NAMES[0]} into a parked arrival, swapped in: bit-equal")
log(f"ok host memory kept while resident after a swap-in: its storages, {kept / 2**10:.1f} KiB/rank max; "
    f"a move with non-zero gradients is refused")
log(f"all megatron reshard checks passed in {time.time() - t_start:.1f} s")
