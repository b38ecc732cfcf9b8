"""A tiny random-init chat model folder, for smoke tests of episode workflows without a
download: a byte-level BPE tokenizer.json (trained here on a few sentences, with ChatML's
special tokens), a ChatML chat template in tokenizer_config.json (SmolLM2's form, with Qwen2.5's
tool calls and tool responses when `tools` are given), and a
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
"""The template before tools (kept: what a tool-free prompt renders to is unchanged)."""
TOOLS = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
         "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_END = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
             "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\\\"name\\\": <function-name>, "
             "\\\"arguments\\\": <args-json-object>}\n</tool_call>")
CHAT_TEMPLATE = (
    # Qwen2.5's tool handling (the tools in the system message, tool calls as <tool_call> JSON,
    # tool results as <tool_response> in a user turn) around CHATML: no default system prompt
    "{% if tools %}{{ '<|im_start|>system\n' }}{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}{% else %}{{ 'You are a helpful assistant.' }}{% endif %}"
    "{{ \"" + TOOLS + "\" }}{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ \"" + TOOLS_END + "<|im_end|>\n\" }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\n' + message['content'] }}{% endif %}"
    "{% for tc in message['tool_calls'] %}{% if tc['function'] is defined %}{% set tc = tc['function'] %}{% endif %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + tc['name'] + '\", \"arguments\": ' }}{{ tc['arguments'] | tojson }}"
    "{{ '}\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}"
    "{% else %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
"""The folder's chat template: CHATML when no tools are given, Qwen2.5's tool handling when they are."""
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
        "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE}, indent=1))
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
