"""
Shuffled minibatches of a rollout, one permutation and a few gathers per epoch instead of per minibatch.

The permutation is ``np.random.permutation`` over SB3's env-major flattening, as ``RolloutBuffer.get`` draws it, so
minibatches hold the same samples as stock SB3's for the same numpy RNG state. Per-minibatch advantage
normalisation is done for the whole epoch at once (it does not depend on the parameters).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch as th

from sb3_speedups.common.on_policy.buffers import env_major_to_time_major
from sb3_speedups.common.torch_utils import is_channels_last, select_rows

Observations = th.Tensor | dict[str, th.Tensor]

#: rows of the packed per-sample scalars
OLD_VALUES, OLD_LOG_PROB, ADVANTAGES, RETURNS = range(4)


@dataclass
class Minibatch:
    """One minibatch on the training device (samples ``start:end`` of the epoch's order)."""

    observations: Observations
    actions: dict[str, th.Tensor]
    old_values: th.Tensor
    old_log_prob: th.Tensor
    advantages: th.Tensor
    returns: th.Tensor
    start: int = 0
    end: int = 0


def normalize_chunks_(x: th.Tensor, chunk: int) -> None:
    """
    ``(a - a.mean()) / (a.std() + 1e-8)`` in place on each consecutive chunk of ``x`` (the last may be shorter; a
    chunk of one sample is left as is, as SB3 does).

    :param x: 1-d tensor
    :param chunk: chunk length
    """
    full = (x.shape[0] // chunk) * chunk
    parts = [x[:full].view(-1, chunk)] if full else []
    if x.shape[0] - full > 1:
        parts.append(x[full:].view(1, -1))
    for part in parts:
        std, mean = th.std_mean(part, dim=1, keepdim=True)
        part.sub_(mean).div_(std.add_(1e-8))


@th.inference_mode(False)
def _empty(shape: list[int], like: th.Tensor, device: th.device | None = None) -> th.Tensor:
    """A normal tensor even under inference mode (PPO's hand-derived update runs there), usable in any mode, laid out
    channels-last where ``like`` is."""
    layout = th.channels_last if is_channels_last(like) else th.contiguous_format
    return th.empty(shape, dtype=like.dtype, device=like.device if device is None else device, memory_format=layout)


class MinibatchSampler:
    """
    Holds one rollout on the training device and serves its shuffled minibatches, epoch after epoch.

    :param n_steps: rollout length per env
    :param n_envs: number of envs
    :param batch_size: minibatch size
    :param device: training device
    :param normalize: ``"minibatch"`` (SB3's default), ``"batch"`` or ``None``
    :param gather_observations: gather observations once per epoch (``"epoch"``, fast for small observations) or
        per minibatch (``"minibatch"``, no second copy of large image observations)
    """

    def __init__(
        self,
        n_steps: int,
        n_envs: int,
        batch_size: int,
        device: th.device,
        normalize: str | None = "minibatch",
        gather_observations: str = "epoch",
    ) -> None:
        self.n_steps, self.n_envs, self.batch_size = n_steps, n_envs, batch_size
        self.n = n_steps * n_envs
        self.device = device
        self.normalize = normalize
        self.per_epoch_obs = gather_observations == "epoch"
        # With one minibatch per epoch its order cannot change the update (a mean over all samples), so the data
        # is gathered (and normalised) once per rollout; the permutation is still drawn to advance numpy's RNG.
        self.single = batch_size >= self.n
        self._prepared = False
        self._single_batch: Minibatch | None = None
        self._epoch: dict[str, th.Tensor] = {}
        self._rollout: dict[str, th.Tensor] = {}
        self.index = _empty([self.n], th.empty(0, dtype=th.int64), device)
        self._arange = np.arange(self.n)
        self._permutation = np.empty_like(self._arange)

    def load(self, observations: Observations, actions: dict[str, th.Tensor], scalars: th.Tensor) -> None:
        """
        Take a rollout (time-major, first dimension ``n_steps * n_envs``). Tensors from another device are copied
        into buffers kept from one rollout to the next (a recorded CUDA graph reads them at fixed addresses).

        :param observations: observations (tensor or dict of tensors)
        :param actions: the per-sample action tensors the update needs
        :param scalars: ``[4, n]``: old values, old log-probabilities, advantages, returns
        """
        if isinstance(observations, dict):
            self.observations: Observations = {k: self._keep(f"obs.{k}", v) for k, v in observations.items()}
        else:
            self.observations = self._keep("obs", observations)
        self.actions = {k: self._keep(f"actions.{k}", v) for k, v in actions.items()}
        self.scalars = self._keep("scalars", scalars)
        self._prepared = False

    def add_actions(self, actions: dict[str, th.Tensor]) -> None:
        """
        Add per-sample tensors to the loaded rollout's actions (e.g. action masks): gathered with them, and handed to
        the update in :attr:`Minibatch.actions`.

        :param actions: time-major tensors, first dimension ``n_steps * n_envs``
        """
        self.actions.update({k: self._keep(f"actions.{k}", v) for k, v in actions.items()})
        self._prepared = False

    def _keep(self, name: str, source: th.Tensor) -> th.Tensor:
        if source.device == self.device:
            self._rollout[name] = source  # already there: no copy
            return source
        kept = self._rollout.get(name)
        if kept is None or kept.shape != source.shape or kept.dtype != source.dtype:
            kept = self._rollout[name] = _empty(list(source.shape), source, self.device)
        return kept.copy_(source)

    def buffer_addresses(self) -> tuple[int, ...]:
        """:return: where the kept rollout and epoch buffers live (a recorded graph is valid while these hold)"""
        return tuple(t.data_ptr() for t in (*self._rollout.values(), *self._epoch.values(), self.index))

    def set_targets(self, advantages: th.Tensor, returns: th.Tensor) -> None:
        """Replace the advantages and returns (after recomputing them), time-major ``[n]``."""
        self.scalars[ADVANTAGES].copy_(advantages)
        self.scalars[RETURNS].copy_(returns)
        self._prepared = False

    def _gather(self, name: str, source: th.Tensor, dim: int, index: th.Tensor) -> th.Tensor:
        shape = list(source.shape)
        shape[dim] = index.shape[0]
        out = self._epoch.get(name)
        if out is None or list(out.shape) != shape or out.dtype != source.dtype or out.device != source.device:
            out = self._epoch[name] = _empty(shape, source)
        return select_rows(source, index, out) if dim == 0 else th.index_select(source, dim, index, out=out)

    def shuffle(self) -> None:
        """Draw the epoch's permutation (numpy's global RNG, as SB3) and gather the data in that order."""
        if self.draw():
            self.gather()

    def draw(self) -> bool:
        """
        Draw the epoch's permutation and copy it to the device (the host part of :meth:`shuffle`).

        :return: whether the data must be gathered again (not for a single minibatch already gathered)
        """
        # np.random.permutation(n) is arange(n) shuffled in place: the same draws into a kept array cost less.
        permutation = self._permutation
        permutation[:] = self._arange
        np.random.shuffle(permutation)
        if self.single and self._prepared:
            return False
        self.index.copy_(th.from_numpy(env_major_to_time_major(permutation, self.n_steps, self.n_envs)))
        return True

    def gather(self) -> None:
        """Gather the rollout in the drawn order and normalise the advantages (device work only: no host sync)."""
        self._prepared = True
        self._single_batch = None
        self.epoch_scalars = self._gather("scalars", self.scalars, 1, self.index)
        self.epoch_actions = {k: self._gather(f"actions.{k}", v, 0, self.index) for k, v in self.actions.items()}
        if self.per_epoch_obs:
            obs = self.observations
            if isinstance(obs, dict):
                self.epoch_obs: Observations = {k: self._gather(f"obs.{k}", v, 0, self.index) for k, v in obs.items()}
            else:
                self.epoch_obs = self._gather("obs", obs, 0, self.index)
        if self.normalize is not None:
            normalize_chunks_(self.epoch_scalars[ADVANTAGES], self.n if self.normalize == "batch" else self.batch_size)

    def n_minibatches(self) -> int:
        """:return: minibatches per epoch"""
        return -(-self.n // self.batch_size)

    def _observations(self, start: int, end: int) -> Observations:
        if self.per_epoch_obs:
            obs = self.epoch_obs
            return {k: v[start:end] for k, v in obs.items()} if isinstance(obs, dict) else obs[start:end]
        index = self.index[start:end]
        obs = self.observations
        if isinstance(obs, dict):
            return {k: select_rows(v, index) for k, v in obs.items()}
        return select_rows(obs, index)

    def minibatches(self) -> Iterator[Minibatch]:
        """:return: the epoch's minibatches, in order (slices of the gathered epoch tensors)"""
        if self._single_batch is not None:
            yield self._single_batch
            return
        s = self.epoch_scalars
        for start in range(0, self.n, self.batch_size):
            end = min(start + self.batch_size, self.n)
            batch = Minibatch(
                self._observations(start, end),
                {k: v[start:end] for k, v in self.epoch_actions.items()},
                s[OLD_VALUES, start:end],
                s[OLD_LOG_PROB, start:end],
                s[ADVANTAGES, start:end],
                s[RETURNS, start:end],
                start,
                end,
            )
            if self.single:
                self._single_batch = batch  # the same views serve every epoch until the data is gathered again
            yield batch
