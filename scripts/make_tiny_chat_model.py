"""A tiny random-init chat model folder, for smoke tests of episode workflows without a
download: a byte-level BPE tokenizer.json (trained here on a few sentences, with ChatML's
special tokens), a ChatML chat template in tokenizer_config.json (SmolLM2's form), and a
2-layer Llama-style model (config.json + model.safetensors). Its answers are noise; the
plumbing it exercises is the real one.

    python scripts/make_tiny_chat_model.py models/tiny-chat [--hidden 64 --layers 2 --seed 0]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["system user assistant You are a helpful assistant. Problem: Tom has 12 apples and buys 30 "
          "more. How many apples does he have? Answer: 42. Which answer is correct? Reply with the "
          "number only. How many people should try 1, 2 or 3? <calc>12 + 30</calc> Calculator: 42",
          "0 1 2 3 4 5 6 7 8 9 10 11 12 + - * / = ( )"] * 20


def write_tokenizer(folder: Path, vocab: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": CHATML}, indent=1))
    return tok.get_vocab_size()


def make(out: Path, hidden: int = 64, layers: int = 2, seed: int = 0, max_seq_len: int = 2048) -> Path:
    """Write the folder atomically (next to `out`, then renamed); returns `out`."""
    from flexmarl_hpc.learn.model import ModelArgs, build_model, save_hf_checkpoint
    tmp = out.with_name(f"{out.name}.tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab = write_tokenizer(tmp, 400)
    args = ModelArgs(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2,
                     intermediate_size=2 * hidden, max_seq_len=max_seq_len, tie_embeddings=True)
    save_hf_checkpoint(build_model(args, seed, 0.02), tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(f"wrote {make(a.out, a.hidden, a.layers, a.seed)}")


if __name__ == "__main__":
    main()
