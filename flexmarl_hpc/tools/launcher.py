"""The sandbox's launcher: sets up isolation, then runs the model's code as an unprivileged
child. Standard library only, because it is started as a script with `python -I -S`:

    python -I -S flexmarl_hpc/tools/launcher.py '<spec json>'

(`tools/sandbox.py` writes the spec and starts it; nobody else should). Spec keys: python,
script, workdir, report (a file path), env, uid, gid, limits {cpu_s, memory_bytes,
file_bytes, nproc}, parent (the caller's pid).

Process tree, where the OS allows each step (what was in force is written to the report):

    launcher (root, new net + mount + pid namespaces; the parent kills its process group;
              SIGKILL when the parent dies: a SIGKILLed rank kills nothing itself)
      init   (pid 1 of the new pid namespace: builds a minimal root and pivots into it)
        code (rlimits, uid/gid dropped, no new privileges, SIGKILL when init dies)

Killing the launcher kills init (parent-death signal), and the kernel kills every process of
a pid namespace when its init dies, so code that calls setsid() cannot outlive the call.
The code is not pid 1 because pid 1 ignores signals it has no handler for (a SIGSEGV it
sends itself, SIGXCPU), which would change what a crash looks like.

The minimal root (as root, `minimal_root`): a small tmpfs, read-only after set-up, holding
read-only binds of the system's /usr, /bin, /sbin and /lib* (or their symlinks), the
interpreter's own tree when it lives elsewhere, /etc/ld.so.cache and /etc/localtime only,
/dev/null, zero, full, random and urandom, a new /proc, and one writable tmpfs of
`file_bytes` at /tmp (the code in /tmp/work; /dev/shm and /var/tmp are links to it), so the
code's disk use in total is capped. Nothing else of the host is there: no /run, /var, /home,
checkout, run folder or dataset, and no host Unix socket (abstract ones are the network
namespace's). Where it cannot be built, the earlier private /tmp, /dev/shm and /var/tmp over
the host's root are used (the report says `private_root: false`).
"""
from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}.get(platform.machine())
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib64", "lib32", "libx32")
ETC_FILES = ("ld.so.cache", "localtime")
DEV_FILES = ("null", "zero", "full", "random", "urandom")
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


def _must_mount(source: str, target: str, fstype: str, flags: int, data: str = "") -> None:
    if not _mount(source, target, fstype, flags, data):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _bind_ro(source: str, target: str) -> None:
    _must_mount(source, target, "", MS_BIND | MS_REC)
    _must_mount("none", target, "", MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID)


def _mkdirs_like_host(new: str, path: str) -> None:
    """`path` under the new root, each directory with the host's owner and mode (a 0700
    /root stays closed to the sandbox uid)."""
    cur = ""
    for part in path.strip("/").split("/"):
        cur += "/" + part
        if not os.path.isdir(new + cur):
            st = os.stat(cur)
            os.mkdir(new + cur)
            os.chown(new + cur, st.st_uid, st.st_gid)
            os.chmod(new + cur, st.st_mode & 0o7777)


def _interpreter_trees(python: str) -> list[str]:
    """The install prefixes of the interpreter (as given and resolved) outside the system dirs."""
    out = []
    for exe in (python, os.path.realpath(python)):
        prefix = os.path.dirname(os.path.dirname(os.path.abspath(exe)))
        top = prefix.strip("/").split("/")[0]
        if prefix != "/" and top not in SYSTEM_DIRS and os.path.isdir(prefix) and prefix not in out:
            out.append(prefix)
    return out


def _populate(new: str, spec: dict) -> None:
    """The read-only part of the minimal root under `new`."""
    for d in SYSTEM_DIRS:
        host = "/" + d
        if os.path.islink(host):
            os.symlink(os.readlink(host), new + host)
        elif os.path.isdir(host):
            os.mkdir(new + host)
            _bind_ro(host, new + host)
    for tree in _interpreter_trees(spec["python"]):
        _mkdirs_like_host(new, tree)
        _bind_ro(tree, new + tree)
    os.makedirs(new + "/etc", exist_ok=True)
    os.mkdir(new + "/dev")
    for d, names, ro in (("/etc/", ETC_FILES, True), ("/dev/", DEV_FILES, False)):
        for name in names:
            if os.path.exists(d + name):
                open(new + d + name, "w").close()          # a file to bind onto
                _bind_ro(d + name, new + d + name) if ro else _must_mount(d + name, new + d + name, "", MS_BIND)


def _pivot(new: str) -> None:
    """Make `new` the root and drop the host's (chroot where pivot_root is not known)."""
    if SYS_PIVOT_ROOT is None:
        os.chroot(new)
        os.chdir("/")
        return
    os.mkdir(new + "/.old")
    if libc.syscall(SYS_PIVOT_ROOT, new.encode(), (new + "/.old").encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root: {os.strerror(err)}")
    os.chdir("/")
    if libc.umount2(b"/.old", MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "umount the host's root")
    os.rmdir("/.old")


def minimal_root(spec: dict, iso: dict) -> None:
    """Pivot into the minimal root (module docstring); the code's directory is /tmp/work."""
    code = open(spec["script"], "rb").read()
    new = os.path.join(os.path.dirname(os.path.abspath(spec["workdir"])), "root")
    os.mkdir(new, 0o755)
    _must_mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    _populate(new, spec)
    # the one writable place, capped: every file the code writes counts against file_bytes
    os.mkdir(new + "/tmp")
    _must_mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
                f"size={int(spec['limits']['file_bytes'])},mode=1777")
    os.symlink("/tmp", new + "/dev/shm")
    os.mkdir(new + "/var")
    os.symlink("/tmp", new + "/var/tmp")
    os.mkdir(new + "/tmp/work", 0o700)
    with open(new + "/tmp/work/" + spec["script"], "wb") as f:
        f.write(code)
    for p in (new + "/tmp/work", new + "/tmp/work/" + spec["script"]):
        os.chown(p, spec["uid"], spec["gid"])
    os.mkdir(new + "/proc")
    _pivot(new)
    iso["private_proc"] = bool(iso["pid"]) and _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _must_mount("none", "/", "", MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir("/tmp/work")
    iso["private_root"] = iso["private_tmp"] = True


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
    iso.update(uid=uid, private_tmp=False, private_proc=False, private_root=False)
    if iso["pid"]:
        init = os.fork()                            # the first child is pid 1 of the namespace
        if init:
            _, status = os.waitpid(init, 0)
            return os.waitstatus_to_exitcode(status) & 0xFF
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if iso["mount"] and root:
        _mount("none", "/", "", MS_REC | MS_PRIVATE)       # nothing propagates back to the host
        try:
            minimal_root(spec, iso)
        except OSError as e:                                # set up under a fresh mount only
            os.write(2, f"sandbox launcher: no minimal root ({e}); private /tmp only\n".encode())
            private_mounts(iso)
    elif iso["mount"]:
        private_mounts(iso)
    return supervise(spec, iso, report, root)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
