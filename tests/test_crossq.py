"""CrossQ: the steps equal sb3-contrib's, the batch-renormalisation layers as functions, the fallback, the Zoo files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import sb3_contrib
import torch as th
from sb3_contrib.common.torch_layers import BatchRenorm1d
from stable_baselines3.common.env_util import make_vec_env

import sb3_speedups
from sb3_speedups.cli import main
from sb3_speedups.crossq import CrossQ
from sb3_speedups.crossq.batch_renorm import RenormCounts, batch_renorm
from sb3_speedups.crossq.update import CrossQUpdate, StockCrossQUpdate
from sb3_speedups.registry import get_algo
from sb3_speedups.zoo.hyperparams import load_yaml_file, rl_zoo_hyperparams_dir
from tests.space_envs import BatchNormExtractor
from tests.test_off_policy import assert_close_grads, record_flat_grads, record_optimizer_grads

SMALL: dict[str, Any] = dict(learning_starts=10_000, batch_size=64, buffer_size=1_000, seed=5)


def filled(cls: type, **kwargs: Any) -> Any:
    """:return: a CrossQ whose replay buffer holds 200 random transitions (no update yet)"""
    model = cls("MlpPolicy", make_vec_env("Pendulum-v1", n_envs=1, seed=5), **{**SMALL, **kwargs})
    model.learn(200)
    return model


def trained(model: Any, steps: int) -> dict[str, float]:
    """Train ``steps`` gradient steps from the same global RNG state; :return: the logged ``train/`` values"""
    np.random.seed(1)
    th.manual_seed(1)
    model.train(gradient_steps=steps, batch_size=64)
    return {k: float(v) for k, v in model.logger.name_to_value.items() if k.startswith("train/")}


def assert_close_states(ours: Any, stock: Any, steps: int) -> None:
    """
    The policies' state dicts after a few steps: the running statistics and step counts, and all but a few entries.

    Adam (``betas=(0.5, 0.999)``) moves an entry by about the learning rate whatever its gradient's size, so where a
    gradient is near 0 its float32 rounding picks the step's sign (the Linear biases before batch-renormalised ReLUs
    active on the whole batch): 1 to 40 entries of 3k to 15k then differ by up to 2e-3 per step (seen on a 2-core AMD
    EPYC), all others within 1e-6. A wrong term moves most entries.
    """
    ours_state, stock_state = ours.policy.state_dict(), stock.policy.state_dict()
    for key, value in stock_state.items():
        if key.endswith("steps"):
            assert th.equal(ours_state[key], value), key
    got = th.cat([ours_state[k].reshape(-1).double() for k in stock_state])
    expected = th.cat([v.reshape(-1).double() for v in stock_state.values()])
    parted = int(((got - expected).abs() > 1e-6).sum())
    assert parted <= 0.02 * expected.numel(), f"{parted} of {expected.numel()} entries differ beyond 1e-6"
    th.testing.assert_close(got, expected, rtol=0, atol=2e-3 * steps)


def assert_later_grads_close(ours: list[th.Tensor], stock: list[th.Tensor], name: str) -> None:
    """
    The gradients after the critics' first step, on parameters that may already differ by Adam's rounding-driven steps
    (see :func:`assert_close_states`): a Linear bias before a batch-renormalised ReLU that is active on the whole batch
    has a gradient of 0 up to rounding, its Adam step a sign picked by rounding, and the next batch, where the unit is
    off on some rows, sees that. Seen: up to 2e-4 of the gradient's largest entry (a 2-core AMD EPYC); a wrong term
    is off by the order of the gradient itself.
    """
    assert len(ours) == len(stock), name
    for i, (a, b) in enumerate(zip(ours, stock, strict=True)):
        th.testing.assert_close(a, b, rtol=0, atol=2e-3 * float(b.abs().max()), msg=f"{name} gradient {i}")


def past_warmup(model: Any) -> Any:
    """Set every batch-renormalisation layer's step count past its warm-up: the next steps renormalise."""
    for module in model.policy.modules():
        if isinstance(module, BatchRenorm1d):
            module.steps.fill_(module.warmup_steps + 1)
    return model


CASES = [
    pytest.param({"policy_delay": 3, "policy_kwargs": dict(net_arch=[64, 64])}, 6, False, id="warmup-delay3"),
    pytest.param(
        {"ent_coef": 0.2, "policy_delay": 1, "policy_kwargs": dict(net_arch=[32, 16], n_critics=3)},
        1,
        True,
        id="renorm-3-critics",
    ),
    pytest.param(
        {"n_steps": 3, "policy_delay": 1, "policy_kwargs": dict(net_arch=dict(pi=[16], qf=[48, 48]))},
        1,
        True,
        id="renorm-3step",
    ),
    # one critic (the stacked norms of one layer view its own buffers); no BatchRenorm layers at all
    pytest.param({"policy_delay": 1, "policy_kwargs": dict(net_arch=[32, 32], n_critics=1)}, 1, True, id="renorm-1-critic"),
    pytest.param({"policy_kwargs": dict(net_arch=[32, 16], batch_norm=False)}, 4, False, id="no-batch-norm"),
]


