"""ARS: the update is stock's, the batched evaluation gives each candidate's own returns, fallback, saves, zoo files."""

from __future__ import annotations

from collections.abc import Iterator

import json
import zipfile
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import sb3_contrib
import torch as th
from sb3_contrib.ars.policies import ARSLinearPolicy
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecNormalize

from sb3_speedups import ARS, BatchedSubprocVecEnv, make_vec_env
from sb3_speedups.cli import main
from sb3_speedups.registry import get_algo
from sb3_speedups.zoo.hyperparams import (
    bundled_hyperparams_dir,
    load_yaml_file,
    preprocess_hyperparams,
    read_hyperparams,
    rl_zoo_hyperparams_dir,
)


class FixedStart(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """Every episode starts from the same state (reset with one seed), so an episode depends on the policy only."""

    def __init__(self, env: gym.Env, seed: int = 0) -> None:
        gym.utils.RecordConstructorArgs.__init__(self, seed=seed)
        gym.Wrapper.__init__(self, env)
        self.start_seed = seed

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return self.env.reset(seed=self.start_seed, options=options)


class Unrecorded(gym.Wrapper):
    """A wrapper whose arguments gymnasium does not record: the candidates' envs cannot be made from the spec."""


def fixed_start_env(env_id: str) -> gym.Env:
    return Monitor(FixedStart(gym.make(env_id, max_episode_steps=60)))


def candidate_weights(model: ARS, scale: float, seed: int) -> th.Tensor:
    generator = th.Generator().manual_seed(seed)
    return model.weights + scale * th.randn(model.pop_size, model.n_params, generator=generator)


def evaluate(model: ARS, weights: th.Tensor) -> th.Tensor:
    """:return: the candidates' returns, evaluated outside ``learn()`` (the test closes the candidates' VecEnv)"""
    _, callback = model._setup_learn(10_000, None)
    return model.evaluate_candidates(weights, callback, None)


@pytest.fixture
def opened() -> Iterator[list[ARS]]:
    """Models the test evaluates outside ``learn()``: their candidates' VecEnv is closed after it (no descriptor left)."""
    models: list[ARS] = []
    yield models
    for model in models:
        model._close_speedups()


@pytest.mark.parametrize(
    ("env_id", "policy", "kwargs"),
    [
        ("CartPole-v1", "LinearPolicy", dict(n_eval_episodes=3, envs_per_candidate=2)),
        ("Pendulum-v1", "MlpPolicy", dict(n_eval_episodes=2, policy_kwargs=dict(net_arch=[8]))),
        ("Pendulum-v1", "LinearPolicy", dict(n_eval_episodes=1, alive_bonus_offset=-0.5)),
    ],
)
@pytest.mark.parametrize("candidate_vec_env", ["default", "dummy"])
def test_batched_evaluation_equals_each_candidate_alone(env_id, policy, kwargs, candidate_vec_env, opened) -> None:
    """
    All candidates at once give each candidate the returns stock's evaluate_policy gives it alone (fixed start state).
    CartPole: exactly (an action flips only if a logit pair ties within float32 rounding). Pendulum: numpy's batched
    products round differently from torch's addmm (~1e-7 relative on the actions), which 60 steps of the pendulum's
    dynamics grow to ~1e-5 relative on the returns: rtol 1e-4.
    """
    extra = (
        {}
        if candidate_vec_env == "default"
        else dict(candidate_env=lambda n: DummyVecEnv([lambda: fixed_start_env(env_id)] * n))
    )
    model = ARS(
        policy, DummyVecEnv([lambda: fixed_start_env(env_id)]), n_delta=3, seed=0, zero_policy=False, **kwargs, **extra
    )
    opened.append(model)
    weights = candidate_weights(model, 2.0, seed=2)
    returns = evaluate(model, weights)
    speed = model._speedups
    assert speed.sequential_reason is None
    assert isinstance(speed.env, BatchedSubprocVecEnv if candidate_vec_env == "default" else DummyVecEnv)
    stock = sb3_contrib.ARS(policy, DummyVecEnv([lambda: fixed_start_env(env_id)]), policy_kwargs=kwargs.get("policy_kwargs"))
    stock.policy.load_state_dict(model.policy.state_dict())
    expected, lengths = [], []
    for candidate in weights:
        stock.policy.load_from_vector(candidate)
        rewards, ep_lengths = evaluate_policy(
            stock.policy, stock.env, n_eval_episodes=model.n_eval_episodes, return_episode_rewards=True, warn=False
        )
        expected.append(sum(rewards) + model.alive_bonus_offset * sum(ep_lengths))
        lengths.append(sum(ep_lengths))
    rtol = 0.0 if env_id == "CartPole-v1" else 1e-4
    np.testing.assert_allclose(returns.numpy(), np.array(expected, dtype=np.float32), rtol=rtol)
    assert model.num_timesteps == sum(lengths)  # one counted step per step of a candidate's episodes (1 training env)
    assert len(model.ep_info_buffer) == model.pop_size * model.n_eval_episodes
    assert len(set(lengths)) > 1 or env_id != "CartPole-v1"  # episodes of different lengths ended at different steps


class FakeEvaluation:
    """Candidate returns as a fixed function of the weights (a quadratic bowl), with stock's step counting."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.target = th.linspace(-1.0, 1.0, model.n_params)

    def __call__(self, candidate_weights: th.Tensor, callback: Any, async_eval: Any) -> th.Tensor:
        self.model.num_timesteps += 50 * len(candidate_weights)
        return -((candidate_weights - self.target) ** 2).sum(dim=1)


@pytest.mark.parametrize("kwargs", [dict(n_delta=4, n_top=2), dict(n_delta=3, learning_rate=0.05, delta_std=0.1)])
def test_update_equals_stock_given_the_same_returns(kwargs) -> None:
    """The update is stock's own code on the same draws: given the same candidate returns, the same weights bit for bit."""
    models = []
    for cls in (ARS, sb3_contrib.ARS):
        model = cls("LinearPolicy", "Pendulum-v1", seed=4, **kwargs)
        model.evaluate_candidates = FakeEvaluation(model)  # type: ignore[method-assign]
        models.append(model.learn(2_000))
    ours, stock = models
    assert ours._n_updates == stock._n_updates > 3
    assert th.equal(ours.weights, stock.weights)  # the same ops on the same shapes
    assert th.equal(th.nn.utils.parameters_to_vector(ours.policy.parameters()), stock.weights)


class Counter(BaseCallback):
    def __init__(self) -> None:
        super().__init__()
        self.calls = [0, 0, 0]

    def _on_rollout_start(self) -> None:
        self.calls[0] += 1

    def _on_step(self) -> bool:
        self.calls[1] += 1
        return True

    def _on_rollout_end(self) -> None:
        self.calls[2] += 1


def test_learning_equals_stock_where_episodes_depend_on_the_policy_only() -> None:
    """
    With every episode starting from one state, a candidate's return does not depend on which env runs it: ours
    (batched, 2 training envs) learns what stock learns, with the same timesteps (2 per counted step, as stock) and
    callback calls. CartPole's argmax actions: equal unless a logit pair ties within float32 rounding; then the update
    is stock's code on equal returns (bit for bit).
    """
    results = []
    for cls in (ARS, sb3_contrib.ARS):  # each made then trained in turn (perturbations from torch's global RNG)
        env = DummyVecEnv([lambda: fixed_start_env("CartPole-v1")] * 2)
        counter = Counter()
        model = cls("LinearPolicy", env, n_delta=3, n_top=2, seed=5).learn(4_000, callback=counter)
        results.append((model, counter.calls))
    (ours, ours_calls), (stock, stock_calls) = results
    assert ours._speedups.sequential_reason is None
    assert ours_calls == stock_calls and ours.num_timesteps == stock.num_timesteps
    assert [info["r"] for info in ours.ep_info_buffer] == [info["r"] for info in stock.ep_info_buffer]
    assert th.equal(ours.weights, stock.weights)


class OwnForwardPolicy(ARSLinearPolicy):
    def forward(self, obs: th.Tensor) -> th.Tensor:
        return super().forward(obs)


def test_policies_it_cannot_stack_take_stocks_evaluation() -> None:
    model = ARS(OwnForwardPolicy, "CartPole-v1", n_delta=2, seed=0)
    assert model.fast_path_unsupported_reason() == "OwnForwardPolicy overrides ARSPolicy's forward"
    model.learn(300)
    assert model._speedups is None and model.num_timesteps >= 300


def make_unreplicable_env() -> DummyVecEnv:
    return DummyVecEnv([lambda: Monitor(Unrecorded(gym.make("CartPole-v1")))])


def test_fallback_runs_candidates_in_sequence_as_stock() -> None:
    """
    An env the candidates' envs cannot be made like: candidates run one after the other on the training env, as
    stock's; same seed, same episodes, so the same returns and weights as stock (CartPole's argmax actions: exact
    unless a logit pair ties within float32 rounding; then the update is stock's code on equal returns).
    """
    kwargs = dict(n_delta=3, seed=2)
    # each made then trained in turn: both draw their perturbations from torch's global RNG, seeded when made
    ours = ARS("LinearPolicy", make_unreplicable_env(), **kwargs).learn(3_000)
    stock = sb3_contrib.ARS("LinearPolicy", make_unreplicable_env(), **kwargs).learn(3_000)
    assert "Unrecorded does not record its arguments" in ours._speedups.sequential_reason
    assert ours.num_timesteps == stock.num_timesteps and ours._n_updates == stock._n_updates
    assert [info["r"] for info in ours.ep_info_buffer] == [info["r"] for info in stock.ep_info_buffer]
    assert th.equal(ours.weights, stock.weights)  # stock's update code on equal returns


def test_training_env_in_worker_processes(tmp_path: Path) -> None:
    """The candidates' envs are made from the spec the workers send (their Monitor files stay out of reach)."""
    kwargs = dict(vec_env_cls=SubprocVecEnv, vec_env_kwargs=dict(start_method="fork"), monitor_dir=str(tmp_path))
    env = make_vec_env("CartPole-v1", n_envs=2, **kwargs)
    try:
        model = ARS("LinearPolicy", env, n_delta=2, seed=0).learn(500)
        assert model._speedups.sequential_reason is None and model.num_timesteps >= 500
    finally:
        env.close()


def test_other_vec_env_wrappers_fall_back() -> None:
    from stable_baselines3.common.vec_env import VecFrameStack

    model = ARS("LinearPolicy", VecFrameStack(DummyVecEnv([lambda: gym.make("CartPole-v1")]), 2), n_delta=2, seed=0)
    model.learn(300)
    assert model._speedups.sequential_reason == "the training env is wrapped in VecFrameStack"


def test_observation_statistics_count_what_stock_counts(opened) -> None:
    """VecNormalize's statistics take each candidate's reset observation and every step's, as stock's evaluation."""
    env = VecNormalize(DummyVecEnv([lambda: fixed_start_env("Pendulum-v1")]))
    model = ARS("MlpPolicy", env, n_delta=2, n_eval_episodes=2, seed=0, zero_policy=False)
    opened.append(model)
    before, returns_before = env.obs_rms.count, env.ret_rms.count
    evaluate(model, candidate_weights(model, 0.1, seed=0))
    assert model._speedups.normalization is not None
    # _setup_learn's reset adds 1; each candidate: a reset observation, then one per step
    assert env.obs_rms.count - before == 1 + model.pop_size + model.num_timesteps
    assert env.ret_rms.count - returns_before == model.num_timesteps  # one discounted return per step


def test_saves_load_both_ways(tmp_path: Path) -> None:
    ours = ARS("MlpPolicy", "Pendulum-v1", n_delta=2, seed=0, policy_kwargs=dict(net_arch=[8]), envs_per_candidate=1)
    ours.learn(800)
    ours.save(tmp_path / "ours.zip")
    with zipfile.ZipFile(tmp_path / "ours.zip") as archive:
        saved = set(json.loads(archive.read("data")))
    assert not {"_speedups", "candidate_env", "candidate_vec_env_cls", "candidate_vec_env_kwargs"} & saved
    stock = sb3_contrib.ARS.load(tmp_path / "ours.zip", env=gym.make("Pendulum-v1"))
    assert th.equal(stock.weights, ours.weights)
    obs = np.array([[0.5, -0.5, 0.2]], dtype=np.float32)
    np.testing.assert_array_equal(stock.predict(obs)[0], ours.predict(obs)[0])
    stock.learn(400, reset_num_timesteps=False)
    stock.save(tmp_path / "stock.zip")
    loaded = ARS.load(tmp_path / "stock.zip", env=gym.make("Pendulum-v1"))
    assert th.equal(loaded.weights, stock.weights) and loaded.num_timesteps == stock.num_timesteps
    loaded.learn(400, reset_num_timesteps=False)
    assert loaded._n_updates > stock._n_updates and loaded._speedups.sequential_reason is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(envs_per_candidate=0), ValueError, r"envs_per_candidate must be an integer in \[1, n_eval_episodes=1\]"),
        (dict(envs_per_candidate=3, n_eval_episodes=2), ValueError, "envs_per_candidate must be"),
        (dict(candidate_env=5), TypeError, "candidate_env must be a function"),
        (dict(candidate_env=lambda n: None, candidate_vec_env_cls=DummyVecEnv), ValueError, "not both"),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        ARS("LinearPolicy", "CartPole-v1", **kwargs)


