"""The rollout buffer of :class:`~sb3_speedups.ppo_mask.MaskablePPO`: PPO's, plus sb3-contrib's action masks."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np
import torch as th
from sb3_contrib.common.maskable.buffers import (
    MaskableDictRolloutBuffer,
    MaskableDictRolloutBufferSamples,
    MaskableRolloutBuffer,
    MaskableRolloutBufferSamples,
)

from sb3_speedups.common.on_policy.buffers import FastDictRolloutBuffer, FastRolloutBase, FastRolloutBuffer


class FastMaskableBase(FastRolloutBase):
    """
    The action masks of sb3-contrib's maskable buffers on a fast buffer's storage: they live in
    ``tensors["action_masks"]`` (float32 ``[n_steps, n_envs, mask_dims]``, as sb3-contrib stores them), so the update
    reads them flattened like every other field.
    """

    #: the sb3-contrib buffer class stood in for (its ``reset`` sizes the masks: ``mask_dims``)
    _stock: Any
    #: its samples' class
    _samples: Any
    action_masks: np.ndarray
    mask_dims: int
    device: th.device

    def _allocate(self) -> None:
        # sb3-contrib's reset sizes the masks for the action space; the rest it allocates is replaced next
        self._stock.reset(self)
        super()._allocate()  # type: ignore[misc]  # the storage's class, after this one in the MRO
        self.tensors["action_masks"] = th.from_numpy(self.action_masks)

    def reset(self) -> None:
        super().reset()
        self.action_masks.fill(1.0)  # a rollout collected without masks trains unmasked, as sb3-contrib's

    def add(self, *args: Any, action_masks: np.ndarray | None = None, **kwargs: Any) -> None:
        """Store one step of every env (SB3's ``RolloutBuffer.add`` arguments) and its action masks."""
        if action_masks is not None:
            self.action_masks[self.pos] = np.asarray(action_masks).reshape((self.n_envs, self.mask_dims))
        super().add(*args, **kwargs)

    def get(self, batch_size: int | None = None) -> Generator[Any, None, None]:
        for rows in self._sample_indices(batch_size):
            index = th.from_numpy(rows)
            obs = self.flat_observations()
            obs = (
                {k: v[index].to(self.device) for k, v in obs.items()} if isinstance(obs, dict) else obs[index].to(self.device)
            )
            masks = self.flat("action_masks")[index].to(self.device)
            yield self._samples(obs, *self._common_samples(rows, self.device), masks)


class FastMaskableRolloutBuffer(FastMaskableBase, FastRolloutBuffer, MaskableRolloutBuffer):  # type: ignore[misc]
    """Drop-in ``MaskableRolloutBuffer`` (same constructor, ``add(..., action_masks=...)``, ``action_masks``,
    ``mask_dims`` and ``get``) on :class:`~sb3_speedups.common.on_policy.buffers.FastRolloutBuffer`'s storage."""

    _stock = MaskableRolloutBuffer
    _samples = MaskableRolloutBufferSamples


class FastMaskableDictRolloutBuffer(FastMaskableBase, FastDictRolloutBuffer, MaskableDictRolloutBuffer):  # type: ignore[misc]
    """The ``Dict``-observation twin (a drop-in ``MaskableDictRolloutBuffer``)."""

    _stock = MaskableDictRolloutBuffer
    _samples = MaskableDictRolloutBufferSamples
