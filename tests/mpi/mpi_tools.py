"""mpiexec -n 3: tool calls and reward functions on tool ranks (flexmarl_hpc/ranks/tool_ranks.py).

Rank 0 is the orchestrator's end (RemotePool over ranks 1 and 2, two workers each); the
calls run on the tool ranks' own pools, concurrently: answers, a refusal, a raising, a
crashing and a slow function each get their defined outcome, a lambda is refused before
it is sent, both ranks serve, then the orchestrator's Stop ends them (Stopped).

`stall OUT` (mpiexec -n 2, FLEXMARL_FAULT=tool_call:1:1:stall): the tool rank hangs inside
its first call; rank 0 gives the call up GRACE past its limit: a `timeout` outcome, not
a hung episode; the verdict goes to the file OUT. Rank 0 then ends the job (the stalled
rank cannot be stopped).

A tool rank's pool forks its reward workers from a forkserver, which imports this script
as __mp_main__: nothing at module level may import mpi4py (MPI_Init would fail there), so
the MPI modules are imported under the __main__ guard (flexmarl_hpc.run imports none at
module level either)."""
import asyncio
import sys
import time

from flexmarl_hpc.config.tools import ToolsConfig
from tests.mpi import tool_fns

cfg = ToolsConfig(cpu_s=1, wall_s=3.0, workers=2)
START_S = 60.0        # a reward worker's first call starts its forkserver process: seconds on a busy machine


async def calls(pool):
    t = pool.tool
    c = pool.call
    return await asyncio.gather(
        t("calculator", "2 ** 10"), t("python", "print(sum(range(10)))"), t("nope", "1"),
        t("python", "while True: pass"), c(tool_fns.add, 2, 3, timeout_s=START_S), c(tool_fns.boom, timeout_s=START_S),
        c(tool_fns.die, timeout_s=START_S), c(tool_fns.sleepy, 30, timeout_s=1.0), c(lambda: 1),
        *(c(tool_fns.where, timeout_s=START_S) for _ in range(4)))


def orchestrator(world, stall: bool) -> None:
    from flexmarl_hpc.runtime import messages
    from flexmarl_hpc.runtime.transport import MpiTransport
    from flexmarl_hpc.ranks.tool_ranks import RemotePool
    ranks = list(range(1, world.Get_size()))
    pool = RemotePool(world, ranks, cfg, grace_s=2.0)
    if stall:
        t0 = time.monotonic()
        r = asyncio.run(pool.tool("calculator", "1 + 1"))
        took = time.monotonic() - t0
        assert r.outcome == "timeout" and "tool rank 1 gave no answer" in r.output, r
        assert cfg.wall_s + 2.0 <= took < cfg.wall_s + 6.0, took
        line = f"ok: a stalled tool rank's call ended as timeout after {took:.1f} s"
        print(line, flush=True)
        # MPI_Abort can kill mpiexec's forwarding of stdout before that line gets through: the
        # test reads the verdict from the file it names
        with open(sys.argv[2], "w") as f:
            f.write(line + "\n")
        world.Abort(0)
    res = asyncio.run(calls(pool))
    calc, py, unknown, loop, add, boom, die, slow, lam, *where = res
    assert (calc.output, calc.outcome) == ("1024", "ok"), calc
    assert (py.output, py.outcome) == ("45\n", "ok"), py
    assert unknown.outcome == "refused" and "nope" in unknown.output, unknown
    assert loop.outcome in ("killed_cpu", "timeout"), loop
    assert (add.value, add.outcome) == (5, "ok"), add
    assert boom.outcome == "error" and "ValueError: boom" in boom.error, boom
    assert die.outcome == "crashed", die
    assert slow.outcome == "timeout" and slow.value is None, slow
    assert lam.outcome == "error" and "cannot send" in lam.error, lam
    assert {w.value for w in where} <= set(ranks) and all(w.outcome == "ok" for w in where), where
    assert set(pool.outstanding.values()) == {0} and not pool.given_up, (pool.outstanding, pool.given_up)
    assert min(pool.served.values()) >= 3 and sum(pool.served.values()) == len(res) - 1, pool.served
    t = MpiTransport(world)
    for r in ranks:
        t.send(r, messages.Stop(0))
    stopped = sorted(src for src, m in (t.receive(timeout=30) for _ in ranks) if isinstance(m, messages.Stopped))
    assert stopped == ranks, stopped
    t.close()
    print(f"ok: {len(res)} calls, answers per tool rank {pool.served}: "
          f"{[getattr(r, 'outcome') for r in res]}; stopped", flush=True)


if __name__ == "__main__":
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.Get_rank() == 0:
        orchestrator(world, sys.argv[1:2] == ["stall"])
    else:
        from flexmarl_hpc.tools.pool import WorkerPool
        from flexmarl_hpc.tools.registry import Tools
        from flexmarl_hpc.ranks.tool_ranks import tools_loop
        sys.exit(tools_loop(world, 0, WorkerPool(Tools.from_config(cfg), cfg)))
