"""The solver/verifier arithmetic workflow on a real `tokenizers` tokenizer (a small word-level
one, the `tokenizer` fixture of tests/conftest.py, so no model is needed) and its error messages
(a real run of it: tests/e2e/test_arithmetic_e2e.py)."""
import numpy as np
import pytest
import torch

from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.run import main as run_main
from flexmarl_hpc.workflows.arithmetic import SolverVerifier
from flexmarl_hpc.workflows.base import Path, TokenizerVocab, load_task
from tests.conftest import SPECIALS, WORDS


def task(tokenizer, **kw):
    return SolverVerifier(["solver", "verifier"], str(tokenizer), **kw)


def ids(t, text):
    return tuple(t.vocab.text_ids(text))


def test_prompts_masks_and_rewards(tokenizer):
    t = task(tokenizer)
    v = t.vocab
    assert (len(v), v.pad_id, v.bos_id, v.eos_id) == (len(SPECIALS + WORDS), 0, 1, 2)
    assert t.stop_tokens == frozenset({2})
    p0 = t.prompt(0, Path([3, "+", 4]))
    assert p0[0] == v.bos_id and v.decode(p0[-4:]) == ["3", "+", "4", "="]
    assert "Whatis3+4?" in v.text(p0)              # word-level pieces, fused by the decoder
    # solver: digits, '-' and end of turn; verifier: yes/no words only
    solver_ok = {v.tokenizer.token_to_id(c) for c in "0123456789-"} | {v.eos_id}
    assert set(torch.nonzero(t.allowed_tokens(0)).flatten().tolist()) == solver_ok
    assert set(v.decode(torch.nonzero(t.allowed_tokens(1)).flatten().tolist())) == {"yes", "no", "Yes", "No"}
    yes, no, Yes = (v.tokenizer.token_to_id(w) for w in ("yes", "no", "Yes"))
    right, wrong = ids(t, "7") + (v.eos_id,), ids(t, "12")
    assert t.reward(Path([3, "+", 4], (right, (yes,)))) == {"solver": 1.0, "verifier": 1.0}
    assert t.reward(Path([3, "+", 4], (right, (no,)))) == {"solver": 1.0, "verifier": 0.0}
    assert t.reward(Path([3, "+", 4], (wrong, (Yes,)))) == {"solver": 0.0, "verifier": 0.0}
    assert t.reward(Path([3, "+", 4], (wrong, (no,)))) == {"solver": 0.0, "verifier": 1.0}
    assert t.reward(Path([2, "-", 9], (ids(t, "-7"), (yes,)))) == {"solver": 1.0, "verifier": 1.0}
    assert t.reward(Path([2, "-", 9], (ids(t, "7-"), (no,)))) == {"solver": 0.0, "verifier": 1.0}
    # the verifier is shown the solver's answer
    p1 = t.prompt(1, Path([3, "+", 4], (wrong,)))
    assert "ProposedAnswer".lower() in v.text(p1).lower() and "12" in v.text(p1)
    # inputs: seeded, in range, every op used
    xs = t.sample_inputs(np.random.default_rng(0), 200)
    assert xs == t.sample_inputs(np.random.default_rng(0), 200)
    assert {op for _, op, _ in xs} == {"+", "-"} and all(0 <= a <= 10 and 0 <= b <= 10 for a, op, b in xs)


def test_heldout_inputs_are_fixed_disjoint_from_training_and_scored(tokenizer):
    t = task(tokenizer, heldout=60)
    held = t.heldout_inputs(60)
    # the same problems whatever the seed or instance, a prefix for smaller n, no duplicates
    assert held == task(tokenizer, heldout=60).heldout_inputs(60) and held[:10] == t.heldout_inputs(10)
    assert len({tuple(x) for x in held}) == 60 and {op for _, op, _ in held} == {"+", "-"}
    # training never draws them, and still covers the rest of the 242 problems
    drawn = {tuple(x) for x in t.sample_inputs(np.random.default_rng(1), 5000)}
    assert not drawn & {tuple(x) for x in held} and len(drawn) == 242 - 60
    # without a reserve the same first problems come back (and may be trained on)
    assert task(tokenizer).heldout_inputs(10) == held[:10]
    with pytest.raises(ValueError, match="61 held-out inputs asked, the task reserves 60"):
        t.heldout_inputs(61)
    with pytest.raises(TypeError, match=r"heldout must be in \[0, 121\]"):
        task(tokenizer, heldout=122)
    yes, no = (t.vocab.tokenizer.token_to_id(w) for w in ("yes", "no"))
    right, wrong = ids(t, "7") + (t.vocab.eos_id,), ids(t, "12")
    assert t.eval_metrics(Path([3, "+", 4], (right, (yes,)))) == {
        "solver_correct": 1.0, "verifier_correct": 1.0, "team": 1.0}
    assert t.eval_metrics(Path([3, "+", 4], (right, (no,))))["team"] == 0.0
    assert t.eval_metrics(Path([3, "+", 4], (wrong, (no,)))) == {
        "solver_correct": 0.0, "verifier_correct": 1.0, "team": 0.0}


def test_bad_task_args_name_the_field(tokenizer, tmp_path):
    with pytest.raises(ConfigError, match=r"workflow.task_args.*nowhere: no tokenizer.json"):
        load_task("flexmarl_hpc.workflows.arithmetic:SolverVerifier", {"tokenizer": str(tmp_path / "nowhere")},
                  ["solver", "verifier"])
    with pytest.raises(ConfigError, match=r"workflow.task_args.*ops"):
        load_task("flexmarl_hpc.workflows.arithmetic:SolverVerifier", {"tokenizer": str(tokenizer), "ops": "/"},
                  ["solver", "verifier"])
    with pytest.raises(ConfigError, match=r"workflow.task_args.*exactly 2 turns"):
        load_task("flexmarl_hpc.workflows.arithmetic:SolverVerifier", {"tokenizer": str(tokenizer)}, ["a", "b", "c"])
    with pytest.raises(ValueError, match="no eos token"):
        TokenizerVocab(tokenizer, eos="<|not_there|>")


def test_checkpoint_with_a_smaller_vocabulary_is_refused_before_launch(tokenizer, tmp_path, capsys):
    from flexmarl_hpc.learn.model import ModelArgs, build_model, save_hf_checkpoint
    save_hf_checkpoint(build_model(ModelArgs(10, 16, 1, 2, 2, 32, 64), seed=0), tmp_path / "tiny")
    code = run_main(["configs/smollm2_arith.yaml", f"workflow.task_args.tokenizer={tokenizer}",
                     f"model.checkpoint={tmp_path / 'tiny'}", f"run.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "model.checkpoint" in err and "vocabulary (10)" in err
    assert not (tmp_path / "run").exists()
