"""mpiexec -n 6 python -m mpi4py tests/mpi/mpi_sync_megatron.py DIR BACKEND [BUCKET_BYTES [bf16]]

Ranks 0-3: one megatron trainer group, TP2 x PP2 (CPU, gloo); ranks 4-5: two replicas with
the torch engine. Rank 0 writes a Qwen2-style HF safetensors checkpoint into DIR, then:

- build: each trainer rank builds from it through WeightSource (safetensors get_slice), its
  shard equal to the converter's slice of the full checkpoint, with the tensor bytes the
  build allocated (runtime/memtrack.TensorBytes) below the full model's: the full state
  dict never exists on a rank;
- train 3 steps; the optimizer step allocates less than the model on every rank (no full
  gather), and the token log-prob path never allocates full-vocabulary logits;
- after each step a weight sync through the production handler (workers.TrainerRank.sync,
  over BACKEND: mpi or gloo, inside the one (trainer group, pool) group made at start, whose
  senders config/sync_groups.stage_senders computes and megatron confirms) to {4, 5}, then
  {4}, then {4, 5}: the replicas' weights are
  bit-equal to the trainer's gathered HF weights, and every trainer rank's peak extra bytes
  during a sync (bucket buffers included) stay within 2 buckets, exactly: the sender's two
  bucket buffers, each row range assembled in place in the bucket being filled and an
  o_proj/down_proj range's column blocks received through the other buffer
  (weight_sync.Destination; a range-sized tensor beside the buffers fails it, as the code
  before did at 2 buckets + 1.5): bounded by the bucket size, not by the largest parameter
  (with 16 KiB buckets the 64 KiB embedding, LM head and MLP weights each exceed
  the bound alone, so a whole-parameter gather fails it); a replica's within one buffer (a
  bucket, or with BUCKET_BYTES below the embedding the largest tensor, whose pieces land in
  it).

With `bf16` the weights travel in bf16 (weight_sync.wire_dtype, rollout.dtype=bf16) from the
fp32 trainer: the TP ranks cast their rows before sending, the sender casts its own on copy
into the bucket, and the replicas hold the bf16 rounding of the trainer's weights, bit for bit.

Prints `ok ...` lines on rank 0 and `all sync checks passed`; any failure aborts the job.
"""
import sys
import warnings
from pathlib import Path

import torch
from mpi4py import MPI

warnings.filterwarnings("ignore")
import logging  # noqa: E402
logging.disable(logging.WARNING)

from flexmarl_hpc.config.schema import TrainerConfig  # noqa: E402
from flexmarl_hpc.learn.convert import hf_to_megatron, padded_vocab  # noqa: E402
from flexmarl_hpc.learn.grpo import MicroBatch  # noqa: E402
from flexmarl_hpc.learn.model import ModelArgs, build_model, hf_state_dict  # noqa: E402
from flexmarl_hpc.learn.weights import WeightSource  # noqa: E402
from flexmarl_hpc.rollout.torch_engine import TorchEngine  # noqa: E402
from flexmarl_hpc.runtime import messages  # noqa: E402
from flexmarl_hpc.runtime.memtrack import TensorBytes  # noqa: E402
from flexmarl_hpc.runtime.weight_sync import SyncChannels, receive_weights  # noqa: E402
from flexmarl_hpc.config.sync_groups import SyncGroup, stage_senders  # noqa: E402

world = MPI.COMM_WORLD
rank = world.Get_rank()
torch.set_num_threads(1)
folder, backend = Path(sys.argv[1]), sys.argv[2]
BUCKET = int(sys.argv[3]) if len(sys.argv) > 3 else 64 << 10
WIRE = torch.bfloat16 if sys.argv[4:] == ["bf16"] else None          # None: as trained (fp32)
V = 256
ARGS = ModelArgs(V, 64, 4, 4, 2, 128, 16, rope_theta=5e4, tie_embeddings=False, qkv_bias=True)
TRAINERS, REPLICAS = [0, 1, 2, 3], [4, 5]
SYNCS = [(4, 5), (4,), (4, 5)]
PAIR = SyncGroup(0, 0, stage_senders(0, len(TRAINERS), 2), tuple(REPLICAS))   # made at start, as run.py does


