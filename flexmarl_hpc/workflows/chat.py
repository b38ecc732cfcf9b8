"""Chat templates and token-exact conversations for episode workflows.

    tok = ChatTokenizer("models/smollm2-135m-instruct")
    conv = Conversation(tok)
    ids = conv.prompt_ids([{"role": "user", "content": "2+3?"}])     # -> the engine
    text = conv.record(sampled_ids)                                 # the engine's ids, kept verbatim
    ids = conv.prompt_ids([..., {"role": "assistant", "content": text}, {"role": "user", ...}])

A prompt is rendered with the checkpoint's own `chat_template`, the way transformers'
`apply_chat_template` renders it (transformers/utils/chat_template_utils.py), but without
importing transformers. Across turns the ids the policy sampled stay in the context as sampled:
decoding them and encoding the text again can give other ids (" 12" sampled as " 1", "2" encodes
as " 12"), and the trainer must score the ids the engine produced.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = dict[str, Any]
# The named special tokens transformers passes to every template (special_tokens_map)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters (<, >, &, '); HF's does not, and templates rely on it
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    # Templates are untrusted code from a checkpoint folder: the sandbox, as transformers uses it
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_string(value):
    """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken."""
    return value.get("content") if isinstance(value, dict) else value


HERMES_TOOLS = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}"
                "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, "
                "\"arguments\": <args-json-object>}}\n</tool_call>")
"""Qwen2.5's tools section of the system message, for templates that render no tools."""


def tools_in_system(messages: Sequence[Message], tools: Sequence[dict]) -> list[Message]:
    """The messages with the tools written into the system message as Qwen2.5's template
    writes them (one is added when there is none): how a template that ignores `tools`
    (SmolLM2's) still shows the model its tools, in the format the hermes parser reads."""
    block = HERMES_TOOLS.format(tools="".join("\n" + _tojson(t) for t in tools))
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": str(messages[0].get("content") or "") + block}, *messages[1:]]
    return [{"role": "system", "content": block.lstrip("\n")}, *messages]


class ChatTemplate:
    """A checkpoint's chat template and the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})      # bos_token, eos_token, ... as in HF
        env = _environment()
        self.template = env.from_string(source)
        self.reads_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        """The template renders `tools` itself (Qwen2.5, Hermes); else render() writes them
        into the system message (tools_in_system)."""

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ChatTemplate":
        """Read `chat_template.jinja` (newer HF folders) or `chat_template` of tokenizer_config.json."""
        folder = Path(folder)
        config_file = folder / "tokenizer_config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file}: no tokenizer_config.json (expected a HF checkpoint folder)")
        config = json.loads(config_file.read_text(encoding="utf-8"))
        jinja_file = folder / "chat_template.jinja"
        source = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else config.get("chat_template")
        if not isinstance(source, str) or not source:
            raise ValueError(f"{config_file}: no chat_template (expected a string field `chat_template` "
                             f"or a file {jinja_file.name} next to it)")
        specials = {k: _token_string(config[k]) for k in SPECIAL_TOKENS
                    if isinstance(_token_string(config.get(k)), str)}
        return cls(source, specials)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool, **kwargs) -> str:
        """The prompt text, as `apply_chat_template(messages, tokenize=False, ...)` gives it."""
        if not messages:
            raise ValueError("messages: expected at least one message, got an empty list")
        chat = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}]: expected a dict with 'role' and 'content', got {m!r}")
            # OpenAI-style None fields (content=None, tool_calls=None) are dropped, as HF does
            chat.append({k: v for k, v in m.items() if v is not None})
        if kwargs.get("tools") and not self.reads_tools:
            chat = tools_in_system(chat, kwargs["tools"])
        return self.template.render(messages=chat, add_generation_prompt=add_generation_prompt,
                                    **{"tools": None, "documents": None, **self.special_tokens, **kwargs})


class ChatTokenizer:
    """A checkpoint folder's tokenizer.json and chat template."""

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer
        folder = Path(folder)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no tokenizer.json (expected a HF checkpoint folder)")
        self.tokenizer = Tokenizer.from_file(str(file))
        self.template = ChatTemplate.from_folder(folder)
        eos = self.template.special_tokens.get("eos_token")
        self.eos_id = self.tokenizer.token_to_id(eos) if eos else None
        if self.eos_id is None:
            raise ValueError(f"{folder / 'tokenizer_config.json'}: eos_token: expected a token of "
                             f"{file.name}, got {eos!r}")
        eot = self.tokenizer.token_to_id("<|endoftext|>")
        self.stop_ids = [self.eos_id] + ([eot] if eot is not None and eot != self.eos_id else [])
        pad = self.template.special_tokens.get("pad_token")
        self.pad_id = next(i for i in (self.tokenizer.token_to_id(pad) if pad else None, eot, self.eos_id)
                           if i is not None)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs) -> str:
        return self.template.render(messages, add_generation_prompt, **kwargs)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special tokens written in it map to their ids; no BOS is added."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


