"""
What the drop-in on-policy algorithms (PPO, A2C, MaskablePPO, TRPO) share around stock's ``OnPolicyAlgorithm``, in one
place: their speed options, our rollout buffer in place of stock's, the life cycle of the speed-only state (built when
missing or stale, dropped with the policy it was built for) and the frozen-actor collection.

Put it first among the bases of the stock class::

    class A2C(FastOnPolicy, stable_baselines3.A2C): ...

A subclass implements :meth:`~sb3_speedups.common.fast_model.FastModel._unsupported_reason` and
:meth:`FastOnPolicy._build_speedups`; it may extend ``__init__`` (pass ``_init_setup_model=False`` up, set its own
options, then call ``_setup_model``) and ``collect_rollouts`` (with :meth:`FastOnPolicy._synced_speedups`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch as th
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecEnv

from sb3_speedups.common.acting.actors import FrozenActorCritic, ModuleActorCritic
from sb3_speedups.common.fast_model import FastModel
from sb3_speedups.common.on_policy.buffers import FastRolloutBase, install_fast_rollout_buffer
from sb3_speedups.common.on_policy.collection import collect_rollout


@dataclass
class OnPolicySpeedups:
    """Speed-only state, rebuilt whenever the policy's parameters or optimizer state are replaced (never saved)."""

    #: the algorithm's update: it has the ``policy`` it was built for and ``is_bound()`` (still that policy's optimizer)
    updater: Any
    actor: FrozenActorCritic | ModuleActorCritic
    #: why the hand-derived update does not run this model, ``None`` where it does
    fallback_reason: str | None


class FastOnPolicy(FastModel):
    """
    Mixin: the speed options, rollout buffer, speed-only state and collection of the on-policy drop-ins (see the
    module docstring). Its ``__init__`` takes these keyword-only arguments and passes the others to the stock class.

    :param num_threads: torch CPU threads; ``None`` keeps a value the user set, else chooses from the network's
        shapes (one for small MLPs)
    :param inference_device: where collection acts, from a copy of the policy synced once per rollout (with a GPU
        ``device``: training on the GPU, acting on the CPU); ``"auto"`` acts on the training device
    :param fast_update: use the hand-derived update for MLP policies (``False`` forces the fallback)
    """

    inference_device: str = "cpu"
    # set by the stock class (an OnPolicyAlgorithm)
    policy: Any  # an ActorCriticPolicy (MaskablePPO types it as its subclass)
    rollout_buffer: Any  # a RolloutBuffer (typed as theirs by the stock classes)
    device: th.device
    gamma: float
    n_envs: int
    verbose: int

    def __init__(
        self,
        policy: Any,
        env: Any,
        *,
        num_threads: int | None = None,
        inference_device: str = "cpu",
        fast_update: bool = True,
        _init_setup_model: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(policy, env, _init_setup_model=False, **kwargs)  # type: ignore[call-arg]  # the stock class's
        self.num_threads = num_threads
        self.inference_device = inference_device
        self.fast_update = fast_update
        self._speedups = None
        if _init_setup_model:
            self._setup_model()

    def _after_stock_setup(self) -> None:
        install_fast_rollout_buffer(self)  # type: ignore[arg-type]  # a mixin of one

    def _inference_device(self) -> th.device:
        return self.device if self.inference_device == "auto" else th.device(self.inference_device)

    def _ensure_speedups(self) -> Any:
        """:return: the speed-only state, built when missing or stale; ``None`` where the stock code runs instead"""
        speed = self._speedups
        if speed is not None and speed.updater.policy is self.policy and speed.updater.is_bound():
            return speed
        self._close_speedups()
        self._speedups = self._build_speedups(self.fast_path_unsupported_reason())
        return self._speedups

    def _build_speedups(self, reason: str | None) -> Any:
        """
        :param reason: why the hand-derived update cannot run this model, ``None`` where it can
        :return: the algorithm's speed-only state (an :class:`OnPolicySpeedups`), or ``None`` for the stock code
        """
        raise NotImplementedError

    def _synced_speedups(self, rollout_buffer: RolloutBuffer) -> Any:
        """
        :param rollout_buffer: the buffer collection fills
        :return: the speed-only state with its frozen actor synced to the policy, or ``None`` where stock's collection
            runs (a rollout buffer not ours, or no fast path)
        """
        if not isinstance(rollout_buffer, FastRolloutBase):
            return None
        speed = self._ensure_speedups()
        if speed is not None:
            speed.actor.sync()
        return speed

    def collect_rollouts(
        self, env: VecEnv, callback: BaseCallback, rollout_buffer: RolloutBuffer, n_rollout_steps: int
    ) -> bool:
        speed = self._synced_speedups(rollout_buffer)
        if speed is None:
            return super().collect_rollouts(env, callback, rollout_buffer, n_rollout_steps)  # type: ignore[misc]
        return collect_rollout(self, env, callback, rollout_buffer, n_rollout_steps, speed.actor, self.gamma)  # type: ignore[arg-type]
