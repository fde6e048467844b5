"""TQC: the hand-derived steps equal sb3-contrib's autograd ones, the fallback, the bundled hyperparameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sb3_contrib
import torch as th
from gymnasium import spaces
from stable_baselines3.common.env_util import make_vec_env

import sb3_speedups
from sb3_speedups.tqc import TQC
from sb3_speedups.sac.update import AutogradSACUpdate, HandDerivedSACUpdate
from sb3_speedups.zoo.hyperparams import load_yaml_file, rl_zoo_hyperparams_dir
from tests.space_envs import dict_pendulum_env, image_env
from tests.test_off_policy import assert_close_grads, record_flat_grads, record_optimizer_grads

SMALL: dict[str, Any] = dict(learning_starts=10_000, batch_size=64, buffer_size=1_000, seed=5)


def filled(cls: type, **kwargs: Any) -> Any:
    """:return: a TQC whose replay buffer holds 200 random transitions (no update yet)"""
    model = cls("MlpPolicy", make_vec_env("Pendulum-v1", n_envs=1, seed=5), **{**SMALL, **kwargs})
    model.learn(200)
    return model


CASES = [
    pytest.param({}, id="defaults"),
    pytest.param(
        {
            "ent_coef": 0.2,
            "top_quantiles_to_drop_per_net": 0,
            "policy_kwargs": dict(n_quantiles=7, n_critics=3, net_arch=[32, 16]),
        },
        id="fixed-3-critics-no-drop",
    ),
    pytest.param(
        {"n_steps": 3, "target_update_interval": 2, "top_quantiles_to_drop_per_net": 4, "policy_kwargs": dict(n_critics=1)},
        id="3step-1-critic",
    ),
]


@pytest.mark.parametrize("kwargs", CASES)
def test_hand_derived_gradients_equal_stock_autograd(kwargs: dict) -> None:
    """Every gradient that stock's optimizers step with (critics, actor, entropy coefficient), step after step, the
    logged losses, and the parameters and targets after three steps."""
    ours, stock = filled(TQC, **kwargs), filled(sb3_contrib.TQC, **kwargs)
    updater = ours._ensure_speedups().updater
    assert isinstance(updater, HandDerivedSACUpdate)
    names = {"actor": (updater.actor.adam, stock.actor.optimizer), "critic": (updater.critics.adam, stock.critic.optimizer)}
    if updater.ent.adam is not None:
        names["ent_coef"] = (updater.ent.adam, stock.ent_coef_optimizer)
    logs: dict[str, tuple[list[th.Tensor], list[th.Tensor]]] = {}
    for name, (adam, optimizer) in names.items():
        assert adam is not None
        logs[name] = ([], [])
        record_flat_grads(adam, logs[name][0])
        record_optimizer_grads(optimizer, logs[name][1])
    logged = []
    for model in (ours, stock):
        np.random.seed(1)
        th.manual_seed(1)
        model.train(gradient_steps=3, batch_size=64)
        logged.append({k: float(v) for k, v in model.logger.name_to_value.items() if k.startswith("train/")})
    for name, (ours_log, stock_log) in logs.items():
        assert_close_grads(ours_log, stock_log, name)  # rtol 1e-4: float32 sums in another order
    assert logged[0].keys() == logged[1].keys()
    for key, value in logged[1].items():
        # float32 sums of the losses in another order (the critic loss sums ~10^5 pairs)
        np.testing.assert_allclose(logged[0][key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    for key, value in stock.policy.state_dict().items():  # the targets too
        # three Adam steps of ~lr = 3e-4 from gradients equal within float32 rounding
        th.testing.assert_close(ours.policy.state_dict()[key], value, rtol=0, atol=1e-6, msg=key)


def test_autograd_update_equals_stock() -> None:
    """``fast_update=False``: SAC's autograd update with TQC's losses makes stock's steps."""
    ours, stock = filled(TQC, fast_update=False), filled(sb3_contrib.TQC)
    assert isinstance(ours._ensure_speedups().updater, AutogradSACUpdate)
    for model in (ours, stock):
        np.random.seed(1)
        th.manual_seed(1)
        model.train(gradient_steps=3, batch_size=64)
    for key, value in stock.policy.state_dict().items():
        # the same operations but the fused flat Adam and no critic weight gradients in the actor loss: rounding only
        th.testing.assert_close(ours.policy.state_dict()[key], value, rtol=0, atol=1e-6, msg=key)


