"""EnvPool and gymnasium vector envs behave as SB3 VecEnvs: immediate auto-reset, terminal_observation, truncation."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode
from stable_baselines3 import PPO
from stable_baselines3.common.vec_env import DummyVecEnv, VecMonitor

from sb3_speedups import make_vec_env
from sb3_speedups.common.vec_env import EnvPoolVecEnv, GymVectorVecEnv
from sb3_speedups.errors import UserError
from sb3_speedups.zoo.envs import make_env
from sb3_speedups.zoo.hyperparams import Hyperparams
from tests.vec_env_helpers import assert_same, assert_same_step, random_actions

pytest.importorskip("envpool")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def check_sb3_semantics(venv, n_steps: int, reset_bound: float = 0.05) -> dict[str, int]:
    """Run random actions and check every episode end; return how many ended by termination and truncation."""
    counts = {"terminated": 0, "truncated": 0}
    venv.reset()
    lengths = np.zeros(venv.num_envs, dtype=int)
    rng = np.random.default_rng(0)
    for _ in range(n_steps):
        actions = rng.integers(0, 2, venv.num_envs)
        obs, rewards, dones, infos = venv.step(actions)
        lengths += 1
        assert rewards.dtype == np.float32 and dones.dtype == bool and obs.dtype == np.float32
        for i, info in enumerate(infos):
            assert info["TimeLimit.truncated"] is bool(info["TimeLimit.truncated"])
            if dones[i]:
                terminal = info["terminal_observation"]
                assert terminal.shape == (4,) and not np.array_equal(terminal, obs[i])
                assert np.all(np.abs(obs[i]) <= reset_bound), "the returned observation starts the next episode"
                counts["truncated" if info["TimeLimit.truncated"] else "terminated"] += 1
                assert lengths[i] == 500 if info["TimeLimit.truncated"] else lengths[i] < 500
                lengths[i] = 0
            else:
                assert "terminal_observation" not in info
    return counts


def test_cartpole_vector_env_semantics() -> None:
    venv = GymVectorVecEnv.from_env_id("CartPole-v1", 4, seed=0)
    try:
        assert isinstance(venv.vector_env.unwrapped, gym.envs.classic_control.cartpole.CartPoleVectorEnv)
        counts = check_sb3_semantics(venv, 600)
        assert counts["terminated"] > 10
    finally:
        venv.close()


def test_cartpole_vector_env_episodes_are_the_native_ones() -> None:
    """One env: our immediate reset draws exactly the state the env would draw on its next step."""
    ours = GymVectorVecEnv.from_env_id("CartPole-v1", 1, seed=7)
    native = gym.make_vec("CartPole-v1", num_envs=1, vectorization_mode="vector_entry_point")
    obs = ours.reset()
    native_obs, _ = native.reset(seed=7)
    assert_same(obs, native_obs)
    rng = np.random.default_rng(1)
    episodes = 0
    for _ in range(300):
        action = rng.integers(0, 2, 1)
        obs, reward, done, infos = ours.step(action)
        native_obs, native_reward, terminated, truncated, _ = native.step(action)
        if done[0]:
            episodes += 1
            np.testing.assert_array_equal(infos[0]["terminal_observation"], native_obs[0])
            assert infos[0]["TimeLimit.truncated"] == bool(truncated[0] and not terminated[0])
            native_obs, native_reward, *_ = native.step(np.zeros(1, dtype=np.int64))  # the native reset step
            assert native_reward[0] == 0.0
        else:
            np.testing.assert_array_equal(reward, native_reward)
        np.testing.assert_array_equal(obs, native_obs)
    assert episodes > 5
    ours.close()
    native.close()


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.DISABLED])
def test_sync_vector_env_same_as_dummy(mode: AutoresetMode) -> None:
    vector_env = gym.make_vec("CartPole-v1", num_envs=3, vectorization_mode="sync", vector_kwargs={"autoreset_mode": mode})
    ours = GymVectorVecEnv(vector_env)
    ref = DummyVecEnv([lambda: gym.make("CartPole-v1") for _ in range(3)])
    try:
        ours.seed(4)
        ref.seed(4)
        assert_same(ours.reset(), ref.reset())
        for t, actions in enumerate(random_actions(ref.action_space, 3, 300)):
            assert_same_step(ours.step(actions), ref.step(actions), f"step {t}")
        assert ours.get_attr("spec", [1])[0].id == "CartPole-v1"
        ours.set_attr("marker", 5, indices=[2])
        assert ours.get_attr("marker", [2]) == [5]
        assert ours.env_method("get_wrapper_attr", "marker", indices=[2]) == [5]
    finally:
        ours.close()


def test_gym_vector_refuses_next_step_autoreset_it_cannot_fix() -> None:
    vector_env = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    with pytest.raises(UserError, match="SameStep"):
        GymVectorVecEnv(vector_env)
    vector_env.close()


def test_envpool_semantics_and_seeding() -> None:
    venv = EnvPoolVecEnv("CartPole-v1", 4, seed=0)
    try:
        counts = check_sb3_semantics(venv, 700)
        assert counts["terminated"] > 10
        assert set(venv.reset_infos[0]) >= {"env_id", "elapsed_step"}
        assert venv.env_is_wrapped(gym.Wrapper) == [False] * 4
    finally:
        venv.close()
    # seed() before reset() rebuilds the pool with that seed: the same trajectories as a pool made with it.
    first, second = EnvPoolVecEnv("CartPole-v1", 3, seed=1), EnvPoolVecEnv("CartPole-v1", 3, seed=99)
    try:
        second.seed(1)
        assert_same(second.reset(), first.reset())
        for actions in random_actions(first.action_space, 3, 100):
            assert_same_step(second.step(actions), first.step(actions))
    finally:
        first.close()
        second.close()
    with pytest.raises(UserError, match="EnvPool has no env"):
        EnvPoolVecEnv("NoSuchEnv-v0", 2)


def test_envpool_time_limit_truncation() -> None:
    venv = EnvPoolVecEnv("CartPole-v1", 2, seed=0, max_episode_steps=5)
    try:
        venv.reset()
        for _ in range(4):
            _, _, dones, _ = venv.step(np.array([0, 1]))
            assert not dones.any()
        _, _, dones, infos = venv.step(np.array([0, 1]))
        assert dones.all() and all(info["TimeLimit.truncated"] for info in infos)
    finally:
        venv.close()


@pytest.mark.parametrize("kind", ["envpool", "gym_vector"])
def test_make_vec_env_zoo_and_ppo_with_adapters(kind: str, tmp_path) -> None:
    env = make_env("CartPole-v1", Hyperparams(n_timesteps=100), 4, seed=0, monitor_dir=tmp_path, vec_env=kind)
    try:
        assert isinstance(env, VecMonitor)
        env.reset()
        episodes = []
        for _ in range(100):
            _, _, dones, infos = env.step(np.ones(4, dtype=np.int64))
            episodes += [info["episode"] for info, done in zip(infos, dones, strict=True) if done]
        assert episodes and all(e["l"] >= 8 for e in episodes)
        model = PPO("MlpPolicy", env, n_steps=16, batch_size=32, n_epochs=1, seed=0, device="cpu")
        model.learn(128)
    finally:
        env.close()
    assert (tmp_path / "vec.monitor.csv").exists()
    with pytest.raises(UserError, match="wrapper_class"):
        make_vec_env("CartPole-v1", 2, vec_env_cls=type(env.unwrapped), wrapper_class=gym.Wrapper)
    with pytest.raises(UserError, match="env id"):
        make_vec_env(lambda: gym.make("CartPole-v1"), 2, vec_env_cls=type(env.unwrapped))
