"""
TRPO: our hand-derived update against sb3-contrib's for the same seed (every action space, sub-sampling, the critic's
epochs, the line search accepting and rejecting), the fallback, the bundled hyperparameters. Learning as stock learns
for the AlgoCases ``trpo*`` and saves loading both ways are in ``test_equivalence.py`` and ``test_saves.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import sb3_contrib
import sb3_contrib.trpo.trpo
import torch as th
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.vec_env import VecEnv

from sb3_speedups.trpo import TRPO
from sb3_speedups.trpo.natural_gradient import CategoricalFisher
from sb3_speedups.trpo.trpo import StockTRPOUpdate
from sb3_speedups.trpo.update import HandDerivedTRPOUpdate
from sb3_speedups.zoo.hyperparams import bundled_hyperparams_dir, load_yaml_file, rl_zoo_hyperparams_dir
from tests.space_envs import ACTION_SPACES, OBSERVATION_SPACES, box_env, code_envs, dict_envs, seeded_envs

# 64 samples per rollout, critic minibatches of 24: two full ones and a shorter one per epoch
SMALL = dict(n_steps=16, batch_size=24, n_critic_updates=3, seed=3)
# The conjugate gradient chains ~10 Fisher-vector products (ours: tangent pass + backward, stock: double backward)
# and divides by their dot products, which amplifies float32 rounding; seen 1e-6 relative after 3 updates on an AMD
# EPYC. A wrong term (a missing 1/d, a wrong sign) moves the parameters by 1e-3 and more.
PARAMS_TOL = dict(atol=1e-5, rtol=1e-4)
STATS = ("policy_objective", "kl_divergence_loss", "value_loss", "is_line_search_success", "explained_variance")
CARTPOLE = seeded_envs("CartPole-v1", 4, 3, max_episode_steps=6)


def learn_both(env: Callable[[], VecEnv], kwargs: dict[str, Any], steps: int) -> tuple[BaseAlgorithm, BaseAlgorithm]:
    """:return: ours and stock, each made (which seeds the global RNGs) and trained in turn"""
    models = []
    for cls in (TRPO, sb3_contrib.TRPO):
        model = cls("MlpPolicy", env(), **kwargs)
        models.append(model.learn(steps))
    return models[0], models[1]


def assert_same_update(ours: BaseAlgorithm, stock: BaseAlgorithm) -> None:
    for (name, ours_p), stock_p in zip(ours.policy.named_parameters(), stock.policy.parameters(), strict=True):
        th.testing.assert_close(ours_p, stock_p, **PARAMS_TOL, msg=name)
    for key in STATS:
        ours_value, stock_value = (model.logger.name_to_value[f"train/{key}"] for model in (ours, stock))
        # statistics of the float32 values above, read as float64
        assert ours_value == pytest.approx(float(stock_value), rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("space", list(ACTION_SPACES))
def test_updates_equal_stock_for_every_action_space(space: str) -> None:
    ours, stock = learn_both(lambda: box_env(space), SMALL, 3 * 64)
    assert isinstance(ours._speedups.updater, HandDerivedTRPOUpdate)
    assert_same_update(ours, stock)


@pytest.mark.parametrize("observations", ["dict", *OBSERVATION_SPACES])
def test_updates_equal_stock_for_every_observation_kind(observations: str) -> None:
    # one-hot inputs (the first layer's tangent is a gather of the direction's rows) and Dict observations
    env, policy = (dict_envs(), "MultiInputPolicy") if observations == "dict" else (code_envs(observations), "MlpPolicy")
    models = [cls(policy, env(), **SMALL).learn(3 * 64) for cls in (TRPO, sb3_contrib.TRPO)]
    assert isinstance(models[0]._speedups.updater, HandDerivedTRPOUpdate)
    assert_same_update(*models)


@pytest.mark.parametrize("sub_sampling_factor", [1, 3])
def test_updates_equal_stock_with_sub_sampling_and_backtracking(
    sub_sampling_factor: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # target_kl 0.3: large steps, where the KL's quadratic model can fall short and the line search shrinks the step
    kwargs = {**SMALL, "sub_sampling_factor": sub_sampling_factor, "target_kl": 0.3, "line_search_shrinking_factor": 0.3}
    trials = []
    ours_kl = CategoricalFisher.kl
    monkeypatch.setattr(CategoricalFisher, "kl", lambda self, *args: trials.append(1) or ours_kl(self, *args))
    ours, stock = learn_both(CARTPOLE, kwargs, 4 * 64)
    assert_same_update(ours, stock)
    assert ours.logger.name_to_value["train/is_line_search_success"] == 1.0
    if sub_sampling_factor == 3:  # this seed's second update backtracks once (so the test covers a shrunk step)
        assert len(trials) == 5


def test_rejected_line_search_restores_the_actor_as_stock(monkeypatch: pytest.MonkeyPatch) -> None:
    # A KL raised by 1 everywhere (its Hessian unchanged) rejects every step of both: the actor goes back to where it
    # was, the critic still trains.
    stock_kl = sb3_contrib.trpo.trpo.kl_divergence
    monkeypatch.setattr(sb3_contrib.trpo.trpo, "kl_divergence", lambda p, q: stock_kl(p, q) + 1.0)
    ours_kl = CategoricalFisher.kl
    monkeypatch.setattr(CategoricalFisher, "kl", lambda self, out, log_std: ours_kl(self, out, log_std) + 1.0)
    models = []
    for cls in (TRPO, sb3_contrib.TRPO):
        model = cls("MlpPolicy", CARTPOLE(), **SMALL)
        _, callback = model._setup_learn(64, None)
        assert model.collect_rollouts(model.env, callback, model.rollout_buffer, model.n_steps)
        before = {name: p.detach().clone() for name, p in model.policy.named_parameters()}
        model.train()
        for name, p in model.policy.named_parameters():
            # the actor restored from its copy: the very same numbers; the critic stepped by Adam
            assert th.equal(p, before[name]) != ("value" in name), name
        models.append(model)
    assert_same_update(*models)
    assert models[0].logger.name_to_value["train/is_line_search_success"] == 0.0
    assert models[0].logger.name_to_value["train/kl_divergence_loss"] == 0.0


def test_gsde_falls_back_to_stock_train_after_our_collection() -> None:
    kwargs = {**SMALL, "use_sde": True, "sde_sample_freq": 4}
    ours, stock = learn_both(seeded_envs("Pendulum-v1", 4, 3, max_episode_steps=6), kwargs, 2 * 64)
    assert ours.fast_path_unsupported_reason() == "gSDE"
    assert isinstance(ours._speedups.updater, StockTRPOUpdate)
    assert_same_update(ours, stock)


def test_fast_update_false_runs_stock_train() -> None:
    model = TRPO("MlpPolicy", CARTPOLE(), fast_update=False, **SMALL).learn(64)
    assert model.fast_path_unsupported_reason() == "fast_update=False"
    assert isinstance(model._speedups.updater, StockTRPOUpdate)


def test_bundled_file_holds_the_rl_zoo_values() -> None:
    ours = load_yaml_file(bundled_hyperparams_dir() / "trpo.yml")
    assert {"CartPole-v1", "Pendulum-v1", "LunarLander-v3", "BipedalWalker-v3"} <= set(ours)
    for env_id in ours:
        assert env_id in gym.registry or env_id == "default", env_id
    zoo_dir = rl_zoo_hyperparams_dir()
    if zoo_dir is None:
        pytest.skip("rl_zoo3 is not installed")
    zoo = load_yaml_file(zoo_dir / "trpo.yml")
    for env_id, section in ours.items():
        assert section == zoo[env_id], env_id


def test_trpo_is_exported_and_registered() -> None:
    import sb3_speedups
    from sb3_speedups.registry import get_algo

    assert sb3_speedups.TRPO is TRPO and issubclass(TRPO, sb3_contrib.TRPO)
    assert get_algo("trpo").cls() is TRPO and get_algo("trpo").cls(stock=True) is sb3_contrib.TRPO
    assert np.isclose(TRPO("MlpPolicy", "CartPole-v1", n_steps=64).cg_damping, 0.1)  # stock's defaults
