"""
Frozen plain-tensor copies of SAC's and TD3's (DDPG's) MLP actors for collection, synced before every collection
(after a ``train()``, a load or a ``set_parameters``), and the ``_sample_action`` that acts from them.

They run torch's own kernels on the copies (:class:`~sb3_speedups.common.acting.torch_mlp.TorchMlp`) and draw SAC's
noise from torch's global RNG as ``torch.distributions.Normal.rsample`` does, so the actions are stock's: the same
draws, the same operations on the same shapes as the actor module (a numpy forward would round differently, and could
not draw torch's Gaussian noise). What they save is
``policy.predict``'s per-call overhead (checks, modes, module calls).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.noise import ActionNoise
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from stable_baselines3.sac.policies import Actor as SACActor
from stable_baselines3.td3.policies import Actor as TD3Actor
from torch import nn

from sb3_speedups.common.acting.actors import box_env_actions
from sb3_speedups.common.acting.mirror import ParameterMirror
from sb3_speedups.common.acting.torch_mlp import TorchMlp
from sb3_speedups.common.nn.inputs import float_rows_unless_box

# SB3's bounds on SAC's log standard deviation
_LOG_STD_MIN, _LOG_STD_MAX = -20.0, 2.0


class FrozenOffPolicyActor:
    """
    A copy of a stock SAC or TD3 ``Actor`` with an MLP on the observations' float rows (no gSDE), on the CPU.

    :param actor: the actor (its ``latent_pi``, ``mu`` and ``log_std`` for SAC; its ``mu`` for TD3)
    :param latent: builds the executor of the actor's ``latent_pi`` (SAC) on the copies; the float buffers are
        copied too (running statistics of normalisation layers, as in CrossQ's actor)
    """

    def __init__(
        self,
        actor: SACActor | TD3Actor,
        latent: Callable[[nn.Module, Callable[[th.Tensor], th.Tensor]], Callable[[th.Tensor], th.Tensor]] = (
            TorchMlp.from_module
        ),
    ) -> None:
        params = [*actor.parameters(), *(b for b in actor.buffers() if b.is_floating_point())]
        self.mirror = ParameterMirror(params, "cpu")
        lookup = {id(p): c for p, c in zip(params, self.mirror.copies, strict=True)}

        def mirrored(t: th.Tensor) -> th.Tensor:
            return lookup[id(t)]

        # SAC's actor, or one built as it (sb3-contrib's TQC Actor): latent, then the mean and the log std as two
        # products (as stock's two Linear calls)
        self.squashed_gaussian = isinstance(actor, SACActor) or hasattr(actor, "latent_pi")
        sac = cast(SACActor, actor)
        self.nets: list[Callable[[th.Tensor], th.Tensor]] = (
            [
                latent(sac.latent_pi, mirrored),
                *(TorchMlp.from_module(m, mirrored) for m in (sac.mu, cast(nn.Module, sac.log_std))),
            ]
            if self.squashed_gaussian
            else [TorchMlp.from_module(actor.mu, mirrored)]
        )

        #: the observations' float rows, ``None`` for a flat ``Box`` (its rows: the observations, flattened)
        self.float_rows = float_rows_unless_box(actor.observation_space)

    def sync(self) -> None:
        """Refresh the copy from the actor."""
        self.mirror.sync()

    def inputs(self, obs: np.ndarray | dict[str, np.ndarray]) -> th.Tensor:
        """:return: the actor's input rows ``[n, obs_dim]`` (float32) of a batch of observations"""
        if self.float_rows is not None:
            return self.float_rows.rows(obs)
        x = th.as_tensor(np.asarray(obs))
        return x.reshape(x.shape[0], -1).float()

    def __call__(self, obs: th.Tensor) -> th.Tensor:
        """:return: sampled (SAC) or deterministic (TD3) actions in ``[-1, 1]`` of flat observations ``[n, obs_dim]``"""
        if not self.squashed_gaussian:
            return self.nets[0](obs)
        latent = self.nets[0](obs)
        mean = self.nets[1](latent)
        log_std = th.clamp(self.nets[2](latent), _LOG_STD_MIN, _LOG_STD_MAX)
        std = log_std.exp()  # stock multiplies by ones first: exact, so the same numbers
        return th.tanh(mean + th.empty_like(mean).normal_() * std)


class FrozenActorSampling(OffPolicyAlgorithm):
    """
    Mixin for our SAC and TD3: ``_sample_action`` acts from the frozen copy in ``self._speedups.actor`` (``None``:
    stock's acting). The algorithm builds it in ``_ensure_speedups()``; it is synced here before each collection,
    the only place it acts.
    """

    _speedups: Any

    def _ensure_speedups(self) -> Any:
        raise NotImplementedError

    def _frozen_actor(self) -> FrozenOffPolicyActor | None:
        """:return: the frozen actor as built now (cheap: for every env step)"""
        return None if self._speedups is None else self._speedups.actor

    def collect_rollouts(self, *args: Any, **kwargs: Any) -> Any:
        speed = self._speedups
        if speed is None or speed.updater.policy is not self.policy:
            # Acting needs only the current policy's copy: its mirror follows moved parameters by itself, and a
            # stale optimizer state is train()'s to check (a full check per env step costs ~20 us).
            speed = self._ensure_speedups()
        if speed.actor is not None:
            speed.actor.sync()  # trained, loaded or set since the last collection
        return super().collect_rollouts(*args, **kwargs)

    def _sample_action(
        self, learning_starts: int, action_noise: ActionNoise | None = None, n_envs: int = 1
    ) -> tuple[np.ndarray, np.ndarray]:
        actor = self._frozen_actor()
        warmup = self.num_timesteps < learning_starts and not (self.use_sde and self.use_sde_at_warmup)
        if actor is None or warmup or self._last_obs is None or not isinstance(self.action_space, spaces.Box):
            return super()._sample_action(learning_starts, action_noise, n_envs)
        with th.inference_mode():
            actions = actor(actor.inputs(self._last_obs)).numpy()
        # what stock's policy.predict returns, then stock's _sample_action from there
        unscaled = box_env_actions(self.policy, self.action_space)(actions.reshape(-1, *self.action_space.shape))
        scaled = self.policy.scale_action(unscaled)
        if action_noise is not None:
            scaled = np.clip(scaled + action_noise(), -1, 1)
        return self.policy.unscale_action(scaled), scaled
