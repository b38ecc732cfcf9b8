"""One writer per run folder: an exclusive lock on `<output_dir>/.lock`, held by rank 0.

    check_free(cfg.output_dir)              # launcher, submit: ConfigError naming the holder if held
    lock = acquire(cfg.output_dir, notice)  # rank 0, before anything in the folder is written
    lock.release()                          # at exit (the kernel also drops it when the process dies)

Two runs on one folder would both write the store, `train.log`, `config.yaml` and the
checkpoints; the second clears the first's HDF5 open-for-write flags and corrupts its
store. Rank 0 (the orchestrator, the only writer of the store) takes the lock before
anything in the folder is written or repaired; the launcher (`python -m flexmarl_hpc.run`
outside MPI) and `submit` only probe it (take it non-blockingly and let go) so a second
run is refused before any rank starts. Under Slurm, srun starts the ranks directly and
rank 0's own `acquire` is the check; every rank learns its outcome (`run.py`).

Mechanism: `flock` (held per open file description, dropped by the kernel when the holder
dies, so a "stale" lock is only a lock file whose record names a holder that is gone: it
is taken over with a one-line notice). Where `flock` is unsupported (ENOLCK, EOPNOTSUPP,
ENOSYS, EINVAL: some network file systems) POSIX `lockf` is tried; `FLEXMARL_LOCK=lockf`
picks it first. If neither works the run is refused unless `FLEXMARL_NO_LOCK=1`. What
Lustre and GPFS give: docs/reliability.md, "One writer per run folder".

The holder's record (host, PID, Slurm job, start time) is one fixed-size JSON line written
with a single `pwrite` into the lock file itself, never by rename: renaming a new file over
`.lock` would replace the locked inode and let the next run lock a fresh one.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from flexmarl_hpc.clock import REAL
from flexmarl_hpc.config.schema import ConfigError

LOCK_NAME = ".lock"
RECORD_BYTES = 512               # one pwrite of at most a page: a kill cannot leave half of it
UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
HELD = {errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK}


@dataclass(frozen=True)
class Holder:
    """Who holds (or last held) a run folder."""
    host: str
    pid: int
    job: str                      # SLURM_JOB_ID, '' outside Slurm
    started: str                  # ISO 8601, UTC

    @staticmethod
    def me() -> "Holder":
        return Holder(socket.gethostname(), os.getpid(), os.environ.get("SLURM_JOB_ID", ""),
                      datetime.fromtimestamp(REAL.time(), timezone.utc).isoformat(timespec="seconds"))

    def describe(self) -> str:
        return (f"host {self.host}, PID {self.pid}, Slurm job {self.job or 'none'}, "
                f"started {self.started}")

    def encode(self) -> bytes:
        line = json.dumps(asdict(self)).encode()
        if len(line) >= RECORD_BYTES:           # an absurd host name: keep the record one write
            line = json.dumps({**asdict(self), "host": self.host[:200]}).encode()
        return line + b" " * (RECORD_BYTES - 1 - len(line)) + b"\n"


def parse_record(data: bytes) -> Holder | None:
    """The holder of a lock file's bytes; None for an empty (released) or unreadable record."""
    try:
        d = json.loads(data.decode().strip() or "null")
        return Holder(str(d["host"]), int(d["pid"]), str(d.get("job", "")), str(d["started"]))
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):
        return None


def read_holder(fd: int) -> Holder | None:
    return parse_record(os.pread(fd, RECORD_BYTES, 0))


def _methods() -> tuple[str, ...]:
    return ("lockf", "flock") if os.environ.get("FLEXMARL_LOCK") == "lockf" else ("flock", "lockf")


def _try_lock(fd: int) -> str | None:
    """Take an exclusive lock on fd without waiting: the method that worked, or None if
    another process holds it. OSError(UNSUPPORTED) when no method works on this file system."""
    last: OSError | None = None
    for method in _methods():
        try:
            if method == "flock":
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            else:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return method
        except OSError as e:
            if e.errno in HELD:
                return None
            if e.errno not in UNSUPPORTED:
                raise
            last = e
    raise last                                            # type: ignore[misc]