@pytest.mark.parametrize(("kwargs", "steps", "renorm"), CASES)
def test_updates_equal_stock(kwargs: dict, steps: int, renorm: bool) -> None:
    """
    Every gradient the optimizers step with, step after step, the logged losses, the running statistics and the
    parameters after the steps: in the warm-up (batch statistics), and after it (renormalised by the running ones).

    After warm-up, one step (the critics' and the actor's): an entry that Adam moved by float32 rounding (see
    :func:`assert_close_states`) changes the next steps' batch corrections ``r`` and ``d`` by more than rounding (seen:
    12% of the critics' gradient entries beyond 1e-4 relative at the second step).
    """
    ours, stock = filled(CrossQ, **kwargs), filled(sb3_contrib.CrossQ, **kwargs)
    if renorm:
        past_warmup(ours), past_warmup(stock)
    updater = ours._ensure_speedups().updater
    assert isinstance(updater, CrossQUpdate)
    logs: dict[str, tuple[list[th.Tensor], list[th.Tensor]]] = {}
    for name, adam, optimizer in (
        ("actor", updater.actor_net.adam if updater.actor_net is not None else None, stock.actor.optimizer),
        ("critic", updater.critics.adam if updater.critics is not None else None, stock.critic.optimizer),
    ):
        assert adam is not None
        logs[name] = ([], [])
        record_flat_grads(adam, logs[name][0])
        record_optimizer_grads(optimizer, logs[name][1])
    logged = [trained(ours, steps), trained(stock, steps)]
    assert len(logs["actor"][1]) == steps // stock.policy_delay > 0
    critic_grads, stock_critic_grads = logs["critic"]
    assert_close_grads(critic_grads[:1], stock_critic_grads[:1], "critic")  # rtol 1e-4: float32 sums in another order
    assert_later_grads_close(critic_grads[1:], stock_critic_grads[1:], "critic")
    # the actor's gradients run through the critics after their Adam step (each gradient step steps the critics first)
    assert_later_grads_close(*logs["actor"], "actor")
    assert logged[0].keys() == logged[1].keys()
    for key, value in logged[1].items():
        # float32 sums in another order (the batch variance as a centred sum of squares); the actor's loss comes after
        # the critics' Adam step, whose rounding-driven entries (assert_close_states) shift the values by ~1e-3
        rtol = 1e-2 if key == "train/actor_loss" else 1e-4
        np.testing.assert_allclose(logged[0][key], value, rtol=rtol, atol=1e-6, err_msg=key)
    assert_close_states(ours, stock, steps)
    # the layers are left as stock's steps leave them: running statistics, not batch ones
    assert [m.training for m in ours.policy.modules()] == [m.training for m in stock.policy.modules()]


