"""workflow.dataset: the three file formats, the field mapping, the deterministic stream and
its resume, and the errors on bad input.

    pytest tests/unit/test_dataset.py
"""
from __future__ import annotations

import json
from collections import Counter

import pytest

from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.workflows.dataset import DatasetConfig, DatasetError, ExampleStream, load_examples
from tests.conftest import need
from tests.helpers import heavy_modules_after

ROWS = [{"problem": f"What is {i} + {i}?", "solution": 2 * i, "level": i % 3} for i in range(10)]


@pytest.fixture
def pa():
    try:
        import pyarrow
    except ImportError:
        need(False, "pyarrow (requirements.txt)")
    return pyarrow


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(pa, path, rows):
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_saved_dataset(pa, folder, rows, shards=2):
    """What datasets' save_to_disk writes: Arrow IPC *stream* files, state.json listing them in
    order, dataset_info.json with the features."""
    folder.mkdir()
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    per = -(-len(rows) // shards)
    for i, name in enumerate(names):
        table = pa.Table.from_pylist(rows[i * per:(i + 1) * per])
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    (folder / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_format_columns": None,
        "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": "train"}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {
        "problem": {"dtype": "string", "_type": "Value"}, "solution": {"dtype": "int64", "_type": "Value"},
        "level": {"dtype": "int64", "_type": "Value"}}}))
    return str(folder)


MAP = {"question": "problem", "answer": "solution"}


def test_jsonl_parquet_and_saved_folder_read_the_same_examples(tmp_path, pa):
    paths = [write_jsonl(tmp_path / "d.jsonl", ROWS), write_parquet(pa, tmp_path / "d.parquet", ROWS),
             write_saved_dataset(pa, tmp_path / "saved", ROWS)]
    loaded = [load_examples(p, MAP, required=("question", "answer", "level")) for p in paths]
    assert loaded[0] == loaded[1] == loaded[2]
    assert [e["question"] for e in loaded[0]] == [r["problem"] for r in ROWS]      # file order
    assert loaded[0][3]["answer"] == 6 and loaded[0][3]["level"] == 0              # mapped, identity


def test_saved_folder_without_state_json_reads_shards_by_name(tmp_path, pa):
    folder = tmp_path / "saved"
    write_saved_dataset(pa, folder, ROWS, shards=3)
    (folder / "state.json").unlink()
    assert [e["solution"] for e in load_examples(str(folder))] == [r["solution"] for r in ROWS]


def test_the_stream_is_deterministic_per_seed_and_a_permutation_per_epoch():
    a, b, c = (ExampleStream(ROWS, seed) for seed in (7, 7, 8))
    ids = lambda s: [s.index(p) for p in range(30)]                     # noqa: E731
    assert ids(a) == ids(b) != ids(c)
    for epoch in range(3):
        assert sorted(ids(a)[epoch * 10:(epoch + 1) * 10]) == list(range(10))
    assert ids(a)[:10] != ids(a)[10:20]                                 # a new order each epoch
    assert ids(ExampleStream(ROWS, 7, shuffle=False)) == list(range(10)) * 3


def test_batch_positions_are_the_example_ids_and_wrap_epochs():
    s = ExampleStream(ROWS, 3)
    got = s.batch(2, 4)                                                 # positions 8..11: epochs 0 and 1
    assert [p for p, _ in got] == [8, 9, 10, 11]
    assert [e for _, e in got] == [ROWS[s.permutation(0)[8]], ROWS[s.permutation(0)[9]],
                                   ROWS[s.permutation(1)[0]], ROWS[s.permutation(1)[1]]]


@pytest.mark.parametrize("resume_step", [1, 3, 7])
def test_a_resume_at_step_s_neither_repeats_nor_skips(tmp_path, resume_step):
    """Steps 0..s-1 in one process, the rest from a fresh stream (a resumed run reloads the
    file): over 3 whole epochs every example is trained exactly 3 times, every id once."""
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = DatasetConfig(train=path, fields=MAP)
    n, steps = 3, 10                                                    # 30 positions = 3 epochs
    first = ExampleStream.from_config(cfg, seed=5)
    seen = [x for step in range(resume_step) for x in first.batch(step, n)]
    resumed = ExampleStream.from_config(cfg, seed=5)
    seen += [x for step in range(resume_step, steps) for x in resumed.batch(step, n)]
    assert [p for p, _ in seen] == list(range(30))
    assert Counter(e["question"] for _, e in seen) == Counter({r["problem"]: 3 for r in ROWS})
    uninterrupted = ExampleStream.from_config(cfg, seed=5)
    assert seen == [x for step in range(steps) for x in uninterrupted.batch(step, n)]


def test_heldout_is_the_first_n_eval_examples_in_file_order(tmp_path):
    cfg = DatasetConfig(train=write_jsonl(tmp_path / "t.jsonl", ROWS),
                        eval=write_jsonl(tmp_path / "e.jsonl", ROWS[::-1]), fields=MAP, shuffle=True)
    s = ExampleStream.from_config(cfg, seed=1)
    assert [e["answer"] for e in s.heldout(4)] == [18, 16, 14, 12]
    with pytest.raises(DatasetError, match=r"11 held-out examples asked for \(run.eval_inputs\), the file has 10"):
        s.heldout(11)
    with pytest.raises(DatasetError, match="workflow.dataset.eval: .*no eval file"):
        ExampleStream(ROWS, 0).heldout(1)


