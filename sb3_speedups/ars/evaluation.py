"""
Evaluating many ARS candidates at once: their policies as one stacked network (one batched product per step for
all of them), their episodes in one vectorised env, each candidate's episodes counted as SB3's ``evaluate_policy``
counts them.

Each candidate owns ``k`` consecutive envs of the batch (candidate ``c``: envs ``c * k`` to ``c * k + k - 1``); env
``j`` of a candidate runs ``(n_eval_episodes + j) // k`` episodes, as ``evaluate_policy`` spreads episodes over the
envs of one VecEnv. Where the VecEnv can step a subset of its envs, envs whose candidate is done stop stepping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch as th
from gymnasium import spaces
from sb3_contrib.ars.policies import ARSPolicy
from stable_baselines3.common.preprocessing import is_image_space
from stable_baselines3.common.running_mean_std import RunningMeanStd
from stable_baselines3.common.vec_env import VecEnv, VecNormalize

from sb3_speedups.common.acting.numpy_actor import NumpyMlp
from sb3_speedups.common.acting.torch_mlp import TorchMlp
from sb3_speedups.common.nn.mlp import Mlp, parse_mlp
from sb3_speedups.common.vec_env.stepping import SubsetSteppingMixin


def stacked_policy_unsupported_reason(policy: ARSPolicy) -> str | None:
    """:return: why :class:`StackedCandidates` cannot run this policy (then stock's evaluation does), or ``None``"""
    if type(policy).forward is not ARSPolicy.forward or type(policy)._predict is not ARSPolicy._predict:
        return f"{type(policy).__name__} overrides ARSPolicy's forward"
    if not isinstance(policy.observation_space, spaces.Box):
        return f"{type(policy.observation_space).__name__} observations (only Box ones are batched)"
    if policy.normalize_images and is_image_space(policy.observation_space):
        return "image observations (SB3 scales them to [0, 1] first)"
    if any(True for _ in policy.features_extractor.parameters()):
        return "a features extractor with parameters"
    mlp = parse_mlp(policy.action_net)
    return mlp if isinstance(mlp, str) else None


class StackedCandidates:
    """
    The candidates' policies as one stacked network: ``G`` copies of the policy's ``action_net``, each on its own
    rows of weights (``th.nn.utils.parameters_to_vector``'s layout, as ``ARSPolicy.load_from_vector`` reads it), run
    as one batched product per layer (numpy's, where it has the activations: a step's few rows cost numpy less call
    overhead than torch; else torch's ``baddbmm``); then what ``policy.predict`` does to the output (argmax, unscale
    or clip).

    :param policy: the policy whose structure the candidates share (its own weights are not used)
    """

    def __init__(self, policy: ARSPolicy) -> None:
        mlp = parse_mlp(policy.action_net)
        assert isinstance(mlp, Mlp), mlp
        self.policy = policy
        self.mlp = mlp
        # Where each parameter lies in the flat vector of the policy's parameters
        self._slices: dict[int, tuple[int, th.Size]] = {}
        offset = 0
        for param in policy.parameters():
            self._slices[id(param)] = (offset, param.shape)
            offset += param.numel()
        self.n_params = offset
        self.discrete = isinstance(policy.action_space, spaces.Discrete)
        self._network: NumpyMlp | TorchMlp | None = None
        self._groups = 0

    def load(self, weights: th.Tensor) -> None:
        """:param weights: ``[G, n_params]`` candidate weights; the next :meth:`act` runs these ``G`` policies"""
        weights = weights.detach().to("cpu", th.float32)

        def view(param: th.Tensor) -> th.Tensor:
            offset, shape = self._slices[id(param)]
            return weights[:, offset : offset + param.numel()].reshape(weights.shape[0], *shape).contiguous()

        stacked = self.mlp.map(view)
        self._network = TorchMlp(stacked) if NumpyMlp.unsupported_reason(stacked) else NumpyMlp(stacked)
        self._groups = weights.shape[0]

    def act(self, obs: np.ndarray) -> np.ndarray:
        """
        :param obs: ``[G * k, *obs_shape]`` observations (as the policy takes them: normalised where the env is), ``k``
            rows per candidate
        :return: the actions ``policy.predict(obs, deterministic=True)`` gives, candidate by candidate
        """
        network = self._network
        assert network is not None, "load() the candidates first"
        x = np.asarray(obs, dtype=np.float32).reshape(self._groups, len(obs) // self._groups, -1)
        if isinstance(network, TorchMlp):
            with th.no_grad():
                out = network(th.from_numpy(x)).numpy()
        else:
            out = network(x)
        if self.discrete:
            return out.argmax(axis=-1).reshape(-1)
        space = self.policy.action_space
        assert isinstance(space, spaces.Box)
        actions = out.reshape(-1, *space.shape)
        if self.policy.squash_output:
            return self.policy.unscale_action(actions)
        return np.clip(actions, space.low, space.high)


@dataclass
class ObsNormalization:
    """
    The training env's ``VecNormalize`` applied to the candidates' raw observations: its statistics updated with the
    observations of the envs that step (and the reset ones), as its own ``reset`` and ``step`` do, and used.

    :param vec_normalize: the training env's ``VecNormalize``
    :param n_envs: envs of the candidates' VecEnv
    """

    vec_normalize: VecNormalize
    n_envs: int
    #: each env's discounted return (``VecNormalize.returns``), for the reward statistics
    returns: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.returns = np.zeros(self.n_envs)

    def reset(self, obs: np.ndarray, rows: np.ndarray) -> None:
        """:param obs: the reset observations of all envs; ``rows``: the envs that will step"""
        self.returns[:] = 0.0
        self._update_obs(obs[rows])

    def _update_obs(self, obs: np.ndarray) -> None:
        norm = self.vec_normalize
        if norm.training and norm.norm_obs:
            assert isinstance(norm.obs_rms, RunningMeanStd)
            norm.obs_rms.update(obs)

    def step(self, obs: np.ndarray, rewards: np.ndarray, dones: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """
        :param obs: new observations of the envs ``rows``; ``rewards``, ``dones``: theirs
        :return: the rewards as the training env would return them (normalised where it normalises them)
        """
        norm = self.vec_normalize
        self._update_obs(obs)
        if norm.training and norm.norm_reward:
            self.returns[rows] = self.returns[rows] * norm.gamma + rewards
            norm.ret_rms.update(self.returns[rows])
        self.returns[rows[dones]] = 0.0
        return norm.normalize_reward(rewards)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """:return: the observations normalised with the current statistics"""
        normalized = self.vec_normalize.normalize_obs(obs)
        assert isinstance(normalized, np.ndarray)
        return normalized


@dataclass
class CandidateEpisodes:
    """What ``evaluate_policy(..., return_episode_rewards=True)`` returns, per candidate."""

    rewards: list[list[float]]
    lengths: list[list[int]]


def evaluate_together(
    env: VecEnv,
    policies: StackedCandidates,
    n_eval_episodes: int,
    envs_per_candidate: int,
    monitor: bool,
    normalization: ObsNormalization | None,
    on_steps: Callable[[int], None],
) -> CandidateEpisodes:
    """
    Run the loaded candidates' episodes in ``env``, all candidates at once.

    :param env: ``G * envs_per_candidate`` envs, reset here
    :param policies: the ``G`` candidates, loaded
    :param n_eval_episodes: episodes per candidate
    :param envs_per_candidate: envs per candidate (``k``)
    :param monitor: take each episode's return and length from Monitor's ``info["episode"]`` (and count only the
        episodes that end there), as ``evaluate_policy`` does for Monitor-wrapped envs; else sum the rewards
    :param normalization: the observation normalisation to apply, or ``None`` where ``env`` applies its own
    :param on_steps: called after each step with the number of envs that counted in it (stock: one callback each)
    :return: each candidate's episodes
    """
    n_envs = env.num_envs
    k = envs_per_candidate
    groups = n_envs // k
    candidate_of = np.arange(n_envs) // k
    targets = (n_eval_episodes + np.arange(n_envs) % k) // k
    counts = np.zeros(n_envs, dtype=np.int64)
    # Without Monitor, each env's running return and length (float64, as evaluate_policy sums them)
    current_rewards = np.zeros(n_envs)
    current_lengths = np.zeros(n_envs, dtype=np.int64)
    episodes = CandidateEpisodes([[] for _ in range(groups)], [[] for _ in range(groups)])
    subsets = isinstance(env, SubsetSteppingMixin)
    obs = np.array(env.reset())
    rows = np.flatnonzero(counts < targets)
    if normalization is not None:
        normalization.reset(obs, rows)
    while rows.size:
        every = rows.size == n_envs
        actions = policies.act(obs if normalization is None else normalization(obs))
        if every or not subsets:
            stepped = env.step(actions)
            obs, rewards, dones, infos = np.asarray(stepped[0]), *stepped[1:]
            if not every:
                rewards, dones, infos = rewards[rows], dones[rows], [infos[i] for i in rows]
        else:
            # Stop stepping the envs whose candidate is done: stock never steps them either.
            env.step_async_indices(actions[rows], rows)  # type: ignore[attr-defined]
            new_obs, rewards, dones, infos = env.step_wait_indices(rows)  # type: ignore[attr-defined]
            obs[rows] = new_obs
        if normalization is not None:
            rewards = normalization.step(obs[rows], rewards, dones, rows)
        on_steps(rows.size)
        if not monitor:
            current_rewards[rows] += rewards
            current_lengths[rows] += 1
        ended = np.flatnonzero(dones)
        if ended.size == 0:
            continue
        for position in ended:
            i = rows[position]
            info = infos[position]
            candidate = candidate_of[i]
            if not monitor:
                episodes.rewards[candidate].append(current_rewards[i])
                episodes.lengths[candidate].append(current_lengths[i])
                counts[i] += 1
            elif "episode" in info:
                episodes.rewards[candidate].append(info["episode"]["r"])
                episodes.lengths[candidate].append(info["episode"]["l"])
                counts[i] += 1
            current_rewards[i] = 0.0
            current_lengths[i] = 0
        rows = rows[counts[rows] < targets[rows]]
    return episodes
