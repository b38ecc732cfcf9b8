"""The sandbox refuses what model-written code must not do, with a recorded outcome, and the
caller goes on: a fork bomb, a 10 GB allocation, an infinite loop, writing outside its
directory, reading the run's environment, opening a socket.

    pytest tests/integration/test_tools_sandbox.py

Tests that need a namespace (network, mount, pid: root, or for the network an unprivileged
user namespace) skip with the reason outside CI and fail under CI=true, which runs as root.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from flexmarl_hpc.config.tools import ToolsConfig
from flexmarl_hpc.tools.sandbox import run_code_sync
from tests.conftest import need

CFG = ToolsConfig(cpu_s=2, wall_s=20, memory_mb=256, nproc=16)
# The tests that count what is left run as a uid of this test process alone: every sandbox of
# one uid shares its processes (and RLIMIT_NPROC), so a second pytest on the machine (seen:
# three unit tiers at once) left its live tools under 65534 to be found, and killed, by reap.
OWN_UID = 59000 + os.getpid() % 1000


@pytest.fixture(scope="module")
def isolation() -> dict:
    r = run_code_sync("print('up')", CFG)
    assert (r.outcome, r.stdout) == ("ok", "up\n"), r
    return r.isolation


def need_root(isolation: dict, *keys: str) -> None:
    need(os.geteuid() == 0, "root (the sandbox drops to another uid only as root)")
    missing = [k for k in keys if not isolation.get(k) or isolation.get(k) == "host"]
    need(not missing, f"sandbox isolation {missing} (namespaces as root)")


def sandbox_processes(uid: int) -> list[int]:
    """Pids of processes owned by `uid` now, on the host."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            status = (d / "status").read_text() if d.name.isdigit() else ""
            if f"Uid:\t{uid}\t" in status and "State:\tZ" not in status:     # zombies are dead
                found.append(int(d.name))
        except OSError:
            pass
    return found


def reap(uid: int) -> list[int]:
    """Stop, then kill, every process of `uid` (a test's own sandbox uid, which nothing else
    runs as): a regression must not leave a fork bomb behind. Returns what it found."""
    found: set[int] = set()
    for _ in range(200):
        pids = sandbox_processes(uid)
        if not pids:
            break
        found.update(pids)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        time.sleep(0.05)
    return sorted(found)


def test_the_limits_and_the_uid_are_in_force_in_the_child(isolation):
    need_root(isolation, "pid")
    code = ("import os, resource as r\n"
            "print(os.getuid(), os.getgid(), os.getgroups(), os.getcwd())\n"
            "for n in ('RLIMIT_CPU', 'RLIMIT_AS', 'RLIMIT_FSIZE', 'RLIMIT_NPROC'):\n"
            "    print(n, *r.getrlimit(getattr(r, n)))\n")
    r = run_code_sync(code, CFG)
    assert r.outcome == "ok", r
    assert r.stdout.splitlines() == [f"{CFG.uid} {CFG.uid} [] /tmp/work", "RLIMIT_CPU 2 3",
                                     f"RLIMIT_AS {256 << 20} {256 << 20}", f"RLIMIT_FSIZE {16 << 20} {16 << 20}",
                                     "RLIMIT_NPROC 16 16"]
    assert resource.getrlimit(resource.RLIMIT_CPU)[0] == resource.RLIM_INFINITY   # not the caller's


def test_a_fork_bomb_is_contained_and_leaves_no_process(isolation):
    need_root(isolation, "pid")
    # each child also leaves the process group, as if to escape a kill of the group
    bomb = ("import os\nwhile True:\n    try:\n        os.fork() or os.setsid()\n"
            "    except OSError:\n        pass\n")
    r = run_code_sync(bomb, ToolsConfig(cpu_s=1, wall_s=6, nproc=16, uid=OWN_UID))
    assert r.outcome in ("killed_cpu", "timeout"), r
    assert reap(OWN_UID) == []
    assert run_code_sync("print(2)", CFG).stdout == "2\n"               # the caller goes on


def test_a_10_gb_allocation_fails_as_memory():
    r = run_code_sync("x = bytearray(10 * 2**30)\nprint('allocated')", CFG)
    assert (r.outcome, r.exit_code, r.stdout) == ("memory", 1, ""), r
    assert r.stderr.rstrip().endswith("MemoryError")


def test_an_infinite_loop_is_killed_at_its_cpu_limit():
    r = run_code_sync("while True:\n    pass\n", ToolsConfig(cpu_s=1, wall_s=60))
    assert r.outcome == "killed_cpu", r
    assert r.cpu_s > 0.5 and r.signal in (signal.SIGXCPU, signal.SIGKILL)   # rusage counts in ticks


