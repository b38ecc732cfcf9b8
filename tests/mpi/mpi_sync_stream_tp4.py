"""mpiexec -n 4 python -m mpi4py tests/mpi/mpi_sync_stream_tp4.py

A megatron TP 4 group (CPU, gloo) streams its weights as a sync does (`sync_stream` with the
plan's pieces, weight_sync.row_pieces, 4 KiB buckets): three remote TP ranks per row range,
q/k/v rows across query groups held by different ranks, o_proj/down_proj column blocks from
all four. Every streamed tensor, once its pieces are put together, is bit-equal to the full
HF weights (`named_weights`); each piece is the plan's rows, in the plan's order; ranks 1-3
yield nothing. Then the same stream into the sender's buckets as a sync fills them
(`weight_sync.fill_stage` with a `Destination`: each range assembled in place, each column
block received through the other bucket buffer): the buckets' bytes, landed as a receiver
lands them, give the HF weights bit for bit, and the sender allocates its two bucket
buffers and nothing else. Prints `all tp4 stream checks passed` on rank 0.
"""
import warnings

import torch
from mpi4py import MPI

warnings.filterwarnings("ignore")

from flexmarl_hpc.config.schema import TrainerConfig  # noqa: E402
from flexmarl_hpc.learn.model import ModelArgs, build_model, hf_state_dict  # noqa: E402
from flexmarl_hpc.runtime import weight_sync as W  # noqa: E402
from flexmarl_hpc.runtime.memtrack import TensorBytes  # noqa: E402

world = MPI.COMM_WORLD
torch.set_num_threads(1)
ARGS = ModelArgs(200, 32, 2, 8, 4, 64, 16, tie_embeddings=False, qkv_bias=True)


def main():
    from flexmarl_hpc.trainer.megatron import MegatronTrainer
    model = build_model(ARGS, seed=5, std=0.1)
    hf = hf_state_dict(model)
    g = torch.Generator().manual_seed(6)
    hf = {k: (torch.randn(v.shape, generator=g) if k.endswith("bias") else v) for k, v in hf.items()}
    cfg = TrainerConfig(backend="megatron", ranks_per_group=4, tensor_parallel=4, lr=1e-2)
    tr = MegatronTrainer(ARGS, cfg, world, 0.9, init=hf)
    plan = W.SyncPlan((0,), tuple(W.plan_buckets(lay, 4096) for lay in tr.sync_layouts()))
    pieces = W.row_pieces(plan)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(pieces), sorted(pieces)
    got: dict[str, list[torch.Tensor]] = {}
    order = []
    for name, t in tr.sync_stream(pieces):
        got.setdefault(name, []).append(t.clone())
        order.append((name, t.shape[0]))
    if world.Get_rank() != 0:
        assert not got, sorted(got)
        return tr, hf, plan
    want = [(name, b - a) for name, shape, _ in tr.sync_layouts()[0]
            for a, b in pieces.get(name, [(0, shape[0])])]
    assert order == want, (order[:5], want[:5])
    for name, parts in got.items():
        assert torch.equal(torch.cat(parts), hf[name]), name
    print(f"ok tp4 stream: {len(order)} tensors or row ranges, {sum(len(v) for v in pieces.values())} "
          f"pieces of {len(pieces)} tensors, bit-equal to the HF weights", flush=True)
    return tr, hf, plan


def in_buckets(tr, hf, plan):
    """The stream into two bucket buffers through a Destination; each filled bucket's bytes
    kept as numpy (outside the tensor tracker) and landed afterwards as a receiver does."""
    buckets, dest, sent = plan.stages[0], W.Destination(plan), []
    largest = max(b.total for b in buckets)
    buffers: list = [None, None]

    def buffer(slot):
        if buffers[slot] is None:
            buffers[slot] = torch.empty(largest, dtype=torch.uint8)
        return buffers[slot]
    stream = iter(tr.sync_stream(W.row_pieces(plan), dest))
    if world.Get_rank() != 0:                  # only sends its rows (send_weights' stage None)
        assert next(stream, None) is None
        return
    with TensorBytes() as mem:
        W.fill_stage(buckets, stream, dest, buffer, lambda slot, flat: sent.append(flat.numpy().copy()),
                     lambda slot: None)
    assert mem.peak <= 2 * largest, (mem.peak, largest)
    buf, got = torch.zeros(plan.span, dtype=torch.uint8), {}
    for b, data in zip(buckets, sent):
        W.landing(b, buf).copy_(torch.from_numpy(data))
        got.update({k: v.clone() for k, v in W.received(b, buf).items()})
    assert sorted(got) == sorted(hf), (sorted(got), sorted(hf))
    for k, v in hf.items():
        assert torch.equal(got[k], v), k
    print(f"ok tp4 buckets: {len(buckets)} buckets filled in place, bit-equal to the HF weights; sender "
          f"allocated {mem.peak} B, two buckets of {largest} B", flush=True)


if __name__ == "__main__":
    in_buckets(*main())
    world.Barrier()
    if world.Get_rank() == 0:
        print("all tp4 stream checks passed", flush=True)
