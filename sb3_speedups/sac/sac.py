"""
SAC as in Stable-Baselines3, faster. What differs from stock, and why it is faster:

- ``train()`` samples its minibatches many at a time (the same global-RNG draws as stock:
  :mod:`sb3_speedups.common.replay.sampling`) and lays them out once (:mod:`sb3_speedups.common.off_policy.batches`);
- each gradient step is :class:`~sb3_speedups.sac.update.HandDerivedSACUpdate` for MLP policies (hand-derived
  gradients, stacked critics, flat parameters, fused Adam, no host sync), the same steps as stock's with the same
  torch RNG draws; the losses are logged once per ``train()``;
- torch runs on one CPU thread unless the user chose otherwise, except in ``train()`` when the matrix products are
  large (the RL Zoo's 256x256 nets): there two threads are faster.

gSDE, CNN and ``Dict`` observations, custom policies and optimizers run stock's ``train()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import stable_baselines3
import torch as th

from sb3_speedups.common.acting.off_policy import FrozenActorSampling, FrozenOffPolicyActor
from sb3_speedups.common.off_policy.collection import FastOffPolicyCollection
from sb3_speedups.common.off_policy.training import check_tau, largest_linear, mean_of, minibatches
from sb3_speedups.common.torch_utils import apply_num_threads, num_threads_during, update_num_threads
from sb3_speedups.errors import UserValueError
from sb3_speedups.sac.update import HandDerivedSACUpdate, SACStepLosses, sac_unsupported_reason


def check_ent_coef(ent_coef: Any) -> None:
    """
    Raise a one-line ``ValueError`` for an entropy coefficient string stock SAC cannot read (where it raises a bare
    one): ``"auto"`` (any string starting so), ``"auto_<initial value>"`` or a number.
    """
    if not isinstance(ent_coef, str):
        return
    value = ent_coef.split("_")[1] if ent_coef.startswith("auto") and "_" in ent_coef else ent_coef
    if value.startswith("auto"):
        return
    try:
        float(value)
    except ValueError:
        raise UserValueError(
            f"ent_coef={ent_coef!r} is invalid: use 'auto', 'auto_<initial value>' (e.g. 'auto_0.1') or a number"
        ) from None


@dataclass
class _Speedups:
    """Speed-only state, rebuilt when the policy or its optimizer state is replaced (never saved)."""

    updater: HandDerivedSACUpdate | None
    fallback_reason: str | None
    #: inputs x outputs of the largest ``Linear`` layer (for the update's thread count)
    largest_linear: int
    #: the actor's frozen copy that acts during collection (with the hand-derived update), else ``None``
    actor: FrozenOffPolicyActor | None


class SAC(FrozenActorSampling, FastOffPolicyCollection, stable_baselines3.SAC):
    """
    Soft Actor-Critic, a drop-in for :class:`stable_baselines3.SAC` (same arguments, ``learn``, ``predict``, saved
    files); see :class:`stable_baselines3.SAC` for every argument not listed here.

    :param num_threads: torch CPU threads; ``None`` keeps a value the user set, else uses the package default (1)
    :param fast_update: use the hand-derived update for MLP policies (``False`` forces stock's ``train()``)
    """

    def __init__(
        self,
        policy: Any,
        env: Any,
        *,
        num_threads: int | None = None,
        fast_update: bool = True,
        _init_setup_model: bool = True,
        **kwargs: Any,
    ) -> None:
        check_ent_coef(kwargs.get("ent_coef", "auto"))
        check_tau(kwargs.get("tau", 0.005))
        super().__init__(policy, env, _init_setup_model=False, **kwargs)
        self.num_threads = num_threads
        self.fast_update = fast_update
        self._speedups: _Speedups | None = None
        if _init_setup_model:
            self._setup_model()

    def _setup_model(self) -> None:
        apply_num_threads(self.num_threads)
        super()._setup_model()
        self._speedups = None

    def _excluded_save_params(self) -> list[str]:
        return [*super()._excluded_save_params(), "_speedups"]

    def fast_path_unsupported_reason(self) -> str | None:
        """:return: why the hand-derived update cannot run this model (so stock's ``train()`` does), or ``None``"""
        if not self.fast_update:
            return "fast_update=False"
        return sac_unsupported_reason(self.policy, self.use_sde)

    def _ensure_speedups(self) -> _Speedups:
        speed = self._speedups
        if speed is not None and (speed.updater is None or (speed.updater.policy is self.policy and speed.updater.is_bound())):
            return speed
        reason = self.fast_path_unsupported_reason()
        updater = None
        if reason is None:
            assert isinstance(self.target_entropy, float)
            updater = HandDerivedSACUpdate(
                self.policy,
                self.log_ent_coef,
                self.ent_coef_optimizer,
                getattr(self, "ent_coef_tensor", None),
                self.target_entropy,
            )
        elif self.verbose >= 1:
            print(f"sb3_speedups SAC: using stock's train() ({reason})")
        self._speedups = _Speedups(
            updater,
            reason,
            largest_linear(self.actor, self.critic),
            None if updater is None else FrozenOffPolicyActor(self.actor),
        )
        return self._speedups

    def train(self, gradient_steps: int, batch_size: int = 64) -> None:
        """Stock's SAC gradient steps (same updates), with the hand-derived update where it applies."""
        speed = self._ensure_speedups()
        updater = speed.updater
        if updater is None:
            return super().train(gradient_steps, batch_size)
        self._set_training_mode(True)
        optimizers = [self.actor.optimizer, self.critic.optimizer]
        if self.ent_coef_optimizer is not None:
            optimizers.append(self.ent_coef_optimizer)
        self._update_learning_rate(optimizers)
        losses = SACStepLosses([], [], [], [])
        threads = update_num_threads(batch_size * speed.largest_linear, self.num_threads, self.device)
        with num_threads_during(threads), th.inference_mode():
            for first, batches in minibatches(self, gradient_steps, batch_size):
                for k in range(batches.rewards.shape[0]):
                    update_target = (first + k) % self.target_update_interval == 0
                    updater.step(batches, k, update_target, self.tau, losses)
        self._n_updates += gradient_steps
        if speed.actor is not None:
            speed.actor.sync()
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/ent_coef", mean_of(losses.ent_coef))
        self.logger.record("train/actor_loss", mean_of(losses.actor))
        self.logger.record("train/critic_loss", mean_of(losses.critic))
        if losses.ent_coef_loss:
            self.logger.record("train/ent_coef_loss", mean_of(losses.ent_coef_loss))
        return None
