"""mpiexec -n 2: MpiTransport.send does not wait for the worker. Rank 0 sends a micro-batch
of 8 MB (far above MPI's eager limit) to rank 1, which is "busy": it only looks for
commands after rank 0's small `go` message, which rank 0 sends after `send` returns. A
blocking send would wait for rank 1's receive and rank 1 for `go`: the job would hang
(the test's timeout fails it). Then three commands arrive in the order sent, the reply
comes back and `close` returns with nothing left in flight."""
import numpy as np
from mpi4py import MPI

from flexmarl_hpc.runtime import comm
from flexmarl_hpc.runtime import messages
from flexmarl_hpc.runtime.transport import MpiTransport, recv_command, send_reply

GO = 77
world = MPI.COMM_WORLD
big = {"input_ids": np.arange(2_000_000, dtype=np.int32)}            # 8 MB
if world.Get_rank() == 0:
    t = MpiTransport(world)
    for step in range(3):
        t.send(1, messages.Train("speaker", step, big, 0.5, step == 2))
    world.send("go", dest=1, tag=GO)
    src, reply = t.receive(timeout=60)
    assert src == 1 and reply == messages.Checkpointed(["speaker"]), reply
    t.close()
    assert t.sending == []
    print("ok: 3 sends of 8 MB returned before the worker received; in order; closed", flush=True)
else:
    comm.recv(world, source=0, tag=GO, timeout=60)
    got = [recv_command(world, 0) for _ in range(3)]
    assert [c.step for c in got] == [0, 1, 2] and got[2].last, got
    assert all(np.array_equal(c.arrays["input_ids"], big["input_ids"]) for c in got)
    send_reply(world, 0, messages.Checkpointed(["speaker"]))
