"""A real run of the solver/verifier arithmetic workflow on a small word-level tokenizer (the
`tokenizer` fixture of tests/conftest.py; the workflow and its errors: tests/unit/test_arithmetic.py)."""
from tests.conftest import run_training
from tests.helpers import check_exactly_once




def test_text_workflow_trains_end_to_end(tokenizer, tmp_path, mpiexec):
    """The tokenizer-backed workflow through the whole job (random-init model, torch backends)."""
    p = run_training(tmp_path, "run.steps=3", f"workflow.task_args.tokenizer={tokenizer}", "model.checkpoint=",
                     "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=2",
                     "model.intermediate_size=64", "model.max_seq_len=96", "trainer.backend=torch",
                     "trainer.lr=1e-3", config="configs/smollm2_arith.yaml")
    assert "step    3/3" in p.stdout
    check_exactly_once(tmp_path / "smollm2_arith.h5", 3)
