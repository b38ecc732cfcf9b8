"""Clear the "file is open for write" flags a killed HDF5 writer leaves in the superblock.

A writer opened with libver="latest" (superblock version 2 or 3) sets bits in the
superblock's file-consistency-flags byte while it has the file open (bit 0: write access,
bit 2: SWMR write access) and clears them on close. After a SIGKILL, OOM kill or node
failure they stay set, and the next open for writing fails with "file is already open for
write/SWMR write (may use <h5clear file> ...)". h5clear is not part of h5py, so we do what
`h5clear -s` does: zero the flags byte and rewrite the superblock checksum (Jenkins
lookup3, initval 0, over every superblock byte before the checksum). Only the 1-byte flag
and its 4-byte checksum change, in place, with pwrite + fsync; the caller must make sure no
live writer has the file open (ours: only the orchestrator writes it, and a new
orchestrator starts only after the old job is gone).

Superblock v2/v3 layout (HDF5 file format spec, "Superblock"):
    signature 8 | version 1 | size of offsets O 1 | size of lengths 1 | flags 1 |
    base address O | superblock extension address O | end of file address O |
    root group object header address O | checksum 4
"""
from __future__ import annotations

import os
from pathlib import Path

SIGNATURE = b"\x89HDF\r\n\x1a\n"
FLAGS_AT = 11
_M = 0xFFFFFFFF


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _M


def lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 hashlittle, byte-wise, as HDF5's H5_checksum_lookup3."""
    n = len(data)
    a = b = c = (0xDEADBEEF + n + initval) & _M
    i = 0
    while n - i > 12:
        a = (a + int.from_bytes(data[i:i + 4], "little")) & _M
        b = (b + int.from_bytes(data[i + 4:i + 8], "little")) & _M
        c = (c + int.from_bytes(data[i + 8:i + 12], "little")) & _M
        a = (a - c) & _M; a ^= _rot(c, 4); c = (c + b) & _M
        b = (b - a) & _M; b ^= _rot(a, 6); a = (a + c) & _M
        c = (c - b) & _M; c ^= _rot(b, 8); b = (b + a) & _M
        a = (a - c) & _M; a ^= _rot(c, 16); c = (c + b) & _M
        b = (b - a) & _M; b ^= _rot(a, 19); a = (a + c) & _M
        c = (c - b) & _M; c ^= _rot(b, 4); b = (b + a) & _M
        i += 12
    if n - i == 0:
        return c
    tail = data[i:] + bytes(12 - (n - i))            # zero padding adds nothing
    a = (a + int.from_bytes(tail[0:4], "little")) & _M
    b = (b + int.from_bytes(tail[4:8], "little")) & _M
    c = (c + int.from_bytes(tail[8:12], "little")) & _M
    c ^= b; c = (c - _rot(b, 14)) & _M
    a ^= c; a = (a - _rot(c, 11)) & _M
    b ^= a; b = (b - _rot(a, 25)) & _M
    c ^= b; c = (c - _rot(b, 16)) & _M
    a ^= c; a = (a - _rot(c, 4)) & _M
    b ^= a; b = (b - _rot(a, 14)) & _M
    c ^= b; c = (c - _rot(b, 24)) & _M
    return c


def open_flags(path: str | Path) -> bool:
    """Whether the superblock's consistency flags are set (a killed writer's), read only.

    Raises ValueError naming the file when the superblock is not v2/v3 or its checksum does
    not match (a damaged file is not "repaired" blindly)."""
    return _superblock(Path(path))[0] != 0


def _superblock(path: Path) -> tuple[int, bytes, int]:
    """(the flags byte, the superblock bytes before its checksum, the checksum's offset)."""
    with open(path, "rb") as fh:
        head = fh.read(64)
    if head[:8] != SIGNATURE:
        raise ValueError(f"{path}: not an HDF5 file (no signature at offset 0)")
    if head[8] not in (2, 3):
        raise ValueError(f"{path}: HDF5 superblock version {head[8]}, expected 2 or 3")
    end = 12 + 4 * head[9]
    if len(head) < end + 4:
        raise ValueError(f"{path}: truncated HDF5 superblock")
    if lookup3(head[:end]) != int.from_bytes(head[end:end + 4], "little"):
        raise ValueError(f"{path}: HDF5 superblock checksum mismatch (damaged file)")
    return head[FLAGS_AT], head[:end], end


def clear_open_flags(path: str | Path) -> bool:
    """Zero the superblock's consistency flags if set; returns whether it changed the file.
    Raises ValueError as open_flags does."""
    path = Path(path)
    flags, head, end = _superblock(path)
    if flags == 0:
        return False
    body = head[:FLAGS_AT] + b"\x00" + head[FLAGS_AT + 1:end]
    with open(path, "r+b") as fh:
        os.pwrite(fh.fileno(), b"\x00", FLAGS_AT)
        os.pwrite(fh.fileno(), lookup3(body).to_bytes(4, "little"), end)
        os.fsync(fh.fileno())
    return True