def test_errors_name_the_field_file_and_row(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "a", "solution": 1}\n\n{"problem": "b", solution: 2}\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:3: expected one JSON object per line"):
        load_examples(str(bad))
    (tmp_path / "list.jsonl").write_text('[1, 2]\n')
    with pytest.raises(DatasetError, match=r"list.jsonl:1: expected a JSON object, got list"):
        load_examples(str(tmp_path / "list.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match=r"workflow.dataset.train: .*empty.jsonl' holds no examples"):
        load_examples(str(tmp_path / "empty.jsonl"))
    rows = ROWS[:4] + [{"problem": "x"}] + ROWS[4:]
    with pytest.raises(DatasetError, match=r"d.jsonl: row 5 has no workflow.dataset.fields.answer -> "
                                           r"column 'solution' \(its columns: \['problem'\]\)"):
        load_examples(write_jsonl(tmp_path / "d.jsonl", rows), MAP)
    with pytest.raises(DatasetError, match=r"row 1 has no field 'hint'"):
        load_examples(write_jsonl(tmp_path / "ok.jsonl", ROWS), MAP, required=("question", "hint"))
    (tmp_path / "d.csv").write_text("problem,solution\n")
    with pytest.raises(DatasetError, match=r"d.csv': expected a .jsonl or .parquet file or a save_to_disk folder"):
        load_examples(str(tmp_path / "d.csv"))


def test_missing_paths_and_bad_config_values_name_the_field(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(DatasetError, match=r"workflow.dataset.eval: '.*nope.jsonl' does not exist"):
        ExampleStream.from_config(DatasetConfig(train=train, eval=str(tmp_path / "nope.jsonl")), seed=0)
    with pytest.raises(DatasetError, match=r"workflow.dataset.train: '.*gone.parquet' does not exist"):
        ExampleStream.from_config(DatasetConfig(train=str(tmp_path / "gone.parquet")), seed=0)
    with pytest.raises(DatasetError, match=r"workflow.dataset.train: expected a path"):
        ExampleStream.from_config(DatasetConfig(), seed=0)
    with pytest.raises(ConfigError, match=r"workflow.dataset.fields: expected a map"):
        DatasetConfig(train=train, fields={"question": 3})
    with pytest.raises(ConfigError, match=r"workflow.dataset.shuffle: expected true or false"):
        DatasetConfig(train=train, shuffle="yes")
    with pytest.raises(ConfigError, match=r"run.seed: expected an integer >= 0"):
        ExampleStream(ROWS, -1)


def test_damaged_binary_files_and_a_dataset_dict_folder_are_refused(tmp_path, pa):
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match=r"x.parquet: not a readable Parquet file"):
        load_examples(str(tmp_path / "x.parquet"))
    folder = tmp_path / "saved"
    write_saved_dataset(pa, folder, ROWS, shards=1)
    (folder / "data-00000-of-00001.arrow").write_bytes(b"garbage")
    with pytest.raises(DatasetError, match=r"data-00000-of-00001.arrow: not a readable Arrow file"):
        load_examples(str(folder))
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(DatasetError, match=r"a DatasetDict folder; expected one split, e.g. .*dd/train"):
        load_examples(str(tmp_path / "dd"))


def test_the_config_module_imports_no_torch_mpi_or_pyarrow():
    code = "from flexmarl_hpc.workflows.dataset import DatasetConfig\nimport sys\nassert 'pyarrow' not in sys.modules"
    assert heavy_modules_after(code) == []


def test_the_config_loads_like_a_schema_section_with_help_for_every_field():
    """How config/load.py will build it as `workflow.dataset` (from YAML, named errors)."""
    from flexmarl_hpc.config.load import field_docs, from_dict
    cfg = from_dict(DatasetConfig, {"train": "t.jsonl", "fields": {"question": "problem"}, "shuffle": False},
                    "workflow.dataset")
    assert cfg == DatasetConfig(train="t.jsonl", fields={"question": "problem"}, shuffle=False)
    with pytest.raises(ConfigError, match=r"workflow.dataset.shufle: unknown key"):
        from_dict(DatasetConfig, {"shufle": True}, "workflow.dataset")
    with pytest.raises(ConfigError, match=r"workflow.dataset.fields.answer: expected str, got \[1\]"):
        from_dict(DatasetConfig, {"fields": {"answer": [1]}}, "workflow.dataset")
    with pytest.raises(ConfigError, match=r"workflow.dataset.fields: expected a map of non-empty names"):
        from_dict(DatasetConfig, {"fields": {"answer": ""}}, "workflow.dataset")
    assert set(field_docs(DatasetConfig)) == {"train", "eval", "fields", "shuffle"}
