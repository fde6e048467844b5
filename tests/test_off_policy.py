"""SAC, TD3, DDPG: the hand-derived gradients equal stock's autograd ones, the flat polyak update, bad input, fallback."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import stable_baselines3
import torch as th
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.distributions import SquashedDiagGaussianDistribution
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.noise import NormalActionNoise
from stable_baselines3.common.utils import polyak_update

from sb3_speedups import DDPG, SAC, TD3
from sb3_speedups.common.nn.optim import FlatAdam
from sb3_speedups.common.off_policy import training as off_policy_training
from sb3_speedups.common.off_policy.critics import foreach_polyak_, polyak_
from sb3_speedups.sac.squashed_gaussian import sample_squashed, squashed_backward

SMALL = dict(learning_starts=10_000, batch_size=64, buffer_size=1_000, seed=5)


def filled(cls: type, n_envs: int = 1, **kwargs: Any) -> Any:
    """:return: a model whose replay buffer holds 200 random transitions (no update yet)"""
    model = cls("MlpPolicy", make_vec_env("Pendulum-v1", n_envs=n_envs, seed=5), **{**SMALL, **kwargs})
    model.learn(200)
    return model


def record_optimizer_grads(optimizer: th.optim.Optimizer, log: list[th.Tensor]) -> None:
    """Record the flat gradient of ``optimizer``'s parameters whenever it steps (stock's own update)."""
    step = optimizer.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        log.append(th.cat([p.grad.reshape(-1) for group in optimizer.param_groups for p in group["params"]]))
        return step(*args, **kwargs)

    optimizer.step = recording_step  # type: ignore[method-assign]


def record_flat_grads(adam: FlatAdam, log: list[th.Tensor]) -> None:
    """Record the gradient a :class:`FlatAdam` steps with, in the optimizer's parameter order."""
    step = adam.step

    def recording_step(*args: Any, **kwargs: Any) -> None:
        log.append(th.cat([adam.flat.grad_of(p).reshape(-1) for p in adam.flat.params]))
        step(*args, **kwargs)

    adam.step = recording_step  # type: ignore[method-assign]


def assert_close_grads(ours: list[th.Tensor], stock: list[th.Tensor], name: str) -> None:
    assert len(ours) == len(stock) > 0, name
    for i, (a, b) in enumerate(zip(ours, stock, strict=True)):
        # float32 sums in another order: relative to the gradient's scale
        th.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()), msg=f"{name} step {i}")


CASES = [
    pytest.param(SAC, stable_baselines3.SAC, {}, id="sac-auto"),
    pytest.param(SAC, stable_baselines3.SAC, {"ent_coef": 0.2, "policy_kwargs": dict(net_arch=[32, 16])}, id="sac-fixed"),
    pytest.param(SAC, stable_baselines3.SAC, {"policy_kwargs": dict(n_critics=3, net_arch=[16])}, id="sac-3-critics"),
    pytest.param(TD3, stable_baselines3.TD3, {"policy_delay": 1, "target_policy_noise": 0.3}, id="td3"),
    pytest.param(TD3, stable_baselines3.TD3, {"policy_kwargs": dict(activation_fn=th.nn.Tanh)}, id="td3-tanh"),
    pytest.param(DDPG, stable_baselines3.DDPG, {}, id="ddpg"),
    pytest.param(TD3, stable_baselines3.TD3, {"n_steps": 3, "policy_kwargs": dict(net_arch=[16])}, id="td3-3step"),
    pytest.param(
        SAC,
        stable_baselines3.SAC,
        {"optimize_memory_usage": True, "replay_buffer_kwargs": dict(handle_timeout_termination=False)},
        id="sac-optimize-memory",
    ),
]


