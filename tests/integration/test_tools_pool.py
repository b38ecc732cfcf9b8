"""The worker pool: a slow call and a crashing call do not delay a fast one, each call has
a defined outcome, and the pool works after them.

    pytest tests/integration/test_tools_pool.py
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

from flexmarl_hpc.config.tools import ToolsConfig
from flexmarl_hpc.tools.pool import WorkerPool
from flexmarl_hpc.tools.registry import Tools


def slow_reward(x: float) -> float:
    time.sleep(60)
    return x


def crashing_reward(x: float) -> float:
    os.kill(os.getpid(), signal.SIGKILL)
    return x


def raising_reward(x: float) -> float:
    raise ValueError(f"bad answer {x}")


def fast_reward(x: float) -> float:
    return 2 * x


async def in_order_of_completion(calls: dict) -> tuple[list[str], dict]:
    """Run the named coroutines at once; their names in the order they finished, and results."""
    done, results = [], {}

    async def one(name, coro):
        results[name] = await coro
        done.append(name)

    await asyncio.gather(*(one(n, c) for n, c in calls.items()))
    return done, results


def test_a_slow_and_a_crashing_tool_call_do_not_delay_a_fast_one():
    cfg = ToolsConfig(wall_s=4, workers=3)
    pool = WorkerPool(Tools.from_config(cfg), cfg)

    async def scenario():
        order, r = await in_order_of_completion({
            "slow": pool.tool("python", "import time\ntime.sleep(60)"),
            "crash": pool.tool("python", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)"),
            "fast": pool.tool("python", "print(6 * 7)"), "calc": pool.tool("calculator", "2 ** 10")})
        return order, r, await pool.tool("shell", "ls")

    order, r, unknown = asyncio.run(scenario())
    assert order[-1] == "slow", order            # run one at a time, fast would wait for slow
    assert [(r[k].outcome, r[k].output) for k in ("fast", "calc")] == [("ok", "42\n"), ("ok", "1024")]
    assert (r["slow"].outcome, r["crash"].outcome) == ("timeout", "crashed")
    assert r["slow"].output.endswith("[timeout]") and r["fast"].latency_s < r["slow"].latency_s
    assert unknown.outcome == "refused"


def test_reward_functions_run_off_the_loop_and_a_lost_worker_is_replaced():
    cfg = ToolsConfig(wall_s=30, workers=3)
    pool = WorkerPool(Tools.from_config(cfg), cfg)

    async def scenario():
        first = await in_order_of_completion({
            "slow": pool.call(slow_reward, 1.0, timeout_s=4), "crash": pool.call(crashing_reward, 1.0),
            "fast": pool.call(fast_reward, 21.0)})
        again = await in_order_of_completion({str(i): pool.call(fast_reward, i) for i in range(4)})
        return first, again[1], await pool.call(raising_reward, 3)

    try:
        (order, r), again, err = asyncio.run(scenario())
    finally:
        pool.close()
    assert order[-1] == "slow", order
    assert (r["fast"].outcome, r["fast"].value) == ("ok", 42.0)
    assert (r["slow"].outcome, r["crash"].outcome) == ("timeout", "crashed")
    assert [again[str(i)].value for i in range(4)] == [0, 2, 4, 6]       # 4 calls on 3 workers
    assert (err.outcome, err.error) == ("error", "ValueError: bad answer 3")
