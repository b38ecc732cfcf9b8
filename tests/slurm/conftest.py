"""The Slurm tier's jobs use MPICH's OFI netmod over libfabric's tcp provider.

The pip `mpich` wheel defaults to UCX, whose start-up puts each node root's address through
PMI-1 in lines that Slurm's pmi2 plugin sometimes cuts in two; every rank then waits in
MPI_Init (docs/slurm.md, 'MPI start-up'). On this 2-core machine under a full test run that
happened at a requeued job's start and at a six-component job's first start. The scripts
guard real jobs with a start-up watchdog (tests/slurm/test_start_watchdog_slurm.py keeps
testing it); these tests are about what runs after start-up, so their jobs (sbatch exports
the submitting environment) take the netmod whose PMI lines are short. libfabric's default
provider hung between the local cluster's nodes; tcp works.
"""
from __future__ import annotations

import subprocess

import pytest


@pytest.fixture(autouse=True)
def _mpich_ofi_tcp(monkeypatch):
    monkeypatch.setenv("MPIR_CVAR_CH4_NETMOD", "ofi")
    monkeypatch.setenv("FI_PROVIDER", "tcp")


@pytest.fixture(autouse=True)
def _job_logs_on_failure(request, tmp_path):
    """A failed test shows the end of its jobs' logs (CI keeps only pytest's output: the
    six-component job that hung in MPI_Init left nothing but "still RUNNING after 900 s"), and a
    job it leaves running is cancelled, so that it does not hold the nodes the next test needs."""
    yield
    jobs = sorted({p.name.split(".")[0] for p in tmp_path.glob("**/logs/*.sbatch")})
    if jobs:
        subprocess.run(["scancel", *jobs], capture_output=True, timeout=30)
    rep = getattr(request.node, "_report_call", None)
    if rep is None or not rep.failed:
        return
    for log in sorted(tmp_path.glob("**/logs/*.out")) + sorted(tmp_path.glob("**/logs/*.err")):
        lines = log.read_text(errors="replace").splitlines()
        print(f"--- {log} (last 40 of {len(lines)} lines)", *lines[-40:], sep="\n")