@pytest.mark.parametrize("steps", [0, 4])
@pytest.mark.parametrize("training", [True, False])
def test_batch_renorm_function_equals_the_module(steps: int, training: bool) -> None:
    """The layer as a function: output, input and parameter gradients, running statistics, before and after warm-up."""
    th.manual_seed(0)
    layers = [BatchRenorm1d(7, warmup_steps=2) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    for layer in layers:
        with th.no_grad():
            layer.steps.fill_(steps)
            layer.ra_mean.normal_(generator=th.Generator().manual_seed(1))
            layer.ra_var.uniform_(0.5, 2.0, generator=th.Generator().manual_seed(2))
            layer.scale.uniform_(0.5, 1.5, generator=th.Generator().manual_seed(3))
        layer.train(training)
    x = (th.randn(40, 7) * 3 + 1).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    weights = th.randn(40, 7)
    expected = layers[0](x)
    got = batch_renorm(layers[1], x2, training, RenormCounts(layers[1]))
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    # float32 rounding of the batch variance summed in another order
    th.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    th.testing.assert_close(x2.grad, x.grad, rtol=1e-4, atol=1e-5)
    for name in ("scale", "bias"):
        th.testing.assert_close(getattr(layers[1], name).grad, getattr(layers[0], name).grad, rtol=1e-4, atol=1e-5)
    for name, value in layers[0].state_dict().items():
        th.testing.assert_close(layers[1].state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_fallbacks_run_stocks_train() -> None:
    """gSDE, other features extractors and ``fast_update=False`` take stock's ``train()``: the same steps bit for bit
    (the same operations on the same tensors)."""
    for kwargs in (
        {"use_sde": True},
        {"policy_kwargs": dict(net_arch=[16], features_extractor_class=BatchNormExtractor)},
        {"fast_update": False},
    ):
        stock_kwargs = {k: v for k, v in kwargs.items() if k != "fast_update"}
        ours, stock = filled(CrossQ, **kwargs), filled(sb3_contrib.CrossQ, **stock_kwargs)
        assert isinstance(ours._ensure_speedups().updater, StockCrossQUpdate)
        assert ours.fast_path_unsupported_reason() is not None
        assert trained(ours, 3) == trained(stock, 3)
        for key, value in stock.policy.state_dict().items():
            assert th.equal(ours.policy.state_dict()[key], value), (kwargs, key)


def test_bad_ent_coef_is_one_line_value_error() -> None:
    with pytest.raises(ValueError, match="ent_coef='abc' is invalid"):
        CrossQ("MlpPolicy", "Pendulum-v1", ent_coef="abc")


def test_registry_and_bundled_hyperparameters() -> None:
    """``--algo crossq`` is ours; hyperparams/crossq.yml holds the Zoo's sections (MuJoCo -v5 with the -v4 values)."""
    assert get_algo("crossq").cls() is CrossQ and sb3_speedups.CrossQ is CrossQ
    ours = load_yaml_file(Path(__file__).resolve().parents[1] / "hyperparams" / "crossq.yml")
    assert {"Pendulum-v1", "LunarLanderContinuous-v3", "HalfCheetah-v4", "HalfCheetah-v5"} <= set(ours)
    zoo_dir = rl_zoo_hyperparams_dir()
    if zoo_dir is None:
        pytest.skip("rl_zoo3 is not installed")
    zoo = load_yaml_file(zoo_dir / "crossq.yml")
    for env_id, section in ours.items():
        assert section == zoo[env_id.replace("-v5", "-v4")], env_id


@pytest.mark.parametrize("conf", ["bundled", "zoo"])
def test_cli_trains_from_the_zoo_file(tmp_path: Path, conf: str) -> None:
    """The RL Zoo's own crossq.yml (or ours) runs unmodified through ``--conf-file``; the saved model is ours."""
    conf_args: list[str] = []
    if conf == "zoo":
        zoo_dir = rl_zoo_hyperparams_dir()
        if zoo_dir is None:
            pytest.skip("rl_zoo3 is not installed")
        conf_args = ["--conf-file", str(zoo_dir / "crossq.yml")]
    run = ["--algo", "crossq", "--env", "Pendulum-v1", "-n", "200", "--seed", "0", "-f", str(tmp_path)]
    quiet = ["--eval-freq", "0", "--eval-episodes", "1", "--no-progress", "--verbose", "0"]
    small = ["-params", "learning_starts:100", "batch_size:32", "policy_kwargs:dict(net_arch=[16])"]
    assert main(["train", *run, *quiet, *conf_args, *small]) == 0
    model = CrossQ.load(tmp_path / "crossq" / "Pendulum-v1_1" / "Pendulum-v1.zip")
    assert model.policy_delay == 2 and model._n_updates == 100
    assert sb3_contrib.CrossQ.load(tmp_path / "crossq" / "Pendulum-v1_1" / "Pendulum-v1.zip").num_timesteps == 200


def test_frozen_actor_acts_as_stocks_predict() -> None:
    """
    Collection acts from a frozen copy of the actor whose batch-renormalisation layers run their evaluation forward
    on copies of the running statistics: after training has moved those statistics, its actions for a seed are
    stock's ``actor`` forward in evaluation mode, bit for bit (the same operations on the same shapes).
    """
    model = CrossQ("MlpPolicy", make_vec_env("Pendulum-v1", n_envs=2, seed=5), learning_starts=50, train_freq=25, seed=5)
    model.learn(300)
    frozen = model._speedups.actor
    assert frozen is not None
    renorm = [m for m in model.actor.modules() if isinstance(m, BatchRenorm1d)]
    assert len(renorm) == 3 and all(bool((m.ra_var != 1).all()) for m in renorm)
    frozen.sync()
    obs = (2 * np.random.default_rng(0).normal(size=(7, 3))).astype(np.float32)
    th.manual_seed(3)
    ours = frozen(frozen.inputs(obs))
    model.policy.set_training_mode(False)
    th.manual_seed(3)
    with th.no_grad():
        stock = model.actor(th.as_tensor(obs), deterministic=False)
    assert th.equal(ours, stock)
    # the copy follows the statistics only when synced (collection syncs it before every rollout)
    renorm[0].ra_mean += 1.0
    th.manual_seed(3)
    assert th.equal(frozen(frozen.inputs(obs)), ours)
    frozen.sync()
    th.manual_seed(3)
    assert not th.equal(frozen(frozen.inputs(obs)), ours)
