"""The pure workflow tree (no store): spawning, rewards, group advantages, readiness,
consumption, and what it reports to the journal."""
import numpy as np

from flexmarl_hpc.workflows.build import build_task
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.store.schema import CONSUMED, GENERATED, READY
from flexmarl_hpc.orchestrator.tree import Tree
from tests.conftest import ROOT


def make(*over):
    cfg = load_config(str(ROOT / "configs/local.yaml"), ["workflow.inputs_per_step=2", *over])
    return Tree(cfg, build_task(cfg))


def answer(tree, agent, tokens):
    nodes = list(tree.pending[agent])
    tree.pending[agent].clear()
    return nodes, tree.record_generation([(n, list(tokens), [-0.5] * len(tokens)) for n in nodes], 0, 0)


def test_a_step_grows_its_trees_and_groups_become_ready_with_zero_mean_advantages():
    tree = make()
    tree.admit_step(0)
    assert len(tree.pending["speaker"]) == 2 * 4 and not tree.pending["listener"]
    speakers, ch = answer(tree, "speaker", [3, 4])
    assert ch.generated == speakers and not ch.ready and not ch.dropped
    assert all(n.status == GENERATED for n in speakers)
    assert len(tree.pending["listener"]) == 8 * 4                 # every speaker answer branches
    assert tree.turn_left[(0, 0)] == 0 and tree.turn_left[(0, 1)] == 32
    listeners, ch = answer(tree, "listener", [5])
    assert set(map(id, ch.ready)) == set(map(id, speakers + listeners))
    for n in speakers:                                            # reward: mean of its leaves
        assert n.reward == np.mean([c.reward for c in n.children])
    for n in speakers + listeners:
        assert n.status == READY
        adv = [m.advantage for m in n.group]
        assert abs(np.mean(adv)) < 1e-6
    assert tree.ready_count("speaker", 0) == tree.batch_size["speaker"] == 8
    assert tree.ready_count("listener", 0) == tree.batch_size["listener"] == 32


def test_take_ready_consumes_in_order_and_forget_step_frees_memory():
    tree = make()
    tree.admit_step(0)
    answer(tree, "speaker", [3, 4])
    answer(tree, "listener", [5])
    first = tree.take_ready("listener", 0, 20)
    rest = tree.take_ready("listener", 0, 20)
    assert len(first) == 20 and len(rest) == 12 and not tree.take_ready("listener", 0, 20)
    assert all(n.status == CONSUMED and n.trainer_step == 0 for n in first + rest)
    tree.forget_step(0)
    assert not tree.nodes and not tree.ready["listener"]


def test_over_provisioning_reports_dropped_generated_nodes_once():
    tree = make("pipeline.overprovision=1")
    tree.admit_step(0)
    speakers, _ = answer(tree, "speaker", [3, 4])
    listeners = list(tree.pending["listener"])
    tree.pending["listener"].clear()
    done = [n for n in listeners if n.input_id in (0, 1)]
    ch = tree.record_generation([(n, [5], [-0.5]) for n in done], 0, 0)
    dropped = {n.input_id for n in ch.dropped}
    assert dropped == {2} and all(n.turn == 0 for n in ch.dropped)   # only generated ones
    assert tree.dropped == {2} and len(ch.dropped) == 4
    ch2 = tree.record_generation([(n, [5], [-0.5]) for n in listeners if n.input_id == 2], 0, 0)
    assert {id(n) for n in ch2.dropped} == {id(n) for n in listeners if n.input_id == 2}
    assert not ch2.ready
