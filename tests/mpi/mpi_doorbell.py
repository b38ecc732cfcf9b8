"""mpiexec -n 3: the orchestrator's doorbell star (flexmarl_hpc.runtime.doorbell.connect) with the
real MpiTransport and worker ends.

Rank 0 (orchestrator) sends worker 1 an 8 MB micro-batch (rendezvous-sized: it moves only
while both ends drive MPI) and worker 2 a small command after a 1 s pause; each worker
replies. Worker 2 spends that second waiting for its command: with a doorbell it sleeps in
the kernel, so it context-switches a few dozen times (one look at MPI per SAFETY_S), where
the back-off polling it replaces wakes ~2,000 times a second. Voluntary context switches
from /proc/self/status count the wake-ups; a polling wait fails the check."""
import time

import numpy as np
from mpi4py import MPI

from flexmarl_hpc.runtime import messages
from flexmarl_hpc.runtime.doorbell import connect
from flexmarl_hpc.runtime.transport import MpiTransport, recv_command, send_reply

world = MPI.COMM_WORLD
rank = world.Get_rank()
bell = connect(world, 0)
assert bell is not None, "the doorbell star could not be opened on one node"
assert sorted(bell.peers) == ([1, 2] if rank == 0 else [0]), bell.peers
big = {"input_ids": np.arange(2_000_000, dtype=np.int32)}            # 8 MB


def switches() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


if rank == 0:
    t = MpiTransport(world, bell)
    t.send(1, messages.Train("speaker", 0, big, 0.5, True))
    src, reply = t.receive(timeout=60)
    assert src == 1 and reply == messages.Checkpointed(["speaker"]), reply
    time.sleep(1.0)
    t.send(2, messages.Checkpoint(["listener"]))
    src, reply = t.receive(timeout=60)
    assert src == 2 and reply.kind == "intervals", reply
    t.close()
    woke = world.recv(source=2, tag=9)
    assert woke < 200, f"worker 2 woke {woke} times in 1 s of waiting: it polled"
    print(f"ok: star of 2 workers; commands and an 8 MB micro-batch delivered; idle waits asleep "
          f"(worker 2: {woke} wake-ups in ~1 s)", flush=True)
elif rank == 1:
    cmd = recv_command(world, 0, bell)
    assert isinstance(cmd, messages.Train) and np.array_equal(cmd.arrays["input_ids"], big["input_ids"])
    send_reply(world, 0, messages.Checkpointed(["speaker"]), bell)
else:
    before = switches()
    cmd = recv_command(world, 0, bell)
    woke = switches() - before
    assert cmd == messages.Checkpoint(["listener"]), cmd
    send_reply(world, 0, messages.Intervals(intervals=[]), bell)
    world.send(woke, dest=0, tag=9)
bell.close()
