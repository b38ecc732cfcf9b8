"""What the agents said, episode by episode, from a run's store alone.

    python -m flexmarl_hpc.analyze RUN.h5 --transcripts [--step N] [--agent A] [--worst K] [--html PAGE]

The store holds each call's prompt and reply as token ids (/tokens/<agent>); they are decoded
with the run's own tokenizer (each agent's `model.checkpoint` folder of the run's config, or
`--tokenizer FOLDER`; the synthetic byte-level one when the run had none). A call whose
prompt extends the agent's earlier call of the episode (its own conversation, token for
token) shows only what was added (tool results, the next user turn). Tool calls are parsed
from the reply in the agent's format (workflow.tool_formats), the /tools rows of the episode
give what ran (outcome, latency), and /failures why an episode failed.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flexmarl_hpc.analysis.load import AnalysisError, Run
from flexmarl_hpc.workflows.toolcalls import parser_for


@dataclass
class CallText:
    """One call of an episode, decoded."""
    agent: str
    turn: int
    step: int
    version: int
    status: str
    reward: float
    advantage: float
    prompt: str
    """The prompt as text (special tokens included); only the new part when `continues`."""
    reply: str
    continues: int | None
    """The agent's earlier call (turn) this prompt extends token for token, else None."""
    prompt_tokens: int
    reply_tokens: int
    tool_calls: list = field(default_factory=list)
    tool_errors: list = field(default_factory=list)


@dataclass
class EpisodeText:
    step: int
    input_id: int
    traj: int
    calls: list[CallText]
    tools: list[tuple[str, str, str, float]]
    """(agent, tool, outcome, latency_s) of each /tools row of the episode."""
    failure: str = ""
    rewards: dict = field(default_factory=dict)
    """Mean reward per agent over its calls."""

    @property
    def score(self) -> float:
        r = [c.reward for c in self.calls if np.isfinite(c.reward)]
        return float(np.mean(r)) if r else float("-inf")


def tokenizers(run: Run, override: str | None = None) -> dict:
    """Each agent's chat tokenizer, as the run's config names it; AnalysisError naming the
    folder when it cannot be read."""
    from flexmarl_hpc.workflows.chat import ChatTokenizer, SyntheticChatTokenizer
    model = run.config.get("model", {}) or {}
    per = run.config.get("agents", {}) or {}
    folders = {a: override or (per.get(a) or {}).get("checkpoint") or model.get("checkpoint") or ""
               for a in run.agents}
    out, made = {}, {}
    for agent, folder in folders.items():
        if folder not in made:
            try:
                made[folder] = ChatTokenizer(folder) if folder else SyntheticChatTokenizer()
            except (OSError, ValueError) as e:
                raise AnalysisError(f"{run.path}: cannot read agent {agent!r}'s tokenizer ({e}); "
                                    f"give the folder with --tokenizer") from None
        out[agent] = made[folder]
    return out


def read_tokens(run: Run, rows) -> dict[tuple[str, int], np.ndarray]:
    """The token ids of the given /samples rows ({(agent, row): ids}), read by range."""
    from flexmarl_hpc.store.checksum import open_read
    out = {}
    with open_read(run.path) as f:
        for r in rows.itertuples():
            ds = f[f"tokens/{r.agent}"]
            n = int(r.prompt_len) + int(r.response_len)
            out[(r.agent, int(r.row))] = ds[int(r.token_offset):int(r.token_offset) + n]["token"].astype(np.int64)
    return out


def select(run: Run, step: int | None, agent: str | None, worst: int | None) -> list[tuple[int, int]]:
    """The (input_id, traj) of the episodes to show, in stream order (worst: lowest mean
    reward of `agent`'s calls, or of all calls, first)."""
    s = run.samples
    if s.empty:
        return []
    if agent is not None and agent not in run.agents:
        raise AnalysisError(f"{run.path}: --agent {agent!r}: expected one of {run.agents}")
    if step is not None:
        s = s[s["step"] == step]
    scored = s if agent is None else s[s["agent"] == agent]
    keys = sorted(set(zip(scored["input_id"].tolist(), scored["traj"].tolist())))
    if worst is not None:
        # a failed episode's dropped calls have no reward (NaN): those come first
        mean = scored.groupby(["input_id", "traj"])["reward"].mean().fillna(-np.inf)
        keys = sorted(keys, key=lambda k: (mean.get(k, np.inf), k))[:worst]
    return keys


def episodes(run: Run, keys: list[tuple[int, int]], toks: dict) -> list[EpisodeText]:
    """The chosen episodes, decoded."""
    s = run.samples
    chosen = s[[k in set(keys) for k in zip(s["input_id"], s["traj"])]].sort_values(["t_generated", "agent", "turn"])
    ids = read_tokens(run, chosen)
    formats = (run.config.get("workflow", {}) or {}).get("tool_formats", {}) or {}
    out = {}
    for key in keys:
        rows = chosen[(chosen["input_id"] == key[0]) & (chosen["traj"] == key[1])]
        calls = _calls(rows, ids, toks, formats)
        tools = run.tools[(run.tools["input_id"] == key[0]) & (run.tools["traj"] == key[1])] if len(run.tools) else []
        fail = run.failures[(run.failures["input_id"] == key[0]) & (run.failures["traj"] == key[1])]
        ep = EpisodeText(int(rows["step"].min()) if len(rows) else -1, key[0], key[1], calls,
                         [(r.agent, r.tool, r.outcome, float(r.latency_s)) for r in getattr(tools, "itertuples", list)()],
                         f"{fail['kind'].iloc[0]}: {fail['message'].iloc[0]}" if len(fail) else "")
        ep.rewards = {a: float(np.mean([c.reward for c in calls if c.agent == a])) for a in dict.fromkeys(c.agent for c in calls)}
        out[key] = ep
    return [out[k] for k in keys]


