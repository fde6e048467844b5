"""Ours equals stock SB3 / sb3-contrib: same seed, same rollouts, same parameters, same callbacks (every AlgoCase)."""

import numpy as np
import pytest
import torch as th
from stable_baselines3.common.callbacks import BaseCallback

from tests.algo_cases import WITH_STOCK, AlgoCase, Counter, as_stock_layout, buffer_of, params
from tests.algo_cases import CASES as ALL_CASES
from tests.space_envs import ROLLOUT_CASES, rollout_case


@pytest.mark.parametrize("case", WITH_STOCK)
def test_learning_equals_stock(case: AlgoCase) -> None:
    """Collection (same samples), buffer, update and optimizer: ``learn_steps`` later both agree."""
    ours = case.make_ours().learn(case.learn_steps)  # each seeds the global RNGs when made: made, then learns
    stock = case.make_stock().learn(case.learn_steps)
    assert case.engine_of(ours) == case.engine
    assert ours._n_updates == stock._n_updates > 0
    assert ours.num_timesteps == stock.num_timesteps
    ours_buffer, stock_buffer = buffer_of(ours), buffer_of(stock)
    if case.on_policy:
        assert ours_buffer.episode_starts.sum() > ours.n_envs  # episodes started inside the compared rollout
    for name in case.exact:
        expected = np.asarray(getattr(stock_buffer, name))
        np.testing.assert_array_equal(as_stock_layout(np.asarray(getattr(ours_buffer, name)), expected), expected, name)
    for name in case.close:
        expected = np.asarray(getattr(stock_buffer, name))
        got = as_stock_layout(np.asarray(getattr(ours_buffer, name)), expected)
        np.testing.assert_allclose(got, expected, rtol=0, atol=case.buffer_atol, err_msg=name)
    ours_state, stock_state = ours.policy.state_dict(), stock.policy.state_dict()
    assert ours_state.keys() == stock_state.keys()
    for key, value in stock_state.items():
        th.testing.assert_close(ours_state[key], value, atol=case.param_atol, rtol=case.param_rtol, msg=key)


@pytest.mark.parametrize("case", WITH_STOCK)
def test_callbacks_see_what_stock_callbacks_see(case: AlgoCase) -> None:
    counters = []
    for make in (case.make_stock, case.make_ours):
        counter = Counter()
        make().learn(96, callback=counter)
        counters.append(counter)
    stock, ours = counters
    assert (ours.steps, ours.starts, ours.ends) == (stock.steps, stock.starts, stock.ends)
    loop_temporaries = {"obs_tensor", "done", "done_", "idx", "terminal_obs", "terminal_value", "terminal_lstm_state"}
    assert stock.keys - loop_temporaries - case.callback_gaps <= ours.keys


class ModeRecorder(BaseCallback):
    """Records the training flags of the policy's modules at every step (collection runs in evaluation mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.modes: list[list[bool]] = []

    def _on_step(self) -> bool:
        self.modes.append([m.training for m in self.model.policy.modules()])
        return True


@pytest.mark.parametrize("case", WITH_STOCK)
def test_policy_modes_equal_stock(case: AlgoCase) -> None:
    """Training mode switched as stock switches it (ours sets the flags without the policy's own call)."""
    seen = []
    for make in (case.make_stock, case.make_ours):
        recorder = ModeRecorder()
        model = make().learn(96, callback=recorder)
        seen.append((recorder.modes, [m.training for m in model.policy.modules()]))
    assert seen[0] == seen[1]
    assert not any(any(modes) for modes in seen[0][0])
    if case.on_policy:  # trained after the last collection (off-policy cases may still be before learning_starts)
        assert all(seen[0][1])


def first_rollout(cls, env, policy, kwargs):
    model = cls(policy, env, **kwargs)
    _, callback = model._setup_learn(10_000, None)
    assert model.collect_rollouts(model.env, callback, model.rollout_buffer, model.n_steps)
    buffer = model.rollout_buffer
    names = ("observations", "actions", "rewards", "episode_starts", "values", "log_probs", "advantages", "returns")
    if isinstance(buffer.observations, dict):
        return {
            **{f"obs.{k}": np.array(v, np.float64) for k, v in buffer.observations.items()},
            **{name: np.array(getattr(buffer, name), dtype=np.float64) for name in names[1:]},
        }
    return {name: np.array(getattr(buffer, name), dtype=np.float64) for name in names}


@pytest.mark.parametrize("name", ROLLOUT_CASES)
@pytest.mark.parametrize("case", params(case for case in ALL_CASES if case.every_space))
def test_first_rollout_equals_stock(case, name):
    env, policy, kwargs = rollout_case(name)
    stock_kwargs = {k: v for k, v in kwargs.items() if k in ("use_sde", "sde_sample_freq")}
    np.random.seed(0)  # SimpleMultiObsEnv draws its observations from numpy's global RNG when created
    stock = first_rollout(case.stock, env(), policy, {**case.kwargs, **stock_kwargs})
    np.random.seed(0)
    ours = first_rollout(case.ours, env(), policy, {**case.kwargs, **kwargs})
    assert stock["episode_starts"].sum() > 0 or name == "dict"
    # Continuous actions (mean + std * noise) are equal up to float32 rounding: ours acts through numpy's matrix
    # products, stock through torch's. Sampled discrete actions must be identical.
    exact = ["episode_starts"] + (["actions"] if name != "box" else [])
    for key in [k for k in stock if k.startswith("obs")] + exact:
        np.testing.assert_array_equal(ours[key], stock[key], err_msg=key)
    np.testing.assert_allclose(ours["actions"], stock["actions"], rtol=0, atol=1e-6, err_msg="actions")
    for key in ("values", "log_probs", "rewards", "advantages", "returns"):
        np.testing.assert_allclose(ours[key], stock[key], rtol=0, atol=1e-5, err_msg=key)
