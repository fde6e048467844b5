"""Search spaces: built-in ones build valid models, options follow the class, YAML files extend or replace them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from sb3_contrib import RecurrentPPO
from sb3_contrib.common.recurrent.policies import RecurrentActorCriticPolicy
from stable_baselines3 import DQN, PPO
from stable_baselines3.dqn.policies import DQNPolicy

from sb3_speedups.errors import UserError
from sb3_speedups.registry import get_algo
from sb3_speedups.tune.search_space import SearchSpace, apply_space_file, check_space_names, merge_hyperparams, to_hyperparams
from sb3_speedups.tune.spaces import dqn_space, ppo_lstm_space, ppo_space
from sb3_speedups.tune.tuner import TuneConfig, build_space
from sb3_speedups.zoo.envs import make_env
from sb3_speedups.zoo.hyperparams import read_hyperparams
from sb3_speedups.zoo.train import TrainConfig, create_model, prepare_experiment


@pytest.mark.parametrize(
    ("algo", "env_id"),
    [
        ("ppo", "CartPole-v1"),
        ("dqn", "CartPole-v1"),
        ("ppo_lstm", "CartPoleNoVel-v1"),
        ("sac", "Pendulum-v1"),
        ("td3", "Pendulum-v1"),
        ("ddpg", "Pendulum-v1"),
        ("crossq", "Pendulum-v1"),
        ("trpo", "CartPole-v1"),
    ],
)
def test_builtin_space_builds_valid_models(algo: str, env_id: str) -> None:
    base = read_hyperparams(algo, env_id)
    algo_cls = get_algo(algo).cls()
    space = build_space(TuneConfig(algo, env_id), algo_cls, base)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), direction="maximize")
    for _ in range(3):
        trial = study.ask()
        hyperparams = merge_hyperparams(base, space.sample(trial), space.constraints)
        experiment = prepare_experiment(TrainConfig(algo, env_id, n_timesteps=1000, seed=0, hyperparams=hyperparams))
        env = make_env(env_id, experiment.hyperparams, experiment.hyperparams.n_envs, seed=0)
        model = create_model(experiment, env)
        assert model.gamma == pytest.approx(hyperparams["gamma"])
        assert model.learning_rate == hyperparams["learning_rate"] or callable(model.learning_rate)
        if algo in ("ppo", "ppo_lstm", "trpo"):  # the minibatch never exceeds the rollout
            assert model.batch_size <= model.n_steps * env.num_envs
        if algo in ("sac", "td3", "ddpg", "crossq"):  # one gradient step per collected step, as the RL Zoo's samplers
            assert model.gradient_steps == model.train_freq.frequency
            noise = hyperparams.get("noise_type")
            assert (model.action_noise is None) == (noise is None), noise
        env.close()
        study.tell(trial, 0.0)


class _RecomputePPO(PPO):
    def __init__(self, *args: Any, recompute_advantages: bool = False, **kwargs: Any) -> None:
        self.recompute_advantages = recompute_advantages
        super().__init__(*args, **kwargs)


class _DuelingPolicy(DQNPolicy):
    def __init__(self, *args: Any, dueling: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


class _ReplayDQN(DQN):
    policy_aliases = {"MlpPolicy": _DuelingPolicy}  # noqa: RUF012

    def __init__(self, *args: Any, double_q: bool = False, combined_replay: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


class _GruPolicy(RecurrentActorCriticPolicy):
    def __init__(self, *args: Any, rnn_type: str = "lstm", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


class _GruPPO(RecurrentPPO):
    policy_aliases = {"MlpLstmPolicy": _GruPolicy}  # noqa: RUF012


@pytest.mark.parametrize(
    ("space_fn", "stock", "ours", "policy", "names"),
    [
        (ppo_space, PPO, _RecomputePPO, "MlpPolicy", {"recompute_advantages"}),
        (dqn_space, DQN, _ReplayDQN, "MlpPolicy", {"double_q", "combined_replay", "policy_kwargs.dueling"}),
        (ppo_lstm_space, RecurrentPPO, _GruPPO, "MlpLstmPolicy", {"policy_kwargs.rnn_type"}),
    ],
)
def test_options_only_where_the_class_accepts_them(space_fn: Any, stock: type, ours: type, policy: str, names: set) -> None:
    assert not names & set(space_fn(stock, {"policy": policy}).params)
    assert names <= set(space_fn(ours, {"policy": policy}).params)


def test_gae_part_of_the_ppo_space() -> None:
    params = ppo_space(PPO, {"policy": "MlpPolicy"}).params
    assert {"one_minus_gamma", "one_minus_gae_lambda", "normalize_advantage"} <= set(params)
    assert params["one_minus_gamma"].log


def test_naming_conventions() -> None:
    values = {
        "one_minus_gamma": 0.01,
        "learning_rate": 0.001,
        "learning_rate_schedule": "linear",
        "clip_range": 0.2,
        "clip_range_schedule": "constant",
        "policy_kwargs.net_arch": "64x32",
        "policy_kwargs.activation_fn": "ReLU",
    }
    assert to_hyperparams(values) == {
        "gamma": pytest.approx(0.99),
        "learning_rate": "lin_0.001",
        "clip_range": 0.2,
        "policy_kwargs": {"net_arch": [64, 32], "activation_fn": "ReLU"},
    }


def test_merge_keeps_fixed_nested_values() -> None:
    base = {"n_envs": 2, "n_steps": 8, "policy_kwargs": "dict(ortho_init=False, net_arch=[16])"}
    merged = merge_hyperparams(base, {"batch_size": 64, "policy_kwargs": {"net_arch": [32]}}, ppo_space(PPO, {}).constraints)
    assert merged["policy_kwargs"] == {"ortho_init": False, "net_arch": [32]}
    assert merged["batch_size"] == 16  # limited to n_steps * n_envs


def _write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "space.yml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_space_file_extends_the_builtin_space(tmp_path: Path) -> None:
    builtin = ppo_space(PPO, {"policy": "MlpPolicy"})
    text = """
