"""scripts/figures.py: a generated block of a doc is what the code makes now (--check passes),
and a change in a simulator input (a hardware profile's figure) makes --check fail naming
the block, with its diff, without writing (unit: one process)."""
from __future__ import annotations

import importlib.util
import shutil
import sys

import pytest

from flexmarl_hpc.sim import hardware
from tests.conftest import ROOT

NAME = "sim_plan_closed_form_48"  # the cheapest deterministic figure (~1 s; sim_plan_48 simulates: ~10 s)


@pytest.fixture(scope="module")
def figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "scripts" / "figures.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["figures"] = mod                 # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def made(figures, tmp_path_factory):
    return figures.FIGURES[NAME].make(figures.Context(ROOT / "docs", tmp_path_factory.mktemp("scratch")))


def doc(tmp_path, body: str):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "small.md").write_text(f"# A doc\n\nSome prose.\n\n<!-- figure: {NAME} -->\n{body.rstrip()}\n"
                                   f"<!-- /figure: {NAME} -->\n\nMore prose.\n")
    return docs


def test_check_passes_on_a_block_made_at_head(figures, made, tmp_path, capsys):
    docs = doc(tmp_path, made)
    before = (docs / "small.md").read_text()
    assert figures.main(["--check", "--docs", str(docs)]) == 0
    assert "as in the docs" in capsys.readouterr().out
    assert (docs / "small.md").read_text() == before


def test_check_fails_naming_the_block_when_a_hardware_figure_changes(figures, made, tmp_path, capsys, monkeypatch):
    """npu64_a3's HBM bandwidth (hbm_gb_s 1600 -> 800 GB/s, in a copy of the profiles in a
    temp folder) changes the planned and simulated step times: --check exits 1, names the
    block, shows the diff and leaves the doc as it was."""
    docs = doc(tmp_path, made)
    before = (docs / "small.md").read_text()
    profiles = tmp_path / "hardware"
    shutil.copytree(hardware.HARDWARE_DIR, profiles)
    text = (profiles / "npu64_a3.yaml").read_text()
    assert "hbm_gb_s: 1600.0" in text
    (profiles / "npu64_a3.yaml").write_text(text.replace("hbm_gb_s: 1600.0", "hbm_gb_s: 800.0"))
    monkeypatch.setattr(hardware, "HARDWARE_DIR", profiles)
    assert figures.main(["--check", "--docs", str(docs)]) == 1
    out = capsys.readouterr().out
    diff = out.splitlines()
    assert f"small.md: figure {NAME} drifted" in out, out
    assert any(d.startswith("-  32b") for d in diff) and any(d.startswith("+  32b") for d in diff), out
    assert (docs / "small.md").read_text() == before


def test_write_fills_a_block_in_place_and_unknown_names_are_refused(figures, made, tmp_path, capsys):
    docs = doc(tmp_path, "stale\n")
    assert figures.main(["--write", "--docs", str(docs)]) == 0
    text = (docs / "small.md").read_text()
    assert figures.blocks(text) == [(NAME, made.rstrip() + "\n")]
    assert text.startswith("# A doc\n\nSome prose.\n\n") and text.endswith("\n\nMore prose.\n")
    (docs / "other.md").write_text("<!-- figure: nope -->\nx\n<!-- /figure: nope -->\n")
    assert figures.main(["--check", "--docs", str(docs)]) == 1
    assert "unknown figure 'nope'" in capsys.readouterr().err


def test_bench_blocks_are_left_to_full_and_every_figure_has_a_block_in_docs(figures):
    found, errors = figures.wanted(ROOT / "docs", full=False)
    assert not errors
    assert all(not figures.FIGURES[n].bench for bs in found.values() for n, _ in bs)
    assert {n for bs in figures.blocks_of(ROOT / "docs").values() for n, _ in bs} == set(figures.FIGURES)