def test_candidate_env_factory_is_checked() -> None:
    model = ARS(
        "LinearPolicy", "CartPole-v1", n_delta=2, candidate_env=lambda n: DummyVecEnv([lambda: gym.make("CartPole-v1")])
    )
    with pytest.raises(ValueError, match=r"candidate_env\(4\) returned 1 envs"):
        model.learn(100)


def test_bundled_file_holds_the_rl_zoo_values() -> None:
    ours = load_yaml_file(bundled_hyperparams_dir() / "ars.yml")
    assert {"CartPole-v1", "Pendulum-v1", "HalfCheetah-v5"} <= set(ours)
    for env_id in ours:
        assert env_id in gym.registry or env_id == "default", env_id
        preprocess_hyperparams(read_hyperparams("ars", env_id))
    zoo_dir = rl_zoo_hyperparams_dir()
    if zoo_dir is not None:
        zoo = load_yaml_file(zoo_dir / "ars.yml")
        for env_id, section in ours.items():
            assert section == zoo[env_id.replace("-v5", "-v4")], env_id


def test_cli_trains_ours_from_the_rl_zoo_file(tmp_path: Path) -> None:
    """The RL Zoo's own ars.yml through --conf-file (Pendulum: VecNormalize, MlpPolicy); the saved model is ours."""
    zoo_dir = rl_zoo_hyperparams_dir()
    conf = [] if zoo_dir is None else ["--conf-file", str(zoo_dir / "ars.yml")]
    run = ["--algo", "ars", "--env", "Pendulum-v1", "-n", "1000", "--seed", "0", "-f", str(tmp_path)]
    quiet = ["--eval-freq", "0", "--eval-episodes", "1", "--no-progress", "--verbose", "0"]
    assert main(["train", *run, *quiet, *conf]) == 0
    assert get_algo("ars").cls() is ARS
    run_dir = tmp_path / "ars" / "Pendulum-v1_1"
    assert (run_dir / "vecnormalize.pkl").is_file()
    # the candidates' episodes go to Monitor files beside the training env's, as stock's go to the training env's
    assert len((run_dir / "ars_candidate_0.monitor.csv").read_text().splitlines()) > 2
    model = ARS.load(run_dir / "Pendulum-v1.zip")
    assert model.num_timesteps >= 1000 and model.n_delta == 4 and model.n_top == 1


def test_tuner_space_builds_valid_models() -> None:
    import optuna

    from sb3_speedups.tune.search_space import merge_hyperparams
    from sb3_speedups.tune.tuner import TuneConfig, build_space

    base = read_hyperparams("ars", "CartPole-v1")
    space = build_space(TuneConfig("ars", "CartPole-v1"), ARS, base)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), direction="maximize")
    for _ in range(5):
        trial = study.ask()
        hyperparams = merge_hyperparams(base, space.sample(trial), space.constraints)
        assert hyperparams["n_top"] <= hyperparams["n_delta"]
        study.tell(trial, 0.0)
