"""GPU: the weight sync's deadline on a real ProcessGroupNCCL (the CPU torch build has none;
tests/unit/test_weight_sync_nccl.py fakes it). One rank, one GPU: a (trainer group, pool)
sync group of the rank alone, made by SyncChannels.open as at a job's start (NCCL refuses
two ranks on one device), so nothing can hang here; what is checked is that the code our
deadline relies on exists and works on the real class: the group is built eagerly on the
device with weight_sync.timeout_s as its timeout and TORCH_NCCL_ASYNC_ERROR_HANDLING set, a
real NCCL Work is waited for through `Work.is_completed` polls, and a pair abandoned after a
timeout aborts its NCCL group and is refused by name. Skipped with "no GPU" elsewhere.

    python tests/gpu/gpu_sync_deadline.py          # on a GPU machine, without pytest
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def check() -> str:
    import torch
    from mpi4py import MPI

    from flexmarl_hpc.runtime import deadline
    from flexmarl_hpc.config.sync_groups import SyncGroup
    from flexmarl_hpc.runtime.weight_sync import SyncChannels
    os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    torch.cuda.set_device(0)
    world = MPI.COMM_SELF
    ch = SyncChannels(world, "nccl", timeout_s=42)
    assert ch.device.type == "cuda" and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    ch.open([SyncGroup(0, 0, (0,), ())])
    pair = ch.pairs[0, 0]
    pg = pair.pg
    assert ch.comms_built == ch.groups_built == 1
    timeout = getattr(getattr(pg, "options", None), "_timeout", None)     # read back where torch shows it
    assert timeout is None or timeout.total_seconds() == 42, timeout
    polled = []
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    work = pg.broadcast([torch.zeros(4, device="cuda")], opts)    # a real NCCL Work
    deadline.wait_until(lambda: polled.append(1) or work.is_completed(), deadline.Deadline(42), "probe")
    ch.abandon([pair], "probe")                                    # what a timeout does: abort the group
    try:
        pair.check()
        raise AssertionError("an abandoned pair was handed out")
    except RuntimeError as e:
        assert "abandoned" in str(e), e
    ch.close()
    return (f"gpu sync deadline ok: NCCL group timeout {timeout} (42 s asked), is_completed polled "
            f"{len(polled)}x, abort ok")


@pytest.mark.gpu
def test_nccl_sync_group_takes_the_deadline_api():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    print(check())


if __name__ == "__main__":
    print(check())
