"""The run folder's lock (flexmarl_hpc.store.lock) with real processes, real locks and real
SIGKILLs: a second taker is refused with one line naming the holder, a lock left by a killed
holder is taken over with a notice, the holder's record is never torn by a kill."""
from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.store.lock import LOCK_NAME, Holder, acquire, check_free, parse_record
from tests.conftest import ROOT

HOLD = """
import sys, time
from flexmarl_hpc.store.lock import acquire
lock = acquire(sys.argv[1], notice=lambda s: print("notice:", s, flush=True))
print("held", flush=True)
time.sleep(60)
"""

# acquire and release as fast as possible: a kill lands anywhere, also inside the record's write
CHURN = """
import sys
from flexmarl_hpc.store.lock import acquire
print("go", flush=True)
while True:
    acquire(sys.argv[1], notice=lambda s: None).release()
"""


def start(code: str, folder, wait_for: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code, str(folder)], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    while True:
        line = p.stdout.readline()
        assert line, f"the child ended (rc {p.wait()}) before printing {wait_for!r}"
        if line.startswith(wait_for):
            return p


def kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait()


def test_second_taker_refused_with_one_line_naming_the_holder(tmp_path):
    holder = start(HOLD, tmp_path, "held")
    try:
        for attempt in (check_free, lambda d: acquire(d, notice=print)):
            with pytest.raises(ConfigError) as e:
                attempt(tmp_path)
            msg = str(e.value)
            assert "\n" not in msg
            assert msg.startswith(f"run.output_dir: {tmp_path} is in use by another run (")
            assert f"host {socket.gethostname()}, PID {holder.pid}, Slurm job none, started 20" in msg
    finally:
        kill(holder)
    # the probe let go of what it took: the holder is gone, the folder is free again
    check_free(tmp_path)
    acquire(tmp_path, notice=print).release()


def test_probe_writes_nothing(tmp_path):
    check_free(tmp_path / "new")                          # no folder: nothing to refuse, nothing made
    assert not (tmp_path / "new").exists()
    acquire(tmp_path, notice=print).release()
    before = (tmp_path / LOCK_NAME).read_bytes()
    check_free(tmp_path)
    assert (tmp_path / LOCK_NAME).read_bytes() == before == b""     # a clean release empties the record


def test_killed_holder_is_taken_over_with_a_notice(tmp_path):
    holder = start(HOLD, tmp_path, "held")
    kill(holder)                                          # SIGKILL: its record stays, its lock goes
    rec = parse_record((tmp_path / LOCK_NAME).read_bytes())
    assert rec is not None and rec.pid == holder.pid and rec.host == socket.gethostname()
    notices: list[str] = []
    lock = acquire(tmp_path, notice=notices.append)
    try:
        assert len(notices) == 1 and f"PID {holder.pid}" in notices[0] and "took over" in notices[0]
        assert parse_record((tmp_path / LOCK_NAME).read_bytes()).pid == os.getpid()
    finally:
        lock.release()
    # a lock file with no record (the last run ended cleanly): taken silently
    notices.clear()
    acquire(tmp_path, notice=notices.append).release()
    assert notices == []


def test_holder_record_survives_kills(tmp_path):
    """However a kill lands (also inside the record's write), the file holds either no
    record (released) or a whole one naming the killed process, and the next run takes the
    folder."""
    for _ in range(12):
        p = start(CHURN, tmp_path, "go")
        time.sleep(0.05 + 0.02 * (_ % 5))
        kill(p)
        data = (tmp_path / LOCK_NAME).read_bytes()
        if data.strip():
            rec = parse_record(data)
            assert rec is not None, f"a torn record: {data!r}"
            assert rec.pid == p.pid
        acquire(tmp_path, notice=lambda s: None).release()


def test_dead_pid_but_lock_held_is_reported(tmp_path):
    """A lock the file system keeps for a holder that is gone (cannot happen with flock on a
    local disk; seen on network file systems): the refusal says the PID is not running."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    record = Holder(socket.gethostname(), gone.pid, "", "2026-01-01T00:00:00+00:00").encode()
    code = ("import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1] + '/.lock', os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            f"os.pwrite(fd, {record!r}, 0)\n"
            "print('held', flush=True)\ntime.sleep(60)\n")
    p = start(code, tmp_path, "held")
    try:
        with pytest.raises(ConfigError, match=f"PID {gone.pid} is not running on this host"):
            check_free(tmp_path)
    finally:
        kill(p)


def _unsupported(*args, **kwargs):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


def test_no_lock_on_this_file_system(tmp_path, monkeypatch):
    """A mount with no flock (Lustre -o noflock gives ENOSYS, some NFS setups ENOLCK): fall
    back to lockf; with neither, refuse unless FLEXMARL_NO_LOCK=1. (The only test that
    fakes the system call: no such file system here.)"""
    monkeypatch.setattr(fcntl, "flock", _unsupported)
    lock = acquire(tmp_path, notice=print)                # lockf, for real
    assert lock.method == "lockf"
    lock.release()
    monkeypatch.setattr(fcntl, "lockf", _unsupported)
    with pytest.raises(ConfigError, match="offers neither flock nor lockf.*FLEXMARL_NO_LOCK=1"):
        acquire(tmp_path, notice=print)
    with pytest.raises(ConfigError, match="offers neither flock nor lockf"):
        check_free(tmp_path)
    monkeypatch.setenv("FLEXMARL_NO_LOCK", "1")
    notices: list[str] = []
    assert acquire(tmp_path, notice=notices.append).method == "none"
    assert len(notices) == 1 and "FLEXMARL_NO_LOCK=1" in notices[0]
    check_free(tmp_path)
