"""The store as it was before a resume's re-open, kept until the resume is reconciled.

    copy = keep_copy(path)          # before the re-open's first write
    put_back(copy, path)            # a refusal found after the repairs: the file as it was
    drop(copy)                      # the resume reconciled: the repairs stand

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

FICLONE = 0x40049409          # linux/fs.h: a copy-on-write clone, where the file system has them


def copy_path(path: Path) -> Path:
    """Beside the store, not matching *.h5 (readers and the tests' store scan skip it)."""
    return path.with_name(path.name + ".undo")


def keep_copy(path: Path) -> Path:
    """A copy of the store (a reflink where the file system clones: btrfs, XFS; else a
    plain copy, the store's size in disk space). OSError (a full disk) before any write of
    the re-open. A copy an earlier resume's kill left is replaced: the store it would put
    back is the one that resume had repaired, crash-safe like any kill."""
    dst = copy_path(path)
    with open(path, "rb") as src, open(dst, "wb") as out:
        try:
            fcntl.ioctl(out.fileno(), FICLONE, src.fileno())
            return dst
        except OSError:               # no clone here (ext4, tmpfs, Lustre): copy the bytes
            pass
    shutil.copyfile(path, dst)
    return dst


def put_back(copy: Path, path: Path) -> None:
    """The store replaced by the copy, durably (its bytes on disk before the rename: a
    crash must not leave a half-written store in its place)."""
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
    if copy is not None:
        copy.unlink(missing_ok=True)
