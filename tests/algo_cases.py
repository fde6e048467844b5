"""
Our algorithms in the configurations that matter, each beside the stock class it stands in for.

The concern-wide tests run over :data:`CASES`: ``test_equivalence.py`` (learns as stock learns) and ``test_saves.py``
(saves load both ways). A new algorithm or configuration joins them all by adding one :class:`AlgoCase` below.
Everything these tests know about our private state (which update ran) is in the ``engine`` functions here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import sb3_contrib
import stable_baselines3
from stable_baselines3 import HerReplayBuffer
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm
from stable_baselines3.common.vec_env import VecEnv
from gymnasium.spaces import Box, Discrete

from sb3_speedups import A2C, DDPG, DQN, PPO, QRDQN, SAC, TD3, TQC, RecurrentPPO
from sb3_speedups.crossq import CrossQ
from sb3_speedups.ppo_mask import MaskablePPO
from sb3_speedups.trpo import TRPO
from sb3_speedups.ppo_recurrent.collection import frozen_actor_unsupported_reason
from tests.space_envs import (
    BatchNormExtractor,
    code_envs,
    bit_flipping_envs,
    dict_envs,
    dict_pendulum_env,
    dqn_env,
    image_env,
    masked_discrete_obs_env,
    masked_env,
    seeded_envs,
)


def updater_engine(model: BaseAlgorithm) -> str:
    """PPO, DQN: the class of the update that trains ``model`` ("unbound" once its optimizer was replaced)."""
    speed = model._speedups  # type: ignore[attr-defined]
    if speed is None:
        return "not built"
    return type(speed.updater).__name__ if speed.updater.is_bound() else "unbound"


def recurrent_engine(model: BaseAlgorithm) -> str:
    """RecurrentPPO: how it collects, what it stores rollouts in, and whether the flat Adam step drives the optimizer."""
    collection = "frozen-actor" if frozen_actor_unsupported_reason(model.policy) is None else "stock"
    step = model._optimizer_step  # type: ignore[attr-defined]
    adam = "flat" if step is not None and step.is_bound(model.policy.optimizer) else "unbound"
    return f"{collection} collection, {type(model.rollout_buffer).__name__}, {adam} Adam"


@dataclass(frozen=True)
class AlgoCase:
    """
    One configuration of one of our algorithms.

    :param name: the test id
    :param ours: our class
    :param stock: the stock class it stands in for, or ``None`` where stock has no such configuration (a GRU
        policy): then only our own save round trip and fast-path checks run
    :param env: a factory of fresh seeded VecEnvs (each side gets its own, equal one)
    :param kwargs: constructor arguments given to both classes (with ``policy``)
    :param engine_of: names the fast paths a model of ours runs on
    :param engine: what ``engine_of`` must say for this case, after learning and after loading
    :param ours_kwargs: arguments only ours takes
    :param policy: the policy name
    :param learn_steps: timesteps learnt before comparing or saving
    :param more_steps: timesteps learnt after loading
    :param exact: rollout/replay buffer fields equal to stock's bit for bit after ``learn_steps``
    :param close: buffer fields equal up to ``buffer_atol``
    :param param_atol: tolerance on the policy's state dict after ``learn_steps``, with ``param_rtol``
    :param predict_atol: tolerance on deterministic actions (0: identical)
    :param every_space: also compare first rollouts over every action space and observation kind (on-policy)
    :param callback_gaps: loop variables that stock's callbacks see in ``locals`` and ours do not offer (known gaps)
    :param marks: pytest marks (platform skips)
    """

    name: str
    ours: type[BaseAlgorithm]
    stock: type[BaseAlgorithm] | None
    env: Callable[[], VecEnv]
    kwargs: dict[str, Any]
    engine_of: Callable[[BaseAlgorithm], str]
    engine: str
    ours_kwargs: dict[str, Any] = field(default_factory=dict)
    policy: str = "MlpPolicy"
    learn_steps: int = 192
    more_steps: int = 64
    exact: tuple[str, ...] = ()
    close: tuple[str, ...] = ()
    buffer_atol: float = 1e-5
    param_atol: float = 1e-5
    param_rtol: float = 0.0
    predict_atol: float = 0.0
    every_space: bool = False
    callback_gaps: frozenset[str] = frozenset()
    marks: tuple[Any, ...] = ()

    def fresh_kwargs(self) -> dict[str, Any]:
        """:return: the constructor arguments with a fresh ``policy_kwargs`` (SB3's SAC writes into the one given)"""
        policy_kwargs = self.kwargs.get("policy_kwargs")
        return self.kwargs if policy_kwargs is None else {**self.kwargs, "policy_kwargs": dict(policy_kwargs)}

    def make_ours(self, env: VecEnv | None = None) -> BaseAlgorithm:
        return self.ours(self.policy, env if env is not None else self.env(), **self.fresh_kwargs(), **self.ours_kwargs)

    def make_stock(self, env: VecEnv | None = None) -> BaseAlgorithm:
        assert self.stock is not None
        return self.stock(self.policy, env if env is not None else self.env(), **self.fresh_kwargs())

    @property
    def on_policy(self) -> bool:
        return issubclass(self.ours, OnPolicyAlgorithm)


def buffer_of(model: BaseAlgorithm) -> Any:
    """:return: where ``model`` keeps its experience (rollout or replay buffer)"""
    return model.rollout_buffer if isinstance(model, OnPolicyAlgorithm) else model.replay_buffer  # type: ignore[attr-defined]


def as_stock_layout(ours: np.ndarray, stock: np.ndarray) -> np.ndarray:
    """Ours keeps rollouts (step, env)-major after train(); stock's get() leaves them flattened env-major."""
    if ours.shape == stock.shape:
        return ours
    return ours.swapaxes(0, 1).reshape(stock.shape)


class Counter(BaseCallback):
    """Counts rollouts and steps, and collects the names of the loop variables callbacks see."""

    def __init__(self):
        super().__init__()
        self.steps = self.starts = self.ends = 0
        self.keys: set[str] = set()

    def _on_rollout_start(self):
        self.starts += 1

    def _on_step(self):
        self.steps += 1
        self.keys |= set(self.locals)
        return True

    def _on_rollout_end(self):
        self.ends += 1


PPO_SMALL = dict(n_steps=16, batch_size=32, n_epochs=2)
SEEDED_PPO = {**PPO_SMALL, "seed": 3}
PPO_BUFFER = dict(exact=("observations", "actions", "episode_starts"), close=("values", "log_probs", "returns", "advantages"))
DQN_SMALL = dict(
    learning_rate=2.3e-3,
    batch_size=32,
    buffer_size=5_000,
    learning_starts=200,
    target_update_interval=10,
    train_freq=64,
    gradient_steps=16,
    exploration_fraction=0.3,
    exploration_final_eps=0.05,
    policy_kwargs=dict(net_arch=[32, 32]),
)
SEEDED_DQN = {**DQN_SMALL, "seed": 3}
SEEDED_QRDQN = {**SEEDED_DQN, "policy_kwargs": dict(net_arch=[32, 32], n_quantiles=10)}
REPLAY_FIELDS = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")
DQN_CASE = dict(engine_of=updater_engine, engine="HandDerivedQUpdate", learn_steps=700, more_steps=300, exact=REPLAY_FIELDS)
RECURRENT_SMALL = dict(n_steps=32, batch_size=64, n_epochs=2, policy_kwargs=dict(lstm_hidden_size=16, net_arch=[16]), seed=0)
RNN_KWARGS = {**RECURRENT_SMALL["policy_kwargs"], "n_lstm_layers": 2}
RECURRENT_CASE = dict(
    env=seeded_envs("CartPole-v1", 4, 0, max_episode_steps=12),
    engine_of=recurrent_engine,
    policy="MlpLstmPolicy",
    learn_steps=4 * 32 * 3,
    more_steps=128,
    exact=("observations", "actions", "episode_starts"),
    close=("values", "log_probs", "returns", "hidden_states_pi", "cell_states_vf"),
    buffer_atol=1e-4,
    param_atol=1e-4,
    param_rtol=1e-3,
    # sb3-contrib's loop offers these to callbacks, our frozen-actor recurrent collection does not
    callback_gaps=frozenset({"episode_starts", "clipped_actions"}),
)
LINUX_ONLY = (pytest.mark.skipif(not sys.platform.startswith("linux"), reason="split updates need Linux's fork()"),)

PPO_ENV = seeded_envs("CartPole-v1", 4, 3, max_episode_steps=6)
SEEDED_TRPO = dict(n_steps=16, batch_size=32, n_critic_updates=3, seed=3)
# The conjugate gradient chains ~10 Fisher-vector products and divides by their dot products, which amplifies the
# float32 rounding of hand-derived against autograd products (seen: 1e-6 relative after 3 updates, AMD EPYC).
TRPO_TOLERANCE = dict(param_atol=1e-5, param_rtol=1e-4)
PENDULUM_ENV = seeded_envs("Pendulum-v1", 4, 3, max_episode_steps=6)
SEEDED_A2C = dict(n_steps=16, seed=3)
A2C_BOX = dict(
    exact=("episode_starts",),
    close=("observations", "actions", "values", "log_probs", "returns", "advantages"),
    buffer_atol=1e-4,
    predict_atol=1e-6,
)

# Ours trains convolutions on channels-last inputs (another summation order in oneDNN's kernels): float32 rounding of
# sums over a batch's pixels, which Adam's normalised steps carry into the parameters: at most 5e-7 measured here
# (ppo-cnn, a2c-cnn, dqn-cnn on a 2-core AMD EPYC), under a tolerance of 1e-5
CNN_ON_POLICY = dict(
    exact=("observations", "episode_starts"),
    close=("actions", "values", "log_probs", "returns", "advantages"),
    buffer_atol=1e-3,
    param_atol=1e-5,
    predict_atol=0,
    learn_steps=224,  # 7 rollouts of 16 steps x 2 envs; the last holds two starts of each env's 12-step episodes
)


OFF_POLICY_SMALL = dict(
    learning_starts=64,
    batch_size=32,
    buffer_size=5_000,
    train_freq=8,
    gradient_steps=4,
    policy_kwargs=dict(net_arch=[32, 32]),
    seed=3,
)
OFF_POLICY_CASE = dict(
    engine_of=updater_engine,
    learn_steps=256,
    more_steps=64,
    close=("observations", "actions", "rewards"),
    buffer_atol=1e-5,
    # float32 sums in another order (batched products, fused Adam): parameters within 3e-7 of stock's after ~100 updates
    param_atol=1e-6,
)
# One-hot inputs to a critic: a weight whose gradient sums a hot column's errors to nearly 0 takes Adam's first step
# (the gradient over its own magnitude) from float32 rounding of that sum: 2.8e-6 seen on one weight of
# sac-multidiscrete-obs (seed 3; seeds 1, 2, 4: within 6e-8), under a tolerance of 1e-5
ONE_HOT_ADAM = dict(close=("actions", "rewards"), param_atol=1e-5)
# goal relabelling with SB3's HerReplayBuffer (its minibatches sampled many at a time by ours)
HER = dict(replay_buffer_class=HerReplayBuffer, replay_buffer_kwargs=dict(n_sampled_goal=2, goal_selection_strategy="future"))
SAC_CASE = {**OFF_POLICY_CASE, "engine": "HandDerivedSACUpdate"}
# TQC runs SAC's update with TQC's critic loss (sb3_speedups.tqc.quantile_loss)
TQC_SMALL = {**OFF_POLICY_SMALL, "policy_kwargs": dict(net_arch=[32, 32], n_quantiles=5)}
TD3_CASE = {**OFF_POLICY_CASE, "engine": "HandDerivedTD3Update"}
# CrossQ: stock's losses through autograd with the batch-renormalisation layers as functions (sb3_speedups.crossq)
CROSSQ_SMALL = {**OFF_POLICY_SMALL, "policy_delay": 2}
# param_atol: a Linear bias before a batch-renormalised ReLU unit that is on for the whole batch has a gradient of 0 up
# to float32 rounding, and Adam (betas 0.5, 0.999) steps it by about the learning rate with the sign rounding picks:
# seen on a 2-core AMD EPYC: crossq-fixed-ent-coef-4envs, 340 of 4569 entries by up to 1.4e-3 after 16 updates, the
# others within 1e-6 (crossq: none beyond 3e-7). The actions (equal until the trajectories part) are the strict check
# here; tests/test_crossq.py compares the gradients.
# predict: ours keeps the weights in flat buffers, off 64-byte alignment after the batch-renormalisation layers'
# numbers, where MKL's products round otherwise than on stock's tensors (seen: 2.4e-7 on a deterministic action)
CROSSQ_CASE = {**OFF_POLICY_CASE, "engine": "CrossQUpdate", "param_atol": 1e-2, "predict_atol": 1e-6}


BATCH_NORM = {**OFF_POLICY_SMALL, "policy_kwargs": dict(net_arch=[32, 32], features_extractor_class=BatchNormExtractor)}
# float32 rounding: ours keeps the actor's weights in a flat buffer after BatchNorm's 6 numbers, off 64-byte alignment,
# where MKL's products round otherwise than on stock's own tensors (seen: 2.4e-7 on a deterministic action)
BATCH_NORM_CASE = dict(predict_atol=1e-6)
SHARED_CNN = {**OFF_POLICY_SMALL, "policy_kwargs": dict(net_arch=[16], share_features_extractor=True)}


MASK_CASE = dict(
    engine_of=updater_engine,
    engine="HandDerivedPPOUpdate",
    ours_kwargs=dict(split_update=False),
    exact=("observations", "actions", "episode_starts", "action_masks"),
    close=("values", "log_probs", "returns", "advantages"),
    callback_gaps=frozenset({"use_masking"}),  # sb3-contrib's collect_rollouts argument; PPO's loop has no such local
)
SEEDED_MASK = {**SEEDED_PPO, "ent_coef": 0.01}

# Discrete, MultiDiscrete and MultiBinary observations: the fast networks gather the first layer's weights of the hot
# columns where stock multiplies by a one-hot row (and sums the weight gradient in another order): float32 rounding,
# within the default tolerances of 1e-5 (measured on a 2-core AMD EPYC with AVX-512: parameters within 1e-7, rollout
# values and log-probabilities within 3e-7, returns and advantages within 1e-6; DQN's actions never parted)
FROZEN_LAKE = seeded_envs("FrozenLake-v1", 4, 3, max_episode_steps=6)
PPO_FAST = dict(engine_of=updater_engine, engine="HandDerivedPPOUpdate", ours_kwargs=dict(split_update=False))


CASES = [
    AlgoCase(
        "ppo", PPO, stable_baselines3.PPO, PPO_ENV, SEEDED_PPO, updater_engine, "HandDerivedPPOUpdate",
        ours_kwargs=dict(split_update=False), every_space=True, **PPO_BUFFER,
    ),
    AlgoCase(
        "ppo-box", PPO, stable_baselines3.PPO, seeded_envs("Pendulum-v1", 4, 3, max_episode_steps=6), SEEDED_PPO,
        updater_engine, "HandDerivedPPOUpdate", ours_kwargs=dict(split_update=False), exact=("episode_starts",),
        close=("observations", "actions", "values", "log_probs", "returns", "advantages"), buffer_atol=1e-4,
        predict_atol=1e-6,
    ),
    AlgoCase(
        "ppo-split", PPO, stable_baselines3.PPO, PPO_ENV, SEEDED_PPO, updater_engine, "SplitPPOUpdate",
        ours_kwargs=dict(split_update=True), marks=LINUX_ONLY, **PPO_BUFFER,
    ),
    AlgoCase(
        "ppo-autograd", PPO, stable_baselines3.PPO, PPO_ENV, SEEDED_PPO, updater_engine, "AutogradPPOUpdate",
        ours_kwargs=dict(fast_update=False), **PPO_BUFFER,
    ),
    AlgoCase(
        "a2c", A2C, stable_baselines3.A2C, PPO_ENV, SEEDED_A2C, updater_engine, "HandDerivedA2CUpdate", every_space=True,
        **PPO_BUFFER,
    ),
    AlgoCase(
        "a2c-adam", A2C, stable_baselines3.A2C, PPO_ENV, {**SEEDED_A2C, "use_rms_prop": False, "normalize_advantage": True},
        updater_engine, "HandDerivedA2CUpdate", **PPO_BUFFER,
    ),
    AlgoCase(
        "a2c-box", A2C, stable_baselines3.A2C, PENDULUM_ENV, {**SEEDED_A2C, "ent_coef": 0.01}, updater_engine,
        "HandDerivedA2CUpdate", **A2C_BOX,
    ),
    AlgoCase(
        "a2c-autograd", A2C, stable_baselines3.A2C, PPO_ENV, SEEDED_A2C, updater_engine, "AutogradA2CUpdate",
        ours_kwargs=dict(fast_update=False), **PPO_BUFFER,
    ),
    AlgoCase(
        "a2c-gsde", A2C, stable_baselines3.A2C, PENDULUM_ENV, {**SEEDED_A2C, "use_sde": True, "use_rms_prop": False},
        updater_engine, "AutogradA2CUpdate", **A2C_BOX,
    ),
    AlgoCase(
        "trpo", TRPO, sb3_contrib.TRPO, PPO_ENV, SEEDED_TRPO, updater_engine, "HandDerivedTRPOUpdate", every_space=True,
        **TRPO_TOLERANCE, **PPO_BUFFER,
    ),
    AlgoCase(
        "trpo-box", TRPO, sb3_contrib.TRPO, PENDULUM_ENV, {**SEEDED_TRPO, "sub_sampling_factor": 2}, updater_engine,
        "HandDerivedTRPOUpdate", **{**A2C_BOX, **TRPO_TOLERANCE},
    ),
    AlgoCase(
        "trpo-gsde", TRPO, sb3_contrib.TRPO, PENDULUM_ENV, {**SEEDED_TRPO, "use_sde": True}, updater_engine,
        "StockTRPOUpdate", **A2C_BOX,
    ),
    AlgoCase(
        "trpo-stock-train", TRPO, sb3_contrib.TRPO, PPO_ENV, SEEDED_TRPO, updater_engine, "StockTRPOUpdate",
        ours_kwargs=dict(fast_update=False), **PPO_BUFFER,
    ),
    AlgoCase(
        "ppo-cnn", PPO, stable_baselines3.PPO, image_env(Discrete(3)), {**SEEDED_PPO, "policy_kwargs": dict(net_arch=[16])},
        updater_engine, "AutogradPPOUpdate", policy="CnnPolicy", **CNN_ON_POLICY,
    ),
    AlgoCase(
        "a2c-cnn", A2C, stable_baselines3.A2C, image_env(Discrete(3)), {**SEEDED_A2C, "policy_kwargs": dict(net_arch=[16])},
        updater_engine, "AutogradA2CUpdate", policy="CnnPolicy", **CNN_ON_POLICY,
    ),
    AlgoCase("dqn", DQN, stable_baselines3.DQN, dqn_env(1), SEEDED_DQN, **DQN_CASE),
    AlgoCase("dqn-4envs", DQN, stable_baselines3.DQN, dqn_env(4), SEEDED_DQN, **DQN_CASE),
    AlgoCase("dqn-defaults", DQN, stable_baselines3.DQN, dqn_env(1), {"seed": 3}, **DQN_CASE),
    AlgoCase("dqn-defaults-2envs", DQN, stable_baselines3.DQN, dqn_env(2), {"seed": 3}, **DQN_CASE),
    AlgoCase("dqn-3step", DQN, stable_baselines3.DQN, dqn_env(1), {**SEEDED_DQN, "n_steps": 3}, **DQN_CASE),
    AlgoCase(
        "dqn-optimize-memory", DQN, stable_baselines3.DQN, dqn_env(2),
        {**SEEDED_DQN, "optimize_memory_usage": True, "replay_buffer_kwargs": dict(handle_timeout_termination=False)},
        **{**DQN_CASE, "exact": tuple(f for f in REPLAY_FIELDS if f != "next_observations")},
    ),
    AlgoCase(
        "dqn-dueling", DQN, None, dqn_env(1), {**SEEDED_DQN, "policy_kwargs": dict(net_arch=[16, 8], dueling=True)},
        **{**DQN_CASE, "engine": "AutogradQUpdate", "learn_steps": 400},
    ),
    AlgoCase(
        "dqn-cnn", DQN, stable_baselines3.DQN, image_env(Discrete(3)),
        {**SEEDED_DQN, "policy_kwargs": dict(net_arch=[16])}, policy="CnnPolicy",
        **{**DQN_CASE, "engine": "AutogradQUpdate", "learn_steps": 400},
    ),
    AlgoCase("sac", SAC, stable_baselines3.SAC, seeded_envs("Pendulum-v1", 1, 3), OFF_POLICY_SMALL, **SAC_CASE),
    AlgoCase(
        "sac-fixed-ent-coef-4envs", SAC, stable_baselines3.SAC, PENDULUM_ENV,
        {**OFF_POLICY_SMALL, "ent_coef": 0.1, "target_update_interval": 2}, **SAC_CASE,
    ),
    AlgoCase(
        "sac-auto-ent-coef-interval", SAC, stable_baselines3.SAC, PENDULUM_ENV,
        {**OFF_POLICY_SMALL, "ent_coef": "auto_0.5", "target_update_interval": 3, "target_entropy": -0.5}, **SAC_CASE,
    ),
    AlgoCase(
        "sac-gsde", SAC, stable_baselines3.SAC, PENDULUM_ENV, {**OFF_POLICY_SMALL, "use_sde": True},
        **{**SAC_CASE, "engine": "AutogradSACUpdate"},
    ),
    AlgoCase(
        "sac-autograd", SAC, stable_baselines3.SAC, seeded_envs("Pendulum-v1", 1, 3), OFF_POLICY_SMALL,
        ours_kwargs=dict(fast_update=False), **{**SAC_CASE, "engine": "AutogradSACUpdate"},
    ),
    AlgoCase(
        "sac-cnn", SAC, stable_baselines3.SAC, image_env(Box(-1, 1, (2,), np.float32)),
        {**OFF_POLICY_SMALL, "policy_kwargs": dict(net_arch=[16])}, policy="CnnPolicy",
        **{**SAC_CASE, "engine": "AutogradSACUpdate", "learn_steps": 160},
    ),
    AlgoCase(
        "sac-cnn-shared", SAC, stable_baselines3.SAC, image_env(Box(-1, 1, (2,), np.float32)), SHARED_CNN,
        policy="CnnPolicy", **{**SAC_CASE, "engine": "AutogradSACUpdate", "learn_steps": 160},
    ),
    AlgoCase(
        "sac-batch-norm", SAC, stable_baselines3.SAC, seeded_envs("Pendulum-v1", 1, 3), BATCH_NORM,
        **{**SAC_CASE, **BATCH_NORM_CASE, "engine": "AutogradSACUpdate"},
    ),
    AlgoCase(
        "sac-dict", SAC, stable_baselines3.SAC, dict_pendulum_env, {**OFF_POLICY_SMALL, "ent_coef": 0.05},
        policy="MultiInputPolicy", **{**SAC_CASE, "close": ("observations", "actions", "rewards")},
    ),
    AlgoCase("tqc", TQC, sb3_contrib.TQC, seeded_envs("Pendulum-v1", 1, 3), TQC_SMALL, **SAC_CASE),
    AlgoCase(
        "tqc-fixed-ent-coef-4envs", TQC, sb3_contrib.TQC, PENDULUM_ENV,
        {**TQC_SMALL, "ent_coef": 0.1, "target_update_interval": 2, "top_quantiles_to_drop_per_net": 1}, **SAC_CASE,
    ),
    AlgoCase(
        "tqc-gsde", TQC, sb3_contrib.TQC, PENDULUM_ENV, {**TQC_SMALL, "use_sde": True},
        **{**SAC_CASE, "engine": "AutogradSACUpdate"},
    ),
    AlgoCase("crossq", CrossQ, sb3_contrib.CrossQ, seeded_envs("Pendulum-v1", 1, 3), CROSSQ_SMALL, **CROSSQ_CASE),
    AlgoCase(
        "crossq-fixed-ent-coef-4envs", CrossQ, sb3_contrib.CrossQ, PENDULUM_ENV,
        {**CROSSQ_SMALL, "ent_coef": 0.1, "policy_delay": 4},
        **CROSSQ_CASE,
    ),
    AlgoCase(
        "crossq-gsde", CrossQ, sb3_contrib.CrossQ, PENDULUM_ENV, {**CROSSQ_SMALL, "use_sde": True},
        **{**CROSSQ_CASE, "engine": "StockCrossQUpdate"},
    ),
    AlgoCase(
        "sac-her", SAC, stable_baselines3.SAC, bit_flipping_envs(continuous=True, n_envs=2), {**OFF_POLICY_SMALL, **HER},
        policy="MultiInputPolicy", **SAC_CASE,
    ),
    AlgoCase(
        "sac-multidiscrete-obs", SAC, stable_baselines3.SAC, code_envs("obs_multidiscrete", continuous=True, n_envs=1),
        OFF_POLICY_SMALL, **{**SAC_CASE, **ONE_HOT_ADAM}, exact=("observations",),
    ),
    AlgoCase(
        "td3-discrete-obs", TD3, stable_baselines3.TD3, code_envs("obs_discrete", continuous=True, n_envs=1),
        OFF_POLICY_SMALL, **{**TD3_CASE, **ONE_HOT_ADAM}, exact=("observations",),
    ),
    AlgoCase(
        "td3-her", TD3, stable_baselines3.TD3, bit_flipping_envs(continuous=True), {**OFF_POLICY_SMALL, **HER},
        policy="MultiInputPolicy", **TD3_CASE,
    ),
    AlgoCase(
        "td3", TD3, stable_baselines3.TD3, seeded_envs("Pendulum-v1", 1, 3),
        {**OFF_POLICY_SMALL, "policy_delay": 2, "target_policy_noise": 0.3, "target_noise_clip": 0.4}, **TD3_CASE,
    ),
    AlgoCase("td3-4envs", TD3, stable_baselines3.TD3, PENDULUM_ENV, OFF_POLICY_SMALL, **TD3_CASE),
    AlgoCase("ddpg", DDPG, stable_baselines3.DDPG, seeded_envs("Pendulum-v1", 1, 3), OFF_POLICY_SMALL, **TD3_CASE),
    AlgoCase(
        "td3-autograd", TD3, stable_baselines3.TD3, PENDULUM_ENV, OFF_POLICY_SMALL, ours_kwargs=dict(fast_update=False),
        **{**TD3_CASE, "engine": "AutogradTD3Update"},
    ),
    AlgoCase(
        "td3-cnn-shared", TD3, stable_baselines3.TD3, image_env(Box(-1, 1, (2,), np.float32)), SHARED_CNN,
        policy="CnnPolicy", **{**TD3_CASE, "engine": "AutogradTD3Update", "learn_steps": 160},
    ),
    AlgoCase(
        "td3-batch-norm", TD3, stable_baselines3.TD3, seeded_envs("Pendulum-v1", 1, 3), BATCH_NORM,
        **{**TD3_CASE, **BATCH_NORM_CASE, "engine": "AutogradTD3Update"},
    ),
    AlgoCase(
        "ppo-mask", MaskablePPO, sb3_contrib.MaskablePPO, masked_env("InvalidActionEnvDiscrete-v0"), SEEDED_MASK, **MASK_CASE
    ),
    AlgoCase(
        "ppo-mask-multidiscrete", MaskablePPO, sb3_contrib.MaskablePPO, masked_env("InvalidActionEnvMultiDiscrete-v0"),
        SEEDED_MASK, **MASK_CASE,
    ),
    AlgoCase(
        "ppo-mask-split", MaskablePPO, sb3_contrib.MaskablePPO, masked_env("InvalidActionEnvDiscrete-v0"), SEEDED_MASK,
        **{**MASK_CASE, "engine": "SplitPPOUpdate", "ours_kwargs": dict(split_update=True)}, marks=LINUX_ONLY,
    ),
    AlgoCase("ppo-frozenlake", PPO, stable_baselines3.PPO, FROZEN_LAKE, SEEDED_PPO, **PPO_FAST, **PPO_BUFFER),
    AlgoCase(
        "ppo-multidiscrete-obs", PPO, stable_baselines3.PPO, code_envs("obs_multidiscrete"), SEEDED_PPO, **PPO_FAST,
        **PPO_BUFFER,
    ),
    AlgoCase(
        "ppo-multibinary-obs", PPO, stable_baselines3.PPO, code_envs("obs_multibinary"), SEEDED_PPO, **PPO_FAST,
        **PPO_BUFFER,
    ),
    AlgoCase(
        "a2c-frozenlake", A2C, stable_baselines3.A2C, FROZEN_LAKE, SEEDED_A2C, updater_engine, "HandDerivedA2CUpdate",
        **PPO_BUFFER,
    ),
    AlgoCase(
        "a2c-multidiscrete-obs", A2C, stable_baselines3.A2C, code_envs("obs_multidiscrete"), SEEDED_A2C, updater_engine,
        "HandDerivedA2CUpdate", **PPO_BUFFER,
    ),
    AlgoCase(
        "ppo-mask-discrete-obs", MaskablePPO, sb3_contrib.MaskablePPO, masked_discrete_obs_env(40, 20), SEEDED_MASK,
        **MASK_CASE,
    ),
    AlgoCase(
        "ppo-dict", PPO, stable_baselines3.PPO, dict_envs(), SEEDED_PPO, policy="MultiInputPolicy", **PPO_FAST, **PPO_BUFFER
    ),
    AlgoCase(
        "a2c-dict", A2C, stable_baselines3.A2C, dict_envs(), SEEDED_A2C, updater_engine, "HandDerivedA2CUpdate",
        policy="MultiInputPolicy", **PPO_BUFFER,
    ),
    AlgoCase(
        "dqn-dict", DQN, stable_baselines3.DQN, dict_envs(n_envs=1), SEEDED_DQN, policy="MultiInputPolicy", **DQN_CASE
    ),
    AlgoCase("dqn-frozenlake", DQN, stable_baselines3.DQN, seeded_envs("FrozenLake-v1", 1, 3), SEEDED_DQN, **DQN_CASE),
    AlgoCase(
        "dqn-her", DQN, stable_baselines3.DQN, bit_flipping_envs(continuous=False), {**SEEDED_DQN, **HER},
        policy="MultiInputPolicy", **DQN_CASE,
    ),
    AlgoCase(
        "dqn-multidiscrete-obs", DQN, stable_baselines3.DQN, code_envs("obs_multidiscrete"), SEEDED_DQN, **DQN_CASE
    ),
    AlgoCase("qrdqn", QRDQN, sb3_contrib.QRDQN, dqn_env(1), SEEDED_QRDQN, **DQN_CASE),
    AlgoCase("qrdqn-defaults-2envs", QRDQN, sb3_contrib.QRDQN, dqn_env(2), {"seed": 3}, **DQN_CASE),
    AlgoCase(
        "qrdqn-autograd", QRDQN, sb3_contrib.QRDQN, dqn_env(1), {**SEEDED_QRDQN, "max_grad_norm": 0.5},
        ours_kwargs=dict(fast_update=False), **{**DQN_CASE, "engine": "AutogradQUpdate"},
    ),
    AlgoCase(
        "qrdqn-cnn", QRDQN, sb3_contrib.QRDQN, image_env(Discrete(3)),
        {**SEEDED_DQN, "policy_kwargs": dict(net_arch=[16], n_quantiles=5)}, policy="CnnPolicy",
        **{**DQN_CASE, "engine": "AutogradQUpdate", "learn_steps": 400},
    ),
    AlgoCase(
        "recurrent-lstm", RecurrentPPO, sb3_contrib.RecurrentPPO, kwargs={**RECURRENT_SMALL, "policy_kwargs": RNN_KWARGS},
        engine="frozen-actor collection, FastRecurrentRolloutBuffer, flat Adam", **RECURRENT_CASE,
    ),
    AlgoCase(
        "recurrent-shared-lstm", RecurrentPPO, sb3_contrib.RecurrentPPO,
        kwargs={**RECURRENT_SMALL, "policy_kwargs": {**RNN_KWARGS, "shared_lstm": True, "enable_critic_lstm": False}},
        engine="stock collection, FastRecurrentRolloutBuffer, flat Adam", **RECURRENT_CASE,
    ),
    AlgoCase(
        "recurrent-dict", RecurrentPPO, sb3_contrib.RecurrentPPO, kwargs={**RECURRENT_SMALL, "policy_kwargs": RNN_KWARGS},
        engine="frozen-actor collection, RecurrentDictRolloutBuffer, flat Adam",
        **{**RECURRENT_CASE, "env": dict_envs(codes=False), "policy": "MultiInputLstmPolicy"},
    ),
    AlgoCase(
        "recurrent-gru", RecurrentPPO, None, kwargs={**RECURRENT_SMALL, "policy_kwargs": RNN_KWARGS},
        engine="frozen-actor collection, FastRecurrentRolloutBuffer, flat Adam",
        **{**RECURRENT_CASE, "policy": "MlpGruPolicy"},
    ),
]  # fmt: skip


def params(cases: Iterable[AlgoCase]) -> list[Any]:
    """:return: ``cases`` as pytest parameters, named and marked"""
    return [pytest.param(case, id=case.name, marks=case.marks) for case in cases]


WITH_STOCK = params(case for case in CASES if case.stock is not None)
ALL = params(CASES)
