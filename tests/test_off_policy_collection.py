"""
The shared off-policy collection loop (:class:`FastOffPolicyCollection`) has stock ``collect_rollouts``' effects: on a
stock algorithm with continuous actions (TD3 with action noise), on our DQN, and on our DQN, SAC and TD3 with ``Dict``
observations, the same replay buffer, parameters, callback calls, logged values and episode bookkeeping as the stock
class for one seed.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import stable_baselines3
import torch as th
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.logger import KVWriter, Logger
from stable_baselines3.common.noise import NormalActionNoise, OrnsteinUhlenbeckActionNoise
from stable_baselines3.common.vec_env import VecNormalize

import sb3_speedups
from sb3_speedups import DQN
from sb3_speedups.common.off_policy.collection import FastOffPolicyCollection
from sb3_speedups.common.off_policy.transitions import add_to_replay_buffer, copies_on_add
from sb3_speedups.common.training_mode import TrainingModeSwitch
from sb3_speedups.dqn.replay.buffers import PrioritizedReplayBuffer
from tests.algo_cases import REPLAY_FIELDS, Counter


class _FastTD3(FastOffPolicyCollection, stable_baselines3.TD3):
    """Stock TD3 with only the collection loop replaced: everything else must come out as stock's."""


class _Recorder(KVWriter):
    """Keeps every dump's values, without the wall-clock ones."""

    def __init__(self) -> None:
        self.dumps: list[dict[str, Any]] = []

    def write(self, key_values: dict[str, Any], key_excluded: dict[str, Any], step: int = 0) -> None:
        self.dumps.append({k: v for k, v in key_values.items() if not k.startswith("time/") or k == "time/episodes"})


class _StopAt(BaseCallback):
    def __init__(self, stop_at: int) -> None:
        super().__init__()
        self.stop_at = stop_at

    def _on_step(self) -> bool:
        return self.n_calls < self.stop_at


def pendulum(n_envs: int, normalize: bool = False) -> Any:
    env = make_vec_env(lambda: gym.make("Pendulum-v1", max_episode_steps=10), n_envs=n_envs, seed=5)
    return VecNormalize(env) if normalize else env


def noise(kind: str, n_actions: int = 1) -> Any:
    if kind == "normal":
        return NormalActionNoise(np.zeros(n_actions), 0.3 * np.ones(n_actions))
    if kind == "ou":
        return OrnsteinUhlenbeckActionNoise(np.zeros(n_actions), 0.3 * np.ones(n_actions))
    return None


def td3_small() -> dict[str, Any]:
    """:return: small TD3 arguments, fresh each time (SB3 writes into the ``policy_kwargs`` it is given)"""
    return dict(
        learning_starts=15,
        batch_size=8,
        train_freq=3,
        gradient_steps=1,
        policy_delay=2,
        policy_kwargs=dict(net_arch=[8]),
        seed=1,
    )


def learn_both(make_ours: Any, make_stock: Any, steps: int, callback: Any = None) -> list[tuple[BaseAlgorithm, Any]]:
    """:return: (model, recorder) for ours and stock, each made, given a recording logger and trained"""
    out = []
    for make in (make_ours, make_stock):
        model = make()
        recorder = _Recorder()
        model.set_logger(Logger(folder=None, output_formats=[recorder]))
        model.learn(steps, log_interval=1, callback=callback() if callback else None)
        out.append((model, recorder))
    return out


def assert_same_arrays(got: Any, expected: Any, name: str) -> None:
    """Equal arrays of the same shape, or dicts of them (``Dict`` observations)."""
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), name
        for key, value in expected.items():
            np.testing.assert_array_equal(got[key], value, err_msg=f"{name}.{key}", strict=True)
    else:
        np.testing.assert_array_equal(got, expected, err_msg=name, strict=True)


