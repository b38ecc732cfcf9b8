"""orchestrator/checkpoint_timer.py: an agent's checkpoint is due every run.checkpoint_every
steps or run.checkpoint_minutes after its last, never for the last step (the run's end
checkpoints it), and each agent's clock restarts alone.

    pytest tests/unit/test_checkpoint_timer.py
"""
from __future__ import annotations

from flexmarl_hpc.config.schema import RunConfig
from flexmarl_hpc.orchestrator.checkpoint_timer import CheckpointTimer


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def time(self) -> float:
        return self.t


def test_every_n_steps_and_never_the_last():
    timer = CheckpointTimer(RunConfig(steps=6, checkpoint_every=2, checkpoint_minutes=0), ["a", "b"], Clock().time)
    assert timer.due([("a", 1), ("b", 1)]) == []
    assert timer.due([("a", 2), ("b", 3)]) == ["a"]
    assert timer.due([("a", 4), ("b", 4)]) == ["a", "b"]
    assert timer.due([("a", 6), ("b", 6)]) == []           # the run's end checkpoints them


def test_by_minutes_each_agent_on_its_own_clock():
    clock = Clock()
    timer = CheckpointTimer(RunConfig(steps=100, checkpoint_every=0, checkpoint_minutes=1), ["a", "b"], clock.time)
    clock.t = 59.0
    assert timer.due([("a", 1), ("b", 1)]) == []
    clock.t = 60.0
    assert timer.due([("a", 2)]) == ["a"]                    # b finished nothing: its clock runs on
    clock.t = 90.0
    assert timer.due([("a", 3), ("b", 2)]) == ["b"]          # a's clock restarted at 60
    clock.t = 120.0
    assert timer.due([("a", 4), ("b", 3)]) == ["a"]