@pytest.mark.parametrize(("ours_cls", "stock_cls", "kwargs"), CASES)
def test_hand_derived_gradients_equal_stock_autograd(ours_cls: type, stock_cls: type, kwargs: dict) -> None:
    """Every gradient that stock's optimizers step with (critics, actor, entropy coefficient), step after step."""
    ours, stock = filled(ours_cls, **kwargs), filled(stock_cls, **kwargs)
    speed = ours._ensure_speedups()
    updater = speed.updater
    assert updater is not None
    names = {"actor": (updater.actor.adam, stock.actor.optimizer), "critic": (updater.critics.adam, stock.critic.optimizer)}
    ent = getattr(updater, "ent", None)
    if ent is not None and ent.adam is not None:
        names["ent_coef"] = (ent.adam, stock.ent_coef_optimizer)
    logs: dict[str, tuple[list[th.Tensor], list[th.Tensor]]] = {}
    for name, (adam, optimizer) in names.items():
        logs[name] = ([], [])
        record_flat_grads(adam, logs[name][0])
        record_optimizer_grads(optimizer, logs[name][1])
    for model in (ours, stock):
        np.random.seed(1)
        th.manual_seed(1)
        model.train(gradient_steps=3, batch_size=64)
    for name, (ours_log, stock_log) in logs.items():
        assert_close_grads(ours_log, stock_log, name)
    for key, value in stock.policy.state_dict().items():  # the targets too
        th.testing.assert_close(ours.policy.state_dict()[key], value, rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("tau", [0.005, 0.3, 1.0])
def test_flat_polyak_is_stocks_bit_for_bit(tau: float) -> None:
    gen = th.Generator().manual_seed(0)
    shapes = [(37, 5), (37,), (300, 37), (300,), (1, 300), (1,)]
    source = [th.randn(s, generator=gen) for s in shapes]
    target = [th.randn(s, generator=gen) for s in shapes]
    flat_source, flat_target = th.cat([t.reshape(-1) for t in source]), th.cat([t.reshape(-1) for t in target])
    foreach_target = [t.clone() for t in target]
    polyak_update(source, target, tau)
    polyak_(flat_target, flat_source, tau)
    foreach_polyak_(foreach_target, source, tau)
    assert th.equal(flat_target, th.cat([t.reshape(-1) for t in target]))
    assert all(th.equal(a, b) for a, b in zip(foreach_target, target, strict=True))


@pytest.mark.parametrize("cls", [SAC, TD3, DDPG])
def test_negative_tau_is_one_clear_value_error(cls: type) -> None:
    with pytest.raises(ValueError, match=r"tau=-0.1 is invalid") as info:
        cls("MlpPolicy", "Pendulum-v1", tau=-0.1)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("ent_coef", ["auto_x", "high", "0.1x"])
def test_unknown_ent_coef_is_one_clear_value_error(ent_coef: str) -> None:
    with pytest.raises(ValueError, match=r"ent_coef=.* is invalid: use 'auto'") as info:
        SAC("MlpPolicy", "Pendulum-v1", ent_coef=ent_coef)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError):  # stock raises the same type
        stable_baselines3.SAC("MlpPolicy", "Pendulum-v1", ent_coef=ent_coef)


@pytest.mark.parametrize(
    ("ours_cls", "stock_cls", "kwargs"),
    [
        pytest.param(SAC, stable_baselines3.SAC, {}, id="sac"),
        pytest.param(TD3, stable_baselines3.TD3, {"action_noise": "normal"}, id="td3-noise"),
        pytest.param(DDPG, stable_baselines3.DDPG, {}, id="ddpg"),
    ],
)
def test_frozen_actor_acts_as_stock_bit_for_bit(ours_cls: type, stock_cls: type, kwargs: dict) -> None:
    """After ``learning_starts``, actions (and the RNG draws of SAC's sampling) are stock's, with 2 envs."""
    buffers = []
    for cls in (ours_cls, stock_cls):
        noise = {"action_noise": NormalActionNoise(np.zeros(1), np.full(1, 0.2))} if kwargs else {}
        model = cls(
            "MlpPolicy", make_vec_env("Pendulum-v1", n_envs=2, seed=5), learning_starts=40, train_freq=500, seed=5, **noise
        )
        model.learn(160)
        buffers.append(model.replay_buffer)
        if cls is ours_cls:
            assert model._speedups.actor is not None
    ours, stock = buffers
    np.testing.assert_array_equal(ours.actions[:80], stock.actions[:80])
    np.testing.assert_array_equal(ours.observations[:80], stock.observations[:80])
    assert np.abs(stock.actions[20:80]).max() > 0


