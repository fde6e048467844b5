"""What is A2C's own: the hand-derived update against autograd and stock, the fallback, the CLI, YAML and tuner wiring.
(Equivalence with stock over learning and saves both ways: the ``a2c*`` cases of ``tests/algo_cases.py``.)"""

from __future__ import annotations

import optuna
import pytest
import stable_baselines3
import torch as th

from gymnasium.spaces import Discrete
from stable_baselines3.common.sb2_compat.rmsprop_tf_like import RMSpropTFLike

from sb3_speedups import A2C
from sb3_speedups.a2c.kept_cnn import KeptConvActorCritic, kept_conv_update
from sb3_speedups.a2c.update import A2CLossConfig, HandDerivedA2CUpdate, a2c_loss
from sb3_speedups.cli import main
from sb3_speedups.registry import get_algo
from sb3_speedups.tune.search_space import merge_hyperparams
from sb3_speedups.tune.tuner import TuneConfig, build_space
from sb3_speedups.zoo.envs import make_env
from sb3_speedups.zoo.hyperparams import default_hyperparams_file, load_yaml_file, read_hyperparams
from sb3_speedups.zoo.train import TrainConfig, create_model, prepare_experiment
from tests.space_envs import ACTION_SPACES, box_env, image_env

LOSS_CASES = [
    dict(),
    dict(use_rms_prop=False, normalize_advantage=True),
    dict(ent_coef=0.05, vf_coef=0.25, max_grad_norm=100.0),
]


@pytest.mark.parametrize("space", list(ACTION_SPACES))
@pytest.mark.parametrize("kwargs", LOSS_CASES, ids=["rmsprop", "adam-normalized", "entropy-unclipped"])
def test_hand_derived_update_equals_autograd_and_stock(space: str, kwargs: dict) -> None:
    """Several whole updates (collection included): ours by hand, ours through autograd and stock agree."""
    models = [
        cls("MlpPolicy", box_env(space, seed=2), n_steps=8, seed=2, **kwargs, **extra).learn(8 * 4 * 5)
        for cls, extra in ((A2C, {}), (A2C, {"fast_update": False}), (stable_baselines3.A2C, {}))
    ]
    ours, autograd, stock = models
    assert isinstance(ours._speedups.updater, HandDerivedA2CUpdate)
    assert ours._n_updates == stock._n_updates == 5
    for key, value in stock.policy.state_dict().items():
        th.testing.assert_close(ours.policy.state_dict()[key], value, rtol=1e-4, atol=1e-5, msg=key)
        th.testing.assert_close(autograd.policy.state_dict()[key], value, rtol=1e-4, atol=1e-5, msg=key)
    for name in ("train/policy_loss", "train/value_loss", "train/entropy_loss"):
        assert ours.logger.name_to_value[name] == pytest.approx(stock.logger.name_to_value[name], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("space", list(ACTION_SPACES))
@pytest.mark.parametrize("normalize_advantage", [False, True])
def test_hand_derived_gradient_equals_autograd(space: str, normalize_advantage: bool) -> None:
    """The gradient of one update (before the optimizer step) against autograd through SB3's ``evaluate_actions``."""
    model = A2C("MlpPolicy", box_env(space, seed=1), n_steps=8, seed=1, ent_coef=0.03, normalize_advantage=normalize_advantage)
    model.learn(32)  # one rollout and update: the buffer holds a rollout, the updater is built
    updater = model._speedups.updater
    assert isinstance(updater, HandDerivedA2CUpdate)
    updater.optimizer.step = lambda *args: None  # keep the gradient, move nothing
    buffer = model.rollout_buffer
    obs, actions = buffer.flat_observations(), buffer.flat("actions")
    advantages, returns = buffer.flat("advantages"), buffer.flat("returns")
    cfg = A2CLossConfig(0.03, 0.5, 0.5, normalize_advantage)
    stats = updater.update(obs, actions, advantages, returns, cfg).clone()
    ours = updater.flat.grad.clone()
    policy = model.policy
    discrete = space == "discrete"
    values, log_prob, entropy = policy.evaluate_actions(obs, actions.long().flatten() if discrete else actions)
    loss, expected_stats = a2c_loss(log_prob, entropy, values.flatten(), advantages, returns, cfg)
    grads = th.autograd.grad(loss, list(policy.parameters()))
    for p, g in zip(policy.parameters(), grads, strict=True):
        # An element is a sum over the rollout of terms as large as the parameter's largest gradient element (the
        # advantages are ~10 here), so one that cancels to ~1e-3 differs between two summation orders by float32
        # rounding of those terms: log_std's element -1.5640e-3 against autograd's -1.5624e-3 (max |g| 4.2) on an
        # AVX2-only EPYC. The tolerance scales with that largest element (10x the measured difference).
        scale = max(float(g.abs().max()), 1.0)
        th.testing.assert_close(updater.flat.grad_of(p), g, rtol=1e-4, atol=4e-6 * scale)
    th.testing.assert_close(stats, expected_stats, rtol=1e-5, atol=1e-6)
    assert float(ours.abs().sum()) > 0


def test_gsde_and_other_policies_fall_back_to_autograd_with_the_flat_optimizer() -> None:
    model = A2C("MlpPolicy", box_env("box"), n_steps=8, use_sde=True, seed=0).learn(64)
    assert model._speedups.fallback_reason == "gSDE"
    assert model._speedups.updater.step.flat_optimizer is not None  # flat RMSprop under autograd
    stock = stable_baselines3.A2C("MlpPolicy", box_env("box"), n_steps=8, use_sde=True, seed=0).learn(64)
    for key, value in stock.policy.state_dict().items():
        th.testing.assert_close(model.policy.state_dict()[key], value, rtol=1e-4, atol=1e-5, msg=key)
    custom = A2C("MlpPolicy", box_env("discrete"), n_steps=8, policy_kwargs=dict(optimizer_class=th.optim.SGD), seed=0)
    assert "SGD" in custom.fast_path_unsupported_reason()
    custom.learn(64)
    assert custom._speedups.updater.step.flat_optimizer is None  # the stock optimizer calls


@pytest.mark.parametrize("optimizer", ["rmsprop", "rmsprop-tf-like"])
def test_cnn_update_starts_from_acting_activations(optimizer: str) -> None:
    """
    A ``CnnPolicy``'s update back-propagates from the convolutions' outputs that acting kept: its gradient is stock's
    (autograd through ``evaluate_actions`` on the whole rollout), and learning equals stock's with the flat RMSprop and
    with the RL Zoo's Atari optimizer (``RMSpropTFLike``, stock's own calls).
    """
    kwargs: dict = dict(n_steps=8, seed=4, policy_kwargs=dict(net_arch=[16]))
    if optimizer == "rmsprop-tf-like":
        kwargs["policy_kwargs"].update(optimizer_class=RMSpropTFLike, optimizer_kwargs=dict(eps=1e-5))
    ours = A2C("CnnPolicy", image_env(Discrete(3))(), **kwargs).learn(8 * 2 * 4)
    stock = stable_baselines3.A2C("CnnPolicy", image_env(Discrete(3))(), **kwargs).learn(8 * 2 * 4)
    actor = ours._speedups.actor
    assert isinstance(actor, KeptConvActorCritic) and actor.rows == -1, "the last update used the kept activations"
    for key, value in stock.policy.state_dict().items():
        th.testing.assert_close(ours.policy.state_dict()[key], value, rtol=1e-4, atol=1e-5, msg=key)
    # one more rollout, then its gradient against autograd on the same weights and rollout
    ours.train = lambda: None  # type: ignore[method-assign]
    ours.learn(16, reset_num_timesteps=False)
    assert actor.complete()
    policy, buffer = ours.policy, ours.rollout_buffer
    obs, actions = buffer.flat_observations(), buffer.flat("actions")
    advantages, returns = buffer.flat("advantages"), buffer.flat("returns")
    cfg = A2CLossConfig(0.0, 0.5, 0.5, False)
    values, log_prob, entropy = policy.evaluate_actions(obs, actions.long().flatten())
    loss, expected_stats = a2c_loss(log_prob, entropy, values.flatten(), advantages, returns, cfg)
    expected = th.autograd.grad(loss, list(policy.parameters()))
    step = ours._speedups.updater.step
    step.step = lambda *args: None  # keep the gradient, move nothing
    stats = kept_conv_update(actor, step, obs, actions, advantages, returns, cfg)
    for p, g in zip(policy.parameters(), expected, strict=True):
        assert p.grad is not None
        # a convolution's weight gradient sums rows x pixels (here 16 x 64) products, in other orders than autograd's
        # (channels-last, acting's row blocks): float32 rounding relative to the gradient's scale, not to each entry
        th.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-4 * float(g.abs().max()))
    th.testing.assert_close(stats, expected_stats, rtol=1e-5, atol=1e-6)


