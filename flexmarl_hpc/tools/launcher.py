"""The sandbox's launcher: sets up isolation, then runs the model's code as an unprivileged
child. Standard library only, because it is started as a script with `python -I -S`:

    python -I -S flexmarl_hpc/tools/launcher.py '<spec json>'

(`tools/sandbox.py` writes the spec and starts it; nobody else should). Spec keys: python,
script, workdir, report (a file path), env, uid, gid, limits {cpu_s, memory_bytes,
file_bytes, nproc}, parent (the caller's pid).

Process tree, where the OS allows each step (what was in force is written to the report):

    launcher (root, new net + mount + pid namespaces; the parent kills its process group;
              SIGKILL when the parent dies: a SIGKILLed rank kills nothing itself)
      init   (pid 1 of the new pid namespace: private /tmp, /dev/shm, /var/tmp, a new /proc)
        code (rlimits, uid/gid dropped, no new privileges, SIGKILL when init dies)

Killing the launcher kills init (parent-death signal), and the kernel kills every process of
a pid namespace when its init dies, so code that calls setsid() cannot outlive the call.
The code is not pid 1 because pid 1 ignores signals it has no handler for (a SIGSEGV it
sends itself, SIGXCPU), which would change what a crash looks like.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
LAUNCH_FAILED = 125                     # the exit code of a launcher that could not start the code
libc = ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> bool:
    return libc.unshare(flags) == 0


def _mount(source: str, target: str, fstype: str, flags: int, data: str = "") -> bool:
    return libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                      flags, data.encode() if data else None) == 0


def namespaces(root: bool) -> dict:
    """Enter new namespaces, as many as allowed; returns what is in force. As root: net, mount
    and pid. Otherwise a user namespace (when the kernel lets unprivileged users make one)
    gives a private network too; nothing else is attempted there."""
    if root:
        if _unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID):
            return {"network": "netns", "mount": True, "pid": True}
        return {"network": "netns" if _unshare(CLONE_NEWNET) else "host",
                "mount": _unshare(CLONE_NEWNS), "pid": False}
    return {"network": "userns+netns" if _unshare(CLONE_NEWUSER | CLONE_NEWNET) else "host",
            "mount": False, "pid": False}


def private_mounts(iso: dict) -> None:
    """In the new mount namespace: nothing propagates back to the host, the shared scratch
    directories are empty tmpfs (the working directory appears as /tmp/work), and /proc
    shows only this pid namespace (no other process's environ or cmdline)."""
    if not _mount("none", "/", "", MS_REC | MS_PRIVATE):
        iso["mount"] = False
        return
    flags = MS_NOSUID | MS_NODEV
    tmp = _mount("tmpfs", "/tmp", "tmpfs", flags, "size=64m,mode=1777")
    others = [_mount("tmpfs", d, "tmpfs", flags, "size=64m,mode=1777")
              for d in ("/dev/shm", "/var/tmp") if os.path.isdir(d)]
    iso["private_tmp"] = tmp and all(others)
    if tmp:
        # the working directory, hidden under the new /tmp, is bound back in as /tmp/work (the
        # source "." is still the old directory); Python resolves its script's path by name
        os.mkdir("/tmp/work")
        if _mount(".", "/tmp/work", "", MS_BIND):
            os.chdir("/tmp/work")
    iso["private_proc"] = bool(iso["pid"]) and _mount("proc", "/proc", "proc", flags | MS_NOEXEC)


def limit(spec: dict) -> None:
    lim = spec["limits"]
    cpu = int(lim["cpu_s"])
    # soft: SIGXCPU; hard a second later: SIGKILL, for code that ignores SIGXCPU
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (lim["memory_bytes"], lim["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_bytes"], lim["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (lim["nproc"], lim["nproc"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_code(spec: dict, root: bool) -> None:
    """The code's process: limits, then (as root) the sandbox uid/gid, then exec. Never returns."""
    try:
        limit(spec)
        if root:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)     # after setuid, which clears it
        py = spec["python"]
        os.execve(py, [py, "-I", "-S", spec["script"]], spec["env"])
    except BaseException as e:                                       # noqa: BLE001 - report, exit
        os.write(2, f"sandbox launcher: {type(e).__name__}: {e}\n".encode())
    os._exit(LAUNCH_FAILED)


def supervise(spec: dict, iso: dict, report, root: bool) -> int:
    """Fork the code's process, wait for it, report. The report is two JSON lines: what
    isolation is in force (written first, so a call killed at its wall-clock limit still
    says), then the code's wait status and CPU seconds."""
    report.write(json.dumps(iso) + "\n")
    report.flush()
    child = os.fork()
    if child == 0:
        run_code(spec, root)
    _, status, usage = os.wait4(child, 0)
    report.write(json.dumps({"status": status, "cpu_s": usage.ru_utime + usage.ru_stime}) + "\n")
    report.close()
    return 0


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != spec.get("parent", os.getppid()):
        return LAUNCH_FAILED                        # the caller died before the prctl
    report = open(spec["report"], "w")              # opened before /tmp is hidden
    os.chdir(spec["workdir"])                       # likewise: the cwd survives the tmpfs mount
    root = os.geteuid() == 0
    uid = spec["uid"] if root else os.geteuid()     # before a user namespace shows it as 65534
    iso = namespaces(root)
    iso.update(uid=uid, private_tmp=False, private_proc=False)
    if iso["pid"]:
        init = os.fork()                            # the first child is pid 1 of the namespace
        if init:
            _, status = os.waitpid(init, 0)
            return os.waitstatus_to_exitcode(status) & 0xFF
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if iso["mount"]:
        private_mounts(iso)
    return supervise(spec, iso, report, root)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
