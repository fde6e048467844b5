"""
RecurrentPPO as in sb3-contrib, faster. What differs from stock, and why it is faster:

- the policies (:mod:`sb3_speedups.ppo_recurrent.policies`) run each padded training sequence through one
  LSTM/GRU call instead of sb3-contrib's Python loop over time steps whenever an episode starts in a sequence;
- GRU policies (``MlpGruPolicy``, ... or ``policy_kwargs=dict(rnn_type="gru")``) are available; on the CPU their
  training pass has a hand-derived backward (:mod:`sb3_speedups.ppo_recurrent.gru`) instead of torch's per-gate autograd;
- collection runs the standard policy as one plain-tensor pass per vectorised step under ``inference_mode``
  (:mod:`sb3_speedups.ppo_recurrent.collection`), same samples for the same seed; other policies use sb3-contrib's;
- the rollout buffer pads each minibatch's sequences with one gather (:mod:`sb3_speedups.ppo_recurrent.buffers`)
  instead of one tensor per sequence and field, with the same samples;
- ``train()`` computes sb3-contrib's loss with masks multiplied instead of boolean-indexed, keeps the statistics as
  tensors (one host sync per call unless ``target_kl`` needs one per minibatch), and steps Adam as one fused kernel
  over one flat gradient buffer (:mod:`sb3_speedups.ppo_recurrent.training`);
- torch runs on one CPU thread unless the user chose otherwise (faster and steadier for small networks).

LSTM models are saved with sb3-contrib's policy classes, so stock sb3-contrib loads them; files saved by
sb3-contrib load here with the fast policies.
"""

from __future__ import annotations

from typing import Any, ClassVar

import sb3_contrib
import torch as th
from gymnasium import spaces
from sb3_contrib.common.recurrent.buffers import RecurrentRolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.policies import BasePolicy
from stable_baselines3.common.vec_env import VecEnv

from sb3_speedups.common.nn.autograd_step import FlatOptimizerStep
from sb3_speedups.common.on_policy.ppo_loss import kl_stops, record_train_stats, start_train
from sb3_speedups.common.torch_utils import apply_num_threads, keep_freed_blocks
from sb3_speedups.ppo_recurrent.buffers import FastRecurrentRolloutBuffer
from sb3_speedups.ppo_recurrent.collection import (
    FrozenRecurrentActor,
    collect_recurrent_rollout,
    frozen_actor_unsupported_reason,
)
from sb3_speedups.ppo_recurrent.policies import (
    FAST_POLICIES,
    CnnGruPolicy,
    CnnLstmPolicy,
    MlpGruPolicy,
    MlpLstmPolicy,
    MultiInputGruPolicy,
    MultiInputLstmPolicy,
)
from sb3_speedups.ppo_recurrent.training import recurrent_ppo_loss


class RecurrentPPO(sb3_contrib.RecurrentPPO):
    """
    Recurrent PPO, a drop-in for :class:`sb3_contrib.RecurrentPPO` (same arguments, ``learn``, ``predict`` with
    ``state``/``episode_start``, saved files); see :class:`sb3_contrib.RecurrentPPO` for every other argument.

    :param num_threads: torch intra-op threads; ``None``: 1 unless the user already chose a number
    """

    policy_aliases: ClassVar[dict[str, type[BasePolicy]]] = {
        "MlpLstmPolicy": MlpLstmPolicy,
        "CnnLstmPolicy": CnnLstmPolicy,
        "MultiInputLstmPolicy": MultiInputLstmPolicy,
        "MlpGruPolicy": MlpGruPolicy,
        "CnnGruPolicy": CnnGruPolicy,
        "MultiInputGruPolicy": MultiInputGruPolicy,
    }

    def __init__(self, *args: Any, num_threads: int | None = None, **kwargs: Any) -> None:
        self.num_threads = num_threads
        super().__init__(*args, **kwargs)

    def _setup_model(self) -> None:
        apply_num_threads(self.num_threads)
        self.policy_class = FAST_POLICIES.get(self.policy_class, self.policy_class)
        super()._setup_model()
        apply_num_threads(self.num_threads, self.policy)  # by the network's shapes: convolutions get every core
        keep_freed_blocks(self.policy, self.device)
        if type(self.rollout_buffer) is RecurrentRolloutBuffer:
            self.rollout_buffer = FastRecurrentRolloutBuffer(
                self.n_steps,
                self.observation_space,
                self.action_space,
                self.rollout_buffer.hidden_state_shape,
                self.device,
                gamma=self.gamma,
                gae_lambda=self.gae_lambda,
                n_envs=self.n_envs,
            )
        self._optimizer_step: FlatOptimizerStep | None = None

    def _excluded_save_params(self) -> list[str]:
        return [*super()._excluded_save_params(), "num_threads", "_optimizer_step"]

    def collect_rollouts(self, env: VecEnv, callback: BaseCallback, rollout_buffer: Any, n_rollout_steps: int) -> bool:
        """sb3-contrib's collection; with the frozen actor when the policy is standard (see the module docstring)."""
        if self.use_sde or frozen_actor_unsupported_reason(self.policy) is not None:
            return super().collect_rollouts(env, callback, rollout_buffer, n_rollout_steps)
        # Built per rollout: cheap, and it follows the parameters wherever train() moved their storage.
        actor = FrozenRecurrentActor(self.policy)  # type: ignore[arg-type]
        return collect_recurrent_rollout(self, env, callback, rollout_buffer, n_rollout_steps, actor)

    def train(self) -> None:
        """sb3-contrib's update (same loss, epochs, minibatches, early stopping and logs), without per-step syncs."""
        cfg = start_train(self)
        step = self._optimizer_step
        if step is None or not step.is_bound(self.policy.optimizer):
            step = self._optimizer_step = FlatOptimizerStep(self.policy, self.policy.optimizer)
        discrete = isinstance(self.action_space, spaces.Discrete)
        rows: list[th.Tensor] = []
        epoch_start = 0
        for epoch in range(self.n_epochs):
            epoch_start, stop = len(rows), False
            for data in self.rollout_buffer.get(self.batch_size):
                loss, stats = recurrent_ppo_loss(self.policy, data, cfg, self.normalize_advantage, discrete)  # type: ignore[arg-type]
                rows.append(stats)
                if kl_stops(self, stats, epoch):
                    stop = True
                    break
                step.backward(loss)
                step.step(cfg.max_grad_norm)
            self._n_updates += 1
            if stop:
                break
        record_train_stats(self, th.stack(rows), epoch_start, cfg)

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Save as :meth:`sb3_contrib.RecurrentPPO.save`; LSTM policies are recorded as sb3-contrib's classes."""
        fast_class = self.policy_class
        if getattr(self.policy, "rnn_type", "lstm") == "lstm":
            stock = {fast: stock for stock, fast in FAST_POLICIES.items()}
            self.policy_class = stock.get(fast_class, fast_class)
        try:
            super().save(*args, **kwargs)
        finally:
            self.policy_class = fast_class
