"""Schema 4 (issue 25): /tools and /episodes written through StoreFile, committed, checksummed,
salvaged and read back by analysis.load and analyze; a schema-3 store (tests/golden/store_v3.h5,
written by the code before the bump) still read by analyze (schema 6's /samples columns as 0),
salvaged into this release's records, and refused by a resume, as is a schema-5 one."""
import hashlib
import json
import shutil

import h5py
import numpy as np
import pandas as pd
import pytest

from flexmarl_hpc.analysis.episodes import _tree_paths, calls_per_episode
from flexmarl_hpc.analysis.load import AnalysisError, load_run, summary
from flexmarl_hpc.analyze import main as analyze_main
from flexmarl_hpc.store.checksum import StoreDamaged
from flexmarl_hpc.store.tables import StoreFile
from flexmarl_hpc.store.schema import CONSUMED, TOOL_OUTCOMES
from tests.conftest import ROOT
from tests.helpers import in_child_then_kill, corrupt

AGENTS = ["planner", "solver", "verifier"]
GOLDEN_V3 = ROOT / "tests" / "golden" / "store_v3.h5"


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def calls_rows(s, agent, episodes, step=0):
    """/samples rows of episode calls as issue 25 numbers them: input_id, traj = the episode,
    turn = the agent's call index in it, parent_id "<agent>/<sample_id>" (root: "")."""
    rows = []
    for input_id, traj, n in episodes:
        for turn in range(n):
            rows.append((f"{input_id}_{turn}_{traj}", f"planner/{input_id}_0_{traj}", input_id, turn, traj))
    out = np.zeros(len(rows), s.samples[agent].dtype)
    for name, values in zip(["sample_id", "parent_id", "input_id", "turn", "traj"], zip(*rows)):
        out[name] = values
    out["step"], out["status"], out["trainer_step"] = step, CONSUMED, 0
    out["reward"] = out["advantage"] = out["t_ready"] = out["t_consumed"] = np.nan
    return out


def skewed(path, record=True):
    """Two examples x 3 episodes: 1 planner call each, 0-4 solver calls, 1 verifier call where
    the planner called any solver; tool calls of the solvers and one reward function each."""
    s = StoreFile(path, AGENTS, {"mode": "flex"}, chunk=8)
    solver = {(0, 0): 1, (0, 1): 4, (0, 2): 0, (1, 0): 2, (1, 1): 2, (1, 2): 3}
    for (i, t), n in solver.items():
        s.samples["planner"].append(calls_rows(s, "planner", [(i, t, 1)]))
        if n:
            s.samples["solver"].append(calls_rows(s, "solver", [(i, t, n)]))
            s.samples["verifier"].append(calls_rows(s, "verifier", [(i, t, 1)]))
        for c in range(n):
            s.record_tool(1.0 + c, "solver", i, t, c, "python", "timeout" if c == 3 else "ok", 0.1 * (c + 1))
        s.record_tool(2.0, None, i, t, -1, "math_reward", "ok", 0.002)
        if record:
            s.record_episode(3.0, 0, i, t, {"planner": 1, "solver": n, "verifier": int(n > 0)},
                             {"planner": 1.0, "solver": 0.5, "verifier": 0.0})
    s.close()
    return solver


def test_tool_and_episode_rows_read_back_after_a_flush_a_reopen_and_through_load(tmp_path):
    path = tmp_path / "s.h5"
    s = StoreFile(path, AGENTS, {})
    s.record_tool(1.5, "solver", 7, 2, 3, "python", "killed_cpu", 0.25)
    s.record_tool(1.75, None, 7, 2, -1, "math_reward", "reward_error", 0.5)
    s.record_episode(2.0, 4, 7, 2, {"planner": 1, "solver": 3}, {"planner": 1.0, "verifier": 0.0})
    s.flush(full=False)                     # written and readable; committed by the next flush
    with h5py.File(path, "r", swmr=True) as f:
        assert len(f["tools"]) == 2 and len(f["episodes"]) == 1
    s.close()
    s = StoreFile(path, AGENTS, {})         # a resume: the rows are kept, more are appended
    assert not s.repaired and len(s.tools.read()) == 2
    s.record_tool(3.0, "verifier", 7, 1, 0, "calculator", "refused", 0.001)
    s.close()
    with h5py.File(path, "r") as f:
        assert f.attrs["schema_version"] == 6
        counts = dict(zip(f["commit"].attrs["tables"], f["commit"][:]))
        assert counts["/tools"] == 3 and counts["/episodes"] == 1
        ep = f["episodes"][0]
        assert ep["calls"].tolist() == [1, 3, 0] and ep["reward"][[0, 2]].tolist() == [1.0, 0.0]
    run = load_run(path)
    assert run.tools.to_dict("list") == {
        "t": [1.5, 1.75, 3.0], "agent": ["solver", "", "verifier"], "input_id": [7, 7, 7], "traj": [2, 2, 1],
        "call": [3, -1, 0], "tool": ["python", "math_reward", "calculator"],
        "outcome": ["killed_cpu", "reward_error", "refused"], "latency_s": pytest.approx([0.25, 0.5, 0.001])}
    ep = run.episodes
    assert ep["agent"].tolist() == AGENTS and ep["calls"].tolist() == [1, 3, 0]
    assert ep["reward"].tolist()[0] == 1.0 and np.isnan(ep["reward"].tolist()[1])
    assert (ep["step"] == 4).all() and (ep["input_id"] == 7).all() and (ep["traj"] == 2).all()