def log(msg):
    if rank == 0:
        print(msg, flush=True)


def full_weights():
    model = build_model(ARGS, seed=3, std=0.1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(4))
    return hf_state_dict(model)


def model_bytes() -> int:
    return sum(t.numel() * 4 for t in full_weights().values())


def batch(seed: int, B: int = 4, T: int = 9) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    behav = -torch.log(torch.tensor(float(V))) + 0.1 * torch.randn(B, T, generator=g)
    return MicroBatch(torch.randint(3, V, (B, T), generator=g), torch.full((B,), 3),
                      torch.randint(1, T - 3, (B,), generator=g), behav, torch.randn(B, generator=g),
                      torch.zeros(B, dtype=torch.bool), None)


def build(group):
    from flexmarl_hpc.trainer.megatron import MegatronTrainer, init_group_distributed
    cfg = TrainerConfig(backend="megatron", ranks_per_group=4, tensor_parallel=2, pipeline_parallel=2,
                        lr=1e-2, pipeline_microbatches=2)
    init_group_distributed(group, 2, 2)
    with TensorBytes() as mem:
        tr = MegatronTrainer(ARGS, cfg, group, 0.9, init=WeightSource(checkpoint=str(folder)))
    kept = mem.now
    full = model_bytes()
    # the build's transient bytes (what it allocated beyond what the trainer keeps) and its
    # peak: far below the model (the old build made the whole model, then a clone of it)
    assert mem.peak < full and mem.peak - kept < full // 2, (mem.peak, kept, full)
    expect = hf_to_megatron(full_weights(), ARGS, tr.tp_rank, 2, tr.pp_rank, 2)
    local = {k: p.detach() for k, p in tr._local_params().items()}
    assert set(local) == set(expect), (sorted(local), sorted(expect))
    for k in expect:
        assert torch.equal(local[k], expect[k]), k
    return tr, mem.peak, kept, full


def train_step(tr, group, step):
    mb = batch(10 + step)
    orig = tr._token_logprobs
    seen = []

    def tracked(logits, mbd):                  # the loss's log-prob path, on its own tracker
        with TensorBytes() as m:
            out = orig(logits, mbd)
        seen.append((m.largest, logits.numel() * logits.element_size()))
        return out
    tr._token_logprobs = tracked
    tr.forward_backward(tr.share(mb), 1.0 / len(mb))
    tr._token_logprobs = orig
    B, T = 2, mb.input_ids.shape[1]             # each chunk (2 micro-batches of the share)
    full_vocab_logits = B * T * padded_vocab(ARGS) * 4
    for largest, local_logits in seen:          # only the last stage runs the loss
        assert local_logits < full_vocab_logits and largest < full_vocab_logits, (largest, full_vocab_logits)
    with TensorBytes() as mem:
        tr.optimizer_step()
    # the step allocates Adam's moments of this rank's shard (first step) and temporaries of
    # the shard: never the model (a full gather would add the whole model on the leader)
    assert mem.peak < model_bytes(), (step, mem.peak, model_bytes())
    return mem.peak, len(seen)


def largest_hf() -> int:
    """Bytes of the largest HF tensor (fp32): a replica's buffer when buckets are smaller."""
    return max(t.numel() * 4 for t in full_weights().values())


def send_bound() -> int:
    """A trainer rank's peak extra bytes during a sync: the sender's two bucket buffers and
    nothing else (row ranges land in the bucket being filled, a column block in the other
    buffer; the ranks that only send their rows hold less: views of their shard)."""
    return 2 * BUCKET


