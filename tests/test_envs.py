import gymnasium as gym
import numpy as np
import pytest
from stable_baselines3.common.vec_env import SubprocVecEnv, VecFrameStack, VecMonitor, VecNormalize

import sb3_speedups  # noqa: F401  (registers the envs)
from sb3_speedups.errors import UserError
from sb3_speedups.zoo.envs import check_env_id, make_env
from sb3_speedups.zoo.hyperparams import preprocess_hyperparams


def test_cartpole_novel_masks_the_velocities():
    env, full = gym.make("CartPoleNoVel-v1"), gym.make("CartPole-v1")
    obs, _ = env.reset(seed=4)
    ref, _ = full.reset(seed=4)
    for _ in range(5):
        obs, *_ = env.step(1)
        ref, *_ = full.step(1)
    assert obs[1] == 0 and obs[3] == 0 and ref[1] != 0 and ref[3] != 0
    np.testing.assert_array_equal(obs[[0, 2]], ref[[0, 2]])
    limits, layer = [], env
    while isinstance(layer, gym.Wrapper):
        if isinstance(layer, gym.wrappers.TimeLimit):
            limits.append(layer._max_episode_steps)
        layer = layer.env
    assert limits == [500]  # the base env's TimeLimit, not a second one


def test_masking_envs_keep_sb3_contribs_discrete_observations_on_request():
    flat = gym.make("InvalidActionEnvDiscrete-v0", dim=40, n_invalid_actions=20)
    own = gym.make("InvalidActionEnvDiscrete-v0", dim=40, n_invalid_actions=20, one_hot=False)
    assert flat.observation_space.shape == (40,) and own.observation_space == gym.spaces.Discrete(40)
    obs, _ = own.reset(seed=0)
    assert own.observation_space.contains(obs)
    assert np.sum(own.unwrapped.action_masks()) == 20


def test_check_env_id_suggests_close_matches():
    check_env_id("CartPoleNoVel-v1")
    check_env_id("gymnasium.envs.classic_control:CartPole-v1")
    with pytest.raises(UserError, match="did you mean CartPoleNoVel-v1"):
        check_env_id("CartPoleNoVell-v1")
    with pytest.raises(UserError, match="cannot import 'no_such_pkg'"):
        check_env_id("no_such_pkg:Env-v0")


@pytest.mark.parametrize("env_id", ["BreakoutNoFrameskip-v4", "ALE/Breakout-v5"])
def test_atari_ids_resolve_as_in_the_rl_zoo_also_in_fresh_workers(env_id):
    """ale-py registers its envs when imported: a fresh process (a spawned worker) must import it before gym.make."""
    pytest.importorskip("ale_py")
    check_env_id(env_id)
    hyperparams = preprocess_hyperparams(
        {"env_wrapper": "stable_baselines3.common.atari_wrappers.AtariWrapper", "frame_stack": 4}, 1
    )
    env = make_env(env_id, hyperparams, n_envs=2, seed=0, vec_env="subproc", vec_env_kwargs={"start_method": "spawn"})
    try:
        assert env.reset().shape == (2, 4, 84, 84)  # AtariWrapper's 84x84 grey frames, stacked, channels first
    finally:
        env.close()


def test_make_env_applies_every_wrapper(tmp_path):
    hp = preprocess_hyperparams(
        {
            "n_timesteps": 10,
            "normalize": "dict(norm_reward=False)",
            "frame_stack": 3,
            "env_wrapper": [{"gymnasium.wrappers.TimeLimit": {"max_episode_steps": 7}}],
            "vec_env_wrapper": "stable_baselines3.common.vec_env.VecMonitor",
        }
    )
    env = make_env("CartPole-v1", hp, n_envs=2, seed=0, monitor_dir=tmp_path)
    assert isinstance(env, VecFrameStack) and isinstance(env.venv, VecNormalize) and isinstance(env.venv.venv, VecMonitor)
    assert env.observation_space.shape == (12,) and not env.venv.norm_reward
    env.reset()
    lengths = []
    for _ in range(20):
        _, _, dones, infos = env.step(np.array([0, 1]))
        lengths += [info["episode"]["l"] for info, done in zip(infos, dones, strict=True) if done]
    assert lengths and max(lengths) <= 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.monitor.csv", "1.monitor.csv"]
    env.close()


def test_eval_env_freezes_normalisation_and_subproc_workers_see_our_envs():
    hp = preprocess_hyperparams({"n_timesteps": 10, "normalize": True})
    eval_env = make_env("CartPoleNoVel-v1", hp, n_envs=1, seed=0, eval_env=True)
    assert isinstance(eval_env, VecNormalize) and not eval_env.training and not eval_env.norm_reward
    eval_env.close()
    env = make_env(
        "CartPoleNoVel-v1",
        preprocess_hyperparams({"n_timesteps": 10}),
        n_envs=2,
        seed=0,
        vec_env="subproc",
        vec_env_kwargs={"start_method": "spawn"},
    )
    assert isinstance(env, SubprocVecEnv)
    assert env.reset().shape == (2, 4)
    env.close()
