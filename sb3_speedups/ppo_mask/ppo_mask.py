"""
MaskablePPO as in sb3-contrib, faster, on PPO's engine. What differs from stock, and why it is faster:

- collection is PPO's (:func:`~sb3_speedups.common.on_policy.collection.collect_rollout`): one batched call of a
  frozen copy of the policy per vectorised step, with the envs' action masks (sb3-contrib's ``get_action_masks``)
  applied to the logits as sb3-contrib does (:mod:`sb3_speedups.common.nn.heads.masked`), into a buffer allocated
  once that also keeps the masks (:class:`~sb3_speedups.ppo_mask.buffers.FastMaskableRolloutBuffer`, its ``Dict``
  twin for vector entries);
- ``train()`` is PPO's (:class:`~sb3_speedups.ppo.training.PPOTraining`): one shuffle per epoch, the masks gathered
  with the actions, the hand-derived update (:class:`~sb3_speedups.ppo.update.HandDerivedPPOUpdate`) with the masked
  categorical head, fused Adam, optionally split over two processes or replayed from a CUDA graph;
- anything else (CNN or image ``Dict`` observations, custom policies or buffers, another optimizer) runs sb3-contrib's own
  code, unchanged.

Saved files are sb3-contrib's (the speed-only state is not saved): each package loads the other's.
"""

from __future__ import annotations

from typing import Any, ClassVar

import sb3_contrib
from sb3_contrib.common.maskable.buffers import MaskableDictRolloutBuffer, MaskableRolloutBuffer
from sb3_contrib.common.maskable.utils import is_masking_supported
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecEnv

from sb3_speedups.common.acting.actors import FrozenActorCritic
from sb3_speedups.common.nn.heads.masked import make_masked_head
from sb3_speedups.common.nn.optim import adam_unsupported_reason
from sb3_speedups.common.nn.actor_critic import mlp_unsupported_reason
from sb3_speedups.common.nn.inputs import flat_input_unsupported_reason
from sb3_speedups.common.on_policy.base import FastOnPolicy
from sb3_speedups.common.on_policy.buffers import install_fast_rollout_buffer
from sb3_speedups.errors import UserValueError
from sb3_speedups.common.on_policy.collection import collect_rollout
from sb3_speedups.ppo.minibatches import MinibatchSampler
from sb3_speedups.ppo.training import PPOSpeedups, PPOTraining
from sb3_speedups.ppo.split_update import SplitPPOUpdate
from sb3_speedups.ppo.update import HandDerivedPPOUpdate
from sb3_speedups.ppo_mask.buffers import FastMaskableDictRolloutBuffer, FastMaskableRolloutBuffer, FastMaskableBase
from sb3_speedups.ppo_mask.masks import masks_reader


