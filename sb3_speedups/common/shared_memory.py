"""Anonymous shared memory: no name in /dev/shm, so nothing can be left behind, and zeroed when created."""

from __future__ import annotations

import mmap
import os
import tempfile


def map_anonymous(nbytes: int) -> mmap.mmap:
    """
    :param nbytes: the block's size in bytes (at least one byte is mapped)
    :return: a zeroed block of shared memory that processes forked later read and write too; it holds no file
        descriptor (a mapping of a descriptor keeps a duplicate of it open for its whole life)
    """
    return mmap.mmap(-1, max(nbytes, 1))


def map_shared(nbytes: int, fd: int | None = None) -> tuple[mmap.mmap, int]:
    """
    Map a block of anonymous shared memory. A process forked later, or one that receives the descriptor (for example
    with ``multiprocessing.reduction.send_handle``), reads and writes the same memory.

    :param nbytes: the block's size in bytes (at least one byte is mapped)
    :param fd: the descriptor of an existing block to map, or ``None`` to create a new, zeroed one
    :return: the mapping and the block's descriptor (the caller closes it; the mapping stays valid without it)
    """
    if fd is None:
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("sb3_speedups", os.MFD_CLOEXEC)
        else:  # pragma: no cover  (non-Linux: a file that is unlinked at once, so it cannot outlive us either)
            shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, name = tempfile.mkstemp(prefix="sb3_speedups-", dir=shm_dir)
            os.unlink(name)
        os.ftruncate(fd, max(nbytes, 1))
    return mmap.mmap(fd, max(nbytes, 1)), fd
