"""Rows of a replay buffer's ``[positions, envs, ...]`` storage, gathered as stock's fancy indexing gathers them."""

from __future__ import annotations

import numpy as np

from sb3_speedups.common.replay.frames import StackedFrames


def take_rows(storage: np.ndarray | StackedFrames, rows: np.ndarray) -> np.ndarray:
    """
    :return: ``storage[b, e]`` for flat rows ``b * n_envs + e`` of a ``[positions, envs, ...]`` storage array: the
        same elements as stock's two-array fancy indexing, for a fraction of its per-call cost
    """
    if isinstance(storage, StackedFrames):
        return storage.take(rows)
    if not storage.flags.c_contiguous:  # a reshape would copy the whole storage: index it as stock does
        return storage[rows // storage.shape[1], rows % storage.shape[1]]
    return storage.reshape(-1, *storage.shape[2:]).take(rows, axis=0)
