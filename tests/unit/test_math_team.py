"""The math_team episode (workflows/math_team.py) on scripted replies: the planner's number
of solvers, a calculator round trip in one solver's own conversation, per-call solver
rewards in call-index order, the verifier's pick as the team answer."""
from __future__ import annotations

from flexmarl_hpc.config.tools import ToolsConfig
from flexmarl_hpc.tools.pool import WorkerPool
from flexmarl_hpc.tools.registry import Tools
from flexmarl_hpc.workflows.episode import EpisodeRunner
from flexmarl_hpc.workflows.math_team import episode, single

STOP = 2


class TextConversation:
    """Ids stand for whole scripted texts (id 1000 + index in `texts`)."""
    texts: list[str] = []
    prefills: list[str] = []
    prefill_len = 0

    def prompt_ids(self, messages, **template_kwargs):
        self.last, self.kwargs = messages, template_kwargs
        self.prefills.append(template_kwargs.get("prefill", ""))
        return [3] * len(messages)

    def record(self, ids):
        return self.texts[ids[0] - 1000]


def reply(call, text):
    TextConversation.texts.append(text)
    call.done([1000 + len(TextConversation.texts) - 1, STOP], frozenset({STOP}))


def run(script, args=None, fn=episode, agents=("planner", "solver", "verifier")):
    """Run one episode, answering each call with script(agent, messages)."""
    cfg = ToolsConfig()
    runner = EpisodeRunner(fn, list(agents), 0, 128,
                           lambda agent: TextConversation(), args,
                           tools=WorkerPool(Tools.from_config(cfg), cfg))
    runner.start(0, 0, 0, {"question": "Tom has 3 apples and gets 4 more. How many?", "answer": 7})
    try:
        while runner.running:
            runner.step()
            calls, done = runner.take()
            for c in calls:
                reply(c, script(c.agent, c.messages))
            if done:
                return done[0]
    finally:
        runner.close()


def test_two_solvers_one_with_the_calculator_and_the_verifier_picks_the_right_answer():
    TextConversation.texts = []
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'
    solvers = iter([call, "Answer: 5"])     # the first solver asks the calculator

    def scripted(agent, messages):
        last = messages[-1]["content"]
        if agent == "planner":
            return "2"
        if agent == "verifier":
            assert "- 7" in last and "- 5" in last          # both marked answers are candidates
            return "7"
        if last.startswith("Now end"):                      # its own conversation, grown
            assert messages[-2] == {"role": "tool", "tool_call_id": "solver-0-0", "name": "calculator",
                                    "content": "7"}
            assert messages[-3] == {"role": "assistant", "content": call}    # the reply as sampled
            return "So Answer: 7"
        return next(solvers)

    f = run(scripted)
    assert not f.error, f.error
    assert f.ctx.calls == {"planner": 1, "solver": 3, "verifier": 1}
    # call 0: first solver's first turn, 1: second solver, 2: first solver's second turn
    assert f.rewards["solver"] == [1.0, 0.1, 1.0]
    assert f.rewards["planner"] == 0.9 and f.rewards["verifier"] == 1.0
    assert f.ctx.metrics == {"team_correct": 1.0, "solvers": 2.0, "tool_calls": 1.0, "tool_errors": 0.0}


def test_a_malformed_tool_call_is_reported_to_the_solver_not_raised():
    TextConversation.texts = []
    seen = []

    def scripted(agent, messages):
        if agent == "solver" and messages[-1]["content"].startswith("Now end"):
            seen.append(messages[-2])
            return "Answer: 7"
        return {"planner": "1", "solver": '<tool_call>{"name": "calculator", "arguments": {"expr', "verifier": "7"}[agent]

    f = run(scripted)
    assert not f.error, f.error
    assert f.ctx.calls["solver"] == 2 and f.rewards["solver"] == [1.0, 1.0]
    assert seen[0]["role"] == "tool" and seen[0]["content"].startswith("error: cannot read the tool call: invalid JSON")
    assert (f.ctx.metrics["tool_calls"], f.ctx.metrics["tool_errors"]) == (0.0, 1.0)


def test_unmarked_answers_earn_nothing_and_the_team_is_wrong():
    TextConversation.texts = []
    f = run(lambda agent, m: {"planner": "one", "solver": "the apples are 7", "verifier": "7"}[agent])
    assert f.ctx.calls == {"planner": 1, "solver": 2, "verifier": 1}     # no digit: two solvers
    assert f.rewards["solver"] == [0.0, 0.0] and f.rewards["verifier"] == 0.0
    assert f.ctx.metrics["team_correct"] == 0.0


def test_the_planners_cost_per_extra_solver_is_an_episode_argument():
    TextConversation.texts = []
    answers = {"planner": "3", "solver": "Answer: 7", "verifier": "7"}
    f = run(lambda agent, m: answers[agent], {"extra_solver_cost": 0.02})
    assert f.ctx.calls["solver"] == 3 and f.rewards["planner"] == 1.0 - 2 * 0.02
    TextConversation.texts = []
    f = run(lambda agent, m: answers[agent])                              # the default: 0.1
    assert abs(f.rewards["planner"] - 0.8) < 1e-12
    for bad, says in (({"extra_solver_costs": 0.1}, "unknown ['extra_solver_costs']"),
                      ({"extra_solver_cost": "0.1"}, "extra_solver_cost: expected a number")):
        TextConversation.texts = []
        f = run(lambda agent, m: answers[agent], bad)
        assert says in f.error


def forced(agent, messages):
    """The solver continues its prefilled call with an expression, then answers."""
    if agent == "solver":
        return "Answer: 7" if messages[-1]["content"].startswith("Now end") else '{"expression": "3 + 4"}}\n</tool_call>'
    return {"planner": "1", "verifier": "7"}[agent]


def test_force_calculator_prefills_each_solver_threads_first_reply_with_a_call():
    TextConversation.texts, TextConversation.prefills = [], []
    f = run(forced, {"force_calculator": True})
    assert not f.error, f.error
    # the planner's and verifier's calls and the solver's second turn are not prefilled
    assert TextConversation.prefills == ["", '<tool_call>\n{"name": "calculator", "arguments": ', "", ""]
    assert f.ctx.metrics["tool_calls"] == 1.0 and f.rewards["solver"] == [1.0, 1.0]
    TextConversation.texts, TextConversation.prefills = [], []
    f = run(forced, {"force_calculator": "yes"})
    assert "force_calculator: expected true or false" in f.error


def test_a_single_solver_episode_is_scored_as_a_team_of_one():
    TextConversation.texts, TextConversation.prefills = [], []
    f = run(forced, {"force_calculator": True}, fn=single, agents=("solver",))
    assert not f.error, f.error
    assert f.ctx.calls == {"solver": 2} and f.rewards == {"solver": [1.0, 1.0]}
    assert f.ctx.metrics == {"team_correct": 1.0, "solvers": 1.0, "tool_calls": 1.0, "tool_errors": 0.0}
