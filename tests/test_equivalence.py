"""Ours equals stock SB3 / sb3-contrib: same seed, same rollouts, same parameters, same callbacks (every AlgoCase)."""

from typing import Any

import numpy as np
import pytest
import torch as th
from stable_baselines3.common.callbacks import BaseCallback

from tests.algo_cases import WITH_STOCK, AlgoCase, Counter, as_stock_layout, buffer_of, params
from tests.algo_cases import CASES as ALL_CASES
from tests.space_envs import ROLLOUT_CASES, rollout_case


class ParamsAtRolloutStart(BaseCallback):
    """Keeps, at every rollout's start, the step count, the update count and the policy's parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.starts: list[tuple[int, int, dict[str, th.Tensor]]] = []

    def _on_rollout_start(self) -> None:
        state = {key: value.detach().clone() for key, value in self.model.policy.state_dict().items()}
        self.starts.append((self.model.num_timesteps, self.model._n_updates, state))

    def _on_step(self) -> bool:
        return True


def assert_close_states(ours: dict[str, th.Tensor], stock: dict[str, th.Tensor], case: AlgoCase, when: str) -> None:
    assert ours.keys() == stock.keys()
    for key, value in stock.items():
        th.testing.assert_close(ours[key], value, atol=case.param_atol, rtol=case.param_rtol, msg=f"{key} {when}")


def first_parting_step(ours: np.ndarray, stock: np.ndarray, atol: float) -> int:
    """:return: the first step (row) where a buffer field differs beyond ``atol`` (discrete: at all), else the row count"""
    parted = (np.abs(ours.astype(np.float64) - stock) > atol).reshape(len(stock), -1).any(axis=1)
    return int(np.argmax(parted)) if parted.any() else len(stock)


@pytest.mark.parametrize("case", WITH_STOCK)
def test_learning_equals_stock(case: AlgoCase) -> None:
    """
    Collection (same samples), buffer, update and optimizer: ``learn_steps`` later both agree.

    Ours and stock round differently (other call shapes; on an AVX2 CPU other kernels than on an AVX-512 one), and an
    off-policy run amplifies that: a ReLU unit at its kink or a near-zero Adam step moves a parameter by ~1e-4 after a
    few train() calls (TD3 on a 2-core AMD EPYC: from the 7th), and the trajectories part. So a replay buffer is
    compared up to the first step whose action differs beyond rounding, and the parameters after every train() call
    whose next rollout acted alike (bar the last: a critic can part one call before the actor that acts); at least
    three such calls must be compared. A real mistake parts at the first train() call.
    """
    recorders = ParamsAtRolloutStart(), ParamsAtRolloutStart()
    ours = case.make_ours().learn(case.learn_steps, callback=recorders[0])  # each seeds the global RNGs when made
    stock = case.make_stock().learn(case.learn_steps, callback=recorders[1])
    assert case.engine_of(ours) == case.engine
    assert ours._n_updates == stock._n_updates > 0
    assert ours.num_timesteps == stock.num_timesteps
    ours_buffer, stock_buffer = buffer_of(ours), buffer_of(stock)
    rows = slice(None)  # a rollout buffer holds the last rollout, whole
    if case.on_policy:
        assert ours_buffer.episode_starts.sum() > ours.n_envs  # episodes started inside the compared rollout
        parted = None
    else:
        assert ours_buffer.pos == stock_buffer.pos and not stock_buffer.full
        stored = stock_buffer.pos
        # Parted where an action, or the observation it was taken on, differs beyond float32 rounding (a tenth of the
        # fields' tolerance). Actions equal within it still add up along a chaotic trajectory: TD3 on Pendulum once
        # moved a reward by 1.2e-5 after 250 steps whose actions agreed within 1e-6, its observations parting first.
        parted = min(
            first_parting_step(np.asarray(got)[:stored], np.asarray(expected)[:stored], case.buffer_atol / 10)
            for name in ("actions", "observations")
            for _, got, expected in entries(name, getattr(ours_buffer, name), getattr(stock_buffer, name))
        )
        rows = slice(0, parted)
    for name in (*case.exact, *case.close):
        for label, got_field, stock_field in entries(name, getattr(ours_buffer, name), getattr(stock_buffer, name)):
            expected = np.asarray(stock_field)[rows]
            got = as_stock_layout(np.asarray(got_field)[rows], expected)
            if name in case.exact:
                np.testing.assert_array_equal(got, expected, label)
            else:
                np.testing.assert_allclose(got, expected, rtol=0, atol=case.buffer_atol, err_msg=label)
    if parted is None or parted == stored:
        assert_close_states(ours.policy.state_dict(), stock.policy.state_dict(), case, "at the end")
    if parted is not None:
        starts = list(zip(recorders[0].starts, recorders[1].starts, strict=True))
        acted_alike = [i for i in range(len(starts) - 1) if starts[i + 1][1][0] // ours.n_envs <= parted]
        compared = acted_alike if parted == stored else acted_alike[:-1]
        for i in compared:
            (steps, updates, ours_state), (_, stock_updates, stock_state) = starts[i]
            assert updates == stock_updates
            assert_close_states(ours_state, stock_state, case, f"at step {steps}")
        trained = [i for i in compared if starts[i][0][1] > 0]
        assert len(trained) >= 3 or parted == stored, f"actions parted at step {parted}, after {len(trained)} train() calls"


def entries(name: str, ours: Any, stock: Any) -> list[tuple[str, Any, Any]]:
    """:return: a buffer field of ours and stock's, as (label, ours, stock) per entry of ``Dict`` observations"""
    if isinstance(stock, dict):
        return [(f"{name}.{key}", ours[key], stock[key]) for key in stock]
    return [(name, ours, stock)]


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
    exact = ["episode_starts"] + (["actions"] if name not in ("box", "box_matrix") else [])
    for key in [k for k in stock if k.startswith("obs")] + exact:
        np.testing.assert_array_equal(ours[key], stock[key], err_msg=key)
    np.testing.assert_allclose(ours["actions"], stock["actions"], rtol=0, atol=1e-6, err_msg="actions")
    # Float32 rounding: 1e-5 near zero, relative 1e-6 for the image env's returns of ~1e3 (one float32 step is 1.2e-4
    # there; the two sides may also run torch on other thread counts, which round convolutions differently).
    for key in ("values", "log_probs", "rewards", "advantages", "returns"):
        np.testing.assert_allclose(ours[key], stock[key], rtol=1e-6, atol=1e-5, err_msg=key)