def assert_same_run(
    ours: BaseAlgorithm, stock: BaseAlgorithm, fields: tuple[str, ...] = REPLAY_FIELDS, param_atol: float = 0.0
) -> None:
    """
    :param param_atol: 0 (``th.equal``) where both run stock's update (the same ops on the same shapes); for our own
        update against stock's, the float32 tolerance of the comparison
    """
    assert ours.num_timesteps == stock.num_timesteps
    assert ours._episode_num == stock._episode_num
    assert ours._n_updates == stock._n_updates
    assert ours._current_progress_remaining == stock._current_progress_remaining
    for name in fields:
        assert_same_arrays(getattr(ours.replay_buffer, name), getattr(stock.replay_buffer, name), name)
    assert (ours.replay_buffer.pos, ours.replay_buffer.full) == (stock.replay_buffer.pos, stock.replay_buffer.full)
    assert_same_arrays(ours._last_obs, stock._last_obs, "_last_obs")
    episodes = [[(e["r"], e["l"]) for e in model.ep_info_buffer] for model in (ours, stock)]  # without wall-clock "t"
    assert episodes[0] == episodes[1]
    ours_state, stock_state = ours.policy.state_dict(), stock.policy.state_dict()
    for key, value in stock_state.items():
        th.testing.assert_close(ours_state[key], value, rtol=0, atol=param_atol, msg=key)


@pytest.mark.parametrize("noise_kind", ["normal", "ou", None])
@pytest.mark.parametrize("n_envs", [1, 2])
def test_td3_with_the_mixin_learns_as_stock(noise_kind: str | None, n_envs: int) -> None:
    def make(cls: type) -> Any:
        return lambda: cls("MlpPolicy", pendulum(n_envs), action_noise=noise(noise_kind), **td3_small())

    (ours, ours_log), (stock, stock_log) = learn_both(make(_FastTD3), make(stable_baselines3.TD3), 90)
    assert stock.replay_buffer.timeouts.any()  # episodes ended inside the run: terminal observations were stored
    assert_same_run(ours, stock)
    assert len(ours_log.dumps) == len(stock_log.dumps) > 3
    assert ours_log.dumps == stock_log.dumps


class _FastSAC(FastOffPolicyCollection, stable_baselines3.SAC):
    """Stock SAC with only the collection loop replaced."""


@pytest.mark.parametrize("sde", [False, True], ids=["gaussian", "gsde"])
def test_sac_with_the_mixin_learns_as_stock(sde: bool) -> None:
    kwargs = {k: v for k, v in td3_small().items() if k != "policy_delay"}
    if sde:
        kwargs.update(use_sde=True, sde_sample_freq=4)  # new exploration noise every 4 steps: reset_noise calls

    def make(cls: type) -> Any:
        return lambda: cls("MlpPolicy", pendulum(2), **kwargs)

    (ours, ours_log), (stock, stock_log) = learn_both(make(_FastSAC), make(stable_baselines3.SAC), 80)
    assert_same_run(ours, stock)
    assert ours_log.dumps == stock_log.dumps


def test_callbacks_are_called_as_stock_calls_them() -> None:
    counters = []
    for cls in (_FastTD3, stable_baselines3.TD3):
        counter = Counter()
        cls("MlpPolicy", pendulum(2), action_noise=noise("ou"), **td3_small()).learn(60, callback=counter)
        counters.append(counter)
    ours, stock = counters
    assert (ours.steps, ours.starts, ours.ends) == (stock.steps, stock.starts, stock.ends) == (30, 10, 10)
    loop_temporaries = {"idx", "done", "kwargs"}  # stock's for-loop variables and its noise-reset arguments
    assert stock.keys - loop_temporaries <= ours.keys


@pytest.mark.parametrize("cls", [_FastTD3, DQN])
def test_a_callback_returning_false_stops_at_the_same_step(cls: type) -> None:
    stock_cls = stable_baselines3.TD3 if cls is _FastTD3 else stable_baselines3.DQN
    env = (lambda: pendulum(2)) if cls is _FastTD3 else (lambda: make_vec_env("CartPole-v1", n_envs=2, seed=5))
    kwargs = td3_small() if cls is _FastTD3 else dict(learning_starts=15, seed=1)
    ours, stock = (c("MlpPolicy", env(), **kwargs).learn(200, callback=_StopAt(17)) for c in (cls, stock_cls))
    assert ours.num_timesteps == stock.num_timesteps == 34
    assert ours.replay_buffer.pos == stock.replay_buffer.pos == 16  # the stopping step is not stored
    # Our DQN's hand-derived update against stock's autograd one: 3 Adam steps at lr 1e-4 from float32 gradients that
    # differ in the last bits (2e-9 here on an AMD EPYC, 0 on an Intel Xeon); a wrong term moves them by ~lr.
    assert_same_run(ours, stock, param_atol=0.0 if cls is _FastTD3 else 1e-7)


