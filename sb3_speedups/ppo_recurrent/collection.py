"""
Rollout collection for recurrent policies: one plain-tensor pass per vectorised step.

sb3-contrib's per-step path goes through ``policy.forward`` (module calls, distribution objects, ``RNNStates``
rebuilt), a ``deepcopy`` of the states and a per-env Python loop for the timeout bootstrap. Here the standard policy
(flattened ``Box`` observations, separate actor and critic LSTM/GRU, plain MLP extractor, a head from
:mod:`sb3_speedups.common.nn.heads`) is evaluated on its live parameters under ``torch.inference_mode`` with
``torch.lstm``/``torch.gru`` (the kernels ``nn.LSTM``/``nn.GRU`` call), states reset at episode starts by one
multiply, and all timeouts of a step bootstrapped in one value call. The sampling draws from torch's RNG as
``torch.distributions`` does, so for one seed the rollout is sb3-contrib's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from sb3_contrib.common.recurrent.policies import RecurrentActorCriticPolicy
from sb3_contrib.common.recurrent.type_aliases import RNNStates
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecEnv
from torch import nn

from sb3_speedups.common.nn.heads import ActionHead, make_head
from sb3_speedups.common.acting.actors import box_env_actions
from sb3_speedups.common.acting.torch_mlp import TorchMlp
from sb3_speedups.common.nn.inputs import flat_extractor_unsupported_reason, flat_input_unsupported_reason, float_rows
from sb3_speedups.common.nn.mlp import parse_mlp
from sb3_speedups.common.on_policy.timeouts import bootstrap_timeouts

State = tuple[th.Tensor, th.Tensor]


def frozen_actor_unsupported_reason(policy: nn.Module) -> str | None:
    """:return: why :class:`FrozenRecurrentActor` cannot act for ``policy``, or ``None`` when it can"""
    if not isinstance(policy, RecurrentActorCriticPolicy):
        return "not a RecurrentActorCriticPolicy"
    cls = type(policy)
    for name in ("forward", "predict_values", "_get_action_dist_from_latent", "extract_features"):
        if getattr(cls, name) is not getattr(RecurrentActorCriticPolicy, name):
            return f"the policy overrides {name}"
    extractors = (policy.pi_features_extractor, policy.vf_features_extractor)
    reason = flat_input_unsupported_reason(policy.observation_space) or next(
        (r for r in map(flat_extractor_unsupported_reason, extractors) if r is not None), None
    )
    if reason is not None:
        return reason
    if policy.lstm_critic is None:
        return "the critic has no recurrent layer of its own (shared_lstm or enable_critic_lstm=False)"
    if policy.use_sde or make_head(policy.action_dist, policy.action_space) is None:
        return "the action distribution has no hand-written head (gSDE or a custom distribution)"
    nets = (policy.mlp_extractor.policy_net, policy.mlp_extractor.value_net, policy.action_net, policy.value_net)
    if any(isinstance(parse_mlp(net), str) for net in nets):
        return "the MLP extractor or the heads are not plain MLPs"
    for rnn in (policy.lstm_actor, policy.lstm_critic):
        if type(rnn) not in (nn.LSTM, nn.GRU) or rnn.batch_first or rnn.bidirectional or getattr(rnn, "proj_size", 0):  # type: ignore[arg-type]
            return "the recurrent layers are not plain unidirectional nn.LSTM/nn.GRU"
    return None


def rnn_step(rnn: nn.Module, x: th.Tensor, state: State, keep: th.Tensor | None = None) -> tuple[th.Tensor, State]:
    """
    One step of a (multi-layer) LSTM or GRU, with the kernel its module would call.

    :param rnn: ``nn.LSTM`` or ``nn.GRU`` (not batch-first, unidirectional)
    :param x: ``(n, input_size)``
    :param state: ``(h, c)``, each ``(n_layers, n, hidden)``; ``c`` passes through unchanged for a GRU (as in
        :func:`sb3_speedups.ppo_recurrent.policies.process_sequence`)
    :param keep: ``(1, n, 1)``: 0 where an episode starts (the state is reset first), 1 elsewhere
    :return: the output ``(n, hidden)`` and the new state
    """
    weights = rnn._flat_weights
    h = state[0] if keep is None else keep * state[0]
    if isinstance(rnn, nn.GRU):
        out, h = th.gru(x.unsqueeze(0), h, weights, rnn.bias, rnn.num_layers, 0.0, False, False, False)  # type: ignore[call-overload]
        return out[0], (h, state[1])
    c = state[1] if keep is None else keep * state[1]
    out, h, c = th.lstm(x.unsqueeze(0), (h, c), weights, rnn.bias, rnn.num_layers, 0.0, False, False, False)  # type: ignore[call-overload]
    return out[0], (h, c)


class FrozenRecurrentActor:
    """
    Acts for all envs with a policy :func:`frozen_actor_unsupported_reason` accepts, on its live parameters (build it again
    after the parameters' storage moved, e.g. once per rollout).

    :param policy: the recurrent policy
    """

    def __init__(self, policy: RecurrentActorCriticPolicy) -> None:
        reason = frozen_actor_unsupported_reason(policy)
        if reason is not None:
            raise ValueError(reason)
        head = make_head(policy.action_dist, policy.action_space)
        assert head is not None
        self.head: ActionHead = head
        self.policy, self.device = policy, policy.device
        same = lambda t: t  # noqa: E731  (live parameters: inference_mode records no graph)
        self.pi = TorchMlp.from_module(policy.mlp_extractor.policy_net, same)
        self.vf = TorchMlp.from_module(policy.mlp_extractor.value_net, same)
        self.action_net = TorchMlp.from_module(policy.action_net, same)
        self.value_net = TorchMlp.from_module(policy.value_net, same)
        self.log_std = getattr(policy, "log_std", None)
        self.env_actions = box_env_actions(policy, policy.action_space)
        self.float_rows = float_rows(policy.observation_space)

    def features(self, obs: np.ndarray | dict[str, np.ndarray]) -> th.Tensor:
        """:return: the observations as the recurrent layers' float input rows (SB3's preprocessing, flattened)"""
        return self.float_rows.rows(obs, self.device)

    def act(
        self, obs: np.ndarray, episode_starts: np.ndarray, states: RNNStates
    ) -> tuple[np.ndarray, th.Tensor, th.Tensor, RNNStates]:
        """
        :param obs: observations of all envs
        :param episode_starts: ``True`` where an env's episode starts at ``obs`` (its states are reset)
        :param states: the states before this step
        :return: actions, values ``(n, 1)``, log-probabilities ``(n,)`` and the states after this step
        """
        x = self.features(obs)
        keep = th.as_tensor(1.0 - episode_starts.astype(np.float32), device=self.device).view(1, -1, 1)
        latent_pi, pi_state = rnn_step(self.policy.lstm_actor, x, states.pi, keep)  # type: ignore[arg-type]
        latent_vf, vf_state = rnn_step(self.policy.lstm_critic, x, states.vf, keep)  # type: ignore[arg-type]
        values = self.value_net(self.vf(latent_vf))
        actions, log_prob = self.head.sample(self.action_net(self.pi(latent_pi)), self.log_std)
        actions = actions.reshape((-1, *self.policy.action_space.shape))  # type: ignore[misc]
        return actions.cpu().numpy(), values, log_prob, RNNStates(pi_state, vf_state)

    def predict_values(self, obs: np.ndarray, state: State, episode_starts: np.ndarray) -> th.Tensor:
        """:return: values ``(n, 1)`` of observations continuing from the critic's ``state``"""
        keep = th.as_tensor(1.0 - episode_starts.astype(np.float32), device=self.device).view(1, -1, 1)
        latent_vf, _ = rnn_step(self.policy.lstm_critic, self.features(obs), state, keep)  # type: ignore[arg-type]
        return self.value_net(self.vf(latent_vf))