def test_a_kill_before_the_commit_leaves_neither_the_episode_nor_its_calls(tmp_path):
    path = tmp_path / "s.h5"

    def write():
        s = StoreFile(path, AGENTS, {})
        s.samples["planner"].append(calls_rows(s, "planner", [(0, 0, 1)]))
        s.record_episode(1.0, 0, 0, 0, {"planner": 1}, {"planner": 1.0})
        s.flush()                                               # committed
        s.samples["solver"].append(calls_rows(s, "solver", [(0, 1, 2)]))
        s.record_tool(2.0, "solver", 0, 1, 0, "python", "ok", 0.1)
        s.record_episode(2.0, 0, 0, 1, {"solver": 2}, {})
        s.flush(full=False)           # written, but /commit names the previous flush's rows
        return s

    in_child_then_kill(write)
    s = StoreFile(path, AGENTS, {})
    assert len(s.episodes.read()) == 1 and not len(s.tools.read()) and not len(s.samples["solver"].read())
    assert any("uncommitted rows of /episodes" in r for r in s.repaired)
    s.close()


def test_bad_tool_and_episode_input_names_the_field(tmp_path):
    s = StoreFile(tmp_path / "s.h5", AGENTS, {})
    with pytest.raises(ValueError, match="/tools outcome 'oom': expected one of ok, error"):
        s.record_tool(0.0, "solver", 0, 0, 0, "python", "oom", 0.1)
    with pytest.raises(ValueError, match="/tools tool 'x{65}': expected 1 to 64 ascii"):
        s.record_tool(0.0, "solver", 0, 0, 0, "x" * 65, "ok", 0.1)
    with pytest.raises(ValueError, match="/tools tool 'caf\u00e9': expected an ascii string"):
        s.record_tool(0.0, "solver", 0, 0, 0, "caf\u00e9", "ok", 0.1)
    with pytest.raises(ValueError, match="/tools agent 'judge': expected one of the run's agents"):
        s.record_tool(0.0, "judge", 0, 0, 0, "python", "ok", 0.1)
    with pytest.raises(ValueError, match="/episodes calls 'judge'"):
        s.record_episode(0.0, 0, 0, 0, {"judge": 1}, {})
    assert not s.tools.n and not s.episodes.n                   # nothing half-queued
    s.close()


def test_the_outcome_codes_cover_every_outcome_the_tools_give():
    from flexmarl_hpc.tools.sandbox import OUTCOMES
    assert set(OUTCOMES) | {"refused", "reward_error"} == set(TOOL_OUTCOMES)
    assert TOOL_OUTCOMES[0] == "ok"            # codes are positions: existing ones never move


@pytest.mark.parametrize("table", ["/tools", "/episodes"])
def test_a_damaged_tools_or_episodes_chunk_is_refused_like_the_other_tables(tmp_path, table):
    path = tmp_path / "s.h5"
    s = StoreFile(path, AGENTS, {})
    for i in range(5):
        s.record_tool(float(i), "solver", i, 0, 0, "python", "ok", 0.1)
        s.record_episode(float(i), 0, i, 0, {"solver": i}, {"solver": 1.0})
    s.close()
    with h5py.File(path, "r") as f:             # committed bytes (past them: a torn append)
        offset = f[table].id.get_chunk_info(0).byte_offset
    with open(path, "r+b") as fh:
        fh.seek(offset + 20)
        fh.write(b"\x5a" * 8)          # not 0xff: Fletcher-32 misses 0x0000 <-> 0xffff words
    before = sha(path)
    with pytest.raises(StoreDamaged, match=f"checksum mismatch in {table} rows 0-"):
        StoreFile(path, AGENTS, {})
    assert sha(path) == before
    with pytest.raises(AnalysisError, match=f"damaged store: checksum mismatch in {table}"):
        load_run(path)


