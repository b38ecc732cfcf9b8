"""Datasets of episode examples: the `workflow.dataset` config, file loaders and the stream.

    cfg = DatasetConfig(train="data/math_team/train.jsonl", eval="data/math_team/eval.jsonl",
                        fields={"question": "question", "answer": "answer"})
    stream = ExampleStream.from_config(cfg, seed=run.seed, required=("question", "answer"))
    for example_id, example in stream.batch(step, n): ...     # the examples of one step
    heldout = stream.heldout(run.eval_inputs)                  # fixed, in file order

A file is JSONL (one object per line), Parquet, or a folder written by HF `datasets`'
`save_to_disk` (its `state.json` and Arrow `data-*.arrow` files, read with pyarrow: the
`datasets` library is not needed). `fields` maps the key an episode reads to the column of
the file; a key it does not map is read from the column of the same name.

The stream has no state of its own. Position p of the stream is example perm_e[p % len]
of epoch e = p // len, perm_e drawn from numpy's default_rng([seed, e]) (the identity when
`shuffle` is off), and step s takes positions [s*n, (s+1)*n). The trainer's step is in the
checkpoint, so a run resumed at step s continues at position s*n: no example is repeated
or skipped as long as `seed`, the file and n (examples per step) are unchanged. The example
id (the store's input_id) is p itself.

Kept free of torch and mpi4py (config/schema.py takes DatasetConfig); numpy is imported by
the stream, pyarrow only by the Parquet and Arrow loaders.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from flexmarl_hpc.config.schema import DATASET_WHERE as WHERE, ConfigError, DatasetConfig, DatasetError  # noqa: F401 (re-exported)



# ---------------------------------------------------------------------------------------
# Loaders: each returns the file's rows as dicts, in file order
# ---------------------------------------------------------------------------------------
MAX_LINE_BYTES = 16 << 20
"""Longest JSONL line (one example) read: a longer one is refused by its line number before
it is read whole (a 2 GiB line grew the launcher past 12 GiB)."""


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            line = _line(path, lineno, raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: expected one JSON object per line ({e.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _line(path: Path, lineno: int, raw: bytes) -> str:
    """A JSONL line's text: at most MAX_LINE_BYTES, UTF-8; DatasetError naming file:line."""
    if len(raw) > MAX_LINE_BYTES:
        raise DatasetError(f"{path}:{lineno}: a line longer than {MAX_LINE_BYTES >> 20} MiB; expected "
                           "one example per line")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") from None


def read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a damaged or foreign file
        raise DatasetError(f"{path}: not a readable Parquet file ({e})") from None


def arrow_files(folder: Path) -> list[Path]:
    """The data files of a `save_to_disk` folder in order: state.json's `_data_files`, or
    `data-*.arrow` sorted by name when there is no state.json."""
    if (folder / "dataset_dict.json").exists():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        raise DatasetError(f"{folder}: a DatasetDict folder; expected one split, e.g. "
                           f"{', '.join(str(folder / s) for s in splits) or folder / 'train'}")
    state = folder / "state.json"
    if not state.exists():
        files = sorted(folder.glob("data-*.arrow"))
    else:
        meta = json.loads(state.read_text())
        if meta.get("_indices_data_files"):
            raise DatasetError(f"{state}: an indices mapping is not supported; save the dataset "
                               "after .flatten_indices()")
        files = [folder / d["filename"] for d in meta.get("_data_files", [])]
    if not files:
        raise DatasetError(f"{folder}: expected a folder saved by datasets' save_to_disk "
                           "(state.json and data-*.arrow files), found none")
    return files


def read_arrow_folder(folder: Path) -> list[dict]:
    import pyarrow as pa
    rows: list[dict] = []
    for path in arrow_files(folder):
        try:
            with pa.memory_map(str(path)) as source:
                try:                    # save_to_disk writes the IPC stream format
                    table = pa.ipc.open_stream(source).read_all()
                except pa.ArrowInvalid:
                    source.seek(0)
                    table = pa.ipc.open_file(source).read_all()
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"{path}: not a readable Arrow file ({e})") from None
        rows.extend(table.to_pylist())
    return rows


