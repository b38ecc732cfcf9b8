"""Held-out evaluation (run.eval_every): the pure bookkeeping, greedy sampling, the /eval
table and the start-up checks (real runs: tests/e2e/test_eval_e2e.py)."""
import importlib.util
import json

import h5py
import pytest
import torch

from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.orchestrator.evaluation import Evaluator, eval_points
from flexmarl_hpc.learn.model import ModelArgs, build_model
from flexmarl_hpc.run import main as run_main
from flexmarl_hpc.learn.sampling import SamplingParams, generate, masked_logits
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.workflows.referential import ReferentialGame
from tests.conftest import ROOT


def test_eval_points_cover_start_every_n_and_end():
    assert eval_points(20, 5) == [0, 5, 10, 15, 20]
    assert eval_points(7, 3) == [0, 3, 6, 7]
    assert eval_points(7, 0) == []


def answer(game, node):
    """The right token for a node: the speaker names the object by its symbol index, the
    listener decodes the symbol back to the object (a perfect protocol)."""
    if node.turn == 0:
        return [game.vocab.index[game.symbols[node.root_input]]] * 2
    sym = game.vocab.tokens[node.path().responses[0][0]]
    return [game.vocab.index[game.objects[game.symbols.index(sym)]]]


def test_evaluator_serves_each_agent_at_the_point_version_then_releases_it():
    cfg = load_config(ROOT / "configs/local.yaml", ["run.steps=4", "run.eval_every=2", "run.eval_inputs=8",
                                                    "run.eval_samples=2"])
    game = ReferentialGame(cfg.agent_names, num_objects=8, num_symbols=8)
    ev = Evaluator(cfg, game, done=set(), versions={"speaker": 0, "listener": 0})
    assert ev.todo == [0, 2, 4] and ev.hold("speaker") == 0 and ev.hold("listener") == 0
    ev.start({"speaker": 0, "listener": 0}, now=0.0)
    assert ev.ready("listener", 0) == []                    # its turn needs the speaker's answers
    assert ev.ready("speaker", 2) == []                     # round 2 is not open yet
    done = []
    for mode in ("greedy", "sample"):
        nodes = ev.ready("speaker", 0)
        assert {n.mode for n in nodes} == {mode} and len(nodes) == (8 if mode == "greedy" else 16)
        assert all(n.sample_id.startswith("eval0_") for n in nodes)
        ev.take(nodes)
        done += ev.record(nodes, [answer(game, n) for n in nodes], 0, now=1.0)
    assert ev.hold("speaker") == 2 and ev.hold("listener") == 0   # the speaker's part is done
    while (nodes := ev.ready("listener", 0)):
        ev.take(nodes)
        # the listener gets greedy chains right, sampled ones wrong
        done += ev.record(nodes, [answer(game, n) if n.mode == "greedy" else [game.vocab.index["obj0"]]
                                  for n in nodes], 0, now=2.0)
    assert ev.hold("listener") == 2 and ev.todo == [2, 4] and len(done) == 1
    rows = done[0].rows
    got = {(a.decode(), m.decode(), mo.decode()): v for a, m, mo, v in
           zip(rows["agent"], rows["metric"], rows["mode"], rows["value"])}
    assert got == {("speaker", "reward", "greedy"): 1.0, ("listener", "reward", "greedy"): 1.0,
                   ("speaker", "reward", "sample"): 0.125, ("listener", "reward", "sample"): 0.125}
    assert set(rows["step"]) == set(rows["version"]) == {0} and set(rows["n_paths"]) == {8, 16}
    assert done[0].summary["speaker/reward/sample"] == 0.125


def test_evaluator_skips_points_a_resume_has_passed():
    cfg = load_config(ROOT / "configs/local.yaml", ["run.steps=6", "run.eval_every=2"])
    game = ReferentialGame(cfg.agent_names)
    ev = Evaluator(cfg, game, done={0}, versions={"speaker": 3, "listener": 3})
    assert ev.todo == [4, 6] and ev.skipped == [2]