class _FrozenActorIsCurrent(BaseCallback):
    """Checks at every collected step that the frozen actor holds the actor's current parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.checked = 0

    def _on_step(self) -> bool:
        speed = self.model._speedups
        if speed is not None and speed.actor is not None:
            params = list(self.model.actor.parameters())
            for copy_, param in zip(speed.actor.mirror.copies, params, strict=True):
                assert th.equal(copy_, param.detach()), "the frozen actor acts with stale parameters"
            self.checked += 1
        return True


@pytest.mark.parametrize("cls", [SAC, TD3])
def test_frozen_actor_acts_with_the_parameters_of_the_last_train(cls: type) -> None:
    model = cls("MlpPolicy", "Pendulum-v1", learning_starts=10, policy_kwargs=dict(net_arch=[16]), seed=0)
    check = _FrozenActorIsCurrent()
    model.learn(40, callback=check)
    assert model._n_updates > 20 and check.checked >= 30
    # parameters set between learn() calls are acted with too
    params = {k: th.zeros_like(v) for k, v in model.get_parameters()["policy"].items()}
    model.set_parameters({"policy": params}, exact_match=False)
    model.learn(5, callback=check, reset_num_timesteps=False)


@pytest.mark.parametrize(("ours_cls", "stock_cls"), [(SAC, stable_baselines3.SAC), (TD3, stable_baselines3.TD3)])
def test_minibatches_sampled_in_several_chunks_are_stocks(ours_cls: type, stock_cls: type, monkeypatch) -> None:
    """A ``train()`` call whose minibatches are sampled a few at a time makes the same steps (draws in stock's order)."""
    monkeypatch.setattr(off_policy_training, "AHEAD_BYTES", 1)  # one minibatch per chunk
    kwargs = {"target_update_interval": 2} if ours_cls is SAC else {"policy_delay": 2}
    test_hand_derived_gradients_equal_stock_autograd(ours_cls, stock_cls, kwargs)


def test_squashed_gaussian_backward_equals_autograd_with_clamped_log_std() -> None:
    """SAC's head: actions, log-probabilities as stock's distribution computes them, and the gradient of
    ``sum(c * a) + w * sum(log pi)`` by hand and by autograd, with log stds inside and outside ``[-20, 2]``."""
    gen = th.Generator().manual_seed(0)
    n, k = 64, 3
    out = th.randn(n, 2 * k, generator=gen, dtype=th.float64)
    out[:8, k:] = 3.0  # clamped above
    out[8:16, k:] = -25.0  # clamped below
    noise = th.randn(n, k, generator=gen, dtype=th.float64)
    c = th.randn(n, k, generator=gen, dtype=th.float64)
    w = th.tensor([0.3], dtype=th.float64)
    sample = sample_squashed(out, noise)
    leaf = out.clone().requires_grad_(True)
    dist = SquashedDiagGaussianDistribution(k).proba_distribution(leaf[:, :k], th.clamp(leaf[:, k:], -20, 2))
    gaussian = dist.distribution.loc + noise * dist.distribution.scale  # Normal.rsample with this noise
    actions = th.tanh(gaussian)
    log_prob = dist.log_prob(actions, gaussian)
    th.testing.assert_close(sample.actions, actions.detach(), rtol=0, atol=0)
    th.testing.assert_close(sample.log_prob.view(-1), log_prob.detach(), rtol=1e-12, atol=1e-12)
    rows = n - 4  # the first rows only, as the actor loss back-propagates the observations' half
    ((c[:rows] * actions[:rows]).sum() + w * log_prob[:rows].sum()).backward()
    d_out = squashed_backward(sample, rows, c[:rows].clone(), w)
    expected = leaf.grad[:rows]
    # With std = e^-20, autograd's mean gradient adds and subtracts the Gaussian term's +-noise/std (~1e9), which
    # cancel exactly in maths (ours leaves them out) but cost autograd the digits below 1e9's rounding step.
    th.testing.assert_close(d_out[8:16, :k], expected[8:16, :k], rtol=0, atol=1e-6)
    expected[8:16, :k] = d_out[8:16, :k]
    th.testing.assert_close(d_out, expected, rtol=1e-9, atol=1e-9)
    assert th.all(d_out[8:16, k:] == 0) and th.all(d_out[:8, k:] == 0)


def test_bundled_fast_sac_config_builds_ours_with_small_nets() -> None:
    """hyperparams/sac_fast.yml: every section builds our SAC with its 64x64 networks and trains."""
    from pathlib import Path

    from sb3_speedups.zoo.envs import make_env
    from sb3_speedups.zoo.hyperparams import load_yaml_file
    from sb3_speedups.zoo.train import TrainConfig, create_model, prepare_experiment

    conf = Path(__file__).resolve().parents[1] / "hyperparams" / "sac_fast.yml"
    env_ids = list(load_yaml_file(conf))
    assert {"Pendulum-v1", "InvertedPendulum-v5"} <= set(env_ids)
    for env_id in env_ids:
        overrides = {"learning_starts": 50}
        config = TrainConfig("sac", env_id, n_timesteps=100, seed=0, conf_file=str(conf), hyperparams=overrides)
        experiment = prepare_experiment(config)
        model = create_model(experiment, make_env(env_id, experiment.hyperparams, 1, seed=0))
        assert isinstance(model, SAC) and model.batch_size == 128
        assert [m.out_features for m in model.actor.latent_pi if isinstance(m, th.nn.Linear)] == [64, 64]
        model.learn(100)
        assert model._n_updates > 0


@pytest.mark.parametrize("n", [1, 3])
def test_logged_mean_equals_stock_np_mean(n: int) -> None:
    """The logged mean of a train() call's per-step losses is stock's ``np.mean`` of their ``.item()`` floats, exactly."""
    values = [th.tensor(v, dtype=th.float32) for v in np.random.default_rng(0).normal(size=n) * 1e3]
    assert off_policy_training.mean_of(values) == np.mean([v.item() for v in values])
