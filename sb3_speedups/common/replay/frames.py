"""
A replay buffer for frame-stacked observations (``VecFrameStack``, as on Atari) that stores each frame once.

Consecutive observations of one env share all frames but one: ``[f1 f2 f3 f4]`` is followed by ``[f2 f3 f4 f5]``.
Stock ``ReplayBuffer`` stores two stacks per transition (one with ``optimize_memory_usage=True``); this buffer keeps
each env's frames once, in a :class:`FrameRing`, and every observation as the ids of its frames, rebuilt by index
when sampled. Whether a stack continues the previous one is checked frame by frame when it is added, so the buffer is
exact for any observations: a stack that does not continue (an episode start, whose padding frames are zeros, or
observations that are no frame stack at all) stores its frames anew.

Stock's code runs unchanged around it: ``add``, ``sample`` and ``_get_samples`` (SB3's n-step one too) use
``observations`` and ``next_observations`` as they use stock's arrays, and these are :class:`StackedFrames`, which
store a position's stacks when assigned to and rebuild them when indexed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import NStepReplayBuffer, ReplayBuffer
from stable_baselines3.common.preprocessing import get_obs_shape, is_image_space
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from sb3_speedups.errors import UserTypeError, UserValueError

#: the id of an all-zero frame (the padding of a stack at an episode start): read from a zero row, never stored
ZERO = -1

# Frames copied at a time when the ring grows (bounds the temporary copy).
_GROW_CHUNK = 4096

# Stock's storage is built for observations with no elements: the observations are StackedFrames instead.
_NO_OBSERVATION = spaces.Box(0, 1, shape=(0,), dtype=np.uint8)


class FrameRing:
    """
    Each env's frames in a ring with reference counts. A frame's id only grows; it lives at slot ``id % capacity``,
    and a slot is written only when no stored stack refers to its frame: the ring grows when the next slots are still
    referred to, so that it never overwrites a frame in use, whatever the order of the writes.

    :param n_envs: number of envs (one ring each)
    :param capacity: slots per env
    :param frame_size: elements of one frame
    :param dtype: dtype of the frames
    """

    def __init__(self, n_envs: int, capacity: int, frame_size: int, dtype: Any) -> None:
        self.capacity = capacity
        # one more row per env: the zero frame that ZERO reads (np.zeros: pages are mapped when first written)
        self.frames = np.zeros((n_envs, capacity + 1, frame_size), dtype=dtype)
        self.refs = np.zeros((n_envs, capacity), dtype=np.int32)
        self.next_ids = np.zeros(n_envs, dtype=np.int64)

    def slots(self, ids: np.ndarray) -> np.ndarray:
        """:return: the rows of ``frames[env]`` that hold the frames ``ids`` (the zero row for ``ZERO``)"""
        return np.where(ids == ZERO, self.capacity, ids % self.capacity)

    def take(self, env_inds: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """:return: the frames ``ids`` (``[rows, n]``) of the envs ``env_inds`` (``[rows]``), ``[rows, n, frame_size]``"""
        flat = env_inds[:, None] * (self.capacity + 1) + self.slots(ids)
        return self.frames.reshape(-1, self.frames.shape[2]).take(flat, axis=0)

    def write(self, env_inds: np.ndarray, frames: np.ndarray) -> np.ndarray:
        """
        Store one new frame for each of ``env_inds`` (unreferenced until :meth:`retain`).

        :param env_inds: distinct envs
        :param frames: ``[len(env_inds), frame_size]``
        :return: their ids
        """
        ids = self.next_ids[env_inds]
        if self.refs[env_inds, ids % self.capacity].any():
            self._grow(1)
        self.frames[env_inds, ids % self.capacity] = frames
        self.next_ids[env_inds] += 1
        return ids

    def replace(self, env_inds: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        """
        Move one reference of each env from the frames ``old`` to the frames ``new`` (``[rows, n]`` ids, distinct in
        a row, of ``env_inds``).
        """
        refs = self.refs.reshape(-1)
        refs[self._flat_refs(env_inds, new)] += 1  # first: new may share frames with old
        refs[self._flat_refs(env_inds, old)] -= 1

    def _flat_refs(self, env_inds: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return (env_inds[:, None] * self.capacity + ids % self.capacity)[ids != ZERO]

    def _grow(self, needed: int) -> None:
        """Add slots so that ``needed`` new frames fit, moving every frame to its slot in the larger ring."""
        old, old_refs, old_capacity = self.frames, self.refs, self.capacity
        # Every frame in use has an id in [next_id - capacity, next_id) (its slot was never reused), so
        # ``capacity + needed`` slots hold them and the new ones; an eighth more keeps growths rare.
        self.capacity = old_capacity + max(old_capacity // 8, needed)
        self.frames = np.zeros((old.shape[0], self.capacity + 1, old.shape[2]), dtype=old.dtype)
        self.refs = np.zeros((old.shape[0], self.capacity), dtype=np.int32)
        for env, next_id in enumerate(self.next_ids.tolist()):
            for start in range(max(0, next_id - old_capacity), next_id, _GROW_CHUNK):
                ids = np.arange(start, min(start + _GROW_CHUNK, next_id), dtype=np.int64)
                self.frames[env, ids % self.capacity] = old[env, ids % old_capacity]
                self.refs[env, ids % self.capacity] = old_refs[env, ids % old_capacity]

    @property
    def nbytes(self) -> int:
        """Bytes of the frames and their reference counts."""
        return self.frames.nbytes + self.refs.nbytes + self.next_ids.nbytes


class StackedFrames:
    """
    The observations (or next observations) of a :class:`FrameStackReplayBuffer`, used as stock uses its
    ``[position, env, *obs_shape]`` arrays: ``stacks[pos] = obs`` stores a position's stacks (all envs),
    ``stacks[positions, envs]`` rebuilds stacks from their frames.

    :param buffer: the buffer
    :param next_observations: whether these are the next observations
    """

    def __init__(self, buffer: FrameStackReplayBuffer, next_observations: bool) -> None:
        self.buffer = buffer
        self.next_observations = next_observations

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.buffer.buffer_size, self.buffer.n_envs, *self.buffer.obs_shape)

    @property
    def dtype(self) -> np.dtype:
        return self.buffer.frames.frames.dtype

    def __getitem__(self, key: Any) -> np.ndarray:
        key = key if isinstance(key, tuple) else (key,)
        positions, envs, *rest = (*key, slice(None)) if len(key) == 1 else key
        if not all(_is_everything(r) for r in rest) or not _is_index(positions):
            raise IndexError("the stacks of a FrameStackReplayBuffer are indexed [positions, envs] by integers")
        if _is_everything(envs):
            positions, envs = np.asarray(positions)[..., None], np.arange(self.buffer.n_envs)
        elif not _is_index(envs):
            raise IndexError("the stacks of a FrameStackReplayBuffer are indexed [positions, envs] by integers")
        rows = np.ravel_multi_index(np.broadcast_arrays(positions, envs), (self.buffer.buffer_size, self.buffer.n_envs))
        return self.take(np.reshape(rows, -1)).reshape(*np.shape(rows), *self.buffer.obs_shape)

    def __setitem__(self, key: Any, stacks: np.ndarray) -> None:
        if not isinstance(key, int | np.integer):
            raise IndexError("a FrameStackReplayBuffer stores whole positions: assign stacks[pos] = (n_envs, *obs_shape)")
        self.buffer._store(self.next_observations, int(key), stacks)

    def take(self, rows: np.ndarray) -> np.ndarray:
        """:return: the stacks at flat rows ``position * n_envs + env``, ``[len(rows), *obs_shape]``"""
        buffer = self.buffer
        records = buffer.next_observation_ids if self.next_observations else buffer.observation_ids
        ids = records.reshape(-1, buffer.n_stack).take(rows, axis=0)
        return buffer.frames.take(rows % buffer.n_envs, ids).reshape(len(rows), *buffer.obs_shape)


def _is_index(value: Any) -> bool:
    return isinstance(value, int | np.integer) or (isinstance(value, np.ndarray) and value.dtype.kind in "iu")


def _is_everything(value: Any) -> bool:
    return value is Ellipsis or (isinstance(value, slice) and value == slice(None))


def _same_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """
    :return: per env, whether ``[n_envs, frames, frame_size]`` arrays hold the same bytes (so ``-0.0`` is not ``0.0``,
        and a NaN matches itself)
    """
    return (a.view(np.uint8) == b.view(np.uint8)).all(axis=(1, 2))


class FrameStackReplayBuffer(ReplayBuffer):
    """
    SB3's ``ReplayBuffer`` for frame-stacked observations (frames along the first axis: ``VecFrameStack`` then
    ``VecTransposeImage``, as SB3's CNN policies see Atari), storing each frame once. Its samples are stock's, draw
    for draw: ``DQN(..., replay_buffer_class=FrameStackReplayBuffer)``.

    Frames live in a :class:`FrameRing` per env with ``buffer_size * 17 / 16`` slots (it grows by an eighth when
    episodes are so short, or observations so unlike frame stacks, that its frames in use fill it).

    :param buffer_size: Max number of transitions (over all envs), as in SB3
    :param observation_space: Observation space: a ``Box`` whose first axis holds the stacked frames
    :param action_space: Action space
    :param device: PyTorch device
    :param n_envs: Number of parallel environments
    :param optimize_memory_usage: must be ``False`` (this buffer stores each frame once already)
    :param handle_timeout_termination: Treat time-limit truncation as non-terminal, as in SB3
    :param n_stack: frames per observation (``VecFrameStack``'s ``n_stack``); ``None``: every channel of the first
        axis is a frame (grey frames, as Atari's)
    :param n_steps: n-step returns as SB3's ``NStepReplayBuffer`` computes them (1: one-step transitions)
    :param gamma: discount factor of the n-step returns (only used when ``n_steps > 1``)
    """

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        *,
        n_stack: int | None = None,
        n_steps: int = 1,
        gamma: float = 0.99,
    ) -> None:
        self.n_stack = _check_arguments(self, observation_space, optimize_memory_usage, n_stack, n_steps)
        super().__init__(buffer_size, _NO_OBSERVATION, action_space, device, n_envs, False, handle_timeout_termination)
        self.observation_space = observation_space
        self.obs_shape = get_obs_shape(observation_space)  # type: ignore[assignment]
        self.frame_size = int(np.prod(self.obs_shape)) // self.n_stack
        self.n_steps = int(n_steps)
        self.gamma = gamma
        capacity = self.buffer_size + self.buffer_size // 16 + 2 * self.n_stack
        self.frames = FrameRing(self.n_envs, capacity, self.frame_size, observation_space.dtype)
        # frame ids of every stored stack (ZERO: an all-zero frame)
        self.observation_ids = np.full((self.buffer_size, self.n_envs, self.n_stack), ZERO, dtype=np.int64)
        self.next_observation_ids = np.full_like(self.observation_ids, ZERO)
        # where the newest next observations are, which the next observations stored usually are
        self.newest_next_pos: int | None = None
        self.observations = StackedFrames(self, next_observations=False)  # type: ignore[assignment]
        self.next_observations = StackedFrames(self, next_observations=True)  # type: ignore[assignment]

    @property
    def nbytes(self) -> int:
        """Bytes of the storage: frames, their reference counts and ids, and stock's other arrays."""
        others = (self.observation_ids, self.next_observation_ids, self.actions, self.rewards, self.dones, self.timeouts)
        return self.frames.nbytes + sum(a.nbytes for a in others)

    def _get_samples(self, batch_inds: np.ndarray, env: VecNormalize | None = None) -> ReplayBufferSamples:
        if self.n_steps > 1:
            return NStepReplayBuffer._get_samples(self, batch_inds, env)  # type: ignore[arg-type]
        return super()._get_samples(batch_inds, env)

    def _store(self, next_observations: bool, pos: int, stacks: np.ndarray) -> None:
        """Store the stacks of all envs at ``pos`` (``StackedFrames.__setitem__``)."""
        frames = np.asarray(stacks, dtype=self.frames.frames.dtype).reshape(self.n_envs, self.n_stack, self.frame_size)
        envs = np.arange(self.n_envs)
        if next_observations:
            # usually the observation shifted by one frame, plus one new frame
            observation = self.observation_ids[pos]
            ids = np.empty_like(observation)
            ids[:, :-1] = observation[:, 1:]
            continues = _same_rows(self.frames.take(envs, observation[:, 1:]), frames[:, :-1])
            ids[continues, -1] = self.frames.write(envs[continues], frames[continues, -1])
            records = self.next_observation_ids
        else:
            # usually the newest next observation (not at an episode start)
            newest = self.newest_next_pos
            ids = np.full_like(self.observation_ids[pos], ZERO) if newest is None else self.next_observation_ids[newest].copy()
            continues = _same_rows(self.frames.take(envs, ids), frames)
            records = self.observation_ids
        if not continues.all():
            ids[~continues] = self._new_stacks(envs[~continues], frames[~continues])
        self.frames.replace(envs, records[pos], ids)
        records[pos] = ids
        if next_observations:
            self.newest_next_pos = pos

    def _new_stacks(self, envs: np.ndarray, stacks: np.ndarray) -> np.ndarray:
        """:return: the ids of stacks stored frame by frame (all-zero frames, a new episode's padding, are not stored)"""
        ids = np.full((len(envs), self.n_stack), ZERO, dtype=np.int64)
        stored = stacks.view(np.uint8).max(axis=2) > 0
        for j in range(self.n_stack):
            rows = np.flatnonzero(stored[:, j])
            ids[rows, j] = self.frames.write(envs[rows], stacks[rows, j])
        return ids


def _check_arguments(
    buffer: object, observation_space: spaces.Space, optimize_memory_usage: bool, n_stack: int | None, n_steps: int
) -> int:
    """:return: the number of frames per observation, after checking the arguments of ``FrameStackReplayBuffer``"""
    if hasattr(buffer, "update_priorities"):
        raise UserTypeError("FrameStackReplayBuffer does not support prioritised replay: use one of the two buffers")
    if not isinstance(observation_space, spaces.Box):
        raise UserTypeError(
            f"FrameStackReplayBuffer needs a Box observation space, got {type(observation_space).__name__}: "
            "use SB3's ReplayBuffer (or DictReplayBuffer) instead"
        )
    if optimize_memory_usage:
        raise UserValueError(
            "optimize_memory_usage=True does not apply to FrameStackReplayBuffer (it stores each frame once): drop it"
        )
    # SB3's channels-last test (the smallest axis is the channels'), without its warning for the ambiguous middle axis
    if is_image_space(observation_space, check_channels=False) and int(np.argmin(observation_space.shape)) == 2:
        raise UserValueError(
            f"FrameStackReplayBuffer needs the frames stacked on the first axis, got channels-last observations of shape "
            f"{observation_space.shape}: wrap the env in VecTransposeImage (SB3's CNN policies do so)"
        )
    channels = observation_space.shape[0]
    n_stack = channels if n_stack is None else n_stack
    if int(n_stack) != n_stack or n_stack < 1 or channels % n_stack:
        raise UserValueError(
            f"n_stack={n_stack} does not divide the {channels} channels of the observations: pass VecFrameStack's n_stack"
        )
    if int(n_steps) != n_steps or n_steps < 1:
        raise UserValueError(f"n_steps={n_steps} is invalid: use a positive integer")
    return int(n_stack)