def test_task_metric_keys_map_to_agents():
    cfg = load_config(ROOT / "configs/local.yaml", ["run.eval_every=2"])
    ev = Evaluator(cfg, ReferentialGame(cfg.agent_names), done=set(), versions={"speaker": 0, "listener": 0})
    assert ev._split("listener") == ("listener", "reward")
    assert ev._split("speaker/accuracy") == ("speaker", "accuracy")
    assert ev._split("solver_correct") == ("", "solver_correct")


def test_greedy_generation_is_the_masked_argmax_whatever_the_seed():
    args = ModelArgs(vocab_size=30, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4,
                     intermediate_size=64, max_seq_len=32)
    model = build_model(args, seed=0, std=0.2).eval()
    allowed = torch.zeros(30, dtype=torch.bool)
    allowed[10:20] = True
    greedy = SamplingParams(temperature=0.0)
    a = generate(model, [[1, 5, 6]], [1], [1], greedy, pad_id=0, allowed=[allowed])[0]
    b = generate(model, [[1, 5, 6]], [2], [1], greedy, pad_id=0, allowed=[allowed])[0]
    logits = model(torch.tensor([[1, 5, 6]]), torch.ones(1, 3, dtype=torch.bool))[:, -1]
    assert a.tokens == b.tokens == [int(masked_logits(logits, allowed, 1.0).argmax())]
    sampled = {tuple(generate(model, [[1, 5, 6]], [s], [1], SamplingParams(1.0), pad_id=0,
                              allowed=[allowed])[0].tokens) for s in range(20)}
    assert len(sampled) > 1                        # (the model is not already deterministic)


@pytest.mark.parametrize("override,field", [("run.eval_every=-1", "run.eval_every"),
                                            ("run.eval_inputs=0", "run.eval_inputs"),
                                            ("run.eval_samples=-2", "run.eval_samples")])
