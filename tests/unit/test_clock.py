"""The simulator's fidelity rests on one clock (issue 39): the parts it runs (orchestrator/,
store/, runtime/) read time only through the flexmarl_hpc.clock.Clock they are built with (or
`REAL` by name, for a wait on something real), never the time module or datetime.now
directly; a simulated run's timestamps are then simulated time whichever call a line makes
(tests/unit/test_sim_transport.py runs one; tests/e2e/test_sim_equals_mpi.py holds that the
simulator and an mpiexec job run the same code)."""
from __future__ import annotations

import ast

import pytest

from flexmarl_hpc.clock import REAL, SimulatedClock
from tests.conftest import ROOT

SIMULATED_PARTS = ("orchestrator", "store", "runtime")
NOW = {"now", "utcnow", "today"}


def wall_time_reads(source: str) -> list[str]:
    """The lines of `source` that import the time module (its time, monotonic, sleep,
    perf_counter...) or call datetime's now/utcnow/today, as 'LINE: code'."""
    found = []
    for n in ast.walk(ast.parse(source)):
        bad = (isinstance(n, ast.Import) and any(a.name == "time" or a.name.startswith("time.") for a in n.names)
               or isinstance(n, ast.ImportFrom) and n.module == "time"
               or isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in NOW
               and ast.unparse(n.func.value).split(".")[-1] in ("datetime", "date"))
        if bad:
            found.append(f"{n.lineno}: {ast.unparse(n)}")
    return found


def test_the_simulated_parts_read_time_only_through_the_clock():
    bad = {}
    for part in SIMULATED_PARTS:
        for p in sorted((ROOT / "flexmarl_hpc" / part).rglob("*.py")):
            if found := wall_time_reads(p.read_text(encoding="utf-8")):
                bad[str(p.relative_to(ROOT))] = found
    assert bad == {}, f"read the run's Clock (or flexmarl_hpc.clock.REAL for a real wait) instead: {bad}"


def test_the_scan_sees_each_way_of_reading_time():
    src = ("import time\nfrom time import monotonic\nimport datetime as dt\n"
           "from datetime import datetime\n\ndef f(clock):\n    import time as t\n"
           "    return t.sleep(1), datetime.now(), dt.datetime.utcnow(), dt.date.today(), clock.time()\n")
    assert [line.split(":")[0] for line in wall_time_reads(src)] == ["1", "2", "7", "8", "8", "8"]
    assert wall_time_reads("from flexmarl_hpc.clock import REAL\nREAL.time()\nx.now\n") == []


class _Source:
    now = 100.0


def test_a_simulated_clock_reads_its_source_and_refuses_to_sleep():
    src = _Source()
    clock = SimulatedClock(src)
    src.now = 250.5
    assert clock.time() == clock.monotonic() == 250.5
    with pytest.raises(RuntimeError, match="simulated clock"):
        clock.sleep(0.1)
    assert abs(REAL.time() - REAL.time()) < 1.0 and REAL.monotonic() <= REAL.monotonic()


def test_the_orchestrator_refuses_a_store_on_another_clock(tmp_path):
    from flexmarl_hpc.config.load import load_config
    from flexmarl_hpc.config.plan import resolve
    from flexmarl_hpc.orchestrator.loop import Orchestrator
    from flexmarl_hpc.store.tables import StoreFile
    cfg = load_config(str(ROOT / "configs/local.yaml"), [f"run.output_dir={tmp_path}"])
    store = StoreFile(tmp_path / "run.h5", cfg.agent_names, {})          # the machine's clock
    try:
        with pytest.raises(ValueError, match="another clock"):
            Orchestrator(resolve(cfg), None, None, store, clock=SimulatedClock(_Source()))
    finally:
        store.close()


def test_the_store_stamps_rows_with_its_clock(tmp_path):
    from flexmarl_hpc.store.tables import StoreFile
    src = _Source()
    store = StoreFile(tmp_path / "s.h5", ["a"], {}, clock=SimulatedClock(src))
    try:
        src.now = 112.0
        assert store.t0 == 100.0 and store.now() == 12.0
    finally:
        store.close()
