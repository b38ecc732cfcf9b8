"""Per-agent checkpoints: atomic, checksummed, the newest valid one wins.

A checkpoint of version N is an *entry* in the agent's folder: one file `v00000N.pt` (the
torch backend: a flat dict of tensors, loaded with `torch.load(weights_only=True)`, so
loading runs no pickled code) or one folder `v00000N/` of files (megatron's
dist_checkpointing). Next to it, `v00000N.manifest.json` lists every file of the entry with
its size and sha256. The manifest is written last, so it is the commit mark: an entry
without a manifest, or whose files do not match it, is not a checkpoint. Every file goes
through tmp -> fsync -> rename -> fsync(dir), so a crash leaves either the old or the new
state. `latest` names the newest entry for people and tools; loading does not trust it.

A bad checkpoint (overwritten bytes, truncated, garbled, garbage in `latest`) is reported
in one line naming the file and what is wrong, and the next older valid one is used. The
last `keep` valid checkpoints stay on disk.

Two calls serve any backend (megatron writes a folder with its own writer):

    tmp = staging_path(folder, version, is_dir=True)    # write the entry here (mkdir it)
    with writing(tmp):                                  # a full disk -> one CheckpointError line
        ...                                             # e.g. dist_checkpointing.save(.., tmp)
    publish(folder, version, tmp, keep)                 # fsync, rename, manifest, prune
    found = newest_valid(folder, report)                # (version, entry path) or None
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from flexmarl_hpc import faults

if TYPE_CHECKING:
    import torch

MANIFEST = ".manifest.json"
_ENTRY = re.compile(r"^v(\d{6,})(\.pt)?$")


class CheckpointError(OSError):
    """A checkpoint could not be written or read; the message is one line naming the path."""

    def __init__(self, message: str, err: int | None = None):
        super().__init__(message)
        self.errno = err


def entry_name(version: int, is_dir: bool = False) -> str:
    return f"v{version:06d}" + ("" if is_dir else ".pt")


def manifest_path(folder: Path, version: int) -> Path:
    return folder / (entry_name(version, is_dir=True) + MANIFEST)


def staging_path(folder: Path, version: int, is_dir: bool = False) -> Path:
    """Where to write the entry of `version` before `publish` (removed if it exists)."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (entry_name(version, is_dir) + ".tmp")
    _remove(tmp)
    return tmp


# ---------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------
def save_checkpoint(folder: Path, version: int, state: dict[str, torch.Tensor], keep: int = 3) -> Path:
    """Write a flat dict of tensors as the checkpoint `version` of `folder`; returns its path."""
    import torch
    tmp = staging_path(folder, version)
    with writing(tmp):
        with open(tmp, "wb") as f:
            torch.save(state, f)
            faults.hit("checkpoint_write")     # test-only: no-op unless FLEXMARL_FAULT is set
    return publish(folder, version, tmp, keep)


def publish(folder: Path, version: int, tmp: Path, keep: int = 3) -> Path:
    """Make the written entry `tmp` (a file or a folder of files) checkpoint `version`:
    fsync its files, rename it into place, write its manifest and `latest`, prune to the
    last `keep`. On any error the staging entry is removed and older checkpoints are intact."""
    path = folder / entry_name(version, tmp.is_dir())
    manifest = manifest_path(folder, version)
    try:
        with writing(tmp):
            files = _describe(tmp)                   # fsyncs every file while hashing it
        # a re-save of the same version (a resumed run checkpoints again) replaces it whole
        manifest.unlink(missing_ok=True)
        _remove(path)
        os.replace(tmp, path)
        _fsync_dir(folder)
        faults.hit("checkpoint_latest")        # renamed, no manifest yet: not a valid checkpoint
        body = {"version": version, "entry": path.name, "files": files}
        atomic_write(manifest, json.dumps(body, indent=1).encode())
        atomic_write(folder / "latest", path.name.encode())
    except BaseException:
        _remove(tmp)
        raise
    prune(folder, keep)
    return path


def replace_file(path: Path, data: bytes) -> None:
    """Any file written whole: tmp -> fsync -> rename -> fsync(dir). `path` is the old file or
    the whole new one, never half of one; on failure no `.tmp` is left."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: Path, data: bytes) -> None:
    """replace_file for a checkpoint's files: a full disk is one CheckpointError line."""
    with writing(path):
        replace_file(path, data)


def prune(folder: Path, keep: int) -> None:
    """Delete all but the newest `keep` committed checkpoints (and stale staging entries)."""
    versions = sorted(committed_versions(folder), reverse=True)
    for v in versions[max(keep, 1):]:
        manifest_path(folder, v).unlink(missing_ok=True)
        for p in (folder / entry_name(v), folder / entry_name(v, True)):
            _remove(p)
    for tmp in folder.glob("v*.tmp"):
        _remove(tmp)
    kept = versions[:max(keep, 1)]
    for p in folder.glob("v*"):           # entries without a manifest older than all kept ones
        m = _ENTRY.match(p.name)
        if m and kept and int(m.group(1)) < kept[-1] and not manifest_path(folder, int(m.group(1))).exists():
            _remove(p)


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------
def committed_versions(folder: Path) -> list[int]:
    """Versions that have a manifest (not yet verified)."""
    out = []
    for m in folder.glob("v*" + MANIFEST):
        stem = m.name[: -len(MANIFEST)]
        if _ENTRY.match(stem):
            out.append(int(stem[1:]))
    return sorted(out)