def bootstrap_recurrent_timeouts(
    actor: FrozenRecurrentActor,
    rewards: np.ndarray,
    dones: np.ndarray,
    infos: list[dict[str, Any]],
    states: RNNStates,
    gamma: float,
) -> None:
    """:func:`~sb3_speedups.common.on_policy.timeouts.bootstrap_timeouts`, valued from the critic's state after the step."""

    def values_of(envs: np.ndarray, obs: np.ndarray) -> th.Tensor:
        rows = th.as_tensor(envs, device=actor.device)
        return actor.predict_values(obs, (states.vf[0][:, rows], states.vf[1][:, rows]), np.zeros(len(envs), dtype=bool))

    bootstrap_timeouts(rewards, dones, infos, gamma, values_of)


def collect_recurrent_rollout(
    model: Any, env: VecEnv, callback: BaseCallback, rollout_buffer: Any, n_rollout_steps: int, actor: FrozenRecurrentActor
) -> bool:
    """
    sb3-contrib's ``RecurrentPPO.collect_rollouts`` with :class:`FrozenRecurrentActor` (same callbacks, buffer
    contents, ``_last_lstm_states``/``_last_obs``/``_last_episode_starts`` and timeout bootstrap).

    :param model: the ``RecurrentPPO``
    :return: ``False`` when a callback stopped training
    """
    self: BaseAlgorithm = model  # callbacks may read ``locals()["self"]``, as in SB3's loop
    assert self._last_obs is not None, "No previous observation was provided"
    self.policy.set_training_mode(False)
    n_steps = 0
    rollout_buffer.reset()
    callback.on_rollout_start()
    discrete = isinstance(self.action_space, spaces.Discrete)
    with th.inference_mode():
        while n_steps < n_rollout_steps:
            starts = self._last_episode_starts
            actions, values, log_probs, lstm_states = actor.act(self._last_obs, starts, model._last_lstm_states)  # type: ignore[arg-type]
            new_obs, rewards, dones, infos = env.step(actor.env_actions(actions))
            self.num_timesteps += env.num_envs
            callback.update_locals(locals())
            if not callback.on_step():
                return False
            self._update_info_buffer(infos, dones)
            n_steps += 1
            if discrete:
                actions = actions.reshape(-1, 1)
            bootstrap_recurrent_timeouts(actor, rewards, dones, infos, lstm_states, model.gamma)
            rollout_buffer.add(
                self._last_obs,
                actions,
                rewards,
                self._last_episode_starts,
                values,
                log_probs,
                lstm_states=model._last_lstm_states,
            )
            self._last_obs = new_obs  # type: ignore[assignment]
            self._last_episode_starts = dones
            model._last_lstm_states = lstm_states
        values = actor.predict_values(new_obs, lstm_states.vf, dones)  # type: ignore[arg-type]
    rollout_buffer.compute_returns_and_advantage(last_values=values, dones=dones)
    callback.on_rollout_end()
    return True
