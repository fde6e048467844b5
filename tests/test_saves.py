"""Saves load both ways: stock SB3 / sb3-contrib loads and trains on our files, we load and train on theirs."""

import json
import zipfile

import numpy as np
import pytest
import torch as th
from stable_baselines3 import HerReplayBuffer
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm

from tests.algo_cases import ALL, CASES, WITH_STOCK, AlgoCase, params

# speed-only state: a stock install could not rebuild it, and it would go stale on load
SPEED_STATE = {"_speedups", "_optimizer_step", "rollout_buffer", "replay_buffer"}


def saved_data(path) -> dict:
    with zipfile.ZipFile(path) as archive:
        return json.loads(archive.read("data"))


def assert_same_state(a: dict, b: dict) -> None:
    """Equal state dicts (of modules, or of optimizers: nested, with step counts), bit for bit."""
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, dict):
            assert_same_state(value, b[key])
        else:
            assert th.equal(th.as_tensor(value), th.as_tensor(b[key])), key


def optimizers(model) -> list:
    """:return: the policy's optimizers (SAC, TD3: the actor's and the critic's)"""
    optimizer = getattr(model.policy, "optimizer", None)
    return [optimizer] if optimizer is not None else [model.policy.actor.optimizer, model.policy.critic.optimizer]


def adam_steps(model) -> list[set[float]]:
    """:return: per optimizer, the step counts of its parameters"""
    return [{float(state["step"]) for state in optimizer.state.values()} for optimizer in optimizers(model)]


def assert_same_actions(case: AlgoCase, a, b) -> None:
    obs = case.env().reset()
    actions = [model.predict(obs, deterministic=True)[0] for model in (a, b)]
    np.testing.assert_allclose(*actions, rtol=0, atol=case.predict_atol)


@pytest.mark.parametrize("case", WITH_STOCK)
def test_ours_load_in_stock_and_stocks_load_in_ours(case: AlgoCase, tmp_path) -> None:
    ours = case.make_ours()
    ours.learn(case.learn_steps)
    ours.save(tmp_path / "ours.zip")
    assert not SPEED_STATE & set(saved_data(tmp_path / "ours.zip"))

    stock = case.stock.load(tmp_path / "ours.zip", env=case.env())
    assert type(stock.policy) is case.stock.policy_aliases[case.policy]  # stock rebuilds its own policy class
    assert_same_state(stock.policy.state_dict(), ours.policy.state_dict())
    for stock_optimizer, our_optimizer in zip(optimizers(stock), optimizers(ours), strict=True):
        assert_same_state(stock_optimizer.state_dict()["state"], our_optimizer.state_dict()["state"])
    saved_steps = adam_steps(ours)
    assert all(len(steps) == 1 and min(steps) > 0 for steps in saved_steps)
    assert_same_actions(case, stock, ours)
    stock.learn(case.more_steps, reset_num_timesteps=False)  # stock keeps training our file
    stock_steps, stock_timesteps = adam_steps(stock), stock.num_timesteps

    stock.save(tmp_path / "stock.zip")
    loaded = case.ours.load(tmp_path / "stock.zip", env=case.env())
    assert type(loaded.policy) is type(ours.policy) and isinstance(loaded.policy, type(stock.policy))
    assert_same_state(loaded.policy.state_dict(), stock.policy.state_dict())
    loaded.learn(case.more_steps, reset_num_timesteps=False)
    assert case.engine_of(loaded) == case.engine
    # the loaded optimizer state carries on as stock carried on from ours
    expected = [{2 * max(stock) - max(saved)} for stock, saved in zip(stock_steps, saved_steps, strict=True)]
    assert adam_steps(loaded) == expected
    assert loaded.num_timesteps - stock_timesteps == stock_timesteps - ours.num_timesteps > 0
    assert loaded._n_updates > stock._n_updates


@pytest.mark.parametrize("case", ALL)
def test_ours_round_trip_and_train_on(case: AlgoCase, tmp_path) -> None:
    ours = case.make_ours()
    ours.learn(case.learn_steps)
    ours.save(tmp_path / "ours.zip")
    loaded = case.ours.load(tmp_path / "ours.zip", env=case.env())
    assert type(loaded.policy) is type(ours.policy) and str(loaded.policy) == str(ours.policy)  # same modules (GRU...)
    assert_same_state(loaded.policy.state_dict(), ours.policy.state_dict())
    assert_same_actions(case, loaded, ours)
    loaded.learn(case.more_steps, reset_num_timesteps=False)
    assert case.engine_of(loaded) == case.engine


@pytest.mark.parametrize("case", ALL)
def test_set_parameters_from_a_loaded_copy_keeps_the_fast_path(case: AlgoCase, tmp_path) -> None:
    model = case.make_ours()
    model.learn(case.learn_steps)
    model.save(tmp_path / "m.zip")
    her = case.kwargs.get("replay_buffer_class") is HerReplayBuffer  # (stock loads a HER model only with an env)
    copy = (case.stock or case.ours).load(tmp_path / "m.zip", env=case.env() if her else None)
    model.set_parameters(copy.get_parameters())  # replaces the optimizer's state: the fast paths rebind
    before = [p.detach().clone() for p in model.policy.parameters()]
    model.learn(case.more_steps, reset_num_timesteps=False)
    assert case.engine_of(model) == case.engine
    assert any(not th.equal(a, b) for a, b in zip(before, model.policy.parameters(), strict=True))


@pytest.mark.parametrize("case", params(case for case in CASES if issubclass(case.ours, OffPolicyAlgorithm)))
def test_replay_buffer_save_load_round_trip(case: AlgoCase, tmp_path) -> None:
    ours = case.make_ours()
    ours.learn(300)
    ours.save_replay_buffer(tmp_path / "buffer")
    fresh = case.make_ours()
    fresh.load_replay_buffer(tmp_path / "buffer", truncate_last_traj=False)  # (HER would end the episode in progress)
    saved, loaded = ours.replay_buffer, fresh.replay_buffer
    assert type(loaded) is type(saved) and (loaded.pos, loaded.full) == (saved.pos, saved.full)
    arrays = {name: value for name, value in vars(saved).items() if isinstance(value, np.ndarray | dict)}
    assert "observations" in arrays
    for name, value in arrays.items():
        parts = value.items() if isinstance(value, dict) else [(None, value)]  # DictReplayBuffer: one array per key
        for key, array in parts:
            got = getattr(loaded, name) if key is None else getattr(loaded, name)[key]
            np.testing.assert_array_equal(got, array, err_msg=f"{name} {key}")
