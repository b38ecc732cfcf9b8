"""GPU: the weight sync's deadline on a real ProcessGroupNCCL (the CPU torch build has none;
tests/unit/test_weight_sync_nccl.py fakes it). One rank, one GPU: a member set of the rank
alone (NCCL refuses two ranks on one device), so nothing can hang here; what is checked is
that the code our deadline relies on exists and works on the real class: the group is built
with weight_sync.timeout_s as its timeout and TORCH_NCCL_ASYNC_ERROR_HANDLING set, a bf16
broadcast of device tensors is waited for through `Work.is_completed` polls, and a member
set forgotten after a timeout aborts its NCCL group. Skipped with "no GPU" elsewhere.

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
    from flexmarl_hpc.runtime.weight_sync import GroupIds, Plan, SyncChannels, layout_of, plan_buckets, send_weights
    os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    torch.cuda.set_device(0)
    world = MPI.COMM_SELF
    ch = SyncChannels(world, "nccl", timeout_s=42)
    assert ch.device.type == "cuda" and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    named = {"w": torch.randn(1024, 1024, device="cuda"), "step": torch.tensor([3], device="cuda")}
    ids = GroupIds()
    plan = Plan((0,), (plan_buckets(layout_of(named), 1 << 20, torch.bfloat16),), (ids.use(0, ()),), (ids.live(0),))
    send_weights(ch, (), plan, 7, 0, named.items(), leader=True)       # 3 buckets (w in 2 pieces), each waited by polls
    (members, _), pg = next(iter(ch.groups.items()))
    timeout = getattr(getattr(pg, "options", None), "_timeout", None)     # read back where torch shows it
    assert timeout is None or timeout.total_seconds() == 42, timeout
    polled = []
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    work = pg.broadcast([torch.zeros(4, device="cuda")], opts)    # a real NCCL Work
    deadline.wait_until(lambda: polled.append(1) or work.is_completed(), deadline.Deadline(42), "probe")
    ch.abandon([members])                                          # what a timeout does: abort the group
    assert not ch.groups and members not in ch.cache
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