def episodic(cls: type) -> Any:
    if issubclass(cls, stable_baselines3.TD3):
        return cls("MlpPolicy", pendulum(1), action_noise=noise("normal"), **{**td3_small(), "train_freq": (2, "episode")})
    env = make_vec_env("CartPole-v1", n_envs=1, seed=5)
    return cls("MlpPolicy", env, learning_starts=30, train_freq=(2, "episode"), policy_kwargs=dict(net_arch=[8]), seed=1)


@pytest.mark.parametrize("classes", [(_FastTD3, stable_baselines3.TD3), (DQN, stable_baselines3.DQN)], ids=["td3", "dqn"])
def test_episodic_train_freq_learns_as_stock(classes: tuple[type, type]) -> None:
    ours_cls, stock_cls = classes
    (ours, ours_log), (stock, stock_log) = learn_both(lambda: episodic(ours_cls), lambda: episodic(stock_cls), 120)
    assert ours._n_updates > 0
    if ours_cls is DQN:  # our update against stock's: float32 rounding of a few Adam steps, as above
        assert_same_run(ours, stock, param_atol=1e-7)
        assert [d.keys() for d in ours_log.dumps] == [d.keys() for d in stock_log.dumps]
        for ours_dump, stock_dump in zip(ours_log.dumps, stock_log.dumps, strict=True):
            assert ours_dump == pytest.approx(stock_dump, rel=1e-6)  # the logged loss: a mean of float32 terms
    else:
        assert_same_run(ours, stock)
        assert ours_log.dumps == stock_log.dumps


def test_vec_normalize_stores_original_observations_and_rewards_as_stock() -> None:
    def make(cls: type) -> Any:
        return lambda: cls("MlpPolicy", pendulum(2, normalize=True), action_noise=noise("normal"), **td3_small())

    (ours, _), (stock, _) = learn_both(make(_FastTD3), make(stable_baselines3.TD3), 60)
    assert_same_run(ours, stock)
    np.testing.assert_array_equal(ours._last_original_obs, stock._last_original_obs)
    assert not np.allclose(stock._last_original_obs, stock._last_obs)  # the policy saw normalised observations


def test_only_buffers_that_copy_skip_the_deep_copy() -> None:
    class KeepsReferences(ReplayBuffer):
        def add(self, *args: Any, **kwargs: Any) -> None:
            super().add(*args, **kwargs)

    space = gym.spaces.Box(-1, 1, (2,))
    assert copies_on_add(ReplayBuffer(10, space, space))
    assert not copies_on_add(KeepsReferences(10, space, space))
    assert copies_on_add(PrioritizedReplayBuffer(10, space, space))  # says so with add_keeps_no_references


@pytest.mark.parametrize("algo", [stable_baselines3.DQN, stable_baselines3.TD3, stable_baselines3.SAC])
def test_training_mode_switch_sets_the_flags_set_training_mode_sets(algo: type) -> None:
    env = "CartPole-v1" if algo is stable_baselines3.DQN else "Pendulum-v1"
    policy = algo("MlpPolicy", env, policy_kwargs=dict(net_arch=[4])).policy
    switch = TrainingModeSwitch(policy)
    assert switch.modules is not None
    for mode in (False, True, False):
        policy.set_training_mode(not mode)
        expected_policy = algo("MlpPolicy", env, policy_kwargs=dict(net_arch=[4])).policy
        expected_policy.set_training_mode(not mode)
        expected_policy.set_training_mode(mode)
        switch(mode)
        assert [m.training for m in policy.modules()] == [m.training for m in expected_policy.modules()]


