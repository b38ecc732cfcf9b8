"""mpiexec -n 2: a workflow.agent program on a tool rank (tools.ranks > 0) reaches its
episode's OpenAI endpoint through the rank's relay (flexmarl_hpc/ranks/tool_ranks.py Relay).

Rank 0 runs the episode (EpisodeRunner over a RemotePool of rank 1) with the tiny chat
model's tokenizer, answering each call from a script; rank 1 is a tool rank. The program is
the unit tests' tool loop (tests/integration/test_openai_endpoint.py tool_program: a completion
with `tools`, its call run by POST /run_tools, the follow-up, an edited call, tool_choice
none, a refused field). Rank 0's own loopback listener is closed before the episode starts,
so every request the program made came over MPI through the relay; its /run_tools call
went back to the tool rank (lent: the program holds the rank's one worker); the follow-up
continues the sampled ids. Then the orchestrator's Stop ends the tool rank.

Like mpi_tools.py, nothing at module level imports mpi4py (the forkserver imports this
script as __mp_main__)."""
import sys
import tempfile
import time
from pathlib import Path

from flexmarl_hpc.config.tools import ToolsConfig

TOOL_FN = {"calculate": "flexmarl_hpc.workflows.calculate_tool:calculate"}
cfg = ToolsConfig(workers=1, functions=TOOL_FN)


def orchestrator(world) -> None:
    from flexmarl_hpc.config.schema import WorkflowConfig
    from flexmarl_hpc.config.tools import read_function
    from flexmarl_hpc.ranks.tool_ranks import RemotePool
    from flexmarl_hpc.runtime import messages
    from flexmarl_hpc.runtime.transport import MpiTransport
    from flexmarl_hpc.workflows.chat import ChatTokenizer, Conversation
    from flexmarl_hpc.workflows.episode import EpisodeRunner
    from flexmarl_hpc.workflows.openai_agent import agent_episode, server_of
    sys.path.insert(0, "scripts")
    from make_tiny_chat_model import write_tokenizer
    from tests.helpers import answer_until_done, scripted_tool_use

    folder = Path(tempfile.mkdtemp())
    write_tokenizer(folder, 400)
    tok = ChatTokenizer(folder)
    w = WorkflowConfig(agent="tests.integration.test_openai_endpoint:tool_program", agents=["solver"], agent_timeout_s=60)
    pool = RemotePool(world, [1], cfg, grace_s=5.0)
    recorded = []
    runner = EpisodeRunner(agent_episode(w), ["solver"], 0, 96, lambda a: Conversation(tok), {}, tools=pool,
                           user_tools={k: read_function(k, v) for k, v in TOOL_FN.items()},
                           record_tool=lambda ctx, name, outcome, s: recorded.append((name, outcome)))
    server_of(runner).close()                   # rank 0's loopback: nothing may come that way
    relayed, answer_here = [], pool.endpoint

    def counting(method, token, tail, body):
        relayed.append(tail)
        return answer_here(method, token, tail, body)

    pool.endpoint = counting
    runner.start(0, 0, 0, {"question": "What is 12 * 30?"})
    calls, t0 = [], time.time()
    done = answer_until_done(runner, tok, scripted_tool_use, calls, 120)
    took = time.time() - t0
    assert done, "the episode did not end"
    f = done[0]
    assert f.failure is None, f.failure.traceback
    assert relayed.count("v1/chat/completions") == 5 and relayed.count("v1/run_tools") == 1, relayed
    assert ("calculate", "ok") in recorded and ("run_program", "ok") in recorded, recorded
    assert pool.served == {1: 2}, pool.served             # the program, and its tool call (lent)
    first, follow = calls[0], calls[1]
    assert follow.thread is first.thread and follow.prompt[:len(first.prompt) + len(first.response)] == \
        first.prompt + first.response
    runner.pool = None
    runner.close()
    t = MpiTransport(world)
    t.send(1, messages.Stop(0))
    src, m = t.receive(timeout=30)
    assert isinstance(m, messages.Stopped), m
    t.close()
    print(f"ok: the program on tool rank 1 made {len(relayed)} requests through its relay "
          f"({sorted(set(relayed))}), {len(calls)} calls, its tool call {recorded}; episode {took:.1f} s; stopped",
          flush=True)


if __name__ == "__main__":
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.Get_rank() == 0:
        orchestrator(world)
    else:
        from flexmarl_hpc.ranks.tool_ranks import tools_loop
        from flexmarl_hpc.tools.pool import WorkerPool
        from flexmarl_hpc.tools.registry import Tools
        sys.exit(tools_loop(world, 0, WorkerPool(Tools.from_config(cfg), cfg)))
