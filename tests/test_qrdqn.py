"""Our QR-DQN: the hand-derived update against autograd, its targets and acting against stock's, the options around it.

Learning as stock learns and saves loading both ways are the ``qrdqn*`` cases of ``tests/algo_cases.py``; the gradient
against autograd is ``tests/test_maths.py::test_quantile_huber_gradient_equals_autograd``.
"""

import numpy as np
import optuna
import pytest
import sb3_contrib
import torch as th
from sb3_contrib.common.utils import quantile_huber_loss
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.type_aliases import ReplayBufferSamples

from sb3_speedups import QRDQN
from sb3_speedups.dqn.replay.buffers import PrioritizedReplayBuffer
from sb3_speedups.dqn.update import AutogradQUpdate, HandDerivedQUpdate
from sb3_speedups.errors import UserError
from sb3_speedups.registry import get_algo
from sb3_speedups.tune.search_space import merge_hyperparams
from sb3_speedups.tune.tuner import TuneConfig, build_space
from sb3_speedups.zoo.envs import make_env
from sb3_speedups.zoo.hyperparams import bundled_hyperparams_dir, load_yaml_file, read_hyperparams, rl_zoo_hyperparams_dir
from sb3_speedups.zoo.train import TrainConfig, create_model, prepare_experiment
from tests.algo_cases import SEEDED_QRDQN


def _max_param_diff(a, b) -> float:
    sa, sb = a.policy.state_dict(), b.policy.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k] - sb[k]).abs().max().item() for k in sa)


def test_fast_update_matches_autograd_update():
    env = make_vec_env("CartPole-v1", n_envs=2, seed=1)
    models = [QRDQN("MlpPolicy", env, fast_update=fast, **SEEDED_QRDQN) for fast in (True, False)]
    models[1].policy.load_state_dict(models[0].policy.state_dict())
    gen = th.Generator().manual_seed(0)
    obs, actions = th.randn(32, 4, generator=gen), th.randint(0, 2, (32, 1), generator=gen)
    target = th.randn(32, 10, generator=gen) * 2.0  # errors on both sides of the Huber kink and of zero
    results = []
    for model in models:
        updater = model._ensure_speedups().updater
        for max_norm in (None, 0.5, None):  # unclipped (stock QR-DQN's default), then clipped
            loss = updater.step(obs, actions, target, None, max_norm)
        results.append(loss)
    assert isinstance(models[0]._speedups.updater, HandDerivedQUpdate)
    assert isinstance(models[1]._speedups.updater, AutogradQUpdate)
    # float32 rounding of the same three Adam steps by two routes (sums in another order): ~1e-7 measured
    assert _max_param_diff(*models) < 1e-6
    th.testing.assert_close(results[0], results[1])


def test_targets_and_greedy_actions_are_stocks():
    """The TD targets (mean-greedy quantiles of the target network) and the acting argmax, against stock's formulas."""
    model = QRDQN("MlpPolicy", "CartPole-v1", gamma=0.9, **SEEDED_QRDQN)
    speed = model._ensure_speedups()
    with th.no_grad():
        for p in model.quantile_net_target.parameters():  # a target network that differs from the online one
            p.add_(th.randn_like(p) * 0.3)
    gen = th.Generator().manual_seed(1)
    next_obs = th.randn(6, 4, generator=gen)
    rewards, dones = th.randn(6, 1, generator=gen), th.tensor([[0.0], [1.0], [0.0], [0.0], [1.0], [0.0]])
    data = ReplayBufferSamples(th.zeros(6, 4), th.zeros(6, 1), next_obs, dones, rewards)
    with th.no_grad():
        target = model._targets(data, model._target_q_values(next_obs), speed.updater)
        quantiles = model.quantile_net_target(next_obs)
        greedy = quantiles.mean(dim=1, keepdim=True).argmax(dim=2, keepdim=True).expand(6, 10, 1)
        expected = rewards + (1 - dones) * 0.9 * quantiles.gather(dim=2, index=greedy).squeeze(dim=2)
        # one forward by the blocked executor against the module's own: float32 rounding
        th.testing.assert_close(target, expected, rtol=1e-6, atol=1e-6)
        assert target.shape == (6, 10)

        model.exploration_rate = 0.0
        model._last_obs = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
        model.num_timesteps = model.learning_starts
        actions, _ = model._sample_action(model.learning_starts, None, 5)
        stock_actions, _ = sb3_contrib.QRDQN.predict(model, model._last_obs, deterministic=True)
        np.testing.assert_array_equal(actions, stock_actions)