def test_images_take_the_autograd_update() -> None:
    env = image_env(spaces.Box(-1, 1, (2,), np.float32))()
    model = TQC("CnnPolicy", env, learning_starts=20, batch_size=16, buffer_size=200, policy_kwargs=dict(net_arch=[8]), seed=0)
    model.learn(30)
    speed = model._speedups
    assert model.fast_path_unsupported_reason() is not None and speed is not None
    assert isinstance(speed.updater, AutogradSACUpdate) and model._n_updates > 0


def test_dict_observations_make_stocks_steps() -> None:
    """``Dict`` observations, on whichever update takes them: three steps from the same state are stock's."""
    models = []
    for cls in (TQC, sb3_contrib.TQC):
        model: Any = cls("MultiInputPolicy", dict_pendulum_env(), **{**SMALL, "policy_kwargs": dict(net_arch=[32])})
        model.learn(200)
        np.random.seed(1)
        th.manual_seed(1)
        model.train(gradient_steps=3, batch_size=64)
        models.append(model)
    ours, stock = models
    for key, value in stock.policy.state_dict().items():
        # float32 rounding of other call shapes, carried by three Adam steps of lr 3e-4
        th.testing.assert_close(ours.policy.state_dict()[key], value, rtol=0, atol=1e-6, msg=key)


def test_frozen_actor_acts_with_the_squashed_gaussian() -> None:
    """TQC's actor (sb3-contrib's class, built as SAC's) acts from the frozen copy, with stock's actions."""
    buffers: list[Any] = []
    for cls in (TQC, sb3_contrib.TQC):
        env = make_vec_env("Pendulum-v1", n_envs=2, seed=5)
        model: Any = cls("MlpPolicy", env, learning_starts=40, train_freq=500, seed=5)
        model.learn(160)
        buffers.append(model.replay_buffer)
        if cls is TQC:
            assert model._speedups.actor is not None and model._speedups.actor.squashed_gaussian
    ours, stock = buffers
    # the same torch operations on the same shapes as stock's actor module
    np.testing.assert_array_equal(ours.actions[:80], stock.actions[:80])
    assert np.abs(stock.actions[20:80]).max() > 0


def test_bundled_hyperparameters_are_the_rl_zoos() -> None:
    """hyperparams/tqc.yml: the Zoo's sections, MuJoCo -v5 with the Zoo's -v4 values, FetchReach-v4 with its -v1 ones."""
    zoo_dir = rl_zoo_hyperparams_dir()
    if zoo_dir is None:
        pytest.skip("rl_zoo3 is not installed")
    ours = load_yaml_file(Path(__file__).resolve().parents[1] / "hyperparams" / "tqc.yml")
    zoo = load_yaml_file(zoo_dir / "tqc.yml")
    assert {"Pendulum-v1", "LunarLanderContinuous-v3", "HalfCheetah-v5", "FetchReach-v4"} <= set(ours)
    for env_id, section in ours.items():
        assert section == zoo[env_id.replace("-v5", "-v4").replace("FetchReach-v4", "FetchReach-v1")], env_id


def test_builtin_space_builds_valid_models() -> None:
    """The ``tqc`` space (SAC's plus the RL Zoo's quantile options) builds our TQC, dropping fewer quantiles than it has."""
    import optuna

    from sb3_speedups.registry import get_algo
    from sb3_speedups.tune.search_space import merge_hyperparams
    from sb3_speedups.tune.tuner import TuneConfig, build_space
    from sb3_speedups.zoo.envs import make_env
    from sb3_speedups.zoo.hyperparams import read_hyperparams
    from sb3_speedups.zoo.train import TrainConfig, create_model, prepare_experiment

    base = read_hyperparams("tqc", "Pendulum-v1")
    algo_cls = get_algo("tqc").cls()
    assert algo_cls is TQC and sb3_speedups.TQC is TQC
    space = build_space(TuneConfig("tqc", "Pendulum-v1"), algo_cls, base)
    assert {"policy_kwargs.n_quantiles", "top_quantiles_to_drop_per_net", "learning_rate"} <= set(space.params)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), direction="maximize")
    for _ in range(4):
        trial = study.ask()
        hyperparams = merge_hyperparams(base, space.sample(trial), space.constraints)
        config = TrainConfig("tqc", "Pendulum-v1", n_timesteps=1000, seed=0, hyperparams=hyperparams)
        experiment = prepare_experiment(config)
        env = make_env("Pendulum-v1", experiment.hyperparams, experiment.hyperparams.n_envs, seed=0)
        model: Any = create_model(experiment, env)
        assert isinstance(model, TQC) and model.gradient_steps == model.train_freq.frequency  # type: ignore[union-attr]
        assert model.top_quantiles_to_drop_per_net < model.policy.critic.n_quantiles
        env.close()
        study.tell(trial, 0.0)