def _lock_or_refuse(fd: int, path: Path) -> str | None:
    """_try_lock, with the refusal when the file system offers no lock at all ('none' with
    FLEXMARL_NO_LOCK=1: the user vouches that no other run uses the folder)."""
    try:
        return _try_lock(fd)
    except OSError as e:
        if e.errno not in UNSUPPORTED:
            raise
        if os.environ.get("FLEXMARL_NO_LOCK") == "1":
            return "none"
        raise ConfigError(f"run.output_dir: cannot lock {path} ({os.strerror(e.errno)}): this file "
                          "system offers neither flock nor lockf, so a second run on this folder "
                          "could not be refused (Lustre: mount with -o flock); set FLEXMARL_NO_LOCK=1 "
                          "to run without the lock, making sure no other run uses this folder") from None


def held_error(path: Path, holder: Holder | None) -> ConfigError:
    who = holder.describe() if holder else "holder unknown: its record is empty or unreadable"
    return ConfigError(f"run.output_dir: {path.parent} is in use by another run ({who}){_doubt(holder)}; "
                       "wait for it to end or use another run.output_dir")


def check_free(out: Path) -> None:
    """Refuse (ConfigError, one line naming the holder) if a run holds `out`. Writes nothing:
    no folder or lock file is created, a lock taken to probe is let go at once."""
    path = Path(out) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return                                   # no run ever locked this folder
    except PermissionError:
        fd = os.open(path, os.O_RDONLY)          # flock needs no write access
    try:
        if _lock_or_refuse(fd, path) is None:
            raise held_error(path, read_holder(fd))
    finally:
        os.close(fd)                             # lets go of the probe's lock (both kinds)


class RunLock:
    """The held lock of one run folder: keep the object (and so its fd) for the life of the
    run. Only this process may open the lock file meanwhile (closing any fd of it would drop
    a lockf lock)."""

    def __init__(self, path: Path, fd: int | None, method: str, holder: Holder) -> None:
        self.path, self.fd, self.method, self.holder = path, fd, method, holder

    def release(self) -> None:
        """Empty the record (a clean end: the next run prints no take-over notice), let go."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)


def acquire(out: Path, notice: Callable[[str], None] = print) -> RunLock:
    """Take `out`'s lock for this process or raise ConfigError naming the holder. A record
    left by a holder that is gone (killed: it could not empty it) is taken over with one
    `notice` line."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        method = _lock_or_refuse(fd, path)
    except BaseException:
        os.close(fd)
        raise
    if method == "none":
        os.close(fd)
        notice(f"run.output_dir: {path}: this file system offers no lock; FLEXMARL_NO_LOCK=1 is set, "
               "going on without one")
        return RunLock(path, None, "none", Holder.me())
    if method is None:
        holder = read_holder(fd)
        os.close(fd)
        raise held_error(path, holder)
    old = read_holder(fd)
    if old is not None:
        notice(f"run.output_dir: took over the lock of a run that ended without releasing it "
               f"({old.describe()})")
    me = Holder.me()
    os.pwrite(fd, me.encode(), 0)                # one write of the whole fixed-size record
    os.fsync(fd)
    _warn_node_local(out, notice)
    return RunLock(path, fd, method, me)


LAUNCHER_ENV = "FLEXMARL_LAUNCHER_LOCK"
"""Set by the launcher to its PID before it becomes mpiexec, holding the lock (hand_down)."""


def hand_down(lock: RunLock) -> None:
    """The launcher keeps the lock across its exec of mpiexec (the fd made inheritable: the
    lock stays with mpiexec, this PID, until the job ends), so a second run is refused at
    its own launcher's lock attempt, not 10-18 s later at its rank 0 (issue 38). Rank 0
    recognises the holder as its own launcher (launched_by_holder)."""
    if lock.fd is not None:
        os.set_inheritable(lock.fd, True)
    os.environ[LAUNCHER_ENV] = f"{os.getpid()}:{-1 if lock.fd is None else lock.fd}"


