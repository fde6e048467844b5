"""
The Q-learning engine that our DQN and QR-DQN share (:class:`FastQLearning`, a mixin put first among the bases of the
stock class). What it does differently from stock, and why it is faster:

- ``train()`` samples all of its minibatches at once (the same global-RNG draws as stock, then one gather and one
  tensor conversion: :mod:`sb3_speedups.common.replay.sampling`) and computes every TD target with one forward of
  the target network (it is constant inside ``train()``: SB3 updates it in ``_on_step``);
- each gradient step is :class:`~sb3_speedups.dqn.update.HandDerivedQUpdate` for MLP networks (hand-derived
  gradients, flat parameters, fused Adam, no host sync), else the autograd
  :class:`~sb3_speedups.dqn.update.AutogradQUpdate`; the loss is logged once per ``train()``;
- collection is the shared lean loop (:class:`~sb3_speedups.common.off_policy.collection.FastOffPolicyCollection`);
  actions come from the network run on plain tensors (:class:`~sb3_speedups.common.acting.torch_mlp.TorchMlp`), one
  call for all envs: views of the update's flat parameters on the CPU (nothing to sync), else a CPU copy synced once
  per rollout. Not numpy: its single-row products round differently from torch's, and a flipped argmax would change
  the run;
- torch runs on one CPU thread unless the user chose otherwise, except in ``train()`` when the network's matrix
  products are large (batch x layer inputs x outputs >= 2M multiply-adds, e.g. the RL Zoo's 256x256 nets): there
  two threads are faster (:func:`~sb3_speedups.common.torch_utils.update_num_threads`).

What the network outputs and its loss are the algorithm's :class:`~sb3_speedups.dqn.update.QHead` (``_q_head``):
DQN's Q-values and Huber TD loss, QR-DQN's quantiles and quantile Huber loss. The options ``double_q``,
``combined_replay`` and prioritised replay are read here; the class that offers them sets them in ``__init__``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch as th
from stable_baselines3.common.noise import ActionNoise
from stable_baselines3.common.type_aliases import ReplayBufferSamples, Schedule

from sb3_speedups.common.acting.mirror import ParameterMirror
from sb3_speedups.common.acting.torch_mlp import TorchMlp
from sb3_speedups.common.fast_model import FastModel
from sb3_speedups.common.nn.blocked import BlockedMlpForward, forward_in_blocks
from sb3_speedups.common.off_policy.collection import FastOffPolicyCollection
from sb3_speedups.common.replay.sampling import batchable, chunk_sizes, newest_indices, rows_of, sample_minibatches
from sb3_speedups.common.torch_utils import match_convolutions_to, num_threads_during, update_num_threads
from sb3_speedups.dqn.replay.buffers import PrioritizedReplayBuffer, PrioritizedReplayBufferSamples
from sb3_speedups.dqn.update import Q_VALUES, AutogradQUpdate, HandDerivedQUpdate, QHead, q_mlp, q_mlp_unsupported_reason


@dataclass
class _Speedups:
    """Speed-only state, rebuilt when the policy or its optimizer state is replaced (never saved)."""

    updater: HandDerivedQUpdate | AutogradQUpdate
    fallback_reason: str | None
    mirror: ParameterMirror | None
    actor: TorchMlp | None
    online: list[th.Tensor]
    target: list[th.Tensor]
    #: inputs x outputs of the network's largest ``Linear`` layer (for the update's thread count)
    largest_linear: int
    #: the target network's forward into kept buffers (with the hand-derived update), else ``None``
    target_forward: BlockedMlpForward | None


class FastQLearning(FastModel, FastOffPolicyCollection):
    """
    Mixin for a stock Q-learning algorithm (DQN, QR-DQN): its collection, target update and ``train()`` on the
    engine described in the module docstring. Put it first among the bases of the stock class.
    """

    #: Double DQN targets (van Hasselt et al. 2016)
    double_q: bool = False
    #: combined experience replay (Zhang & Sutton 2017)
    combined_replay: bool = False
    #: a prioritised buffer's ``beta`` at the end of training
    per_final_beta: float = 1.0
    _per_initial_beta: float | None = None
    # set by the stock class (DQN, QR-DQN)
    _n_calls: int
    target_update_interval: int
    exploration_schedule: Schedule
    max_grad_norm: Any

    def _q_head(self) -> QHead:
        """:return: what the network outputs and its loss (DQN's Q-values and Huber TD loss here)"""
        return Q_VALUES

    # ----- speed-only state ---------------------------------------------------------------------------------------

    def _unsupported_reason(self) -> str | None:
        return q_mlp_unsupported_reason(self.policy, self._q_head())

    def _ensure_speedups(self, for_acting: bool = False) -> _Speedups:
        """
        :param for_acting: only acting follows (it reads the parameters; ``train()`` checks the optimizer state)
        :return: the speed-only state, rebuilt if the policy, its parameters or its optimizer state were replaced
        """
        speed = self._speedups
        if speed is not None and speed.updater.policy is self.policy and speed.updater.is_bound(optimizer=not for_acting):
            return speed
        reason = self.fast_path_unsupported_reason()
        head = self._q_head()
        net, target_net = head.network(self.policy), head.target_network(self.policy)
        if reason:  # a CNN acting on SB3's transposed frames: its weights in their order (the target's stay)
            match_convolutions_to(net, self._last_obs, self.device)
        updater: HandDerivedQUpdate | AutogradQUpdate = (
            AutogradQUpdate(self.policy, head) if reason else HandDerivedQUpdate(self.policy, head)
        )
        mirror, actor, target_forward = None, None, None
        if isinstance(updater, HandDerivedQUpdate):
            online_mlp, target_mlp = q_mlp(net, head), q_mlp(target_net, head)
            assert not isinstance(online_mlp, str) and not isinstance(target_mlp, str)
            target_forward = BlockedMlpForward(target_mlp)
            if self.device.type == "cpu":
                # The parameters live in the update's flat buffer, updated in place: acting reads plain views of it,
                # always current, so there is no copy to sync.
                actor = TorchMlp(online_mlp.map(updater.flat.data_of))
            else:
                params = list(net.parameters())
                mirror = ParameterMirror(params, "cpu")
                lookup = {id(p): c for p, c in zip(params, mirror.copies, strict=True)}
                actor = TorchMlp(online_mlp.map(lambda t: lookup[id(t)]))
        elif self.verbose >= 1:
            print(f"sb3_speedups {type(self).__name__}: using the autograd update ({reason})")
        online = [*net.parameters(), *self.batch_norm_stats]  # type: ignore[attr-defined]
        target = [*target_net.parameters(), *self.batch_norm_stats_target]  # type: ignore[attr-defined]
        largest = max((m.in_features * m.out_features for m in net.modules() if isinstance(m, th.nn.Linear)), default=0)
        self._speedups = _Speedups(updater, reason, mirror, actor, online, target, largest, target_forward)
        return self._speedups

    # ----- collection ---------------------------------------------------------------------------------------------

    def collect_rollouts(self, *args: Any, **kwargs: Any) -> Any:
        speed = self._ensure_speedups(for_acting=True)
        if speed.mirror is not None:
            speed.mirror.sync()
        return super().collect_rollouts(*args, **kwargs)

    def _sample_action(
        self, learning_starts: int, action_noise: ActionNoise | None = None, n_envs: int = 1
    ) -> tuple[np.ndarray, np.ndarray]:
        speed, last = self._speedups, self._last_obs
        # Without the MLP actor (a CNN, a dueling net...), the Q-network's own forward, as stock's predict calls it,
        # minus predict's per-call checks: for batched observations exactly as the env hands them over.
        whole_module = speed is not None and speed.actor is None
        batch = type(last) is np.ndarray and last.shape[1:] == self.observation_space.shape
        if speed is None or self.num_timesteps < learning_starts or last is None or (whole_module and not batch):
            return super()._sample_action(learning_starts, action_noise, n_envs)
        # stock DQN's (and QR-DQN's) predict(deterministic=False): one draw decides for all envs of this step
        if np.random.rand() < self.exploration_rate:
            actions = np.array([self.action_space.sample() for _ in range(n_envs)])
        elif whole_module:
            actions = speed.updater.q_values(th.as_tensor(last, device=self.device)).argmax(dim=1).cpu().numpy()
        else:
            # The actor's weights are plain tensors (no autograd), so no grad-mode context is needed. numpy's argmax
            # picks the first maximum, as torch's does.
            obs = last if isinstance(last, dict) else th.from_numpy(last) if type(last) is np.ndarray else th.as_tensor(last)
            actions = speed.updater.head.q_values(speed.actor(speed.actor.mlp.inputs(obs))).numpy().argmax(axis=1)
        return actions, actions

    def _on_step(self) -> None:
        if self.tau != 1.0:
            return super()._on_step()
        # A hard target update is one fused copy instead of SB3's per-tensor scale-and-add (same values).
        self._n_calls += 1
        if self._n_calls % max(self.target_update_interval // self.n_envs, 1) == 0:
            speed = self._ensure_speedups()
            with th.no_grad():
                th._foreach_copy_(speed.target, speed.online)
        self.exploration_rate = self.exploration_schedule(self._current_progress_remaining)
        self.logger.record("rollout/exploration_rate", self.exploration_rate)

    # ----- update -------------------------------------------------------------------------------------------------

    def _targets(
        self, data: ReplayBufferSamples, next_q_target: th.Tensor, updater: HandDerivedQUpdate | AutogradQUpdate
    ) -> th.Tensor:
        """:return: the TD targets ``r + (1 - done) * discount * Q_target(s', a')`` for one minibatch (QR-DQN: per quantile)"""
        next_actions = updater.q_values(data.next_observations).argmax(dim=1, keepdim=True) if self.double_q else None
        next_q = updater.head.next_values(next_q_target, next_actions)
        if data.discounts is not None:
            return data.rewards + (1 - data.dones) * data.discounts * next_q
        # Stock's (1 - dones) * gamma in one kernel: with dones 0 or 1, gamma - gamma * dones is exact (same numbers).
        return data.rewards + th.rsub(data.dones, self.gamma, alpha=self.gamma) * next_q

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        """Update the network on ``gradient_steps`` minibatches: stock's loss, minus its per-step overheads."""
        speed = self._ensure_speedups()
        self._set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        tds: list[Any] = []
        weights: list[th.Tensor] | None = None
        threads = update_num_threads(batch_size * speed.largest_linear, self.num_threads, self.device)
        # The hand-derived update needs no autograd: without its dispatch every op is cheaper. The results it returns
        # are inference tensors (read-only outside); its cached buffers are normal tensors.
        with num_threads_during(threads), th.inference_mode(isinstance(speed.updater, HandDerivedQUpdate)):
            if is_prioritized(self.replay_buffer):
                weights = self._train_prioritized(speed.updater, gradient_steps, batch_size, tds)
            elif batchable(self.replay_buffer):
                self._train_batched(speed.updater, gradient_steps, batch_size, tds)
            else:
                for _ in range(gradient_steps):
                    data = self.replay_buffer.sample(batch_size, env=self._vec_normalize_env)  # type: ignore[union-attr]
                    tds.append(self._step(speed.updater, data, None))
        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        if tds:
            self.logger.record("train/loss", float(speed.updater.head.logged_loss(tds, weights)))

    def _target_q_values(self, obs: Any) -> th.Tensor:
        """:return: the target network's output for ``obs``, in a buffer that the next call overwrites on the fast path"""
        # Called per gradient step inside train(), which has already run _ensure_speedups().
        speed = self._speedups
        assert speed is not None
        forward = speed.target_forward
        if forward is not None:
            return forward(forward.mlp.inputs(obs))
        target_net = speed.updater.head.target_network(self.policy)
        with th.no_grad():
            return forward_in_blocks(target_net, obs) if isinstance(obs, th.Tensor) else target_net(obs)

    def _step(
        self,
        updater: HandDerivedQUpdate | AutogradQUpdate,
        data: ReplayBufferSamples,
        weights: th.Tensor | None,
        next_q_target: th.Tensor | None = None,
    ) -> Any:
        if next_q_target is None:
            next_q_target = self._target_q_values(data.next_observations)
        with th.no_grad():
            target = self._targets(data, next_q_target, updater)
        return updater.step(data.observations, data.actions, target, weights, self.max_grad_norm)

    def _train_batched(
        self, updater: HandDerivedQUpdate | AutogradQUpdate, gradient_steps: int, batch_size: int, tds: list[Any]
    ) -> None:
        buffer = self.replay_buffer
        assert buffer is not None
        for n in chunk_sizes(gradient_steps, batch_size, buffer):
            data = sample_minibatches(buffer, batch_size, n, self._vec_normalize_env, combined=self.combined_replay)
            next_q_all = self._target_q_values(data.next_observations)
            with th.no_grad():
                # Plain DQN targets only read the target network, constant inside train(): all at once.
                targets = None if self.double_q else self._targets(data, next_q_all, updater)
            if n == 1 and targets is not None:
                tds.append(updater.step(data.observations, data.actions, targets, None, self.max_grad_norm))
                continue
            actions = data.actions.long()
            for k in range(n):
                rows = slice(k * batch_size, (k + 1) * batch_size)
                minibatch = rows_of(data, rows)
                if targets is None:  # Double DQN: the online network picks the next actions, after each step
                    tds.append(self._step(updater, minibatch, None, next_q_all[rows]))
                else:
                    tds.append(updater.step(minibatch.observations, actions[rows], targets[rows], None, self.max_grad_norm))

    def _train_prioritized(
        self, updater: HandDerivedQUpdate | AutogradQUpdate, gradient_steps: int, batch_size: int, tds: list[Any]
    ) -> list[th.Tensor]:
        """:return: the importance-sampling weights of every minibatch (for the logged loss)"""
        buffer: Any = self.replay_buffer
        if self._per_initial_beta is None:
            self._per_initial_beta = float(buffer.beta)
        beta0 = self._per_initial_beta
        done = min(max(1.0 - self._current_progress_remaining, 0.0), 1.0)
        buffer.beta = beta0 + (self.per_final_beta - beta0) * done
        weights = []
        for _ in range(gradient_steps):
            data = buffer.sample(batch_size, env=self._vec_normalize_env)
            if self.combined_replay:
                data = _combine_newest(buffer, data, self._vec_normalize_env)
            base = ReplayBufferSamples(*(getattr(data, f) for f in ReplayBufferSamples._fields))
            td = self._step(updater, base, data.weights)
            buffer.update_priorities(data.indices, td.abs().reshape(-1).cpu().numpy())
            tds.append(td)
            weights.append(data.weights)
        return weights


def is_prioritized(buffer: object) -> bool:
    """:return: whether ``buffer`` is a prioritised replay buffer (it has ``update_priorities`` and ``beta``)"""
    return hasattr(buffer, "update_priorities") and hasattr(buffer, "beta")


def _combine_newest(buffer: PrioritizedReplayBuffer, data: PrioritizedReplayBufferSamples, env: Any) -> Any:
    """Put the newest transitions (one per env) in the first rows of a prioritised minibatch, with weight 1."""
    batch_inds, env_inds = newest_indices(buffer)
    samples = buffer.get_samples_at(batch_inds, env_inds, env)
    newest = PrioritizedReplayBufferSamples(
        *samples[:5], samples.discounts, th.ones_like(samples.rewards), batch_inds * buffer.n_envs + env_inds
    )
    rows = min(newest.observations.shape[0], data.observations.shape[0])
    fields: dict[str, Any] = {}
    for name in data._fields:
        value, new = getattr(data, name), getattr(newest, name)
        if value is None:
            fields[name] = None
            continue
        value = value.copy() if isinstance(value, np.ndarray) else value.clone()
        value[:rows] = new[:rows]
        fields[name] = value
    return type(data)(**fields)