def test_a_schema_3_store_is_read_by_analyze_and_refused_by_a_resume(tmp_path, capsys, monkeypatch):
    path = tmp_path / "local.h5"
    shutil.copy(GOLDEN_V3, path)
    before = sha(path)
    run = load_run(path)
    assert run.attrs["schema_version"] == 3 and run.tools.empty and run.episodes.empty
    # the /samples columns of schema 6 it lacks read as 0, integers as written
    assert len(run.samples) == 8 and (run.samples[["retokenized", "prefill_len"]] == 0).all().all()
    assert run.samples["retokenized"].dtype == np.int8 and run.samples["prefill_len"].dtype == np.int32
    assert list(run.tools.columns)[:3] == ["t", "agent", "input_id"] and "calls" in run.episodes
    s = summary(run)
    assert s["per_agent"]["a"]["reward_last"] == pytest.approx(0.75) and s["tools"] == {}
    # fixed turns [a, b], two episodes per input: every agent calls once per episode
    assert s["calls_per_episode"] == {"source": "/samples tree paths", "per_agent": {
        a: {"episodes": 4, "mean": 1.0, "min": 1, "max": 1, "hist": {1: 4}} for a in ("a", "b")}}
    assert analyze_main([str(path), "--out", str(tmp_path / "figs")]) == 0
    assert "calls/episode a            mean 1.00  min 1  max 1" in capsys.readouterr().out
    assert (tmp_path / "figs" / "calls_per_episode.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="schema version 3; this flexmarl_hpc writes version 6"):
        StoreFile(path, ["a", "b"], {})
    import flexmarl_hpc.submit as sub
    from flexmarl_hpc.config.schema import ConfigError
    monkeypatch.setattr(sub, "_slurm", lambda *a, **k: pytest.fail("sbatch was called"))
    with pytest.raises(ConfigError, match="cannot resume: .*schema version 3; this flexmarl_hpc writes version 6"):
        sub.submit("configs/local.yaml", [f"run.output_dir={tmp_path}"], check_partitions=False)
    assert sha(path) == before


def test_a_schema_5_store_is_refused_by_a_resume_and_salvage_writes_the_new_columns_as_0(tmp_path):
    """The release before (schema 5) is refused as 3 and 4 were: finish a run with the release
    that started it. Salvage reads an older store (here the golden schema 3) and writes this
    release's records, by column name, the columns the source lacks 0."""
    from flexmarl_hpc.store.salvage import salvage
    path = tmp_path / "s.h5"
    StoreFile(path, ["a", "b"], {}).close()
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = 5               # what the schema-5 release wrote there
    before = sha(path)
    with pytest.raises(ValueError, match="schema version 5; this flexmarl_hpc writes version 6"):
        StoreFile(path, ["a", "b"], {})
    assert sha(path) == before
    old = load_run(GOLDEN_V3).samples
    rep = salvage(GOLDEN_V3, tmp_path / "new.h5")
    assert not any(rep.lost_ids.values())
    run = load_run(tmp_path / "new.h5")
    assert run.attrs["schema_version"] == 6
    pd.testing.assert_frame_equal(run.samples, old)             # every column, the new ones 0
    with h5py.File(tmp_path / "new.h5", "r") as f:
        assert (f["samples/a"]["retokenized"] == 0).all() and (f["samples/b"]["prefill_len"] == 0).all()


def test_analyze_shows_the_skew_of_calls_per_episode_and_the_tools(tmp_path, capsys):
    path = tmp_path / "s.h5"
    solver = skewed(path)
    s = summary(load_run(path))
    c = s["calls_per_episode"]
    assert c["source"] == "/episodes"
    assert c["per_agent"]["solver"] == {"episodes": 6, "mean": pytest.approx(2.0), "min": 0, "max": 4,
                                        "hist": {0: 1, 1: 1, 2: 2, 3: 1, 4: 1}}
    assert c["per_agent"]["verifier"]["hist"] == {0: 1, 1: 5} and c["per_agent"]["planner"]["max"] == 1
    py = s["tools"]["python"]
    lat = [0.1 * (c + 1) for n in solver.values() for c in range(n)]
    assert py["calls"] == 12 and py["outcomes"] == {"ok": 11, "timeout": 1}
    assert py["latency_median_s"] == pytest.approx(np.median(lat), rel=1e-6)
    assert py["latency_p95_s"] == pytest.approx(np.percentile(lat, 95), rel=1e-6)
    assert s["tools"]["math_reward"]["calls"] == 6
    assert analyze_main([str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calls_per_episode"]["per_agent"]["solver"]["max"] == 4
    assert analyze_main([str(path), "--out", str(tmp_path / "figs")]) == 0
    out = capsys.readouterr().out
    assert "calls/episode solver       mean 2.00  min 0  max 4  (6 episodes; /episodes)" in out
    assert "tool python               12 calls (ok 11, timeout 1)" in out
    assert len((tmp_path / "figs" / "calls_per_episode.png").read_bytes()) > 10_000


def test_without_episode_rows_the_calls_come_from_the_samples_grouped_by_episode(tmp_path):
    """No /episodes (a workflow that records none): /samples rows of episode calls grouped by
    (input_id, traj); an agent with no row in an episode that has rows counts 0."""
    skewed(tmp_path / "s.h5", record=False)
    calls, source = calls_per_episode(load_run(tmp_path / "s.h5"))
    assert source == "/samples by (input_id, traj)"
    solver = calls[calls["agent"] == "solver"].sort_values(["input_id", "traj"])["calls"].tolist()
    assert solver == [1, 4, 0, 2, 2, 3]


def test_tree_paths_count_each_complete_root_to_leaf_path():
    """Fixed turns [a, b, a] with 2 samples at turns 0 and 1: 4 paths per input, each with a
    twice and b once; a path cut short (no turn-2 leaf) is not an episode. Grouping by
    (input_id, traj) would count b's children under traj 0..3 and a's roots under 0..1."""
    rows = []
    for r in range(2):
        rows.append(("a", f"0_0_{r}", "", 0, r))
        for b in range(2):
            t1 = r * 2 + b
            rows.append(("b", f"0_1_{t1}", f"0_0_{r}", 1, t1))
            if t1 != 3:                                    # path 3 cut short
                rows.append(("a", f"0_2_{t1}", f"0_1_{t1}", 2, t1))
    s = pd.DataFrame(rows, columns=["agent", "sample_id", "parent_id", "turn", "traj"]).assign(input_id=0)
    out = _tree_paths(s, ["a", "b"])
    assert out.groupby("agent")["calls"].apply(list).to_dict() == {"a": [2, 2, 2], "b": [1, 1, 1]}
    assert sorted(out["traj"].unique().tolist()) == [0, 1, 2]


def test_salvage_copies_tools_and_episodes_and_drops_the_episodes_of_lost_samples(tmp_path):
    from flexmarl_hpc.store.salvage import salvage
    path = tmp_path / "s.h5"
    s = StoreFile(path, AGENTS, {}, chunk=8)                 # /tokens chunks of 64 tokens
    rows = calls_rows(s, "planner", [(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)])
    rows["token_offset"], rows["prompt_len"], rows["response_len"] = np.arange(4) * 40, 20, 20
    s.samples["planner"].append(rows)
    s.tokens["planner"].append(np.zeros(160, s.tokens["planner"].dtype))
    for i, t in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        s.record_episode(1.0, 0, i, t, {"planner": 1}, {"planner": 1.0})
        s.record_tool(1.0, "planner", i, t, 0, "calculator", "ok", 0.01)
    s.record_failure(1.0, 0, 1, 1, "KeyError", "'x'", "Traceback ...\nKeyError: 'x'\n")
    s.close()
    corrupt(path, "/tokens/planner", chunk=0, nbytes=16)    # input 0's two calls lose tokens
    rep = salvage(path, tmp_path / "new.h5")
    assert rep.lost_ids["planner"] == ["0_0_0", "0_0_1"] and rep.lost_rows["/episodes"] == 2
    run = load_run(tmp_path / "new.h5")
    assert run.attrs["schema_version"] == 6 and len(run.tools) == 4
    assert run.failures[["input_id", "traj", "kind", "message"]].values.tolist() == [[1, 1, "KeyError", "'x'"]]
    assert sorted(set(zip(run.episodes["input_id"], run.episodes["traj"]))) == [(1, 0), (1, 1)]
