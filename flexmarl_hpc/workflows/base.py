"""The workflow interface: what a user implements to train agents on their own task.

A workflow is a fixed sequence of turns (declared in YAML under `workflow.turns`); at each
turn one agent answers every path of the previous turn `samples` times, so one root input
grows a tree. The task class supplies the pieces that depend on the problem:

    class MyTask(Task):
        vocab = Vocab(["yes", "no", ...])            # or TokenizerVocab("tokenizer.json")
        def sample_inputs(self, rng, n): ...          # n root inputs (JSON-able values)
        def prompt(self, turn, path): ...             # token ids the agent of `turn` sees
        def reward(self, path): ...                   # {agent: reward} at a finished leaf
        def allowed_tokens(self, turn): ...           # optional action mask (None: all)
        def heldout_inputs(self, n): ...              # n fixed held-out inputs (run.eval_every)
        def eval_metrics(self, path): ...             # optional: {metric: value} of an eval leaf

and is referenced from YAML as `workflow.task: my_pkg.my_module:MyTask`; it is built as
`MyTask(turns=[agent of each turn], **workflow.task_args)`. The constructor checks its
arguments: `raise TaskArgError("num_objects", "expected >= 1, got 0")` (or `int_arg(...)`)
refuses the config with `config error: workflow.task_args.num_objects: expected >= 1, got 0`
before any rank starts; any other exception it raises is reported on one line under
`workflow.task_args` (with its type and the line that raised it). `path` is a `Path`: the root input plus the responses
(token id lists) of the turns so far. A turn's sample is rewarded with the mean reward of
the leaves below it, and its advantage is normalised among its siblings (the GRPO group).

Evaluation (run.eval_every > 0) walks `heldout_inputs(run.eval_inputs)` down the same turns
on the rollout replicas, one greedy response per turn (and run.eval_samples sampled chains),
and averages `eval_metrics` over the finished paths; it is never trained on. A metric keyed
by an agent's name is that agent's (default: its reward), `agent/name` is that agent's
metric `name`, any other key is the task's (e.g. "solver_correct").
"""
from __future__ import annotations

import importlib
import math
import traceback
from dataclasses import dataclass
from os import PathLike
from pathlib import Path as FsPath
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


class Vocab:
    """Token strings <-> ids; ids 0, 1, 2 are <pad>, <bos>, <eos>."""

    def __init__(self, tokens: Sequence[str]):
        self.tokens = [PAD, BOS, EOS] + [t for t in tokens if t not in (PAD, BOS, EOS)]
        self.index = {t: i for i, t in enumerate(self.tokens)}
        if len(self.index) != len(self.tokens):
            raise ValueError("vocab has duplicate tokens")

    def __len__(self) -> int:
        return len(self.tokens)

    pad_id, bos_id, eos_id = 0, 1, 2

    def encode(self, toks: Sequence[str]) -> list[int]:
        return [self.index[t] for t in toks]

    def decode(self, ids: Sequence[int]) -> list[str]:
        return [self.tokens[i] for i in ids]

    def mask(self, toks: Sequence[str]) -> torch.Tensor:
        import torch  # not at import: the orchestrator and simulate import Task without torch
        m = torch.zeros(len(self), dtype=torch.bool)
        m[self.encode(toks)] = True
        return m


