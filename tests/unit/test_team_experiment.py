"""scripts/team_experiment.py's pure parts: the sign test against known values, the held-out
set's disjointness check (and that the split it checks is disjoint), flip counting, and the
calculator calls per episode by step."""
from __future__ import annotations

import importlib.util

import pytest

from flexmarl_hpc.workflows.wordproblems import HELDOUT_TEMPLATES, numbers, split_by_template
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def te():
    spec = importlib.util.spec_from_file_location("team_experiment", ROOT / "scripts" / "team_experiment.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sign_test_known_values(te):
    # scipy.stats.binomtest(k, n).pvalue: (2, 10) 0.109375, (0, 10) 0.001953125, (5, 0) 0.0625
    assert te.sign_test(8, 2) == te.sign_test(2, 8) == 0.109375
    assert te.sign_test(10, 0) == 2 / 1024 and te.sign_test(0, 5) == 0.0625
    assert te.sign_test(0, 0) == 1.0 and te.sign_test(4, 4) == 1.0 and te.sign_test(3, 4) == 1.0
    assert abs(te.sign_test(55, 5) - 1.0e-11) < 0.05e-11          # docs/LOG.md's +55/-5


def test_flips_count_wins_losses_and_ties(te):
    assert te.flips([1, 1, 0, 0, 1], [0, 1, 1, 0, 0]) == (2, 1, 2)
    assert te.flips([], []) == (0, 0, 0)
    with pytest.raises(ValueError, match="different lengths"):
        te.flips([1], [1, 0])


def rows(ps):
    return [{**p.row(), "template": p.template} for p in ps]


def test_the_split_is_disjoint_and_the_check_sees_an_overlap(te):
    train, heldout = split_by_template(0, 300, 60, max_steps=2)
    assert {p.template for p in heldout} <= HELDOUT_TEMPLATES
    assert not {p.template for p in train} & HELDOUT_TEMPLATES
    assert te.check_disjoint(rows(train), rows(heldout)) == {"same question": 0, "same template": 0, "same numbers": 0}
    # one training problem in the held-out set, and one held-out problem reworded (another
    # name, a training template's row): each is counted
    reworded = {**rows(train)[1], "question": "Please help. " + rows(train)[1]["question"]}
    leaky = rows(heldout) + [rows(train)[0], reworded]
    assert numbers(reworded["question"]) == numbers(train[1].question)
    assert te.check_disjoint(rows(train), leaky) == {"same question": 1, "same template": 2, "same numbers": 2}


def test_calls_per_step_joins_tools_to_episodes(te):
    episodes = [(1, 0, 0), (1, 0, 1), (2, 4, 0)]
    calls = [(0, 0, "ok"), (0, 1, "ok"), (0, 1, "error"), (4, 0, "ok"), (4, 0, "ok"), (9, 9, "ok")]
    assert te.calls_per_step(episodes, calls) == {
        1: {"episodes": 2, "ok": 1.0, "refused": 0.5}, 2: {"episodes": 1, "ok": 2.0, "refused": 0.0}}