def trainer_side(world_group):
    import time
    from flexmarl_hpc.runtime.state_swap import StateMover
    from flexmarl_hpc.ranks.workers import TrainerRank
    group = world_group
    tr, peak, kept, full = build(group)
    log(f"ok build: TP2 x PP2 shards == the checkpoint's slices (safetensors get_slice); tensor bytes "
        f"allocated by the build: peak {peak} B, kept {kept} B, model {full} B")
    mover = StateMover(world, group, 0, lambda g: TRAINERS, {"a": tr}, build=None)
    channels = SyncChannels(world, backend)
    channels.open([PAIR])
    assert [MPI.Group.Translate_ranks(group.Get_group(), tr.sync_senders(), world.Get_group())] == \
        [list(PAIR.senders)], (tr.sync_senders(), PAIR.senders)       # the pure senders == megatron's
    handler = TrainerRank(world, group, mover, folder / "ckpt", BUCKET, 1, channels, WIRE)
    bound = send_bound()
    assert bound < full // 2, (bound, full)        # a model-sized buffer cannot pass unseen
    sender = group.Get_rank() in tr.sync_senders()
    for step, targets in enumerate(SYNCS):
        opt_peak, losses = train_step(tr, group, step)
        # the bucket buffers a sync keeps for the next (SyncChannels.buffer) count in every
        # sync's peak, so a later sync's transients have what they left: nothing
        kept_buffers = sum(b.numel() for b in channels._buffers if b is not None)
        with TensorBytes() as mem:
            handler.sync(messages.Sync("a", tr.version, (0,) + targets), time.time())
        extra = kept_buffers + mem.peak
        assert extra <= bound, (step, group.Get_rank(), sender, kept_buffers, mem.peak, bound)
        peaks = group.gather((group.Get_rank(), sender, extra, opt_peak), root=0)
        expect = tr.named_weights()                     # collective: the full HF weights on rank 0
        if rank == 0:
            for r in targets:
                world.send({k: v.clone() if WIRE is None else v.to(WIRE).float() for k, v in expect.items()}, dest=r)
            got = [world.recv(source=r) for r in targets]
            assert all(g == "bit-equal" for g in got), got
            log(f"ok sync {step + 1} (v{tr.version}) to {targets}: bit-equal on every replica; sender "
                f"peak extra (its kept bucket buffers + the sync's allocations) {max(p for _, s, p, _ in peaks if s)} B, other ranks "
                f"{max(p for _, s, p, _ in peaks if not s)} B (bound 2 buckets of {BUCKET} B = {bound} B; "
                f"largest HF tensor {largest_hf()} B; model {full} B); optimizer step peak "
                f"{max(o for *_, o in peaks)} B")
    assert channels.buffer_allocations <= 2, channels.buffer_allocations
    assert channels.comms_built == (rank in PAIR.senders), channels.comms_built
    channels.close()


def replica_side():
    from flexmarl_hpc.workflows.referential import ReferentialGame
    engine = TorchEngine({"a": ARGS}, ReferentialGame(["a", "b"]), max_batch=4)
    channels = SyncChannels(world, backend)
    channels.open([PAIR])
    for targets in SYNCS:
        if rank not in targets:
            continue
        with TensorBytes() as mem:
            v, _, buckets = receive_weights(channels, (0,) + targets)
            engine.load_weights("a", v, buckets)
        # one buffer, nothing else: a bucket, or the largest tensor sent in pieces (they land in it);
        # a relay of the chain (4 in (4, 5)) a second bucket, for whole buckets in turn
        relay = targets.index(rank) + 1 < len(targets)
        assert mem.peak <= max(BUCKET, largest_hf()) + relay * BUCKET + 16, (mem.peak, BUCKET, relay)
        expect = world.recv(source=0)
        got = hf_state_dict(engine.models["a"])
        ok = set(got) == set(expect) and all(torch.equal(got[k], expect[k]) for k in expect)
        world.send("bit-equal" if ok else f"differs: {[k for k in expect if not torch.equal(got[k], expect[k])][:3]}",
                   dest=0)
    assert channels.comms_built == 1, channels.comms_built
    channels.close()


if __name__ == "__main__":
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file
        import json
        save_file({k: v.contiguous() for k, v in full_weights().items()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(ARGS.to_hf_config()))
    world.Barrier()
    group = world.Split(0 if rank in TRAINERS else 1, rank)
    if rank in TRAINERS:
        trainer_side(group)
    else:
        replica_side()
    world.Barrier()
    log("all sync checks passed")