def test_a_sleeping_loop_is_killed_at_the_wall_clock_limit():
    r = run_code_sync("import time\nwhile True:\n    time.sleep(1)\n", ToolsConfig(cpu_s=5, wall_s=1.5, uid=OWN_UID))
    assert (r.outcome, r.exit_code) == ("timeout", None), r
    assert r.wall_s >= 1.5 and reap(OWN_UID) == []                  # killed, not abandoned


def test_writing_outside_its_directory_is_refused(isolation, tmp_path):
    need_root(isolation, "private_tmp")
    shared = Path(tempfile.mkdtemp(prefix="flexmarl-shared-", dir="/tmp"))   # world-writable, on the host
    shared.chmod(0o1777)
    targets = [shared / "escape", tmp_path / "escape", Path.cwd() / "escape-from-sandbox", Path("/etc/escape")]
    code = ("import sys\nopen('inside.txt', 'w').write('fine')\nprint('inside', open('inside.txt').read())\n"
            f"for t in {[str(t) for t in targets]!r}:\n"
            "    try:\n        open(t, 'w').write('x')\n        print('WROTE', t)\n"
            "    except OSError as e:\n        print('refused', type(e).__name__)\n")
    try:
        r = run_code_sync(code, CFG)
        assert r.outcome == "ok", r
        assert r.stdout.splitlines()[0] == "inside fine" and "WROTE" not in r.stdout, r.stdout
        assert [t for t in targets if t.exists()] == []
    finally:
        for t in targets:
            t.unlink(missing_ok=True)
        shared.rmdir()


def test_the_runs_environment_cannot_be_read(isolation, monkeypatch):
    need_root(isolation, "pid")
    secret = "s3cret-" + os.urandom(8).hex()
    monkeypatch.setenv("FLEXMARL_TEST_SECRET", secret)
    code = (f"import os\nprint(dict(os.environ))\n"
            f"for pid in ({os.getpid()}, {os.getppid()}, 1, 'self'):\n"
            "    try:\n        print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
            "    except OSError as e:\n        print(pid, 'refused', type(e).__name__)\n")
    r = run_code_sync(code, CFG)
    assert r.outcome == "ok", r
    assert secret not in r.stdout + r.stderr and "FLEXMARL_TEST_SECRET" not in r.stdout
    assert f"{os.getpid()} refused" in r.stdout


def test_opening_a_socket_to_a_local_listener_fails(isolation):
    need(isolation.get("network", "host") != "host", "a network namespace (root or user namespaces)")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = ("import socket\ns = socket.socket()\ns.settimeout(3)\n"
                f"try:\n    s.connect(('127.0.0.1', {port}))\n    print('connected')\n"
                "except OSError as e:\n    print('refused', e)\n")
        r = run_code_sync(code, CFG)
        server.settimeout(0.5)
        with pytest.raises(TimeoutError):
            server.accept()
    assert r.outcome == "ok" and r.stdout.startswith("refused"), r


def test_a_crash_and_long_output_give_defined_results():
    r = run_code_sync("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", CFG)
    assert (r.outcome, r.signal, r.exit_code) == ("crashed", signal.SIGSEGV, None), r
    r = run_code_sync("print('x' * 100000)\nraise SystemExit(3)", ToolsConfig(output_bytes=100))
    assert (r.outcome, r.exit_code, r.stdout, r.truncated) == ("error", 3, "x" * 100, True)


def test_an_interpreter_the_sandbox_uid_cannot_run_is_a_launch_failure(isolation, tmp_path):
    need_root(isolation)
    private = tmp_path / "private"                       # 0700 root, like a venv under /root
    private.mkdir(mode=0o700)
    (private / "python").symlink_to(os.path.realpath("/usr/bin/python3"))
    r = run_code_sync("print(1)", ToolsConfig(python=str(private / "python")))
    assert (r.outcome, r.exit_code, r.stdout) == ("launch_failed", 125, ""), r
    # PermissionError, or FileNotFoundError where the private /tmp hides tmp_path
    assert r.stderr.startswith("sandbox launcher: ") and "Error" in r.stderr, r.stderr


NOT_ROOT = """
import json, sys
sys.path.insert(0, {root!r})
from flexmarl_hpc.config.tools import ToolsConfig
from flexmarl_hpc.tools.sandbox import run_code_sync
code = ("import os, socket\\nprint(os.getuid())\\ntry:\\n    socket.create_connection(('127.0.0.1', 9), 2)\\n"
        "except OSError as e:\\n    print('refused', e.errno)")
r = run_code_sync(code, ToolsConfig(cpu_s=2, wall_s=20))
print(json.dumps([r.outcome, r.stdout, r.isolation]))
"""


