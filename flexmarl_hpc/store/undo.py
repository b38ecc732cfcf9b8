"""The store as it was before a resume's re-open, kept until the resume is reconciled.

    copy = keep_copy(path, error)   # before the re-open's first write
    copy = put_back(copy, path, f)  # a refusal found after the repairs: the file as it was
    copy = drop(copy)               # the resume reconciled: the repairs stand

A re-open repairs the file (store.recovery names what) before the orchestrator replays the
journal. Every refusal the file alone decides is found first, by reading only; one the
replay decides (an episode function that asks another prompt than the one journalled:
orchestrator.episodes.ReplayMismatch) comes after those writes, so the re-open keeps this
copy and a refusal puts it back (docs/store.md, "A refused resume").
"""
from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable

FICLONE = 0x40049409          # linux/fs.h: a copy-on-write clone, where the file system has them


def copy_path(path: Path) -> Path:
    """Beside the store, not matching *.h5 (readers and the tests' store scan skip it)."""
    return path.with_name(path.name + ".undo")


def keep_copy(path: Path, error: Callable[[Path, OSError], Exception]) -> Path:
    """A copy of the store (a reflink where the file system clones: btrfs, XFS; else a
    plain copy, the store's size in disk space). A failure (a full disk) raises
    error(path, e), before any write of the re-open. A copy an earlier resume's kill left is
    replaced: the store it would put back is the one that resume had repaired, crash-safe
    like any kill."""
    dst = copy_path(path)
    try:
        with open(path, "rb") as src, open(dst, "wb") as out:
            try:
                fcntl.ioctl(out.fileno(), FICLONE, src.fileno())
                return dst
            except OSError:           # no clone here (ext4, tmpfs, Lustre): copy the bytes
                pass
        shutil.copyfile(path, dst)
    except OSError as e:
        dst.unlink(missing_ok=True)
        raise error(path, e) from None
    return dst


def put_back(copy: Path | None, path: Path, f) -> None:
    """The store's open h5py file `f` closed (its buffered rows not written) and the store
    replaced by the copy, durably (its bytes on disk before the rename: a crash must not
    leave a half-written store in its place). Returns None (no copy left)."""
    if copy is None:
        raise RuntimeError(f"{path}: no copy from before the re-open to put back")
    f.close()
    fd = os.open(copy, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(copy, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def drop(copy: Path | None) -> None:
    """The copy removed; returns None (no copy left)."""
    if copy is not None:
        copy.unlink(missing_ok=True)
