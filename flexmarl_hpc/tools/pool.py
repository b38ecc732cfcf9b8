"""A bounded pool that runs tool calls and reward functions off the caller's loop.

    pool = WorkerPool(Tools.from_config(cfg), cfg)
    call = await pool.tool("python", "print(1)")          # ToolCall: output, outcome, latency
    done = await pool.call(my_reward, text, answer, timeout_s=5)   # Called: value, outcome, latency
    pool.close()

At most `cfg.workers` calls run at once. A tool call is its own sandbox process (or, for the
calculator, a thread). A reward function runs in one of `workers` single-process executors
(a "slot"): a call that times out or kills its process costs only its own slot, which is
replaced, so a slow or crashing function never blocks or breaks the other calls.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable

from flexmarl_hpc.tools import lifeline
from flexmarl_hpc.config.tools import ToolsConfig
from flexmarl_hpc.tools.registry import ToolCall, Tools


@dataclass(frozen=True)
class Called:
    value: Any
    """The function's return value; None unless outcome is 'ok'."""
    outcome: str
    """'ok', 'error' (it raised), 'timeout' or 'crashed' (its process died)."""
    latency_s: float
    error: str = ""
    traceback: str = ""
    """Where the function raised: its traceback in the worker (outcome 'error')."""


def _executor() -> ProcessPoolExecutor:
    # forkserver: workers are forked from a clean server, not from a caller holding threads;
    # the server and the workers die with this rank (lifeline.py)
    return ProcessPoolExecutor(1, mp_context=lifeline.forkserver_context(), initializer=lifeline.worker_init)


def _kill(executor: ProcessPoolExecutor) -> None:
    """End an executor whose one worker may be stuck in a call: shutdown() alone would wait
    for it. Python 3.14 has kill_workers(); before it the processes are only reachable
    through the private _processes."""
    kill = getattr(executor, "kill_workers", None)
    if kill is None:
        for p in list((getattr(executor, "_processes", None) or {}).values()):
            p.kill()
    else:
        kill()
    executor.shutdown(wait=False, cancel_futures=True)


class WorkerPool:
    def __init__(self, tools: Tools, cfg: ToolsConfig):
        self.tools, self.cfg = tools, cfg
        self._running = asyncio.Semaphore(cfg.workers)
        self._slots: list[ProcessPoolExecutor] = []

    async def tool(self, name: str, argument: str, lent: bool = False) -> ToolCall:
        """Call a tool by the name a model used; an unknown name is a 'refused' call. lent:
        the caller holds a slot and waits on this call (a `workflow.agent` program's tool
        calls, workflows/openai_agent.py), so it runs in that slot rather than taking one."""
        try:
            tool = self.tools.get(name)
        except KeyError as e:
            return ToolCall(name, f"error: {e.args[0]}", "refused", 0.0)
        if lent:
            return await tool(argument)
        async with self._running:
            return await tool(argument)

    async def call(self, fn: Callable, *args, timeout_s: float | None = None) -> Called:
        """fn(*args) in a worker process (fn and args must pickle: a module-level function);
        timeout_s defaults to the config's wall_s."""
        timeout_s = self.cfg.wall_s if timeout_s is None else timeout_s
        async with self._running:
            slot = self._slots.pop() if self._slots else _executor()
            t0 = time.perf_counter()
            future = asyncio.get_running_loop().run_in_executor(slot, fn, *args)
            try:
                value = await asyncio.wait_for(future, timeout_s)
            except asyncio.TimeoutError:
                return self._lost(slot, "timeout", t0, f"no result in {timeout_s} s")
            except BrokenProcessPool as e:
                return self._lost(slot, "crashed", t0, f"the worker process died: {e}")
            except asyncio.CancelledError:
                _kill(slot)
                raise
            except Exception as e:                      # noqa: BLE001 - the function's own error
                self._slots.append(slot)
                return Called(None, "error", time.perf_counter() - t0, f"{type(e).__name__}: {e}",
                              str(e.__cause__ or ""))      # concurrent.futures' _RemoteTraceback
            self._slots.append(slot)
            return Called(value, "ok", time.perf_counter() - t0)

    def _lost(self, slot: ProcessPoolExecutor, outcome: str, t0: float, why: str) -> Called:
        _kill(slot)                                     # a fresh slot is made on demand
        return Called(None, outcome, time.perf_counter() - t0, why)

    def close(self) -> None:
        for slot in self._slots:
            slot.shutdown(wait=True, cancel_futures=True)
        self._slots.clear()
