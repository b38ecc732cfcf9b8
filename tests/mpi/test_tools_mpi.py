"""Tool calls and reward functions on tool ranks of their own (flexmarl_hpc/ranks/tool_ranks.py),
on real MPI ranks: each failure of a call is its defined outcome, and a stalled tool rank
costs its calls a `timeout`, never a hung episode.

    .venv/bin/python -m pytest tests/mpi/test_tools_mpi.py
"""
from tests.conftest import run_mpi


def test_tool_calls_on_two_tool_ranks_get_their_defined_outcomes(mpiexec):
    p = run_mpi(mpiexec, 3, ["tests/mpi/mpi_tools.py"], timeout=240)
    assert ("calls, answers per tool rank" in p.stdout and "['ok', 'ok', 'refused'" in p.stdout
            and "'ok', 'error', 'crashed', 'timeout', 'error', 'ok'" in p.stdout and "stopped" in p.stdout), \
        p.stdout + p.stderr


def test_a_stalled_tool_rank_gives_its_call_a_timeout(mpiexec, tmp_path):
    out = tmp_path / "verdict.txt"
    p = run_mpi(mpiexec, 2, ["tests/mpi/mpi_tools.py", "stall", str(out)], timeout=120, check=False,
                env={"FLEXMARL_FAULT": "tool_call:1:1:stall"})
    verdict = out.read_text() if out.exists() else ""
    assert "ok: a stalled tool rank's call ended as timeout" in verdict, p.stdout + p.stderr


def test_an_openai_program_on_a_tool_rank_reaches_its_endpoint_through_the_relay(mpiexec):
    """tools.ranks > 0 with workflow.agent: rank 0's loopback listener is closed, so every
    request of the program (completions, /run_tools) must come over MPI via rank 1's relay."""
    p = run_mpi(mpiexec, 2, ["tests/mpi/mpi_openai_relay.py"], timeout=120)
    assert "ok: the program on tool rank 1 made 6 requests through its relay" in p.stdout and "stopped" in p.stdout, \
        p.stdout + p.stderr
