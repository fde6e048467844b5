"""Anonymous shared memory (no name in /dev/shm, so nothing can be left behind) carved into named numpy arrays."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from sb3_speedups.common.shared_memory import map_shared

_ALIGN = 64  # one cache line: arrays written by different processes never share a line


@dataclass(frozen=True)
class ArraySpec:
    """
    One array inside a shared block.

    :param name: key used to look the array up
    :param shape: array shape
    :param dtype: numpy dtype string (``np.dtype(...).str``)
    """

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class SharedArrays:
    """
    Numpy arrays living in one anonymous shared mapping, rebuilt from the same specs and file descriptor in
    every process that uses them (the descriptor is handed over with ``multiprocessing.reduction.send_handle``).

    :param specs: the arrays, in layout order
    :param fd: an existing descriptor of the block (worker side), or ``None`` to create a new block
    """

    def __init__(self, specs: list[ArraySpec], fd: int | None = None) -> None:
        self.specs = list(specs)
        self.offsets: dict[str, int] = {}
        offset = 0
        for spec in self.specs:
            self.offsets[spec.name] = offset
            offset += -(-spec.nbytes // _ALIGN) * _ALIGN
        self.nbytes = offset
        mapping, self.fd = map_shared(self.nbytes, fd)
        self._mmap: mmap.mmap | None = mapping
        self.arrays: dict[str, np.ndarray] = {
            spec.name: np.ndarray(spec.shape, dtype=spec.dtype, buffer=self._mmap, offset=self.offsets[spec.name])
            for spec in self.specs
        }

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def view(self, name: str, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        """
        :param name: an array of the block
        :param dtype: how to read its bytes
        :param shape: shape of the view (must fit in the array's bytes)
        :return: a view of the same memory with another dtype and shape
        """
        spec = next(s for s in self.specs if s.name == name)
        dtype = np.dtype(dtype)
        assert int(np.prod(shape, dtype=np.int64)) * dtype.itemsize <= spec.nbytes, "view larger than its array"
        return np.ndarray(shape, dtype=dtype, buffer=self._mmap, offset=self.offsets[name])  # type: ignore[arg-type]

    def close(self) -> None:
        """Drop the arrays and unmap the block (the memory is freed once every process has closed it)."""
        self.arrays = {}
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # A caller still holds a view: the mapping is released when that view is garbage collected.
                pass
            self._mmap = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
