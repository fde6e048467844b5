"""Thread and memory-allocator defaults, and small torch helpers shared by the algorithms."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch as th
from torch import nn

# torch's intra-op thread count when the package was imported: a later difference means the user chose one.
_STARTUP_NUM_THREADS = th.get_num_threads()
_THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_NUM_THREADS")
# Small MLPs are as fast on 1 thread as on 2, and far steadier when anything else runs on the machine.
DEFAULT_CPU_THREADS = 1
# Updates whose largest matrix product has at least this many multiply-adds run faster on 2 threads than on 1 (a DQN
# step of a 256x256 net does; PPO's 64x64 nets at batch 256 are slower on 2).
PARALLEL_GEMM_MACS = 2_000_000
# Thread count for large updates: more than 2 was never measured, so never more than 2.
PARALLEL_UPDATE_THREADS = 2
# The value this package last set as its default (so that it is not mistaken for the user's choice).
_package_set: int | None = None


def user_chose_num_threads() -> bool:
    """:return: whether the thread count was set explicitly (environment variable or ``th.set_num_threads``)"""
    if any(var in os.environ for var in _THREAD_ENV_VARS):
        return True
    current = th.get_num_threads()
    return current != _STARTUP_NUM_THREADS and current != _package_set


def has_convolutions(module: nn.Module) -> bool:
    """:return: whether ``module`` holds a convolution (compute-bound work, unlike a small MLP's per-op overhead)"""
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in module.modules())


def trains_channels_last(module: nn.Module, device: th.device) -> bool:
    """
    :param module: a network that is trained
    :param device: where it trains
    :return: whether its training forward and backward should get image inputs in channels-last memory order: it
        has 2-D convolutions and runs on the CPU, where oneDNN's convolution backward is faster in that order (the
        same values and shapes; acting's forward is not faster, so only training converts)
    """
    return device.type == "cpu" and any(isinstance(m, nn.Conv2d) for m in module.modules())


def to_channels_last(observations: th.Tensor | dict[str, th.Tensor]) -> th.Tensor | dict[str, th.Tensor]:
    """:return: ``observations`` with their 4-D tensors (a dict's entries too) in channels-last memory order"""
    if isinstance(observations, dict):
        return {k: _channels_last(v) for k, v in observations.items()}
    return _channels_last(observations)


def _channels_last(tensor: th.Tensor) -> th.Tensor:
    # converted before the float scaling of SB3's preprocessing, which keeps the order: a uint8 copy is the cheap one
    return tensor.contiguous(memory_format=th.channels_last) if tensor.dim() == 4 else tensor


def is_channels_last(tensor: th.Tensor) -> bool:
    """:return: whether ``tensor`` is 4-D and laid out channels-last (and not also plain contiguous, as one channel is)"""
    return tensor.dim() == 4 and tensor.is_contiguous(memory_format=th.channels_last) and not tensor.is_contiguous()


def match_convolutions_to(module: nn.Module, observations: object, device: th.device) -> bool:
    """
    Lay out the 2-D convolution weights of ``module`` channels-last where acting hands it channels-last observations
    (SB3's ``VecTransposeImage`` returns transposed views of channel-last frames) and training converts its inputs to
    that order (:func:`trains_channels_last`). oneDNN runs a convolution with a channels-last input or weight in that
    order, converting the other operand at every call: this layout runs the same kernels on the same values, minus
    those conversions (the same numbers up to float32 rounding: MKL's products round by their operands' memory
    alignment). Call it before flat buffers take the weights (they keep each parameter's strides).

    :param module: the trained network
    :param observations: the batch acting will see next (an array or tensor; anything else leaves the weights as they are)
    :param device: where the network runs
    :return: whether the weights are channels-last now
    """
    if not trains_channels_last(module, device) or not isinstance(observations, np.ndarray | th.Tensor):
        return False
    if not is_channels_last(th.as_tensor(observations)):
        return False
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            m.weight.data = m.weight.data.contiguous(memory_format=th.channels_last)
    return True


def select_rows(source: th.Tensor, index: th.Tensor, out: th.Tensor | None = None) -> th.Tensor:
    """
    ``th.index_select(source, 0, index)``, keeping a channels-last ``source`` channels-last (``index_select`` itself
    returns plain contiguous rows, which training would convert back).

    :param source: rows to select from
    :param index: the rows, ``[k]``
    :param out: where to write them (channels-last when ``source`` is)
    :return: the selected rows ``[k, ...]``
    """
    if not is_channels_last(source):
        return th.index_select(source, 0, index, out=out)
    if out is None:
        return th.index_select(source.permute(0, 2, 3, 1), 0, index).permute(0, 3, 1, 2)
    th.index_select(source.permute(0, 2, 3, 1), 0, index, out=out.permute(0, 2, 3, 1))
    return out


