"""
All the minibatches of one off-policy ``train()`` call, sampled at once.

Stock SB3 samples one minibatch per gradient step: two ``np.random.randint`` draws, five fancy-indexing gathers and
five ``th.tensor`` copies each time. The buffer's contents do not change inside ``train()``, so the same draws (in
the same order, from the same global numpy RNG: the minibatches are identical to stock's) can be made first and
the data gathered and converted once for all of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple, cast

import numpy as np
import torch as th
from stable_baselines3.common.buffers import NStepReplayBuffer, ReplayBuffer
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from sb3_speedups.common.replay.frames import FrameStackReplayBuffer
from sb3_speedups.common.replay.her import her_sampling_supported, sample_her_minibatches
from sb3_speedups.common.replay.rows import take_rows

# Above this many bytes of observations per train() call, the minibatches are gathered in several chunks.
CHUNK_BYTES = 64 * 2**20


class IndexDraw(NamedTuple):
    """Positions and env columns of sampled transitions (flattened over the minibatches)."""

    batch_inds: np.ndarray
    env_inds: np.ndarray


def batched_sampling_supported(buffer: object) -> bool:
    """
    :param buffer: the replay buffer
    :return: whether :func:`draw_indices` reproduces its ``sample`` (stock ``ReplayBuffer``, and
        ``FrameStackReplayBuffer`` without n-step returns); other buffers in :func:`sample_minibatches` are sampled
        with their own ``sample`` per minibatch
    """
    return type(buffer) is ReplayBuffer or (type(buffer) is FrameStackReplayBuffer and buffer.n_steps == 1)


def draw_indices(buffer: ReplayBuffer, batch_size: int, n_batches: int) -> IndexDraw:
    """
    Draw the indices of ``n_batches`` minibatches exactly as ``n_batches`` calls of ``ReplayBuffer.sample`` would.

    :param buffer: a buffer that :func:`batched_sampling_supported` accepts
    :param batch_size: transitions per minibatch
    :param n_batches: number of minibatches
    :return: ``n_batches * batch_size`` positions and env columns, minibatch after minibatch
    """
    if n_batches == 1:
        return IndexDraw(_draw_positions(buffer, batch_size), _draw_envs(buffer, batch_size))
    batch_inds = np.empty((n_batches, batch_size), dtype=np.int64)
    env_inds = np.empty((n_batches, batch_size), dtype=np.int64)
    for i in range(n_batches):
        batch_inds[i] = _draw_positions(buffer, batch_size)
        env_inds[i] = _draw_envs(buffer, batch_size)
    return IndexDraw(batch_inds.reshape(-1), env_inds.reshape(-1))


def _draw_positions(buffer: ReplayBuffer, batch_size: int) -> np.ndarray:
    """:return: the positions one ``ReplayBuffer.sample`` draws"""
    if not buffer.optimize_memory_usage:
        return np.random.randint(0, buffer.buffer_size if buffer.full else buffer.pos, size=batch_size)
    if buffer.full:
        return (np.random.randint(1, buffer.buffer_size, size=batch_size) + buffer.pos) % buffer.buffer_size
    return np.random.randint(0, buffer.pos, size=batch_size)


def _draw_envs(buffer: ReplayBuffer, batch_size: int) -> np.ndarray:
    """:return: the env columns one ``ReplayBuffer._get_samples`` draws"""
    if buffer.n_envs == 1:
        # randint over a single value draws nothing from the legacy RNG (whose stream numpy keeps frozen): zeros
        # without the call leave the RNG exactly as stock leaves it
        return np.zeros(batch_size, dtype=np.int64)
    return np.random.randint(0, high=buffer.n_envs, size=(batch_size,))


def newest_indices(buffer: ReplayBuffer) -> IndexDraw:
    """:return: where the last ``add`` wrote (one transition per env)"""
    if buffer.pos == 0 and not buffer.full:
        raise ValueError("the replay buffer is empty")
    pos = (buffer.pos - 1) % buffer.buffer_size
    return IndexDraw(np.full(buffer.n_envs, pos, dtype=np.int64), np.arange(buffer.n_envs, dtype=np.int64))


def gather(buffer: ReplayBuffer, draw: IndexDraw, env: VecNormalize | None = None) -> ReplayBufferSamples:
    """
    The transitions at ``draw``, as ``ReplayBuffer._get_samples`` builds them (one conversion for all of them).

    :param buffer: a buffer that :func:`batched_sampling_supported` accepts (a ``FrameStackReplayBuffer``'s stacks
        are rebuilt from its frames for all of them at once)
    :param draw: positions and env columns
    :param env: the ``VecNormalize`` wrapper to normalise with, if any
    """
    b, e = draw
    n_envs = buffer.n_envs

    def flat(positions: np.ndarray) -> np.ndarray:
        # one row index per transition into [positions * envs, ...] views of the storage (see take_rows)
        return positions * n_envs + e if n_envs > 1 else positions

    rows = flat(b)
    if buffer.optimize_memory_usage:
        next_obs = take_rows(buffer.observations, flat((b + 1) % buffer.buffer_size))
    else:
        next_obs = take_rows(buffer.next_observations, rows)
    obs, rewards = take_rows(buffer.observations, rows), take_rows(buffer.rewards, rows).reshape(-1, 1)
    if env is not None:
        obs, next_obs = (
            cast(np.ndarray, buffer._normalize_obs(obs, env)),
            cast(np.ndarray, buffer._normalize_obs(next_obs, env)),
        )
        rewards = buffer._normalize_reward(rewards, env)
    dones = take_rows(buffer.dones, rows) * (1 - take_rows(buffer.timeouts, rows))
    data = (obs, take_rows(buffer.actions, rows), next_obs, dones.reshape(-1, 1), rewards)
    if buffer.device.type == "cpu":
        # take made fresh arrays: wrap them instead of copying them again (same dtypes and values)
        return ReplayBufferSamples(*(th.from_numpy(x) for x in data))  # type: ignore[arg-type]
    return ReplayBufferSamples(*(buffer.to_torch(x) for x in data))  # type: ignore[arg-type]


def _concat(samples: list[ReplayBufferSamples]) -> ReplayBufferSamples:
    fields = []
    for values in zip(*samples, strict=True):
        fields.append(None if values[0] is None else th.cat(values))
    return ReplayBufferSamples(*fields)  # type: ignore[arg-type]


def sample_minibatches(
    buffer: ReplayBuffer,
    batch_size: int,
    n_batches: int,
    env: VecNormalize | None = None,
    combined: bool = False,
) -> ReplayBufferSamples:
    """
    ``n_batches`` minibatches, concatenated, equal to what ``n_batches`` calls of ``buffer.sample`` return.

    :param buffer: a stock ``ReplayBuffer`` or a ``FrameStackReplayBuffer`` (one index draw, one gather), a stock
        ``HerReplayBuffer`` (:func:`~sb3_speedups.common.replay.her.sample_her_minibatches`), or an n-step buffer (its
        own ``sample`` per minibatch: its n-step sums are not vectorised here)
    :param batch_size: transitions per minibatch
    :param n_batches: number of minibatches
    :param env: the ``VecNormalize`` wrapper, if any
    :param combined: combined experience replay (Zhang & Sutton 2017): the first ``n_envs`` rows of every
        minibatch are the newest transitions (one per env); needs a buffer that :func:`batched_sampling_supported`
        accepts
    :return: ``ReplayBufferSamples`` with ``n_batches * batch_size`` rows
    """
    if batched_sampling_supported(buffer):
        draw = draw_indices(buffer, batch_size, n_batches)
        if combined:
            newest = newest_indices(buffer)
            rows = min(len(newest.batch_inds), batch_size)
            for arr, new in zip(draw, newest, strict=True):
                arr.reshape(n_batches, batch_size)[:, :rows] = new[:rows]
        return gather(buffer, draw, env)
    if not combined and her_sampling_supported(buffer):
        return sample_her_minibatches(buffer, batch_size, n_batches, env)  # type: ignore[arg-type, return-value]
    if combined:
        raise ValueError(
            f"combined replay needs a stock ReplayBuffer or a one-step FrameStackReplayBuffer, not {type(buffer).__name__}"
        )
    return _concat([buffer.sample(batch_size, env=env) for _ in range(n_batches)])


def rows_of(data: ReplayBufferSamples, rows: slice) -> ReplayBufferSamples:
    """:return: the rows ``rows`` of every field of ``data`` (each entry of ``Dict`` observations), as the same type"""

    def part(x: th.Tensor | dict[str, th.Tensor] | None) -> th.Tensor | dict[str, th.Tensor] | None:
        if isinstance(x, dict):
            return {key: value[rows] for key, value in x.items()}
        return None if x is None else x[rows]

    samples: Any = type(data)
    return samples(*(part(x) for x in data))


def batchable(buffer: object) -> bool:
    """:return: whether :func:`sample_minibatches` can sample ahead for this buffer (its draws ignore the network)"""
    return type(buffer) in (ReplayBuffer, NStepReplayBuffer, FrameStackReplayBuffer) or her_sampling_supported(buffer)


def row_bytes(buffer: ReplayBuffer) -> int:
    """:return: the bytes of one transition's observation (each entry's, for ``Dict`` observations)"""
    observations = buffer.observations
    if isinstance(observations, dict):
        return sum(int(storage[0, 0].nbytes) for storage in observations.values())
    return int(observations[0, 0].nbytes)


def chunk_sizes(n_batches: int, batch_size: int, buffer: ReplayBuffer) -> Iterator[int]:
    """
    :return: how many minibatches to sample at a time so that one chunk of observations and next observations
        stays under :data:`CHUNK_BYTES`
    """
    per_chunk = max(1, min(n_batches, CHUNK_BYTES // max(1, 2 * row_bytes(buffer) * batch_size)))
    done = 0
    while done < n_batches:
        step = min(per_chunk, n_batches - done)
        yield step
        done += step