class TokenizerVocab:
    """A pretrained model's tokenizer (a HF `tokenizer.json`, read by the `tokenizers`
    library) as the task vocabulary, for tasks on real text. `pad`, `bos` and `eos` name
    its special tokens (defaults: SmolLM2's chat tokens)."""

    def __init__(self, path: str | PathLike, pad: str = "<|endoftext|>", bos: str = "<|im_start|>",
                 eos: str = "<|im_end|>"):
        from tokenizers import Tokenizer
        file = FsPath(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no tokenizer.json (expected a HF tokenizer file or a "
                                    "checkpoint folder holding one)")
        self.path = str(file)
        self.tokenizer = Tokenizer.from_file(self.path)
        ids = {name: self.tokenizer.token_to_id(tok) for name, tok in
               (("pad", pad), ("bos", bos), ("eos", eos))}
        missing = [f"{name} token {tok!r}" for (name, i), tok in zip(ids.items(), (pad, bos, eos)) if i is None]
        if missing:
            raise ValueError(f"{file}: tokenizer has no {', '.join(missing)}")
        self.pad_id, self.bos_id, self.eos_id = ids["pad"], ids["bos"], ids["eos"]

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, toks: Sequence[str]) -> list[int]:
        out = [self.tokenizer.token_to_id(t) for t in toks]
        if None in out:
            raise KeyError(f"not in {self.path}: {[t for t, i in zip(toks, out) if i is None]}")
        return out

    def decode(self, ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.id_to_token(int(i)) for i in ids]

    def text_ids(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in it (e.g. `<|im_start|>`) map to their ids."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def text(self, ids: Sequence[int]) -> str:
        """`ids` as text, special tokens dropped."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def mask(self, toks: Sequence[str]) -> torch.Tensor:
        import torch  # not at import: the orchestrator and simulate import Task without torch
        m = torch.zeros(len(self), dtype=torch.bool)
        m[self.encode(toks)] = True
        return m


class TaskArgError(ValueError):
    """A task argument out of range, raised by a task's constructor; the run reports it as
    `workflow.task_args.<arg>: <expected>` (load_task)."""

    def __init__(self, arg: str, expected: str):
        super().__init__(f"{arg}: {expected}")
        self.arg, self.expected = arg, expected


def int_arg(value: Any, arg: str, lo: int, hi: int) -> int:
    """`value` if it is an int in lo..hi, else TaskArgError naming `arg`."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise TaskArgError(arg, f"expected an integer in {lo}..{hi}, got {value!r}")
    return value


def float_arg(value: Any, arg: str, lo: float, hi: float) -> float:
    """`value` as a float if it is a finite number in lo..hi, else TaskArgError naming `arg`."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and lo <= value <= hi):
        raise TaskArgError(arg, f"expected a number in {lo:g}..{hi:g}, got {value!r}")
    return float(value)


MAX_TASK_TOKENS = 1 << 16
"""Most objects/symbols a built-in task takes: each becomes a vocabulary token (and an
embedding row), so a typo like 10**9 is refused instead of filling memory."""


@dataclass(frozen=True)
class Path:
    """One path from a root input down the workflow tree."""
    input: Any
    """The root input, as sample_inputs returned it."""
    responses: tuple[tuple[int, ...], ...] = ()
    """Token ids of each turn's response so far."""

    @classmethod
    def to(cls, node) -> "Path":
        """The path down to `node` (a training or evaluation node: `root_input`, `parent`):
        its root input and the responses of the nodes above it, top first."""
        responses, n = [], node.parent
        while n is not None:
            responses.append(tuple(n.response))
            n = n.parent
        return cls(node.root_input, tuple(reversed(responses)))


class Task:
    """Base class of workflow tasks (see the module docstring)."""

    vocab: Vocab | TokenizerVocab
    stop_tokens: frozenset[int] = frozenset({Vocab.eos_id})

    def sample_inputs(self, rng: np.random.Generator, n: int) -> list[Any]:
        raise NotImplementedError

    def prompt(self, turn: int, path: Path) -> list[int]:
        raise NotImplementedError

    def reward(self, path: Path) -> dict[str, float]:
        raise NotImplementedError

    def allowed_tokens(self, turn: int) -> torch.Tensor | None:
        return None

    def heldout_inputs(self, n: int) -> list[Any]:
        """`n` fixed root inputs for evaluation: deterministic (no rng is passed, so the
        training input stream is untouched) and, where the input space allows, disjoint from
        what sample_inputs draws."""
        raise NotImplementedError(f"{type(self).__module__}:{type(self).__name__} defines no "
                                  "heldout_inputs(n)")

    def eval_metrics(self, path: Path) -> dict[str, float]:
        """Metrics of one finished evaluation path (averaged over the held-out paths).
        Default: each agent's reward, keyed by the agent's name."""
        return dict(self.reward(path))

    def response_budget(self, turn: int, sample_id: str, default: int) -> int:
        """Most new tokens for this sample (default: the turn's max_new_tokens)."""
        return default

    def render(self, path: Path) -> str:
        """Human-readable episode (logs, analysis)."""
        parts = [str(path.input)] + [" ".join(self.vocab.decode(r)) for r in path.responses]
        return " | ".join(parts)


def load_task(spec: str, args: dict, turns: Sequence[str]) -> Task:
    """Import `module:Class` and build it as `Class(turns=[agent of each turn], **args)`."""
    from flexmarl_hpc.config.schema import ConfigError
    mod_name, _, cls_name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(mod_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"workflow.task: cannot import {spec!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(f"workflow.task: {spec!r} is not a flexmarl_hpc Task subclass")
    try:
        return cls(turns=list(turns), **args)
    except TaskArgError as e:
        raise ConfigError(f"workflow.task_args.{e.arg}: {e.expected}") from None
    except TypeError as e:
        raise ConfigError(f"workflow.task_args: {spec} rejected them: {e}") from None
    except (OSError, ValueError, KeyError) as e:       # e.g. a tokenizer file that is not there
        raise ConfigError(f"workflow.task_args: {spec} could not be built from them: {e}") from None
    except Exception as e:          # a user task's bug: still one line, with where it raised
        where = traceback.extract_tb(e.__traceback__)[-1]
        raise ConfigError(f"workflow.task_args: {spec}(**{args!r}) raised {type(e).__name__}: {e} "
                          f"({where.filename}:{where.lineno})") from None