def apply_num_threads(num_threads: int | None, network: nn.Module | None = None) -> int:
    """
    Set torch's intra-op threads: ``num_threads`` when given, else, unless the user already chose a value, the
    default for the work: torch's own (every core, as stock SB3 runs) for a network with convolutions, else
    :data:`DEFAULT_CPU_THREADS` (small MLPs are overhead-bound).

    :param num_threads: explicit thread count, or ``None`` for the default
    :param network: the policy, once built (``None``: not known yet, an MLP is assumed)
    :return: the thread count in effect
    """
    global _package_set
    if num_threads is not None and num_threads > 0:
        th.set_num_threads(num_threads)
    elif not user_chose_num_threads():
        default = _STARTUP_NUM_THREADS if network is not None and has_convolutions(network) else DEFAULT_CPU_THREADS
        th.set_num_threads(default)
        _package_set = default
    return th.get_num_threads()


# glibc's mallopt parameters, and what convolutional training sets them to: blocks up to REUSED_BLOCK_BYTES come from
# the heap, and up to KEPT_FREE_BYTES of freed heap stay with the process (see keep_freed_blocks)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
REUSED_BLOCK_BYTES = 256 * 2**20
KEPT_FREE_BYTES = 2**30
# set by the user (or glibc.malloc.* in GLIBC_TUNABLES): glibc reads them at start-up, and their choice wins
_MALLOC_ENV_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_freed_blocks_kept = False


def keep_freed_blocks(network: nn.Module, device: th.device) -> bool:
    """
    For a network with convolutions trained on the CPU, let glibc's ``malloc`` reuse freed blocks of up to
    :data:`REUSED_BLOCK_BYTES` instead of returning them to the system. Each minibatch of a convolutional update
    allocates and frees tens of megabytes (its float inputs, activations and gradients); by default glibc maps such
    blocks afresh and unmaps them when freed, so every minibatch pays a page fault per 4 KB page again. The numbers
    computed do not change. Nothing is set where the user set glibc's malloc parameters (``MALLOC_*_`` or
    ``glibc.malloc.*`` in ``GLIBC_TUNABLES``), on another C library, or for a network without convolutions.

    :param network: the policy, once built
    :param device: where it trains
    :return: whether the setting is in effect in this process (set now or before)
    """
    global _freed_blocks_kept
    if _freed_blocks_kept:
        return True
    if device.type != "cpu" or not has_convolutions(network) or _user_set_malloc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, Windows)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the trim threshold first: setting either turns off glibc's own adjustment of both
    _freed_blocks_kept = bool(mallopt(_M_TRIM_THRESHOLD, KEPT_FREE_BYTES) and mallopt(_M_MMAP_THRESHOLD, REUSED_BLOCK_BYTES))
    return _freed_blocks_kept


def _user_set_malloc() -> bool:
    """:return: whether the environment sets glibc's malloc parameters"""
    return any(var in os.environ for var in _MALLOC_ENV_VARS) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")


def available_cpus() -> int:
    """:return: the CPUs this process may run on"""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def update_num_threads(largest_gemm_macs: int, num_threads: int | None, device: th.device) -> int | None:
    """
    The thread count for an update, by the size of its matrix products: large products (at least
    :data:`PARALLEL_GEMM_MACS` multiply-adds) get :data:`PARALLEL_UPDATE_THREADS` threads where the CPUs allow.

    :param largest_gemm_macs: multiply-adds of the update's largest matrix product (rows x inputs x outputs)
    :param num_threads: the algorithm's ``num_threads`` argument (set: the user chose, nothing changes)
    :param device: where the update runs (only CPU updates are affected)
    :return: the thread count to use during the update, or ``None`` to keep the current one
    """
    if largest_gemm_macs < PARALLEL_GEMM_MACS or num_threads is not None or device.type != "cpu":
        return None
    if user_chose_num_threads():
        return None
    return max(min(PARALLEL_UPDATE_THREADS, available_cpus()), th.get_num_threads())


@contextmanager
def num_threads_during(num_threads: int | None) -> Iterator[None]:
    """
    Run the block with ``num_threads`` torch threads and restore the previous count after it (switching is cheap
    enough to do around every update).

    :param num_threads: thread count, or ``None`` to leave it as it is
    """
    previous = th.get_num_threads()
    if num_threads is None or num_threads == previous:
        yield
        return
    th.set_num_threads(num_threads)
    try:
        yield
    finally:
        th.set_num_threads(previous)


class KeptScalar:
    """
    A number as a kept 0-dim tensor, refilled only when the number changes. An arithmetic op given a Python number
    wraps it in a fresh tensor and converts it at every call; given this tensor, the op computes the same (a float32
    op casts the number to float32 either way) without that.

    :param device: where the tensor lives
    :param dtype: its dtype (the dtype of the tensors it multiplies or adds to)
    """

    def __init__(self, device: th.device | str = "cpu", dtype: th.dtype = th.float32) -> None:
        with th.inference_mode(False):  # a normal tensor even when made under inference mode, usable in any mode
            self.tensor = th.empty((), device=device, dtype=dtype)
        self.value: float | None = None

    def __call__(self, value: float) -> th.Tensor:
        """:return: the tensor, holding ``value``"""
        if value != self.value:
            self.tensor.fill_(value)
            self.value = value
        return self.tensor