def verify(folder: Path, version: int) -> tuple[Path | None, str]:
    """(entry path, "") if checkpoint `version` matches its manifest, else (None, what is wrong)."""
    manifest = manifest_path(folder, version)
    try:
        body = json.loads(manifest.read_bytes())
        entry, files = folder / body["entry"], body["files"]
        if int(body["version"]) != version or not _ENTRY.match(entry.name):
            return None, f"{manifest}: names version {body['version']} / entry {body['entry']!r}"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{manifest}: unreadable manifest ({type(e).__name__}: {e})"
    if not entry.exists():
        return None, f"{entry}: missing (its manifest exists)"
    for rel, want in files.items():
        p = entry / rel if rel else entry
        try:
            size = p.stat().st_size
        except OSError:
            return None, f"{p}: missing (listed in {manifest.name})"
        if size != want["size"]:
            return None, f"{p}: {size} bytes, the manifest says {want['size']} (truncated or overwritten)"
        if _sha256(p) != want["sha256"]:
            return None, f"{p}: sha256 does not match the manifest (corrupted bytes)"
    return entry, ""


def newest_valid(folder: Path, report: Callable[[str], None] = print) -> tuple[int, Path] | None:
    """The newest checkpoint that verifies, as (version, entry path); each bad one newer than it
    is reported in one line. None if there is none."""
    if not folder.is_dir():
        return None
    legacy = _check_latest(folder, report)
    found = None
    for v in sorted(committed_versions(folder), reverse=True):
        entry, problem = verify(folder, v)
        if entry is not None:
            found = v, entry
            break
        report(f"bad checkpoint, skipped: {problem}")
    if legacy is not None and (found is None or legacy[0] > found[0]):
        # written before manifests existed: `latest` was renamed into place after the file,
        # so the file it names is complete, but nothing can verify its bytes
        report(f"checkpoint without a manifest (written by an older flexmarl_hpc), loaded "
               f"unverified: {legacy[1]}")
        return legacy
    return found


def latest_version(folder: Path, report: Callable[[str], None] = print) -> int | None:
    found = newest_valid(folder, report)
    return None if found is None else found[0]


def load_latest(folder: Path, report: Callable[[str], None] = print) -> dict[str, torch.Tensor] | None:
    """The state of the newest valid file checkpoint, or None when there is none."""
    found = newest_valid(folder, report)
    if found is None:
        return None
    import torch
    v, path = found
    try:
        # mmap: the tensors are pages of the file until a trainer copies them in, not a
        # second model-sized copy in memory next to the trainer's own
        return torch.load(path, weights_only=True, mmap=True)
    except Exception as e:   # checksums matched, so the writer itself wrote something unloadable
        raise CheckpointError(f"{path}: matches its manifest but does not load "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def _check_latest(folder: Path, report) -> tuple[int, Path] | None:
    """Report a garbled `latest`; return the entry it names if that has no manifest (legacy)."""
    latest = folder / "latest"
    if not latest.exists():
        return None
    try:
        name = latest.read_bytes().decode("ascii").strip()
        m = _ENTRY.match(name)
    except (OSError, UnicodeDecodeError):
        m = None
    if m is None:
        report(f"bad checkpoint pointer, ignored: {latest}: expected an entry name like v000012.pt, "
               f"got {latest.read_bytes()[:40]!r}; using the newest valid checkpoint")
        return None
    version = int(m.group(1))
    entry = folder / name
    if entry.is_file() and not manifest_path(folder, version).exists():
        return version, entry
    return None


def _files(entry: Path) -> list[tuple[str, Path]]:
    if entry.is_file():
        return [("", entry)]
    return sorted((str(p.relative_to(entry)), p) for p in entry.rglob("*") if p.is_file())


def _describe(entry: Path) -> dict[str, dict]:
    out = {}
    for rel, p in _files(entry):
        with open(p, "rb") as f:
            os.fsync(f.fileno())
        out[rel] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    if entry.is_dir():
        for d in [entry, *(p for p in entry.rglob("*") if p.is_dir())]:
            _fsync_dir(d)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


class writing:
    """Context manager: a full disk (or quota) while writing `path` becomes one CheckpointError
    line naming it; on any error a partial staging entry (`*.tmp`) is removed."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, tp, e, tb):
        if e is None:
            return False
        if self.path.name.endswith(".tmp"):
            _remove(self.path)
        # torch.save's C++ writer turns the OSError of a full disk into a RuntimeError
        # ("unexpected pos ..."): look down the chain for the errno
        errs = set()
        while e is not None:
            errs.add(getattr(e, "errno", None))
            e = e.__cause__ or e.__context__
        for err in (errno.ENOSPC, errno.EDQUOT):
            if err in errs:
                target = self.path.with_name(self.path.name.removesuffix(".tmp"))
                raise CheckpointError(f"{target}: cannot write checkpoint: no space left on device "
                                      f"(errno {err}; nothing half-written is left, the previous "
                                      "checkpoint is kept)", err) from None
        return False
