"""
DQN as in Stable-Baselines3, faster, with modern replay options. What differs from stock, and why it is faster:

- ``train()`` samples all of its minibatches at once (the same global-RNG draws as stock, then one gather and one
  tensor conversion: :mod:`sb3_speedups.common.replay.sampling`) and computes every TD target with one forward of
  the target network (it is constant inside ``train()``: SB3 updates it in ``_on_step``);
- each gradient step is :class:`~sb3_speedups.dqn.update.HandDerivedQUpdate` for MLP Q-networks (hand-derived
  gradients, flat parameters, fused Adam, no host sync), else the autograd
  :class:`~sb3_speedups.dqn.update.AutogradQUpdate`; the loss is logged once per ``train()``;
- collection is the shared lean loop (:class:`~sb3_speedups.common.off_policy.collection.FastOffPolicyCollection`);
  actions come from the Q-network run on plain tensors (:class:`~sb3_speedups.common.acting.torch_mlp.TorchMlp`), one
  call for all envs: views of the update's flat parameters on the CPU (nothing to sync), else a CPU copy synced once
  per rollout. Not numpy: its single-row products round differently from torch's, and a flipped argmax would change
  the run;
- torch runs on one CPU thread unless the user chose otherwise, except in ``train()`` when the Q-network's matrix
  products are large (batch x layer inputs x outputs >= 2M multiply-adds, e.g. the RL Zoo's 256x256 nets): there
  two threads are faster (:func:`~sb3_speedups.common.torch_utils.update_num_threads`).

Options, off by default so that the defaults are stock SB3 DQN: ``double_q``, ``combined_replay``, dueling heads
(``policy_kwargs=dict(dueling=True)``), and prioritised replay (any ``replay_buffer_class`` with ``update_priorities``,
e.g. :class:`sb3_speedups.dqn.replay.buffers.PrioritizedReplayBuffer`); n-step returns as stock (``n_steps``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import stable_baselines3
import torch as th
from stable_baselines3.common.noise import ActionNoise
from stable_baselines3.common.type_aliases import ReplayBufferSamples

from sb3_speedups.common.acting.actors import ParameterMirror
from sb3_speedups.common.acting.torch_mlp import TorchMlp
from sb3_speedups.common.fast_model import FastModel
from sb3_speedups.common.off_policy.collection import FastOffPolicyCollection
from sb3_speedups.common.nn.blocked import BlockedMlpForward, forward_in_blocks
from sb3_speedups.dqn.update import AutogradQUpdate, HandDerivedQUpdate, huber_, q_mlp, q_mlp_unsupported_reason
from sb3_speedups.dqn.replay.buffers import PrioritizedReplayBuffer, PrioritizedReplayBufferSamples
from sb3_speedups.common.replay.sampling import (
    batchable,
    batched_sampling_supported,
    chunk_sizes,
    newest_indices,
    sample_minibatches,
)
from sb3_speedups.common.torch_utils import (
    num_threads_during,
    update_num_threads,
)
from sb3_speedups.dqn.policies import DUELING_POLICIES
from sb3_speedups.common.replay.frames import FrameStackReplayBuffer
from sb3_speedups.errors import UserValueError

# Buffers that compute n-step returns themselves (given n_steps and gamma), where SB3 would ignore n_steps
_N_STEP_BUFFERS = (PrioritizedReplayBuffer, FrameStackReplayBuffer)

SelfDQN = TypeVar("SelfDQN", bound="DQN")


@dataclass
class _Speedups:
    """Speed-only state, rebuilt when the policy or its optimizer state is replaced (never saved)."""

    updater: HandDerivedQUpdate | AutogradQUpdate
    fallback_reason: str | None
    mirror: ParameterMirror | None
    actor: TorchMlp | None
    online: list[th.Tensor]
    target: list[th.Tensor]
    #: inputs x outputs of the Q-network's largest ``Linear`` layer (for the update's thread count)
    largest_linear: int
    #: the target network's forward into kept buffers (with the hand-derived update), else ``None``
    target_forward: BlockedMlpForward | None


class DQN(FastModel, FastOffPolicyCollection, stable_baselines3.DQN):
    """
    Deep Q-Network, a drop-in for :class:`stable_baselines3.DQN` (same arguments, ``learn``, ``predict``, saved
    files); see :class:`stable_baselines3.DQN` for every argument not listed here. ``policy_kwargs`` may hold
    ``dueling=True`` for dueling heads (:mod:`sb3_speedups.dqn.policies`).

    :param double_q: Double DQN targets (van Hasselt et al. 2016): the online network picks the next action, the
        target network values it
    :param combined_replay: combined experience replay (Zhang & Sutton 2017): the newest transition of every env is
        part of every minibatch (needs the stock ``ReplayBuffer``)
    :param per_final_beta: with a prioritised replay buffer (one with ``update_priorities`` and ``beta``), its
        ``beta`` goes linearly from its initial value to this over training
    :param num_threads: torch CPU threads; ``None`` keeps a value the user set, else uses the package default (1)
    :param fast_update: use the hand-derived update for MLP Q-networks (``False`` forces the autograd update)
    """

    #: ``policy_kwargs`` keys this class reads beyond the policy's own arguments (for the tuner's checks)
    extra_policy_kwargs: ClassVar[frozenset[str]] = frozenset({"dueling"})

    def __init__(
        self,
        policy: Any,
        env: Any,
        *,
        double_q: bool = False,
        combined_replay: bool = False,
        per_final_beta: float = 1.0,
        num_threads: int | None = None,
        fast_update: bool = True,
        _init_setup_model: bool = True,
        **kwargs: Any,
    ) -> None:
        policy_kwargs = dict(kwargs.pop("policy_kwargs", None) or {})
        dueling = policy_kwargs.pop("dueling", False)
        if dueling:
            if isinstance(policy, str):
                if policy not in DUELING_POLICIES:
                    raise UserValueError(
                        f"dueling=True is not available for policy {policy!r}: use one of {list(DUELING_POLICIES)}"
                    )
                policy = DUELING_POLICIES[policy]
            policy_kwargs["dueling"] = True
        n_steps = int(kwargs.pop("n_steps", 1))
        buffer_class = kwargs.get("replay_buffer_class")
        if n_steps > 1 and isinstance(buffer_class, type) and issubclass(buffer_class, _N_STEP_BUFFERS):
            # SB3 only wires n_steps into its own NStepReplayBuffer; ours compute the same returns.
            buffer_kwargs = dict(kwargs.get("replay_buffer_kwargs") or {})
            buffer_kwargs.setdefault("n_steps", n_steps)
            buffer_kwargs.setdefault("gamma", kwargs.get("gamma", 0.99))
            kwargs["replay_buffer_kwargs"] = buffer_kwargs
            super().__init__(policy, env, policy_kwargs=policy_kwargs or None, _init_setup_model=False, **kwargs)
            self.n_steps = n_steps
        else:
            super().__init__(
                policy, env, policy_kwargs=policy_kwargs or None, n_steps=n_steps, _init_setup_model=False, **kwargs
            )
        if not 0.0 <= per_final_beta <= 1.0:
            raise UserValueError(f"per_final_beta={per_final_beta} is invalid: use a value in [0, 1]")
        self.double_q = double_q
        self.combined_replay = combined_replay
        self.per_final_beta = per_final_beta
        self.num_threads = num_threads
        self.fast_update = fast_update
        self._per_initial_beta: float | None = None
        self._speedups: _Speedups | None = None
        if _init_setup_model:
            self._setup_model()

    def _setup_model(self) -> None:
        n_steps = self.n_steps
        if isinstance(self.replay_buffer_class, type) and issubclass(self.replay_buffer_class, _N_STEP_BUFFERS):
            self.n_steps = 1  # the buffer has them (see __init__); SB3 would warn that they are ignored
        try:
            super()._setup_model()
        finally:
            self.n_steps = n_steps
        if (
            self.combined_replay
            and not _is_prioritized(self.replay_buffer)
            and not batched_sampling_supported(self.replay_buffer)
        ):
            raise UserValueError(
                f"combined_replay=True needs one-step transitions from the stock ReplayBuffer or a FrameStackReplayBuffer, "
                f"not {type(self.replay_buffer).__name__}: drop replay_buffer_class, n_steps or combined_replay"
            )

    # ----- speed-only state ---------------------------------------------------------------------------------------

    def _unsupported_reason(self) -> str | None:
        return q_mlp_unsupported_reason(self.policy)

    def _ensure_speedups(self, for_acting: bool = False) -> _Speedups:
        """
        :param for_acting: only acting follows (it reads the parameters; ``train()`` checks the optimizer state)
        :return: the speed-only state, rebuilt if the policy, its parameters or its optimizer state were replaced
        """
        speed = self._speedups
        if speed is not None and speed.updater.policy is self.policy and speed.updater.is_bound(optimizer=not for_acting):
            return speed
        reason = self.fast_path_unsupported_reason()
        updater: HandDerivedQUpdate | AutogradQUpdate = (
            AutogradQUpdate(self.policy) if reason else HandDerivedQUpdate(self.policy)
        )
        mirror, actor, target_forward = None, None, None
        if isinstance(updater, HandDerivedQUpdate):
            online_mlp, target_mlp = q_mlp(self.q_net), q_mlp(self.q_net_target)
            assert not isinstance(online_mlp, str) and not isinstance(target_mlp, str)
            target_forward = BlockedMlpForward(target_mlp)
            if self.device.type == "cpu":
                # The parameters live in the update's flat buffer, updated in place: acting reads plain views of it,
                # always current, so there is no copy to sync.
                actor = TorchMlp(online_mlp.map(updater.flat.data_of))
            else:
                params = list(self.q_net.parameters())
                mirror = ParameterMirror(params, "cpu")
                lookup = {id(p): c for p, c in zip(params, mirror.copies, strict=True)}
                actor = TorchMlp(online_mlp.map(lambda t: lookup[id(t)]))
        elif self.verbose >= 1:
            print(f"sb3_speedups DQN: using the autograd update ({reason})")
        online = [*self.q_net.parameters(), *self.batch_norm_stats]
        target = [*self.q_net_target.parameters(), *self.batch_norm_stats_target]
        largest = max((m.in_features * m.out_features for m in self.q_net.modules() if isinstance(m, th.nn.Linear)), default=0)
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
        speed = self._speedups
        if speed is None or speed.actor is None or self.num_timesteps < learning_starts or self._last_obs is None:
            return super()._sample_action(learning_starts, action_noise, n_envs)
        # stock DQN.predict(deterministic=False): one draw decides for all envs of this step
        if np.random.rand() < self.exploration_rate:
            actions = np.array([self.action_space.sample() for _ in range(n_envs)])
        else:
            # The actor's weights are plain tensors (no autograd), so no grad-mode context is needed. numpy's argmax
            # picks the first maximum, as torch's does.
            last = self._last_obs
            obs = th.from_numpy(last) if type(last) is np.ndarray else th.as_tensor(last)
            actions = speed.actor(speed.actor.mlp.inputs(obs)).numpy().argmax(axis=1)
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
        """:return: the TD targets ``r + (1 - done) * discount * Q_target(s', a')`` for one minibatch"""
        if self.double_q:
            next_actions = updater.q_values(data.next_observations).argmax(dim=1, keepdim=True)
            next_q = next_q_target.gather(1, next_actions)
        else:
            next_q = th.amax(next_q_target, dim=1, keepdim=True)  # stock's max(...).values without the indices
        if data.discounts is not None:
            return data.rewards + (1 - data.dones) * data.discounts * next_q
        # Stock's (1 - dones) * gamma in one kernel: with dones 0 or 1, gamma - gamma * dones is exact (same numbers).
        return data.rewards + th.rsub(data.dones, self.gamma, alpha=self.gamma) * next_q

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        """Update the Q-network on ``gradient_steps`` minibatches: SB3's DQN loss, minus its per-step overheads."""
        speed = self._ensure_speedups()
        self._set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        tds: list[th.Tensor] = []
        weights: list[th.Tensor] | None = None
        threads = update_num_threads(batch_size * speed.largest_linear, self.num_threads, self.device)
        # The hand-derived update needs no autograd: without its dispatch every op is cheaper. The TD errors it returns
        # are inference tensors (read-only outside); its cached buffers are normal tensors.
        with num_threads_during(threads), th.inference_mode(isinstance(speed.updater, HandDerivedQUpdate)):
            if _is_prioritized(self.replay_buffer):
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
            # Every minibatch has batch_size rows: the mean over all of them is the mean of the per-step losses.
            loss = huber_(_joined(tds), None if weights is None else _joined(weights))
            self.logger.record("train/loss", float(loss))

    def _target_q_values(self, obs: Any) -> th.Tensor:
        """:return: ``Q_target(obs, .)``, in a buffer that the next call overwrites when the fast path runs"""
        # Called per gradient step inside train(), which has already run _ensure_speedups().
        forward = self._speedups.target_forward if self._speedups is not None else None
        if forward is not None:
            return forward(forward.mlp.inputs(obs))
        with th.no_grad():
            return forward_in_blocks(self.q_net_target, obs) if isinstance(obs, th.Tensor) else self.q_net_target(obs)

    def _step(
        self,
        updater: HandDerivedQUpdate | AutogradQUpdate,
        data: ReplayBufferSamples,
        weights: th.Tensor | None,
        next_q_target: th.Tensor | None = None,
    ) -> th.Tensor:
        if next_q_target is None:
            next_q_target = self._target_q_values(data.next_observations)
        with th.no_grad():
            target = self._targets(data, next_q_target, updater)
        return updater.step(data.observations, data.actions, target, weights, self.max_grad_norm)

    def _train_batched(
        self, updater: HandDerivedQUpdate | AutogradQUpdate, gradient_steps: int, batch_size: int, tds: list[th.Tensor]
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
            obs, actions = data.observations, data.actions.long()
            for k in range(n):
                rows = slice(k * batch_size, (k + 1) * batch_size)
                if targets is None:  # Double DQN: the online network picks the next actions, after each step
                    minibatch = ReplayBufferSamples(*(None if x is None else x[rows] for x in data))  # type: ignore[arg-type]
                    tds.append(self._step(updater, minibatch, None, next_q_all[rows]))
                else:
                    tds.append(updater.step(obs[rows], actions[rows], targets[rows], None, self.max_grad_norm))

    def _train_prioritized(
        self, updater: HandDerivedQUpdate | AutogradQUpdate, gradient_steps: int, batch_size: int, tds: list[th.Tensor]
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


def _joined(tensors: list[th.Tensor]) -> th.Tensor:
    return tensors[0] if len(tensors) == 1 else th.cat(tensors)


def _is_prioritized(buffer: object) -> bool:
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
