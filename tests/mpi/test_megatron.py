"""megatron-core backend on CPU (gloo): real 2- and 4-rank trainer groups under mpiexec.

Each case runs tests/mpi/mpi_megatron.py, which checks a megatron trainer group against the torch
reference trainer on the same init weights and batches: logits, GRPO losses and grad norms
over 2 steps of 2 accumulated micro-batches, weights after the steps, the training state
(TorchTrainer's format, Adam moments included) and loading a TorchTrainer state (the DP/TP
model has Qwen2's QKV biases, random, the PP ones tied embeddings); and, for checkpoints, a
TP2 dist_checkpointing save loaded into TP1xDP2 and PP2 (resharding, odd vocab size 23).
Needs megatron-core (requirements-megatron.txt): under CI=true a missing megatron fails,
elsewhere the tests skip with that reason.

    .venv/bin/python -m pytest tests/mpi/test_megatron.py
"""
from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import need, run_mpi

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def megatron(mpiexec) -> str:
    need(importlib.util.find_spec("megatron") is not None
         and importlib.util.find_spec("megatron.core") is not None,
         "megatron-core (pip install -r requirements-megatron.txt)")
    return mpiexec


def _run(mpiexec: str, n: int, *args: str) -> str:
    p = run_mpi(mpiexec, n, ["tests/mpi/mpi_megatron.py", *args], timeout=240,
                env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert "all megatron checks passed" in p.stdout, p.stdout[-3000:]
    print("\n".join(line for line in p.stdout.splitlines() if line.startswith("ok")))
    return p.stdout


def test_data_parallel_group_matches_torch_trainer(megatron):
    out = _run(megatron, 2, "dp")
    assert "ok dp: losses" in out and "ok dp: state() == TorchTrainer.state()" in out


def test_tensor_parallel_matches_torch_and_tp1_loss(megatron):
    out = _run(megatron, 2, "dp", "tp")
    assert "ok tp: losses" in out and "ok TP2 loss == TP1 (DP2) loss" in out
    assert "megatron logits == torch logits (QKV biases)" in out
    # the loss's log-probs/entropy come from the vocab shards, equal to the gathered logits'
    assert "ok tp (rank 0, tp 0/2): vocab-parallel log-probs and entropy == gathered logits' (action mask)" in out


def test_pipeline_parallel_with_tied_embeddings_matches_torch(megatron):
    out = _run(megatron, 2, "pp")
    assert "ok pp: losses" in out and "ok pp: load_state(TorchTrainer state)" in out
    # PP2 runs 1F1B over 6 micro-batches per call (same losses as the PP1 torch reference
    # above) and its two stages compute at overlapping times
    assert "ok pp: 1F1B with 6 micro-batches per call" in out


def test_ppo_epochs_replay_matches_torch_with_tp2_and_pp2(megatron):
    """trainer.ppo_epochs=2: with TP2 both TP ranks train the same share and with PP2 only the
    last stage computes log-probs; the replay's old log-probs must line up with the rows
    each rank trains, so the step equals the torch trainer's."""
    out = _run(megatron, 2, "ppo-tp", "ppo-pp")
    assert "ok ppo tp: ppo_epochs=2 == torch" in out and "ok ppo pp: ppo_epochs=2 == torch" in out


def test_checkpoint_saved_with_tp2_loads_into_tp1_and_pp2(megatron, tmp_path):
    out = _run(megatron, 2, "ckpt", str(tmp_path / "ckpt"))
    assert "-> TP1xPP1xDP2 load" in out and "-> TP1xPP2xDP1 load" in out
    assert "ok checkpoint: TP1xDP2 save -> TP2xDP1 load" in out          # the DP gather, mem-efficient
    assert "vocab 23 padded to 128 at every TP" in out
    assert "gathered without copies == megatron's" in out
    # published through checkpoint.py: a folder entry with its sha256 manifest
    from flexmarl_hpc.store.checkpoint import newest_valid
    assert newest_valid(tmp_path / "ckpt") == (1, tmp_path / "ckpt" / "v000001")
    # export's reader: the TP2 entry resharded into one CPU rank gives the saved HF weights
    code = ("import sys, torch; sys.argv = ['x']; import tests.mpi.mpi_megatron as m; "
            "from flexmarl_hpc.trainer.megatron import hf_weights_of_entry; "
            f"got = hf_weights_of_entry({str(tmp_path / 'ckpt' / 'v000001')!r}, m.ARGS['tp'], m.cfg_for(2, 1)); "
            f"want = torch.load({str(tmp_path / 'ckpt.weights.pt')!r}); "
            "assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want); print('export ok')")
    import subprocess
    import sys
    from tests.conftest import ROOT
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert "export ok" in p.stdout, p.stderr[-3000:]


def test_four_ranks_tp2_dp2_and_tp2_pp2(megatron):
    # "tp" on 4 ranks is TP2 x DP2, "tppp" is TP2 x PP2; "bytes-*" drives micro-batches through
    # the trainer loop's path (group_command, share) on a recording communicator: each crosses
    # the group once as raw buffers, with no allgather and no array-sized pickle (issue 39)
    out = _run(megatron, 4, "tp", "tppp", "bytes-tp", "bytes-tppp")
    assert "ok tp: losses" in out and "ok tppp: losses" in out
    assert "ok bytes tp: each micro-batch crosses the group once" in out
    assert "ok bytes tppp: each micro-batch crosses the group once" in out


def test_bf16_config_builds_bf16_megatron_and_optimizer_configs(megatron):
    """trainer.precision (auto = bf16 on GPU) -> TransformerConfig bf16 with bf16 params and
    pipeline dtype, OptimizerConfig bf16 with fp32 main params / moments / grads; recompute
    and overlap flags reach megatron. Structural: no GPU needed."""
    import torch

    from flexmarl_hpc.config.schema import TrainerConfig
    from flexmarl_hpc.learn.model import ModelArgs
    from flexmarl_hpc.trainer.megatron import configs
    args = ModelArgs(23, 32, 2, 4, 2, 64, 16)
    gpu = TrainerConfig(backend="megatron", recompute="full", overlap_grad_reduce=True,
                        overlap_param_gather=True)
    t, o, d = (configs.transformer_config(args, gpu, cuda=True), configs.optimizer_config(gpu, cuda=True),
               configs.ddp_config(gpu))
    assert t.bf16 and t.params_dtype == torch.bfloat16 and t.pipeline_dtype == torch.bfloat16
    assert t.recompute_granularity == "full" and t.recompute_method == "uniform"
    assert o.bf16 and o.params_dtype == torch.bfloat16 and o.main_params_dtype == torch.float32
    assert o.exp_avg_dtype == torch.float32 and o.use_distributed_optimizer
    assert d.overlap_grad_reduce and d.overlap_param_gather and d.grad_reduce_in_fp32
    cpu = TrainerConfig(backend="megatron")                 # auto on CPU: fp32
    assert not configs.transformer_config(args, cpu, cuda=False).bf16
    assert configs.optimizer_config(cpu, cuda=False).params_dtype == torch.float32
    forced = TrainerConfig(backend="megatron", precision="fp32")
    assert not configs.transformer_config(args, forced, cuda=True).bf16


def test_bf16_load_state_reloads_the_fp32_main_params(megatron):
    # bf16 on CPU (gloo), DP2: after load_state the DistributedOptimizer's fp32 main params
    # equal the loaded weights, so the next step starts from them (not from the old weights)
    out = _run(megatron, 2, "bf16")
    assert "ok bf16: after load_state the fp32 main params equal the loaded weights" in out


def test_state_swap_keeps_the_trainer_and_is_bit_equal(megatron):
    # offload/onload through StateMover, DP2 fp32 and bf16 (fp32 main params), reference model
    out = _run(megatron, 2, "swap")
    for p in ("fp32", "bf16"):
        assert f"ok swap {p}: offload freed every state storage" in out
        assert "no build, no checkpoint or state read" in out


def test_kl_term_matches_torch_trainer_on_tp2(megatron):
    out = _run(megatron, 2, "kl")
    assert "ok kl: TP2 megatron with kl_coef 0.5 == torch trainer" in out


def test_a_full_disk_under_megatrons_checkpoint_writer_is_reported_as_enospc(megatron):
    """torch.save writes a shard through the file's `write` and may report a short write as
    "unexpected pos ...", without the errno: the writer's files keep it (/dev/full: every
    write fails with ENOSPC), and _root_cause finds it under a failure that lost it."""
    import errno
    from pathlib import Path

    import torch
    from torch.distributed.checkpoint import CheckpointException

    from flexmarl_hpc.trainer.megatron.dist_ckpt import _root_cause, _WriteErrors, _write_in_process
    _write_in_process()
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    assert fa.open == _WriteErrors.open            # megatron's writer opens its files through it
    _WriteErrors.seen.clear()
    with pytest.raises(Exception):
        with fa.open("/dev/full", "wb") as f:
            torch.save(torch.zeros(1 << 16), f)
    lost = CheckpointException("save", {0: (RuntimeError("unexpected pos 64 vs 0"), None)})
    cause = _root_cause(lost, Path("/nowhere"))
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, cause
    _WriteErrors.seen.clear()
    assert not isinstance(_root_cause(lost, Path("/nowhere")), OSError)


def test_state_moves_shard_to_shard_between_two_tp2_groups(megatron):
    """Two TP2 groups of 2 ranks, bf16 (fp32 main params apart from the bf16 weights;
    tests/mpi/mpi_megatron_move.py): a trained agent moves
    group 0 -> 1 as each rank's own storages (no state() gather), bit-equal, and its next
    step equals a twin's that never moved; each rank receives exactly its shard's bytes; a
    destination of another layout gets state() instead (the fallback: the whole state on
    every rank); a shelved trainer's shard moves into a parked arrival. TP2 x PP2 on 8 ranks
    with a larger model and the peak RSS per rank: bench/bench_state_move.py."""
    p = run_mpi(megatron, 4, ["tests/mpi/mpi_megatron_move.py", "2", "1", "bf16"], timeout=240,
                env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MALLOC_MMAP_THRESHOLD_": "65536"})
    out = p.stdout
    assert "all megatron move checks passed" in out, out[-3000:]
    print("\n".join(line for line in out.splitlines() if line.startswith(("ok", "   "))))
    assert "ok shard move TP2 x PP1 x DP1 bf16: state() bit-equal after the move, next step == a twin's" in out
    assert "each rank received its shard only" in out
    assert "ok fallback (other layout): state() sent" in out
    assert "ok shard move from a shelved trainer into a parked arrival, swapped in: bit-equal" in out
    assert "ok zero gradients not sent" in out


def test_state_reshards_between_groups_of_other_layouts(megatron):
    """A trained bf16 agent moves TP2 x PP1 -> TP1 x PP2 and back into a parked arrival
    (tests/mpi/mpi_megatron_reshard.py) by runtime/reshard.py's plan: each rank receives its
    own shard's bytes (the state() fallback sends the whole state to every rank: fails),
    bit-equal state(), the next step bit-equal to a twin of the new layout loaded by
    load_state and within 3 x lr of the never-moved twin of the old one."""
    p = run_mpi(megatron, 4, ["tests/mpi/mpi_megatron_reshard.py"], timeout=240,
                env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    out = p.stdout
    assert "all megatron reshard checks passed" in out, out[-3000:]
    print("\n".join(line for line in out.splitlines() if line.startswith("ok")))
    assert "ok resharded move TP2 x PP1 -> TP1 x PP2 bf16: state() bit-equal after the move" in out
    assert "each rank received its shard only" in out
    assert "ok the next step: bit-equal to a TP1 x PP2 twin" in out
    assert "ok resharded back TP1 x PP2 -> TP2 x PP1 into a parked arrival, swapped in: bit-equal" in out