def test_bundled_hyperparams_and_tuner_space_build_our_a2c() -> None:
    assert get_algo("a2c").cls() is A2C
    data = load_yaml_file(default_hyperparams_file("a2c"))
    for env_id in ("CartPole-v1", "LunarLander-v3", "Acrobot-v1", "Pendulum-v1"):
        assert env_id in data
    base = read_hyperparams("a2c", "CartPole-v1")
    space = build_space(TuneConfig("a2c", "CartPole-v1"), A2C, base)
    assert {"use_rms_prop", "normalize_advantage", "one_minus_gae_lambda", "n_steps"} <= set(space.params)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), direction="maximize")
    for _ in range(3):
        hyperparams = merge_hyperparams(base, space.sample(study.ask()), space.constraints)
        experiment = prepare_experiment(TrainConfig("a2c", "CartPole-v1", n_timesteps=1000, seed=0, hyperparams=hyperparams))
        env = make_env("CartPole-v1", experiment.hyperparams, experiment.hyperparams.n_envs, seed=0)
        model = create_model(experiment, env)
        assert isinstance(model, A2C) and model.gamma == pytest.approx(hyperparams["gamma"])
        env.close()


def test_cli_trains_a2c_with_the_bundled_config(tmp_path) -> None:
    argv = ["train", "--algo", "a2c", "--env", "CartPole-v1", "-n", "2000", "-f", str(tmp_path), "--no-progress"]
    assert main([*argv, "--seed", "0"]) == 0
    saved = [path for path in tmp_path.rglob("*.zip") if "best" not in path.name]
    assert saved
    stock = stable_baselines3.A2C.load(saved[0])  # our file loads in stock
    assert stock.num_timesteps >= 2000 and stock.n_envs == 8
