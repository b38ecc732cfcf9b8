"""The weight path at a sharded trainer's shape, on CPU: a megatron TP2 x PP2 group (4 ranks,
gloo) built from an HF safetensors checkpoint by slices, trained 3 steps and synced after
each to two torch-engine replicas through the production handler (tests/mpi/mpi_sync_megatron.py
says what each check measures: shards == checkpoint slices, build / optimizer step / sync
tensor bytes against the model's, the sender's sync bytes within 2 buckets exactly, bit-equal
replicas after every sync); and a TP 4 group's stream of the plan's pieces put together
bit-equal, also filled in place into two bucket buffers that are all the sender allocates
(tests/mpi/mpi_sync_stream_tp4.py).

    .venv/bin/python -m pytest tests/mpi/test_sync_megatron.py
"""
from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import need, run_mpi

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("backend,bucket,wire", [("gloo", 64 << 10, "fp32"), ("mpi", 64 << 10, "fp32"),
                                                 ("gloo", 16 << 10, "fp32"), ("gloo", 16 << 10, "bf16")])
def test_tp2_pp2_trainer_streams_bit_equal_weights_within_two_buckets(mpiexec, tmp_path, backend, bucket, wire):
    """64 KiB: the embedding and LM head fill a bucket each; 16 KiB: they and the MLP
    weights go in pieces (runtime/weight_sync.Piece); bf16: the wire's dtype is not the
    trainer's (each rank casts its rows, never a range-sized copy on the sender)."""
    need(importlib.util.find_spec("megatron") is not None, "megatron-core (pip install -r requirements-megatron.txt)")
    p = run_mpi(mpiexec, 6, ["tests/mpi/mpi_sync_megatron.py", str(tmp_path / "ckpt"), backend, str(bucket), wire],
                timeout=240,
                env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert "all sync checks passed" in p.stdout, p.stdout[-3000:]
    assert "ok build: TP2 x PP2 shards == the checkpoint's slices" in p.stdout
    for n in (1, 2, 3):
        assert f"ok sync {n} (v{n})" in p.stdout
    print("\n".join(line for line in p.stdout.splitlines() if line.startswith("ok")))


def test_tp4_stream_puts_every_row_range_together_bit_equal(mpiexec):
    """TP 4 (three remote ranks per range; tests/mpi/mpi_sync_stream_tp4.py): the plan's
    pieces, streamed from the shards, make the HF weights bit for bit, in the plan's order."""
    need(importlib.util.find_spec("megatron") is not None, "megatron-core (pip install -r requirements-megatron.txt)")
    p = run_mpi(mpiexec, 4, ["tests/mpi/mpi_sync_stream_tp4.py"], timeout=240,
                env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert "all tp4 stream checks passed" in p.stdout, p.stdout[-3000:]
    print("\n".join(line for line in p.stdout.splitlines() if line.startswith("ok")))
