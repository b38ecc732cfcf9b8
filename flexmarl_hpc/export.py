"""Export a trained agent of a run as a HF checkpoint folder: config.json, model.safetensors
and, for tasks on a pretrained tokenizer, its tokenizer files. transformers, vLLM and our own
`model.checkpoint` load the folder.

    python -m flexmarl_hpc.export runs/smollm2_arith solver exported/solver
    python -m flexmarl_hpc.export runs/local speaker out/speaker --version 500

The weights come from the run's checkpoint (the latest, or `--version`), whichever trainer
backend wrote it: a torch-format file holds the portable HF-named state; a megatron
dist_checkpointing folder is loaded into a one-rank megatron trainer (resharding) and its
weights converted to HF names.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from flexmarl_hpc.config.hf_config import model_args
from flexmarl_hpc.workflows.build import build_task
from flexmarl_hpc.config.schema import ConfigError
from flexmarl_hpc.config.load import load_config
from flexmarl_hpc.learn.model import CausalLM, save_hf_checkpoint
from flexmarl_hpc.workflows.base import TokenizerVocab

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def checkpoint_file(run_dir: Path, agent: str, version: int | None) -> Path:
    folder = run_dir / "checkpoints" / agent
    if version is None:
        latest = folder / "latest"
        if not latest.is_file():
            raise FileNotFoundError(f"{latest}: no checkpoint of agent {agent!r} in this run")
        return folder / latest.read_text().strip()
    path = folder / f"v{version:06d}.pt"
    if not path.is_file() and (folder / path.stem).is_dir():
        return folder / path.stem                     # a megatron dist_checkpointing entry
    if not path.is_file():
        have = sorted(p.stem for p in folder.glob("v*") if p.suffix in ("", ".pt") and p.name != "latest")
        raise FileNotFoundError(f"{path}: no checkpoint of version {version} (kept: {have or 'none'})")
    return path


def load_agent(run_dir: Path, cfg, task, agent: str, version: int | None = None) -> tuple[CausalLM, Path]:
    """Agent's model at checkpoint `version` of the run (default the latest), whatever wrote
    it: a torch `.pt` file or a megatron dist_checkpointing folder (resharded into one CPU
    rank). Returns the model and the checkpoint entry used."""
    path = checkpoint_file(run_dir, agent, version)
    args = model_args(cfg, task, agent)
    if path.is_dir():
        from flexmarl_hpc.trainer.megatron import hf_weights_of_entry
        weights = hf_weights_of_entry(path, args, cfg.trainer)
    else:
        state = torch.load(path, weights_only=True)
        weights = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    model = CausalLM(args)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not (model.args.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the run's model: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    return model, path


def export(run_dir: str | Path, agent: str, out: str | Path, version: int | None = None) -> Path:
    """Write agent's weights (checkpoint `version`, default the latest) to `out`; returns the
    checkpoint file used."""
    run_dir, out = Path(run_dir), Path(out)
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: not a run directory (no resolved config.yaml)")
    cfg = load_config(cfg_file)
    if agent not in cfg.agent_names:
        raise ConfigError(f"agent {agent!r} is not in this run (agents: {cfg.agent_names})")
    task = build_task(cfg)
    model, path = load_agent(run_dir, cfg, task, agent, version)
    save_hf_checkpoint(model, out)
    if isinstance(task.vocab, TokenizerVocab):
        src = Path(task.vocab.path).parent
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, out / name)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flexmarl_hpc.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="the run's output_dir (holds config.yaml and checkpoints/)")
    ap.add_argument("agent", help="which agent to export")
    ap.add_argument("out", help="folder to write the HF checkpoint into")
    ap.add_argument("--version", type=int, default=None, help="policy version (default: latest)")
    args = ap.parse_args(argv)
    try:
        path = export(args.run_dir, args.agent, args.out, args.version)
    except (OSError, ValueError) as e:
        print(f"export: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.agent} from {path} to {args.out}: "
          f"{', '.join(sorted(p.name for p in Path(args.out).iterdir()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