class MaskablePPO(PPOTraining, sb3_contrib.MaskablePPO):
    """
    PPO with invalid-action masking, a drop-in for :class:`sb3_contrib.MaskablePPO` (same arguments, ``learn`` with
    ``use_masking``, ``predict`` with ``action_masks``, saved files); see :class:`sb3_contrib.MaskablePPO` for every
    argument not listed here.

    :param num_threads: torch CPU threads; ``None`` keeps a value the user set, else uses the package default (1)
    :param inference_device: where collection acts, from a copy of the policy synced once per rollout; ``"auto"``
        acts on the training device
    :param fast_update: use PPO's hand-derived update for MLP policies (``False``: sb3-contrib's own code throughout)
    :param cuda_graphs: on a CUDA ``device``, replay the epochs from a CUDA graph (as :class:`sb3_speedups.PPO`)
    :param split_update: run the critic's half of each minibatch update in a helper process (as
        :class:`sb3_speedups.PPO`): ``True``, ``False`` or ``"auto"``; off by default: masking problems are
        mostly collection-bound (env and mask calls), where the helper's per-update handshakes cost more than they save
    """

    def __init__(
        self,
        policy: Any,
        env: Any,
        *,
        cuda_graphs: bool = True,
        split_update: bool | str = False,
        _init_setup_model: bool = True,
        **kwargs: Any,
    ) -> None:
        if split_update not in (True, False, "auto"):
            raise UserValueError(f"split_update={split_update!r} is invalid: use True, False or 'auto'")
        super().__init__(policy, env, _init_setup_model=False, **kwargs)
        self.cuda_graphs = cuda_graphs
        self.split_update = split_update
        self._fallback_reason: str | None = None  # the last one printed
        if _init_setup_model:
            self._setup_model()

    #: speed-only attributes, never saved (the last fallback reason printed is one)
    speed_only_attributes: ClassVar[tuple[str, ...]] = ("_speedups", "_fallback_reason")

    def _after_stock_setup(self) -> None:
        install_fast_rollout_buffer(
            self,  # type: ignore[arg-type]  # a mixin of one
            {MaskableRolloutBuffer: FastMaskableRolloutBuffer, MaskableDictRolloutBuffer: FastMaskableDictRolloutBuffer},
        )

    # ----- speed-only state ---------------------------------------------------------------------------------------

    def _unsupported_reason(self) -> str | None:
        """:return: why this model runs sb3-contrib's own collection and update, or ``None`` when it runs ours"""
        if not isinstance(self.rollout_buffer, FastMaskableBase):
            return f"rollout buffer {type(self.rollout_buffer).__name__} is not the default MaskableRolloutBuffer"
        reason = flat_input_unsupported_reason(self.observation_space) or mlp_unsupported_reason(self.policy)
        if reason is None and make_masked_head(self.policy.action_dist) is None:
            reason = f"action distribution {type(self.policy.action_dist).__name__} has no masked head"
        return reason or adam_unsupported_reason(self.policy.optimizer, list(self.policy.parameters()))

    def _build_speedups(self, reason: str | None) -> PPOSpeedups | None:
        """:return: the fast path's state, or ``None`` where sb3-contrib's code runs"""
        if reason is not None:
            if self.verbose >= 1 and reason != self._fallback_reason:
                print(f"sb3_speedups MaskablePPO: using sb3-contrib's code ({reason})")
            self._fallback_reason = reason
            return None
        head = make_masked_head(self.policy.action_dist)
        assert head is not None
        policy: Any = self.policy  # a MaskableActorCriticPolicy: the same networks as an ActorCriticPolicy
        split = self.split_update_unsupported_reason() is None
        updater = SplitPPOUpdate(policy, head) if split else HandDerivedPPOUpdate(policy, head)
        return PPOSpeedups(updater, FrozenActorCritic(policy, head, self._inference_device()), None)

    # ----- collection and update ----------------------------------------------------------------------------------

    def collect_rollouts(
        self,
        env: VecEnv,
        callback: BaseCallback,
        rollout_buffer: RolloutBuffer,
        n_rollout_steps: int,
        use_masking: bool = True,
    ) -> bool:
        speed = self._ensure_speedups()  # before the buffer check: with verbose, it says why sb3-contrib's code runs
        if speed is None or not isinstance(rollout_buffer, FastMaskableBase):
            # sb3-contrib's (the next in the MRO after the base's four-argument version); not by the class's name, which
            # a test harness may point at this class
            stock = super(FastOnPolicy, self)
            return stock.collect_rollouts(env, callback, rollout_buffer, n_rollout_steps, use_masking)  # type: ignore[attr-defined]
        if use_masking and not is_masking_supported(env):
            raise ValueError("Environment does not support action masking. Consider using ActionMasker wrapper")
        speed.actor.sync()
        masks_of = masks_reader(env) if use_masking else None
        return collect_rollout(self, env, callback, rollout_buffer, n_rollout_steps, speed.actor, self.gamma, masks_of)

    def _load_rollout(self, speed: PPOSpeedups, sampler: MinibatchSampler) -> None:
        """PPO's, plus the rollout's masks as one more per-sample action tensor (gathered with the actions)."""
        super()._load_rollout(speed, sampler)
        assert isinstance(self.rollout_buffer, FastMaskableBase)
        sampler.add_actions({"masks": self.rollout_buffer.flat("action_masks").bool()})