def _calls(rows, ids: dict, toks: dict, formats: dict) -> list[CallText]:
    seen: dict[str, list[tuple[int, np.ndarray]]] = {}
    calls = []
    for r in rows.itertuples():
        seq, tok, p = ids[(r.agent, int(r.row))], toks[r.agent], int(r.prompt_len)
        prompt, reply = seq[:p], seq[p:]
        earlier = next(((t, full) for t, full in reversed(seen.get(r.agent, []))
                        if len(full) <= p and np.array_equal(prompt[:len(full)], full)), None)
        new = prompt[len(earlier[1]):] if earlier else prompt
        text = tok.decode(reply.tolist(), skip_special_tokens=False)
        parsed, errors = parser_for(formats.get(r.agent, "hermes"))(text, f"{r.agent}-{int(r.turn)}")
        seen.setdefault(r.agent, []).append((int(r.turn), seq))
        calls.append(CallText(r.agent, int(r.turn), int(r.step), int(r.policy_version), str(r.status_name),
                              float(r.reward), float(r.advantage), tok.decode(new.tolist(), skip_special_tokens=False),
                              text, earlier[0] if earlier else None, p, len(reply), parsed, errors))
    return calls


def _indent(text: str, pad: str = "      ") -> str:
    return "\n".join(pad + line for line in text.splitlines() or [""])


def format_text(eps: list[EpisodeText]) -> str:
    lines = []
    for ep in eps:
        rewards = ", ".join(f"{a} {r:.3f}" for a, r in ep.rewards.items())
        lines.append(f"== step {ep.step}, example {ep.input_id}, episode {ep.traj}  (mean reward: {rewards})"
                     + (f"  FAILED {ep.failure}" if ep.failure else ""))
        for c in ep.calls:
            lines.append(f"-- {c.agent} call {c.turn}  reward {c.reward:.3f}  advantage {c.advantage:.3f}  "
                         f"[{c.status}, v{c.version}, {c.prompt_tokens} prompt + {c.reply_tokens} reply tokens]")
            lines.append("   prompt" + (f" (continues {c.agent} call {c.continues}; added):" if c.continues is not None else ":"))
            lines.append(_indent(c.prompt))
            lines.append("   reply:")
            lines.append(_indent(c.reply))
            for t in c.tool_calls:
                lines.append(f"   tool call {t.id}: {t.name} {t.arguments}")
            for e in c.tool_errors:
                lines.append(f"   unreadable tool call {e.id}: {e.error}")
        for agent, tool, outcome, latency in ep.tools:
            lines.append(f"   ran: {tool} ({agent or 'reward'}) {outcome} in {latency:.3f} s")
        lines.append("")
    return "\n".join(lines)


def format_html(eps: list[EpisodeText], title: str) -> str:
    """One self-contained page: an episode per section, a call per box."""
    e = html.escape
    parts = [f"<!doctype html><meta charset='utf-8'><title>{e(title)}</title><style>"
             "body{font:14px sans-serif;margin:2em;max-width:70em}section{border-top:2px solid #888;margin:1.5em 0}"
             ".call{border:1px solid #ccc;border-radius:6px;padding:.5em 1em;margin:.6em 0}"
             "pre{white-space:pre-wrap;background:#f6f6f6;padding:.5em;margin:.2em 0}.reply pre{background:#eef6ee}"
             ".bad{color:#b00}.meta{color:#555}</style>", f"<h1>{e(title)}</h1>"]
    for ep in eps:
        rewards = ", ".join(f"{e(a)} {r:.3f}" for a, r in ep.rewards.items())
        parts.append(f"<section><h2>step {ep.step}, example {ep.input_id}, episode {ep.traj}</h2>"
                     f"<p class=meta>mean reward: {rewards}</p>"
                     + (f"<p class=bad>failed: {e(ep.failure)}</p>" if ep.failure else ""))
        for c in ep.calls:
            cont = f" (continues call {c.continues}; added)" if c.continues is not None else ""
            tools = "".join(f"<li>{e(t.name)} {e(str(t.arguments))}</li>" for t in c.tool_calls)
            tools += "".join(f"<li class=bad>unreadable: {e(x.error)}</li>" for x in c.tool_errors)
            parts.append(f"<div class=call><b>{e(c.agent)}</b> call {c.turn} <span class=meta>reward "
                         f"{c.reward:.3f}, advantage {c.advantage:.3f}, {e(c.status)}, v{c.version}</span>"
                         f"<div>prompt{cont}:<pre>{e(c.prompt)}</pre></div><div class=reply>reply:<pre>"
                         f"{e(c.reply)}</pre></div>" + (f"<ul>{tools}</ul>" if tools else "") + "</div>")
        ran = "".join(f"<li>{e(t)} ({e(a or 'reward')}): {e(o)} in {lat:.3f} s</li>" for a, t, o, lat in ep.tools)
        parts.append((f"<ul class=meta>{ran}</ul>" if ran else "") + "</section>")
    return "".join(parts)


def transcripts_main(run: Run, step, agent, worst, tokenizer: str | None, page: Path | None) -> str:
    """The text to print (and the page written when `page`); AnalysisError for bad input."""
    if not (run.config.get("workflow", {}) or {}).get("episode"):
        raise AnalysisError(f"{run.path}: --transcripts reads episode workflows (workflow.episode is empty)")
    keys = select(run, step, agent, worst)
    eps = episodes(run, keys, tokenizers(run, tokenizer))
    if page is not None:
        page.write_text(format_html(eps, f"{run.path.name}: transcripts"), encoding="utf-8")
    return format_text(eps) if eps else f"{run.path}: no episodes match"
