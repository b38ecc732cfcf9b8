"""Checkpoints: atomic, checksummed, the newest valid one is used, the last K are kept,
and a full disk fails in one line with nothing half-written left behind."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from flexmarl_hpc.store import checkpoint as ck
from tests.helpers import tmpfs


def state(v: int, n: int = 1000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {"version": torch.tensor(v), "model.w": torch.randn(n, generator=g)}


def saved(tmp_path: Path, versions=(1, 2, 3), keep: int = 3) -> Path:
    folder = tmp_path / "agent"
    for v in versions:
        ck.save_checkpoint(folder, v, state(v), keep=keep)
    return folder


def lines(report: list[str]) -> list[str]:
    assert all("\n" not in r for r in report), report
    return report


def test_roundtrip_manifest_and_keep(tmp_path):
    folder = saved(tmp_path, versions=range(1, 7), keep=3)
    assert ck.committed_versions(folder) == [4, 5, 6]
    assert sorted(p.name for p in folder.iterdir()) == [
        "latest", "v000004.manifest.json", "v000004.pt", "v000005.manifest.json", "v000005.pt",
        "v000006.manifest.json", "v000006.pt"]
    body = json.loads((folder / "v000006.manifest.json").read_text())
    assert body["entry"] == "v000006.pt" and body["files"][""]["size"] == (folder / "v000006.pt").stat().st_size
    got = ck.load_latest(folder)
    assert torch.equal(got["model.w"], state(6)["model.w"])


def _overwrite(p: Path) -> None:
    with open(p, "r+b") as f:
        f.seek(p.stat().st_size // 2)
        f.write(os.urandom(64))


def _truncate(p: Path) -> None:
    os.truncate(p, p.stat().st_size // 2)


def _garble_header(p: Path) -> None:
    with open(p, "r+b") as f:
        f.write(b"\0" * 32)


@pytest.mark.parametrize("damage,expect", [
    (_overwrite, "sha256 does not match"),
    (_truncate, "truncated or overwritten"),
    (_garble_header, "sha256 does not match"),
    (lambda p: p.unlink(), "missing"),
    (lambda p: (p.parent / "v000003.manifest.json").write_text("{not json"), "unreadable manifest"),
])
def test_bad_newest_falls_back_to_previous(tmp_path, damage, expect):
    folder = saved(tmp_path)
    damage(folder / "v000003.pt")
    report: list[str] = []
    assert ck.latest_version(folder, report.append) == 2
    got = ck.load_latest(folder, report.append)
    assert torch.equal(got["model.w"], state(2)["model.w"])
    assert len(lines(report)) == 2 and all(expect in r and "v000003" in r for r in report), report


def test_garbage_in_latest_is_one_line_and_ignored(tmp_path):
    folder = saved(tmp_path)
    (folder / "latest").write_bytes(b"\xff\xfegarbage\n")
    report: list[str] = []
    assert ck.latest_version(folder, report.append) == 3
    assert len(lines(report)) == 1 and "latest" in report[0]


def test_all_bad_means_no_checkpoint(tmp_path):
    folder = saved(tmp_path, versions=(1,))
    _overwrite(folder / "v000001.pt")
    report: list[str] = []
    assert ck.load_latest(folder, report.append) is None and len(report) == 1


def test_a_folder_entry_is_verified_file_by_file(tmp_path):
    """megatron's dist_checkpointing writes a folder of files: the same publish/verify."""
    folder = tmp_path / "agent"
    for v in (1, 2):
        tmp = ck.staging_path(folder, v, is_dir=True)
        (tmp / "sub").mkdir(parents=True)
        (tmp / "metadata.json").write_text(json.dumps({"v": v}))
        (tmp / "sub" / "shard_0.distcp").write_bytes(os.urandom(5000))
        ck.publish(folder, v, tmp, keep=3)
    assert ck.newest_valid(folder) == (2, folder / "v000002")
    _overwrite(folder / "v000002" / "sub" / "shard_0.distcp")
    report: list[str] = []
    assert ck.newest_valid(folder, report.append) == (1, folder / "v000001")
    assert "shard_0.distcp" in report[0] and "sha256" in report[0]


def test_uncommitted_entry_is_ignored_and_cleaned(tmp_path):
    """A crash after the data but before the manifest: not a checkpoint; a staging file is removed."""
    folder = saved(tmp_path, versions=(1,))
    torch.save(state(2), folder / "v000002.pt")          # no manifest: never committed
    (folder / "v000003.pt.tmp").write_bytes(b"half")
    assert ck.latest_version(folder) == 1
    ck.save_checkpoint(folder, 4, state(4))
    assert not list(folder.glob("*.tmp"))


def test_resaving_a_version_replaces_it(tmp_path):
    folder = saved(tmp_path, versions=(1, 2))
    ck.save_checkpoint(folder, 2, state(7))
    assert torch.equal(ck.load_latest(folder)["model.w"], state(7)["model.w"])


@pytest.fixture
def small_tmpfs(tmp_path):
    with tmpfs(tmp_path, "2m") as mnt:
        yield mnt


def test_disk_full_is_one_line_and_keeps_the_previous(small_tmpfs):
    folder = small_tmpfs / "agent"
    ck.save_checkpoint(folder, 1, state(1, n=1000))                  # ~4 kB fits
    with pytest.raises(ck.CheckpointError) as e:
        ck.save_checkpoint(folder, 2, state(2, n=1_000_000))         # 4 MB does not
    msg = str(e.value)
    assert "\n" not in msg and "no space left" in msg and str(folder) in msg, msg
    assert e.value.errno == 28
    from flexmarl_hpc.ranks.job import exit_code
    assert exit_code(e.value) == 75             # EXIT_REQUEUE: free space, run the same command
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "v000001.manifest.json", "v000001.pt"]
    assert torch.equal(ck.load_latest(folder)["model.w"], state(1)["model.w"])


def test_a_pre_manifest_checkpoint_still_resumes(tmp_path):
    """Run folders written before manifests: the file `latest` names is loaded, with one line."""
    folder = tmp_path / "agent"
    folder.mkdir()
    torch.save(state(5), folder / "v000005.pt")
    (folder / "latest").write_text("v000005.pt")
    report: list[str] = []
    assert torch.equal(ck.load_latest(folder, report.append)["model.w"], state(5)["model.w"])
    assert len(lines(report)) == 1 and "without a manifest" in report[0]
    ck.save_checkpoint(folder, 6, state(6))          # the next save is verified as usual
    assert ck.latest_version(folder, report.append) == 6 and len(report) == 1
    assert not (folder / "v000005.pt").exists()         # pruned like any older checkpoint