def test_logged_loss_is_stocks_mean():
    losses = []
    for cls in (QRDQN, sb3_contrib.QRDQN):
        model = cls("MlpPolicy", make_vec_env("CartPole-v1", n_envs=1, seed=3), **SEEDED_QRDQN)
        model.learn(300)
        losses.append(model.logger.name_to_value["train/loss"])
    # the mean of the same 16 per-step losses, each computed by another formula: float32 rounding of ~6
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_step_loss_is_sb3_contribs():
    """The loss the hand-derived step computes for the log (from its own terms), against ``quantile_huber_loss``."""
    model = QRDQN("MlpPolicy", "CartPole-v1", policy_kwargs=dict(n_quantiles=5), seed=0)
    head = model._ensure_speedups().updater.head
    gen = th.Generator().manual_seed(3)
    out, target = th.randn(8, 5 * 2, generator=gen), th.randn(8, 5, generator=gen) * 2
    actions = th.randint(0, 2, (8, 1), generator=gen)
    _, loss = head.output_grad(out, actions, target, None)
    current = out.view(8, 5, 2).gather(2, actions.view(8, 1, 1).expand(8, 5, 1)).squeeze(2)
    # float32 rounding of two summation orders of 200 terms
    th.testing.assert_close(loss, quantile_huber_loss(current, target, sum_over_quantiles=True), rtol=1e-6, atol=1e-7)
    assert head.logged_loss([loss, 2 * loss], None).item() == pytest.approx(1.5 * loss.item())


def test_cnn_and_custom_optimizers_take_the_autograd_update():
    model = QRDQN("MlpPolicy", "CartPole-v1", policy_kwargs=dict(optimizer_class=th.optim.RMSprop), seed=0)
    assert isinstance(model._ensure_speedups().updater, AutogradQUpdate)
    assert "RMSprop" in (model.fast_path_unsupported_reason() or "")


def test_prioritized_replay_is_refused():
    with pytest.raises(UserError, match="prioritised replay"):
        QRDQN("MlpPolicy", "CartPole-v1", replay_buffer_class=PrioritizedReplayBuffer)


def test_registry_and_package_name_ours():
    import sb3_speedups

    assert get_algo("qrdqn").cls() is QRDQN is sb3_speedups.QRDQN
    assert issubclass(QRDQN, sb3_contrib.QRDQN)


def test_bundled_file_holds_the_rl_zoo_values():
    zoo_dir = rl_zoo_hyperparams_dir()
    if zoo_dir is None:
        pytest.skip("rl_zoo3 is not installed")
    ours, zoo = load_yaml_file(bundled_hyperparams_dir() / "qrdqn.yml"), load_yaml_file(zoo_dir / "qrdqn.yml")
    assert {"default", "atari", "CartPole-v1", "Acrobot-v1", "MountainCar-v0", "LunarLander-v3"} <= set(ours)
    for section, values in ours.items():
        assert values == zoo[section], section


def test_zoo_config_and_builtin_space_build_valid_models():
    base = read_hyperparams("qrdqn", "CartPole-v1")
    space = build_space(TuneConfig("qrdqn", "CartPole-v1"), QRDQN, base)
    assert "policy_kwargs.n_quantiles" in space.params and "replay_buffer_class" not in space.params
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), direction="maximize")
    for hyperparams in (base, merge_hyperparams(base, space.sample(study.ask()), space.constraints)):
        experiment = prepare_experiment(TrainConfig("qrdqn", "CartPole-v1", n_timesteps=200, seed=0, hyperparams=hyperparams))
        model = create_model(experiment, make_env("CartPole-v1", experiment.hyperparams, 1, seed=0))
        assert isinstance(model, QRDQN) and isinstance(model._ensure_speedups().updater, HandDerivedQUpdate)
        model.learn(200)