params:
  learning_rate: {low: 1e-4, high: 1.0e-3, log: true}
  n_epochs: [3, 7]
  vf_coef: null
  ent_coef: 0.0
  target_kl: {low: 0.01, high: 0.1}
  policy_kwargs.net_arch: {value: "32x32"}
"""
    space = apply_space_file(builtin, _write(tmp_path, text))
    assert (space.params["learning_rate"].low, space.params["learning_rate"].high) == (1e-4, 1e-3)
    assert space.params["n_epochs"].choices == (3, 7)
    assert "vf_coef" not in space.params
    assert space.fixed == {"ent_coef": 0.0, "policy_kwargs.net_arch": "32x32"}
    assert "target_kl" in space.params and "clip_range" in space.params
    assert space.constraints == builtin.constraints
    check_space_names(space, PPO, {"policy": "MlpPolicy"}, "ppo")


def test_space_file_replaces_and_round_trips(tmp_path: Path) -> None:
    builtin = ppo_space(PPO, {"policy": "MlpPolicy"})
    space = apply_space_file(
        builtin, _write(tmp_path, {"replace": True, "params": {"n_steps": {"low": 8, "high": 64, "log": True}}})
    )
    assert list(space.params) == ["n_steps"] and space.params["n_steps"].integer
    again = apply_space_file(SearchSpace(), _write(tmp_path, builtin.to_yaml()))
    assert again.params == builtin.params and again.fixed == builtin.fixed


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"params": {"n_steps": []}}, "empty list"),
        ({"params": {"learning_rate": {"low": 1.0, "high": 0.1}}}, "low < high"),
        ({"params": {"learning_rate": {"low": 0.0, "high": 0.1, "log": True}}}, "must be > 0"),
        ({"params": {"learning_rate": {"min": 0.0}}}, "low and high"),
        ({"params": {"net_arch": [[64, 64]]}}, "scalars"),
        ({"parameters": {}}, "expected the keys"),
        ({"replace": "yes", "params": {}}, "true or false"),
    ],
)
def test_bad_space_files(tmp_path: Path, data: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        apply_space_file(ppo_space(PPO, {}), _write(tmp_path, data))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"learning_rat": [0.1]}, "no hyperparameter 'learning_rat'"),
        ({"policy_kwargs.lstm_hidden_size": [8]}, "no keyword 'lstm_hidden_size'"),
        ({"clip_range_schedule": ["linear"]}, "needs clip_range"),
    ],
)
def test_unknown_names_fail_before_any_trial(tmp_path: Path, params: dict, message: str) -> None:
    space = apply_space_file(SearchSpace(), _write(tmp_path, {"replace": True, "params": params}))
    with pytest.raises(UserError, match=message):
        check_space_names(space, PPO, {"policy": "MlpPolicy"}, "ppo")


@pytest.mark.parametrize(("algo", "env_id"), [("ppo", "CartPole-v1"), ("ppo_lstm", "CartPoleNoVel-v1")])
def test_builtin_on_policy_spaces_offer_only_rollouts_that_fit_between_evaluations(algo: str, env_id: str) -> None:
    base = read_hyperparams(algo, env_id)
    algo_cls = get_algo(algo).cls()
    full = build_space(TuneConfig(algo, env_id), algo_cls, base).params["n_steps"].choices
    limit = 1000
    fitted = build_space(TuneConfig(algo, env_id), algo_cls, base, limit).params["n_steps"].choices
    assert fitted and set(fitted) == {n for n in full if n * base["n_envs"] <= limit} and set(fitted) < set(full)
