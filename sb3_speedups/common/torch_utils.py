"""Thread defaults and small torch helpers shared by the algorithms."""

from __future__ import annotations

import os

import torch as th

# torch's intra-op thread count when the package was imported: a later difference means the user chose one.
_STARTUP_NUM_THREADS = th.get_num_threads()
_THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_NUM_THREADS")
# Measured on 2-core machines (shared/MEASUREMENTS.md): small MLPs are as fast on 1 thread as on 2, and far
# steadier when anything else runs on the machine.
DEFAULT_CPU_THREADS = 1


def user_chose_num_threads() -> bool:
    """:return: whether the thread count was set explicitly (environment variable or ``th.set_num_threads``)"""
    return any(var in os.environ for var in _THREAD_ENV_VARS) or th.get_num_threads() != _STARTUP_NUM_THREADS


def apply_num_threads(num_threads: int | None) -> int:
    """
    Set torch's intra-op threads: ``num_threads`` when given, else :data:`DEFAULT_CPU_THREADS` unless the user
    already chose a value.

    :param num_threads: explicit thread count, or ``None`` for the default
    :return: the thread count in effect
    """
    if num_threads is not None and num_threads > 0:
        th.set_num_threads(num_threads)
    elif not user_chose_num_threads():
        th.set_num_threads(DEFAULT_CPU_THREADS)
    return th.get_num_threads()


def forward_in_blocks(net: th.nn.Module, x: th.Tensor, rows: int = 1024) -> th.Tensor:
    """
    ``net(x)`` computed ``rows`` rows at a time: the activations of thousands of rows spill out of the CPU caches
    (measured here, 256x256 MLP, 1 thread: 8 blocks of 1,024 rows 14.3 ms, one call on 8,192 rows 18.0 ms).

    :param net: a row-wise network (each output row depends only on its input row)
    :param x: the input batch
    :param rows: rows per call
    :return: the outputs, concatenated
    """
    if x.shape[0] <= rows:
        return net(x)
    return th.cat([net(x[i : i + rows]) for i in range(0, x.shape[0], rows)])