def test_without_root_the_result_says_which_isolation_was_in_force(isolation):
    """The caller as uid 1000 (stdlib-only /usr/bin/python3, as the package imports no more):
    no uid drop, no mount or pid namespace; a network namespace only through a user
    namespace, and then the loopback of the host is out of reach."""
    need_root(isolation)
    from flexmarl_hpc.config.tools import others_can_run
    from tests.conftest import ROOT
    if not (others_can_run("/usr/bin/python3") and others_can_run(str(ROOT / "flexmarl_hpc" / "tools"))):
        pytest.skip("the checkout or /usr/bin/python3 is not reachable by uid 1000")
    p = subprocess.run(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "/usr/bin/python3", "-I",
                        "-c", NOT_ROOT.format(root=str(ROOT))], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin"}, cwd="/")
    assert p.returncode == 0, p.stderr
    outcome, stdout, iso = json.loads(p.stdout.splitlines()[-1])
    # in a user namespace without a uid map the code sees itself as the overflow uid 65534
    assert outcome == "ok" and stdout.splitlines()[0] in ("1000", "65534"), stdout
    assert (iso["uid"], iso["mount"], iso["pid"], iso["private_tmp"]) == (1000, False, False, False)
    assert iso["network"] in ("userns+netns", "host")
    if iso["network"] == "userns+netns":
        assert stdout.splitlines()[1].startswith("refused"), stdout


# Escape classes of issue 40: the filesystem beyond /tmp, host Unix sockets, host files, and
# the total disk the code may fill. Each was seen to escape the sandbox before the minimal root.

def test_writes_to_world_writable_host_directories_do_not_persist(isolation):
    need_root(isolation, "mount")
    tag = os.urandom(6).hex()
    targets = [Path(d) / f"flexmarl-escape-{tag}" for d in ("/run/lock", "/var/tmp", "/dev/shm", "/tmp")
               if os.path.isdir(d)]
    code = ("import os\n"
            f"for t in {[str(t) for t in targets]!r}:\n"
            "    try:\n        os.makedirs(os.path.dirname(t), exist_ok=True)\n"
            "        open(t, 'w').write('x')\n        print('wrote', t)\n"
            "    except OSError as e:\n        print('refused', t, type(e).__name__)\n")
    try:
        r = run_code_sync(code, CFG)
        assert r.outcome == "ok", r
        assert [t for t in targets if t.exists()] == [], r.stdout
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


def test_a_unix_socket_of_the_host_is_unreachable(isolation):
    need_root(isolation, "mount")
    path = Path("/run/lock") / f"flexmarl-{os.urandom(6).hex()}.sock"        # world-writable, not /tmp
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        path.chmod(0o777)
        server.listen()
        code = ("import socket\ns = socket.socket(socket.AF_UNIX)\n"
                f"try:\n    s.connect({str(path)!r})\n    print('connected')\n"
                "except OSError as e:\n    print('refused', type(e).__name__)\n")
        try:
            r = run_code_sync(code, CFG)
            server.settimeout(0.5)
            with pytest.raises(TimeoutError):
                server.accept()
        finally:
            path.unlink(missing_ok=True)
    assert r.outcome == "ok" and r.stdout.startswith("refused"), r


def test_a_host_file_given_by_path_cannot_be_read(isolation):
    """A world-readable file of the checkout (a dataset's answer file), the home folders and
    the host's /etc are not in the sandbox's root."""
    need_root(isolation, "mount")
    answers = Path.cwd() / f".flexmarl-answers-{os.urandom(6).hex()}.jsonl"
    answers.write_text('{"answer": 42}\n')
    answers.chmod(0o644)
    code = ("import os\n"
            f"for p in ({str(answers)!r}, '/etc/passwd', '/home', '/var/log', '/run'):\n"
            "    try:\n        print('READ', p, open(p).read()[:20] if os.path.isfile(p) else os.listdir(p))\n"
            "    except OSError as e:\n        print('refused', p, type(e).__name__)\n")
    try:
        r = run_code_sync(code, CFG)
    finally:
        answers.unlink()
    assert r.outcome == "ok" and "READ" not in r.stdout, r.stdout


def test_disk_use_past_file_mb_in_total_fails(isolation):
    """file_mb caps each file and, with the minimal root, everything the code writes: many
    files below the per-file limit, in every writable place, add up to at most file_mb."""
    need_root(isolation, "mount")
    cfg = ToolsConfig(cpu_s=5, wall_s=20, memory_mb=256, nproc=16, file_mb=4)
    code = ("import os\ntotal = 0\nchunk = b'x' * (1 << 20)\n"
            "for i in range(6):\n    for k, d in enumerate(('.', '/tmp', '/dev/shm', '/var/tmp')):\n"
            "        try:\n            with open(os.path.join(d, f'f{i}_{k}'), 'wb') as f:\n"
            "                f.write(chunk)\n            total += len(chunk)\n"
            "        except OSError as e:\n            pass\n"
            "print(total >> 20)\n")
    r = run_code_sync(code, cfg)
    assert r.outcome == "ok", r
    assert int(r.stdout.split()[-1]) <= cfg.file_mb, r.stdout