class Conversation:
    """The token-exact context of one agent in one episode.

    `ids` are the last prompt's ids followed by the response ids recorded since, and `text` is
    the text they stand for (special tokens included). A new prompt whose rendering extends
    `text` is `ids + encode(rest)`; any other rendering (history rewritten, or a template that
    renders earlier turns differently, e.g. Qwen3 dropping past thinking) is encoded from
    scratch and counted in `rerendered`."""

    def __init__(self, tokenizer: ChatTokenizer, **template_kwargs):
        self.tok = tokenizer
        self.template_kwargs = template_kwargs
        self.ids: list[int] = []
        self.text = ""
        self.rerendered = 0
        self.prefill_len = 0
        """The last prompt's final ids that are its prefill (0 without one)."""

    def prompt_ids(self, messages: Sequence[Message], prefill: str = "", **kwargs) -> list[int]:
        """The prompt's ids; kwargs (`tools=[...]`) reach the template with template_kwargs.
        prefill: text the reply starts with, not sampled (a forced tool call's opening): it
        is prompt text, so its ids are outside the trained mask, and the reply recorded next
        continues it (`record`'s text is without it). Its ids are encoded on their own and
        end the prompt, `prefill_len` of them: encoded with the rendering, a token merged
        across the boundary would be neither the template's nor the prefill's."""
        rendered = self.tok.render(messages, add_generation_prompt=True, **{**self.template_kwargs, **kwargs})
        if self.ids and rendered.startswith(self.text):
            self.ids = self.ids + self.tok.encode(rendered[len(self.text):])
        else:
            self.rerendered += bool(self.ids)
            self.ids = self.tok.encode(rendered)
        head = self.tok.encode(prefill) if prefill else []
        self.ids += head
        self.prefill_len = len(head)
        self.text = rendered + prefill
        return list(self.ids)

    def record(self, response_ids: Sequence[int]) -> str:
        """Append the sampled ids; returns the response text (stop token stripped) for the
        episode to put in the next assistant message. A special token the model sampled
        mid-reply stays in the text: dropped, the next rendering would no longer extend
        `text`, and the whole context would be re-encoded from text (not token-exact)."""
        response_ids = list(map(int, response_ids))
        self.ids += response_ids
        stopped = bool(response_ids) and response_ids[-1] in self.tok.stop_ids
        body = response_ids[:-1] if stopped else response_ids
        self.text += self.tok.decode(body, skip_special_tokens=False)
        if stopped:
            # another stop token (<|endoftext|>) ends the turn as the template's eos would:
            # the sampled id stays, and the next rendering still extends these ids
            self.text += self.tok.decode([self.tok.eos_id], skip_special_tokens=False)
        return self.tok.decode(body, skip_special_tokens=False)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""The synthetic tokenizer's template: ChatML, as Qwen2.5 and SmolLM2 write it (no default system)."""


class SyntheticChatTokenizer:
    """A byte-level tokenizer with ChatML special tokens, for models without a checkpoint
    (`model.checkpoint` empty: random init, the paper's 14B/32B shapes in the simulator).

    Ids 0-255 are the UTF-8 bytes, then <|endoftext|>, <|im_start|>, <|im_end|> (eos); one
    ASCII character is one token, so a text of n ASCII characters is n tokens: the lengths
    an episode writes are the lengths priced. Same interface as ChatTokenizer, so
    Conversation keeps sampled ids verbatim the same way. A real run of a random-init model
    may use it too (a smoke test of the whole path without a download); it is no model's
    tokenizer, so it never pairs with a checkpoint."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    FILLER = b"abcdefghijklmnopqrstuvwxyz"
    """The bytes synthetic replies are drawn from (sim.transport.SyntheticWorkers): letters,
    so reply text is plain ASCII whatever the draw."""

    def __init__(self):
        import re
        self.ids = {tok: 256 + i for i, tok in enumerate(self.SPECIALS)}
        self.split = re.compile("(" + "|".join(re.escape(t) for t in self.SPECIALS) + ")")
        self.template = ChatTemplate(CHATML, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
        self.eos_id, self.pad_id = self.ids["<|im_end|>"], self.ids["<|endoftext|>"]
        self.bos_id = self.ids["<|im_start|>"]          # the task vocabulary's (it is its own)
        self.stop_ids = [self.eos_id, self.pad_id]

    def __len__(self) -> int:
        return 256 + len(self.SPECIALS)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True, **kwargs) -> str:
        return self.template.render(messages, add_generation_prompt, **kwargs)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for part in self.split.split(text):
            out.extend([self.ids[part]] if part in self.ids else part.encode("utf-8"))
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # runs of byte ids between specials decode at once: an id at a time was the simulator's
        # largest cost of our own on the paper tasks (8k-token synthetic replies, 2026-11-26)
        if isinstance(ids, (list, tuple)):       # (bytes() of an array would read its buffer)
            try:                                 # no special id (every synthetic reply): one call
                return bytes(ids).decode("utf-8", errors="replace")
            except (ValueError, TypeError):      # an id >= 256 (or not an int): split below
                pass
        ids = [int(i) for i in ids]
        out, start = [], 0
        for k in [k for k, i in enumerate(ids) if i >= 256]:
            out.append(bytes(ids[start:k]).decode("utf-8", errors="replace"))
            if not skip_special_tokens:
                out.append(self.SPECIALS[ids[k] - 256])
            start = k + 1
        out.append(bytes(ids[start:]).decode("utf-8", errors="replace"))
        return "".join(out)

    @property
    def filler_ids(self) -> list[int]:
        return list(self.FILLER)