def read_rows(path: str | os.PathLike, where: str = f"{WHERE}.train") -> list[dict]:
    """The rows of a dataset file or folder; `where` names the config field in errors."""
    p = Path(path)
    if not p.exists():
        raise DatasetError(f"{where}: {str(path)!r} does not exist")
    if p.is_dir():
        rows = read_arrow_folder(p)
    elif p.suffix == ".jsonl":
        rows = read_jsonl(p)
    elif p.suffix == ".parquet":
        rows = read_parquet(p)
    else:
        raise DatasetError(f"{where}: {str(path)!r}: expected a .jsonl or .parquet file or a "
                           "save_to_disk folder")
    if not rows:
        raise DatasetError(f"{where}: {str(path)!r} holds no examples")
    return rows


def map_fields(rows: list[dict], fields: dict[str, str], required: Iterable[str], path: str) -> list[dict]:
    """Each row with the episode's keys: key k is column fields.get(k, k). Every key in
    `required` and every mapped key must be present; the error names the first bad row."""
    keys = list(dict.fromkeys([*fields, *required]))
    out = []
    for i, row in enumerate(rows):
        example = dict(row)
        for k in keys:
            column = fields.get(k, k)
            if column not in row:
                via = f"{WHERE}.fields.{k} -> column {column!r}" if k in fields else f"field {k!r}"
                raise DatasetError(f"{path}: row {i + 1} has no {via} (its columns: {sorted(row)})")
            example[k] = row[column]
        out.append(example)
    return out


def load_examples(path: str, fields: dict[str, str] | None = None, required: Iterable[str] = (),
                  where: str = f"{WHERE}.train") -> list[dict]:
    """The examples of one file, their fields mapped (see map_fields)."""
    return map_fields(read_rows(path, where), fields or {}, required, str(path))


# ---------------------------------------------------------------------------------------
# The stream
# ---------------------------------------------------------------------------------------
class ExampleStream:
    """Training examples as an endless, deterministic stream of positions (module docstring),
    and the held-out examples in file order."""

    def __init__(self, examples: list[dict], seed: int, shuffle: bool = True,
                 heldout_examples: list[dict] | None = None):
        if not examples:
            raise DatasetError(f"{WHERE}.train: no examples")
        if not isinstance(seed, int) or seed < 0:
            raise DatasetError(f"run.seed: expected an integer >= 0 for the dataset stream, got {seed!r}")
        self.examples, self.seed, self.shuffle = examples, seed, shuffle
        self.heldout_examples = heldout_examples
        self._perms: dict[int, Any] = {}

    @classmethod
    def from_config(cls, cfg: DatasetConfig, seed: int, required: Iterable[str] = ()) -> "ExampleStream":
        required = tuple(required)
        if not cfg.train:
            raise DatasetError(f"{WHERE}.train: expected a path, got \"\"")
        train = load_examples(cfg.train, cfg.fields, required, f"{WHERE}.train")
        heldout = load_examples(cfg.eval, cfg.fields, required, f"{WHERE}.eval") if cfg.eval else None
        return cls(train, seed, cfg.shuffle, heldout)

    def __len__(self) -> int:
        return len(self.examples)

    def permutation(self, epoch: int):
        """The order of epoch `epoch` (a few recent epochs are cached)."""
        if epoch not in self._perms:
            import numpy as np
            n = len(self.examples)
            perm = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            if len(self._perms) >= 4:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return self._perms[epoch]

    def index(self, position: int) -> int:
        """The file row of stream position `position`."""
        if position < 0:
            raise ValueError(f"stream position must be >= 0, got {position}")
        epoch, offset = divmod(position, len(self.examples))
        return int(self.permutation(epoch)[offset])

    def take(self, start: int, count: int) -> list[tuple[int, dict]]:
        """(position, example) of positions [start, start + count): the position is the example id."""
        return [(p, self.examples[self.index(p)]) for p in range(start, start + count)]

    def batch(self, step: int, n: int) -> list[tuple[int, dict]]:
        """The n examples of step `step` (0-based): positions [step*n, (step+1)*n)."""
        if n <= 0:
            raise ValueError(f"examples per step must be > 0, got {n}")
        return self.take(step * n, n)

    def heldout(self, n: int) -> list[dict]:
        """The first n held-out examples, in file order."""
        if self.heldout_examples is None:
            raise DatasetError(f"{WHERE}.eval: held-out examples were asked for (run.eval_every > 0) "
                               "but no eval file is set")
        if n > len(self.heldout_examples):
            raise DatasetError(f"{WHERE}.eval: {n} held-out examples asked for (run.eval_inputs), "
                               f"the file has {len(self.heldout_examples)}")
        return self.heldout_examples[:n]
