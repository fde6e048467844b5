"""What SAC's and TD3's ``train()`` share around their gradient steps: argument checks, sampling and threads."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch as th
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from torch import nn

from sb3_speedups.common.nn.inputs import float_rows_unless_box
from sb3_speedups.common.off_policy.batches import OffPolicyBatches, lay_out
from sb3_speedups.common.replay.sampling import batchable, chunk_sizes, row_bytes, rows_of, sample_minibatches
from sb3_speedups.errors import UserValueError


#: at most about this many bytes of transitions sampled ahead at a time (their laid-out copies are about as large
#: again), so that a train() call of many gradient steps stays within a few tens of megabytes more than stock's
AHEAD_BYTES = 4 * 2**20


def check_tau(tau: float) -> None:
    """Raise a one-line ``ValueError`` for a negative polyak coefficient (stock takes any value)."""
    if not tau >= 0.0:
        raise UserValueError(f"tau={tau} is invalid: the soft update coefficient must be in [0, 1] (e.g. 0.005)")


def largest_linear(*modules: nn.Module) -> int:
    """:return: inputs x outputs of the largest ``Linear`` layer in ``modules`` (for the update's thread count)"""
    return max(
        (m.in_features * m.out_features for mod in modules for m in mod.modules() if isinstance(m, nn.Linear)), default=0
    )


def sampled_minibatches(
    model: OffPolicyAlgorithm, gradient_steps: int, batch_size: int
) -> Iterator[tuple[int, ReplayBufferSamples]]:
    """
    The minibatches of one ``train()`` call, with the global-RNG draws of stock's one ``sample`` per step; for stock
    buffers many at a time (:func:`~sb3_speedups.common.replay.sampling.sample_minibatches`).

    :return: ``(number of minibatches, their rows concatenated)`` pairs, in order
    """
    buffer = model.replay_buffer
    assert buffer is not None
    env = model._vec_normalize_env
    if batchable(buffer):
        transition_bytes = 2 * row_bytes(buffer) + buffer.actions[0, 0].nbytes + 16
        ahead = max(1, AHEAD_BYTES // (transition_bytes * batch_size))
        for chunk in chunk_sizes(gradient_steps, batch_size, buffer):
            for start in range(0, chunk, ahead):  # smaller chunks, the same draws in the same order
                n = min(ahead, chunk - start)
                yield n, sample_minibatches(buffer, batch_size, n, env)
        return
    for _ in range(gradient_steps):
        yield 1, buffer.sample(batch_size, env=env)


def minibatches(model: OffPolicyAlgorithm, gradient_steps: int, batch_size: int) -> Iterator[tuple[int, OffPolicyBatches]]:
    """
    :return: the minibatches of one ``train()`` call laid out for the hand-derived steps
        (:func:`~sb3_speedups.common.off_policy.batches.lay_out`), as ``(index of the first gradient step,
        minibatches)`` pairs
    """
    rows = float_rows_unless_box(model.observation_space)
    done = 0
    for n, data in sampled_minibatches(model, gradient_steps, batch_size):
        yield done, lay_out(data, n, batch_size, model.gamma, rows)
        done += n


def split_minibatches(model: OffPolicyAlgorithm, gradient_steps: int, batch_size: int) -> Iterator[ReplayBufferSamples]:
    """:return: the minibatches of one ``train()`` call one by one (for the autograd updates)"""
    for n, data in sampled_minibatches(model, gradient_steps, batch_size):
        if n == 1:
            yield data
            continue
        for k in range(n):
            yield rows_of(data, slice(k * batch_size, (k + 1) * batch_size))


def mean_of(values: list[th.Tensor]) -> float:
    """:return: the mean of per-step scalars as stock logs it (``np.mean`` of their Python floats), one host read"""
    if len(values) == 1:  # one gradient step per train() (train_freq=1: SAC, TD3, TQC, CrossQ): the value, 20x cheaper
        return float(values[0])
    return float(np.mean(th.stack([v.reshape(()) for v in values]).tolist()))
