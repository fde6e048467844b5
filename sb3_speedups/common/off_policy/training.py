"""What SAC's and TD3's ``train()`` share around their gradient steps: argument checks, sampling and threads."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch as th
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from torch import nn

from sb3_speedups.common.off_policy.batches import OffPolicyBatches, lay_out
from sb3_speedups.common.replay.sampling import batchable, chunk_sizes, sample_minibatches
from sb3_speedups.errors import UserValueError


def check_tau(tau: float) -> None:
    """Raise a one-line ``ValueError`` for a negative polyak coefficient (stock takes any value)."""
    if not tau >= 0.0:
        raise UserValueError(f"tau={tau} is invalid: the soft update coefficient must be in [0, 1] (e.g. 0.005)")


def largest_linear(*modules: nn.Module) -> int:
    """:return: inputs x outputs of the largest ``Linear`` layer in ``modules`` (for the update's thread count)"""
    return max(
        (m.in_features * m.out_features for mod in modules for m in mod.modules() if isinstance(m, nn.Linear)), default=0
    )


def minibatches(model: OffPolicyAlgorithm, gradient_steps: int, batch_size: int) -> Iterator[tuple[int, OffPolicyBatches]]:
    """
    The minibatches of one ``train()`` call, with the global-RNG draws of stock's one ``sample`` per step; for stock
    buffers many at a time (:func:`~sb3_speedups.common.replay.sampling.sample_minibatches`).

    :return: ``(index of the first gradient step, minibatches)`` pairs, in order
    """
    buffer = model.replay_buffer
    assert buffer is not None
    env = model._vec_normalize_env
    done = 0
    if batchable(buffer):
        for n in chunk_sizes(gradient_steps, batch_size, buffer):
            yield done, lay_out(sample_minibatches(buffer, batch_size, n, env), n, batch_size, model.gamma)
            done += n
        return
    for _ in range(gradient_steps):
        yield done, lay_out(buffer.sample(batch_size, env=env), 1, batch_size, model.gamma)
        done += 1


def mean_of(values: list[th.Tensor]) -> float:
    """:return: the mean of per-step scalars as stock logs it (``np.mean`` of their Python floats), one host read"""
    return float(np.mean(th.stack([v.reshape(()) for v in values]).tolist()))