def test_eval_fields_are_range_checked(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config(ROOT / "configs/local.yaml", [override])


def test_a_task_without_heldout_inputs_is_refused_at_start(capsys, tmp_path):
    rc = run_main(["configs/local.yaml", f"run.output_dir={tmp_path}", "run.eval_every=5",
                   "workflow.task=tests.faulty_tasks:NoHeldoutGame"])
    err = capsys.readouterr().err
    assert rc == 2 and "run.eval_every" in err and "tests.faulty_tasks:NoHeldoutGame" in err
    assert "heldout_inputs" in err and not (tmp_path / "local.h5").exists()
    # without evaluation the task passes the same start-up check
    from flexmarl_hpc.workflows.build import build_task
    from flexmarl_hpc.launch.preflight import check_eval
    cfg = load_config(ROOT / "configs/local.yaml", ["workflow.task=tests.faulty_tasks:NoHeldoutGame",
                                                    "run.eval_every=0"])
    check_eval(cfg, build_task(cfg))


def test_a_store_written_before_eval_existed_gains_the_table(tmp_path):
    path = tmp_path / "old.h5"
    s = StoreFile(path, ["a"], {})
    s.metrics.append({"step": [0], "t": [0.0], "wall": [1.0], "samples": [1], "tokens": [1],
                      "samples_per_s": [1.0], "rollout_s": [0.0], "train_s": [0.0], "sync_s": [0.0],
                      "swap_s": [0.0], "utilization": [0.0], "staleness_max": [0]})
    s.close()
    with h5py.File(path, "a") as f:                 # what the previous release wrote
        tables = [str(t) for t in f["commit"].attrs["tables"]]
        counts = f["commit"][:]
        keep = [i for i, t in enumerate(tables) if t != "/eval"]
        del f["eval"], f["commit"]
        c = f.create_dataset("commit", data=counts[keep])
        c.attrs["tables"] = [tables[i] for i in keep]
    s = StoreFile(path, ["a"], {})
    assert any("/eval" in r for r in s.repaired) and s.metrics.disk == 1
    s.append_eval({"step": [0], "agent": [b"a"], "metric": [b"reward"], "mode": [b"greedy"],
                   "value": [0.5], "n_inputs": [4], "n_paths": [4], "version": [0], "t_start": [0.0],
                   "t_end": [1.0]})
    s.close()
    s = StoreFile(path, ["a"], {})
    assert s.eval.read()["value"].tolist() == [0.5] and s.metrics.disk == 1
    s.close()


@pytest.fixture(scope="module")
def ev():
    """scripts/eval_heldout.py as a module (a script, not a package member)."""
    spec = importlib.util.spec_from_file_location("eval_heldout", ROOT / "scripts" / "eval_heldout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sign_test_of_paired_flips(ev):
    """scripts/eval_heldout.py --paired: the exact two-sided sign test of wrong->right vs
    right->wrong flips (values by hand: 2 * sum C(n, i) for i <= k over 2^n)."""
    assert ev.sign_test(0, 0) == 1.0 and ev.sign_test(3, 3) == 1.0
    assert ev.sign_test(5, 0) == ev.sign_test(0, 5) == 2 / 32
    assert abs(ev.sign_test(10, 2) - 2 * (1 + 12 + 66) / 4096) < 1e-12
    base = [{"ok": 0.0}, {"ok": 1.0}, {"ok": 0.0}, {"ok": 1.0}]
    now = [{"ok": 1.0}, {"ok": 1.0}, {"ok": 1.0}, {"ok": 0.0}]
    assert ev.flips(base, now) == f"ok +2/-1 (p={ev.sign_test(2, 1):.3g})"


def test_kept_rows_are_read_back_only_for_the_same_n(ev, tmp_path):
    """--rows: a version's per-input scores written by one process are paired by another."""
    path = tmp_path / "base.json"
    assert ev.cached_rows(path, 2) is None and ev.cached_rows(None, 2) is None
    path.write_text(json.dumps({"n": 2, "rows": [{"ok": 1.0}, {"ok": 0.0}]}))
    assert ev.cached_rows(path, 2) == [{"ok": 1.0}, {"ok": 0.0}]
    assert ev.cached_rows(path, 3) is None


def test_standard_errors_of_a_rate_and_of_a_count(ev):
    rows = [{"ok": 1.0, "calls": 1.0}, {"ok": 0.0, "calls": 3.0}, {"ok": 0.0, "calls": 2.0}, {"ok": 1.0, "calls": 2.0}]
    err = ev.std_err(rows)
    assert abs(err["ok"] - (0.5 * 0.5 / 4) ** 0.5) < 1e-12          # the binomial one
    assert abs(err["calls"] - (0.5 / 4) ** 0.5) < 1e-12             # a count: mean 2, variance 0.5


def test_the_plot_draws_a_count_with_the_error_written_beside_it(ev, tmp_path):
    lines = [{"version": 0, "n": 4, "ok": 0.5, "calls": 2.0, "std_err": {"ok": 0.25, "calls": 0.35}},
             {"version": 5, "n": 4, "ok": 0.25}]                  # a line written before std_err
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[:1]))
    ev.plot(str(tmp_path / "c.jsonl"), str(tmp_path / "c.png"))    # the binomial sqrt of 2*(1-2) raised
    (tmp_path / "d.jsonl").write_text(json.dumps(lines[1]) + "\n")
    ev.plot(str(tmp_path / "d.jsonl"), str(tmp_path / "d.png"))
    assert (tmp_path / "c.png").stat().st_size and (tmp_path / "d.png").stat().st_size
    ev.plot(str(tmp_path / "c.jsonl"), str(tmp_path / "e.png"), keys=["ok"])      # the rate only
    assert (tmp_path / "e.png").stat().st_size
    with pytest.raises(SystemExit, match=r"no metric \['solved'\] \(it has \['ok', 'calls'\]\)"):
        ev.plot(str(tmp_path / "c.jsonl"), str(tmp_path / "f.png"), keys=["solved"])


def test_only_takes_base_latest_or_a_version_number(ev):
    import argparse
    assert ev.only_choice("base") == "base" and ev.only_choice("latest") == "latest" and ev.only_choice("14") == 14
    with pytest.raises(argparse.ArgumentTypeError, match="expected base, latest or a version number, got 'v14'"):
        ev.only_choice("v14")
