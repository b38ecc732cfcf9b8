"""The login-node side stays light: the config, the Slurm scripts and `submit` import no torch
and no mpi4py, so `submit --dry-run` and `simulate` start in a second on a login node; the
orchestrator's loop imports neither, and a simulation never initialises MPI. And what
vLLM's TP workers import for our worker extension loads no MPI (they are processes spawned by
an MPI rank, where initialising MPI aborts them: tests/mpi/test_vllm_workers_mpi.py).
Each check imports in a fresh python and lists what got loaded (tests/helpers.py
heavy_modules_after).

    pytest tests/integration/test_import_probes.py
"""
from __future__ import annotations

import ast
import pickle

from tests.conftest import ROOT
from tests.helpers import heavy_modules_after

LOCAL = str(ROOT / "configs" / "local.yaml")
LIGHT = ["flexmarl_hpc.config.schema", "flexmarl_hpc.config.load", "flexmarl_hpc.config.validate",
         "flexmarl_hpc.config.validate_slurm", "flexmarl_hpc.config.resources",
         "flexmarl_hpc.config.layout", "flexmarl_hpc.launch.sbatch", "flexmarl_hpc.launch.preflight",
         "flexmarl_hpc.submit"]


def test_config_and_submit_import_no_torch_or_mpi():
    assert heavy_modules_after("\n".join(f"import {m}" for m in LIGHT)) == []


def test_submit_dry_run_imports_no_torch_or_mpi():
    code = ("import contextlib, io\nfrom flexmarl_hpc.submit import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            f"    assert main([{LOCAL!r}, '--dry-run', '--no-partition-check']) == 0\n"
            f"    assert main([{LOCAL!r}, '--dry-run', '--no-partition-check', '--single']) == 0")
    assert heavy_modules_after(code) == []


def test_the_orchestrator_imports_no_torch_or_mpi():
    """Importing mpi4py.MPI initialises MPI: the orchestrator's loop is imported by simulate and
    unit tests, which give it other transports (the MPI one is imported by run.py)."""
    assert heavy_modules_after("import flexmarl_hpc.orchestrator.loop") == []


def test_a_simulation_starts_no_mpi(tmp_path):
    """The real orchestrator on the simulated clock (torch may load to pack micro-batches)."""
    code = ("import contextlib, io\nfrom flexmarl_hpc.simulate import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            f"    assert main(['compare', {LOCAL!r}, 'workflow.inputs_per_step=2', 'run.steps=3', "
            f"'--variants', 'flex', '--out', {str(tmp_path)!r}]) == 0")
    assert heavy_modules_after(code, ("mpi4py",)) == []


def test_the_probe_sees_torch():
    """The check can fail: a module that imports torch is reported."""
    assert heavy_modules_after("import torch") == ["torch"]


def worker_imports() -> list[str]:
    """The imports of our modules in SyncWorker's methods, as written: what a vLLM TP worker
    process runs when the replica calls flexmarl_join / flexmarl_recv / flexmarl_leave."""
    tree = ast.parse((ROOT / "flexmarl_hpc" / "rollout" / "vllm_engine.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SyncWorker")
    return [ast.unparse(n) for n in ast.walk(cls) if isinstance(n, ast.ImportFrom) and n.module.startswith("flexmarl_hpc")]


def test_what_a_vllm_worker_imports_loads_no_mpi():
    import torch
    from flexmarl_hpc.runtime.weight_sync import plan_buckets
    imports = worker_imports()
    assert any("sync_channels" in i for i in imports) and any("weight_sync" in i for i in imports), imports
    # flexmarl_recv's arguments as collective_rpc pickles them: unpickling imports their classes
    piece = plan_buckets([("w", (4, 8), torch.float32)], 64)[0]
    header = pickle.dumps(("wsync_0_0/", piece, 1.0, (0, 1, 2)))
    code = "\n".join(["import pickle", "import flexmarl_hpc.rollout.vllm_engine", *imports,
                      f"pickle.loads({header!r})"])
    assert heavy_modules_after(code, ("mpi4py", "mpi4py.MPI")) == []
