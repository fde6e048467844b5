"""The rollout buffer of :class:`~sb3_speedups.ppo_mask.MaskablePPO`: PPO's, plus sb3-contrib's action masks."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np
import torch as th
from sb3_contrib.common.maskable.buffers import MaskableRolloutBuffer, MaskableRolloutBufferSamples

from sb3_speedups.ppo.buffers import FastRolloutBuffer


class FastMaskableRolloutBuffer(FastRolloutBuffer, MaskableRolloutBuffer):
    """
    Drop-in ``MaskableRolloutBuffer`` (same constructor, ``add(..., action_masks=...)``, ``action_masks``,
    ``mask_dims`` and ``get``) on :class:`~sb3_speedups.ppo.buffers.FastRolloutBuffer`'s storage: the masks live in
    ``tensors["action_masks"]`` (float32 ``[n_steps, n_envs, mask_dims]``, as sb3-contrib stores them), so the
    update reads them flattened like every other field.
    """

    def _allocate(self) -> None:
        # sb3-contrib's reset sizes the masks (mask_dims) for the action space; the rest it allocates is replaced next
        MaskableRolloutBuffer.reset(self)
        super()._allocate()
        self.tensors["action_masks"] = th.from_numpy(self.action_masks)

    def reset(self) -> None:
        super().reset()
        self.action_masks.fill(1.0)  # a rollout collected without masks trains unmasked, as sb3-contrib's

    def add(self, *args: Any, action_masks: np.ndarray | None = None, **kwargs: Any) -> None:
        """Store one step of every env (SB3's ``RolloutBuffer.add`` arguments) and its action masks."""
        if action_masks is not None:
            self.action_masks[self.pos] = np.asarray(action_masks).reshape((self.n_envs, self.mask_dims))
        super().add(*args, **kwargs)

    def get(self, batch_size: int | None = None) -> Generator[MaskableRolloutBufferSamples, None, None]:  # type: ignore[override]
        for rows in self._sample_indices(batch_size):
            index = th.from_numpy(rows)
            obs = self.flat_observations()[index].to(self.device)
            masks = self.flat("action_masks")[index].to(self.device)
            actions, values, log_probs, advantages, returns = self._common_samples(rows, self.device)
            yield MaskableRolloutBufferSamples(obs, actions, values, log_probs, advantages, returns, masks)