def drop_inherited(out: Path) -> None:
    """Every rank: close the launcher's lock fd if it came down to this process (mpiexec may
    pass its fds on), so only mpiexec holds the lock and no process a rank starts can keep
    it past the job. Closing it drops no lock: flock belongs to the open file description,
    which mpiexec keeps open, and a lockf lock is mpiexec's own (not inherited by a fork)."""
    _, _, fd = os.environ.get(LAUNCHER_ENV, "").partition(":")
    if not fd.isdigit():
        return
    try:
        mine, lock = os.fstat(int(fd)), os.stat(Path(out) / LOCK_NAME)
    except OSError:
        return
    if (mine.st_dev, mine.st_ino) == (lock.st_dev, lock.st_ino):
        os.close(int(fd))


def launched_by_holder(out: Path) -> bool:
    """Whether `out`'s lock is held by this process's own launcher: the record names this
    host and the PID the launcher left in LAUNCHER_ENV, and that PID is an ancestor of
    this process (mpiexec, which the launcher became)."""
    want = os.environ.get(LAUNCHER_ENV, "").partition(":")[0]
    try:
        fd = os.open(Path(out) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False
    try:
        holder = read_holder(fd)
    finally:
        os.close(fd)
    if not want.isdigit() or holder is None or holder.pid != int(want) or holder.host != socket.gethostname():
        return False
    return int(want) in _ancestors()


def _ancestors() -> set[int]:
    pids, pid = set(), os.getppid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def empty_record(out: Path) -> None:
    """Rank 0 of a run whose launcher holds the lock, at its clean end: empty the record (the
    next run prints no take-over notice); the lock itself ends with mpiexec."""
    try:
        fd = os.open(Path(out) / LOCK_NAME, os.O_WRONLY)
    except OSError:
        return
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------
# what the record says about a holder that the lock calls alive
# ---------------------------------------------------------------------------------------
def _doubt(holder: Holder | None) -> str:
    """With flock on a local file system a dead holder holds nothing; a network file system
    may keep it. Say so when the record's PID (this host) or Slurm job is gone."""
    if holder is None:
        return ""
    if holder.host == socket.gethostname() and not _pid_alive(holder.pid):
        return (f"; but PID {holder.pid} is not running on this host: the file system kept a dead "
                "holder's lock (check, then remove the .lock file or set FLEXMARL_NO_LOCK=1)")
    if holder.job and _job_running(holder.job) is False:
        return (f"; but squeue says Slurm job {holder.job} is not running: the file system kept a "
                "dead holder's lock (check, then remove the .lock file or set FLEXMARL_NO_LOCK=1)")
    return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True                              # alive, another user's
    return True


def _job_running(job: str) -> bool | None:
    """Whether squeue lists the job; None where squeue cannot tell (no Slurm here)."""
    if not shutil.which("squeue"):
        return None
    try:
        p = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
                           timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0 and "Invalid job id" not in p.stderr:
        return None
    return bool(p.stdout.strip())


def mount_of(path: Path) -> tuple[str, str]:
    """(fstype, options) of the mount holding `path`, from /proc/mounts; ('', '') if unknown."""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "", ""
    real, best = str(Path(path).resolve()), ("", "", "")
    for line in lines:
        f = line.split()
        if len(f) >= 4 and (real == f[1] or real.startswith(f[1].rstrip("/") + "/")) \
                and len(f[1]) >= len(best[0]):
            best = (f[1], f[2], f[3])
    return best[1], best[2]


def _warn_node_local(out: Path, notice: Callable[[str], None]) -> None:
    fstype, opts = mount_of(out)
    if fstype == "lustre" and "localflock" in opts.split(","):
        notice(f"run.output_dir: {out} is on Lustre mounted with -o localflock: the run lock is seen "
               "on this node only, a run on another node would not be refused (mount with -o flock)")