@pytest.mark.parametrize("optimize_memory_usage", [False, True])
@pytest.mark.parametrize("obs_space", [gym.spaces.Discrete(5), gym.spaces.Box(-1, 1, (3, 2))], ids=["discrete", "box"])
def test_add_to_replay_buffer_stores_what_stock_add_stores(obs_space: gym.spaces.Space, optimize_memory_usage: bool) -> None:
    action_space = gym.spaces.Box(-1, 1, (2,))
    kwargs = dict(n_envs=2, optimize_memory_usage=optimize_memory_usage, handle_timeout_termination=not optimize_memory_usage)
    ours, stock = (ReplayBuffer(4, obs_space, action_space, **kwargs) for _ in range(2))  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    for step in range(7):  # wraps around the buffer
        obs, next_obs = (np.array([obs_space.sample() for _ in range(2)]) for _ in range(2))
        action = rng.uniform(-1, 1, (2, 2)).astype(np.float64)
        reward, done = rng.normal(size=2), np.array([step % 3 == 0, False])
        infos = [{"TimeLimit.truncated": bool(step % 2)}, {}]
        add_to_replay_buffer(ours, obs, next_obs, action, reward, done, infos)
        stock.add(obs, next_obs, action, reward, done, infos)
    for name in ("observations", "actions", "rewards", "dones", "timeouts", "pos", "full"):
        np.testing.assert_array_equal(getattr(ours, name), getattr(stock, name), err_msg=name)
    if not optimize_memory_usage:
        np.testing.assert_array_equal(ours.next_observations, stock.next_observations)


class _DictWithDiscreteEnv(gym.Env):
    """``Dict`` observations with a ``Discrete`` entry beside a ``Box`` one (as SB3's ``DummyDictEnv``), short episodes."""

    def __init__(self, action_space: gym.spaces.Space) -> None:
        self.observation_space = gym.spaces.Dict(
            {"vec": gym.spaces.Box(-1, 1, (3,), np.float32), "discrete": gym.spaces.Discrete(4)}
        )
        self.action_space = action_space

    def _observe(self) -> dict[str, Any]:
        return {"vec": self.np_random.uniform(-1, 1, 3).astype(np.float32), "discrete": int(self.np_random.integers(4))}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict]:
        super().reset(seed=seed)
        self.t = 0
        self.state = self._observe()
        return self.state, {}

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict]:
        self.t += 1
        reward = float(self.state["vec"].sum()) - 0.1 * self.state["discrete"] - float(np.sum(action))
        self.state = self._observe()
        return self.state, reward, self.t == 5 and self.state["discrete"] == 0, self.t >= 7, {}


@pytest.mark.parametrize("n_envs", [1, 2])
@pytest.mark.parametrize("name", ["DQN", "SAC", "TD3"])
def test_dict_observations_with_discrete_entries_collect_as_stock(name: str, n_envs: int) -> None:
    """
    ``DictReplayBuffer.add`` reshapes the ``Discrete`` entries of the dicts it is given in place: the observations the
    policy acts on next must keep the env's ``(n_envs,)`` shape, as after stock's deep copy.
    """
    action_space = gym.spaces.Discrete(3) if name == "DQN" else gym.spaces.Box(-1, 1, (2,), np.float32)
    # No gradient step: both act with the same initial policy through stock's predict (Dict observations), the same
    # ops on the same shapes, so the collected buffers are equal exactly.
    kwargs = dict(learning_starts=6, buffer_size=100, gradient_steps=0, policy_kwargs=dict(net_arch=[8]), seed=3)

    def make(cls: type) -> Any:
        env = make_vec_env(lambda: _DictWithDiscreteEnv(action_space), n_envs, seed=4)
        return lambda: cls("MultiInputPolicy", env, **kwargs)

    (ours, _), (stock, _) = learn_both(make(getattr(sb3_speedups, name)), make(getattr(stable_baselines3, name)), 40)
    assert stock.replay_buffer.timeouts.any() and stock.replay_buffer.dones.any()  # terminal observations were patched in
    assert_same_run(ours, stock)  # the buffers and _last_obs entry by entry, shapes included
