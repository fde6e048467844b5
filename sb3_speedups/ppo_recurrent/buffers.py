"""
sb3-contrib's recurrent rollout buffer with the sequence padding done by index arithmetic instead of Python lists.

sb3-contrib's ``RecurrentRolloutBuffer._get_samples`` builds one tensor per sequence and field and pads them with
``pad_sequence`` for every minibatch. Here all per-step fields live in one float32 matrix (built once per rollout)
and each minibatch is one gather into a zero-initialised padded matrix: the same minibatches, sequences, padding
and random draws (``np.random.randint`` for the split, as sb3-contrib), in a handful of tensor operations.
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np
import torch as th
from sb3_contrib.common.recurrent.buffers import RecurrentRolloutBuffer
from sb3_contrib.common.recurrent.type_aliases import RecurrentRolloutBufferSamples, RNNStates

STATE_FIELDS = ("hidden_states_pi", "cell_states_pi", "hidden_states_vf", "cell_states_vf")
STEP_FIELDS = ("observations", "actions", "values", "log_probs", "advantages", "returns", "episode_starts")


def padded_positions(seq_start: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """
    :param seq_start: ``(batch,)`` bools, ``True`` where a sequence starts (the first entry is treated as ``True``)
    :return: the indices of the sequence starts, each batch entry's row in the ``(n_seq * max_length)`` padded
        layout (sequence-major, sequences left-aligned), and ``max_length``
    """
    seq_start = seq_start.copy()
    seq_start[0] = True
    starts = np.flatnonzero(seq_start)
    lengths = np.diff(np.append(starts, len(seq_start)))
    max_length = int(lengths.max())
    seq_id = np.cumsum(seq_start) - 1
    offset = np.arange(len(seq_start)) - starts[seq_id]
    return starts, seq_id * max_length + offset, max_length


class FastRecurrentRolloutBuffer(RecurrentRolloutBuffer):
    """:class:`sb3_contrib.common.recurrent.buffers.RecurrentRolloutBuffer` with vectorised padding (same samples)."""

    def reset(self) -> None:
        super().reset()
        self._steps: th.Tensor | None = None

    def _prepare(self) -> None:
        """sb3-contrib's layout (env-major, each env's steps in order), then the float32 matrices for gathering."""
        for name in STATE_FIELDS:
            # (n_steps, n_layers, n_envs, dim) -> (n_steps, n_envs, n_layers, dim) -> (n_envs * n_steps, n_layers, dim)
            self.__dict__[name] = self.swap_and_flatten(self.__dict__[name].swapaxes(1, 2))
        for name in STEP_FIELDS:
            self.__dict__[name] = self.swap_and_flatten(self.__dict__[name])
        self.generator_ready = True
        n = self.buffer_size * self.n_envs
        columns = [self.__dict__[name].reshape(n, -1).astype(np.float32, copy=False) for name in STEP_FIELDS]
        self._widths = [c.shape[1] for c in columns]
        self._steps = self.to_torch(np.concatenate([*columns, np.ones((n, 1), dtype=np.float32)], axis=1))
        # (n, 4, n_layers, dim)
        self._states = self.to_torch(np.stack([self.__dict__[name] for name in STATE_FIELDS], axis=1))
        env_change = np.zeros((self.buffer_size, self.n_envs), dtype=bool)
        env_change[0, :] = True
        self._new_sequence = np.logical_or(self.swap_and_flatten(env_change).ravel(), self.episode_starts.ravel() > 0)

    def get(self, batch_size: int | None = None) -> Generator[RecurrentRolloutBufferSamples, None, None]:  # type: ignore[override]
        assert self.full, "Rollout buffer must be full before sampling from it"
        if not self.generator_ready or self._steps is None:
            self._prepare()
        n = self.buffer_size * self.n_envs
        if batch_size is None:
            batch_size = n
        # sb3-contrib's shuffle: keep the order, split the indices in two at a random point
        split_index = np.random.randint(n)
        indices = np.concatenate((np.arange(split_index, n), np.arange(split_index)))
        for start in range(0, n, batch_size):
            yield self._padded_samples(indices[start : start + batch_size])

    def _padded_samples(self, batch_inds: np.ndarray) -> RecurrentRolloutBufferSamples:
        assert self._steps is not None
        starts, rows, max_length = padded_positions(self._new_sequence[batch_inds])
        n_seq = len(starts)
        padded = self._steps.new_zeros((n_seq * max_length, self._steps.shape[1]))
        padded[th.as_tensor(rows, device=padded.device)] = self._steps[th.as_tensor(batch_inds, device=padded.device)]
        fields = padded.split([*self._widths, 1], dim=1)
        obs, actions, values, log_probs, advantages, returns, episode_starts, mask = fields
        # (n_seq, 4, n_layers, dim) -> 4 x (n_layers, n_seq, dim)
        states = self._states[th.as_tensor(batch_inds[starts], device=padded.device)].permute(1, 2, 0, 3)
        h_pi, c_pi, h_vf, c_vf = (s.contiguous() for s in states)
        return RecurrentRolloutBufferSamples(
            observations=obs.reshape((n_seq * max_length, *self.obs_shape)),
            actions=actions.reshape((n_seq * max_length, *self.actions.shape[1:])),
            old_values=values.flatten(),
            old_log_prob=log_probs.flatten(),
            advantages=advantages.flatten(),
            returns=returns.flatten(),
            lstm_states=RNNStates((h_pi, c_pi), (h_vf, c_vf)),
            episode_starts=episode_starts.flatten(),
            mask=mask.flatten(),
        )
