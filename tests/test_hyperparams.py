from pathlib import Path

import gymnasium as gym
import pytest
import torch as th
from sb3_contrib.common.wrappers import TimeFeatureWrapper
from stable_baselines3.common.callbacks import CheckpointCallback

from sb3_speedups.common.schedules import ConstantSchedule, LinearSchedule
from sb3_speedups.errors import UserError
from sb3_speedups.zoo.hyperparams import (
    bundled_hyperparams_dir,
    default_hyperparams_file,
    load_yaml_file,
    parse_overrides,
    preprocess_hyperparams,
    read_hyperparams,
    rl_zoo_hyperparams_dir,
)

ZOO_FEATURES_YAML = """
default:
  n_timesteps: !!float 1e6
  policy: 'MlpPolicy'

atari:
  policy: 'CnnPolicy'
  frame_stack: 4

base: &base
  n_envs: 4
  n_timesteps: !!float 2e4
  policy: 'MlpPolicy'
  learning_rate: lin_0.001
  clip_range: 0.2
  clip_range_vf: -1
  gamma: 0.98
  normalize: "{'norm_obs': True, 'norm_reward': False}"

CartPole-v1:
  <<: *base
  learning_rate: !!float 3e-4
  env_wrapper:
    - gymnasium.wrappers.TimeLimit:
        max_episode_steps: 100
    - sb3_contrib.common.wrappers.TimeFeatureWrapper
  vec_env_wrapper: stable_baselines3.common.vec_env.VecMonitor
  frame_stack: 2
  callback:
    - stable_baselines3.common.callbacks.CheckpointCallback:
        save_freq: 1000
        save_path: /tmp/ckpt
  env_kwargs:
    render_mode: rgb_array
  monitor_kwargs: "dict(info_keywords=('is_success',))"
  policy_kwargs: "dict(net_arch=[64, 64], activation_fn=nn.ReLU)"
  train_freq: [1, "episode"]
"""


@pytest.fixture
def zoo_file(tmp_path: Path) -> Path:
    path = tmp_path / "zoo.yml"
    path.write_text(ZOO_FEATURES_YAML)
    return path


def test_every_rl_zoo_feature(zoo_file):
    raw = read_hyperparams("ppo", "CartPole-v1", zoo_file)
    assert raw["n_envs"] == 4 and raw["n_timesteps"] == 2e4 and raw["learning_rate"] == 3e-4  # anchor merged, overridden
    hp = preprocess_hyperparams(raw)
    assert hp.n_timesteps == 20_000 and hp.n_envs == 4
    kwargs = hp.model_kwargs
    assert kwargs["policy"] == "MlpPolicy"
    assert isinstance(kwargs["learning_rate"], ConstantSchedule) and kwargs["learning_rate"](0.5) == 3e-4
    assert kwargs["clip_range_vf"] == -1
    assert kwargs["policy_kwargs"] == {"net_arch": [64, 64], "activation_fn": th.nn.ReLU}
    assert kwargs["train_freq"] == (1, "episode")
    assert kwargs["gamma"] == 0.98
    for key in ("n_envs", "n_timesteps", "normalize", "env_wrapper", "frame_stack", "callback", "env_kwargs"):
        assert key not in kwargs
    assert hp.normalize and hp.normalize_kwargs == {"norm_obs": True, "norm_reward": False, "gamma": 0.98}
    assert [w for w, _ in hp.env_wrappers] == [gym.wrappers.TimeLimit, TimeFeatureWrapper]
    assert hp.env_wrappers[0][1] == {"max_episode_steps": 100}
    assert hp.vec_env_wrappers[0][0].__name__ == "VecMonitor"
    assert hp.frame_stack == 2
    assert hp.callbacks[0] == (CheckpointCallback, {"save_freq": 1000, "save_path": "/tmp/ckpt"})
    assert hp.env_kwargs == {"render_mode": "rgb_array"}
    assert hp.monitor_kwargs == {"info_keywords": ("is_success",)}


def test_linear_schedule_and_fallbacks(zoo_file):
    hp = preprocess_hyperparams(read_hyperparams("ppo", "Acrobot-v1", zoo_file))
    assert hp.n_timesteps == 1_000_000 and hp.model_kwargs == {"policy": "MlpPolicy"}  # default section
    atari = read_hyperparams("ppo", "PongNoFrameskip-v4", zoo_file, is_atari=True)
    assert atari["policy"] == "CnnPolicy"
    base = preprocess_hyperparams(read_hyperparams("ppo", "base", zoo_file))
    schedule = base.model_kwargs["learning_rate"]
    assert (
        isinstance(schedule, LinearSchedule)
        and schedule(1.0) == pytest.approx(1e-3)
        and schedule(0.25) == pytest.approx(2.5e-4)
    )


def test_normalize_variants():
    assert preprocess_hyperparams({"n_timesteps": 10, "normalize": True}).normalize_kwargs == {}
    as_dict = preprocess_hyperparams({"n_timesteps": 10, "normalize": {"norm_reward": False}, "gamma": 0.9})
    assert as_dict.normalize and as_dict.normalize_kwargs == {"norm_reward": False, "gamma": 0.9}
    assert not preprocess_hyperparams({"n_timesteps": 10, "normalize": False}).normalize


def test_real_mappings_with_dotted_classes():
    hp = preprocess_hyperparams({"n_timesteps": 10, "policy_kwargs": {"activation_fn": "torch.nn.ELU", "net_arch": [8]}})
    assert hp.model_kwargs["policy_kwargs"]["activation_fn"] is th.nn.ELU


def test_overrides_parse_yaml_and_literals():
    assert parse_overrides(
        ["learning_rate:0.001", "n_envs:4", "policy_kwargs:dict(net_arch=[8])", "lr:lin_1e-3", "t:[1, 'episode']", "flag:True"]
    ) == {
        "learning_rate": 0.001,
        "n_envs": 4,
        "policy_kwargs": "dict(net_arch=[8])",
        "lr": "lin_1e-3",
        "t": [1, "episode"],
        "flag": True,
    }
    with pytest.raises(UserError, match="key:value"):
        parse_overrides(["learning_rate=0.1"])


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yml"
    path.write_text("CartPole-v1:\n  n_envs: 8\n  policy: [unclosed\n  gamma: 0.9\n")
    with pytest.raises(UserError) as info:
        load_yaml_file(path)
    assert f"{path}:" in str(info.value) and "malformed YAML" in str(info.value)


def test_missing_env_section(tmp_path):
    path = tmp_path / "only.yml"
    path.write_text("CartPole-v1:\n  policy: MlpPolicy\n")
    with pytest.raises(UserError, match=r"no hyperparameters for CartPole-v0 .*close: CartPole-v1"):
        read_hyperparams("ppo", "CartPole-v0", path)


OFF_POLICY = ("sac", "td3", "ddpg", "crossq")


def test_bundled_off_policy_files_hold_the_rl_zoo_values():
    """sac/td3/ddpg/crossq.yml: the Zoo's sections for installed envs, MuJoCo -v5 with the Zoo's -v4 values."""
    zoo_dir = rl_zoo_hyperparams_dir()
    if zoo_dir is None:
        pytest.skip("rl_zoo3 is not installed")
    for algo in OFF_POLICY:
        ours, zoo = load_yaml_file(bundled_hyperparams_dir() / f"{algo}.yml"), load_yaml_file(zoo_dir / f"{algo}.yml")
        assert {"Pendulum-v1", "LunarLanderContinuous-v3", "HalfCheetah-v5"} <= set(ours)
        for env_id, section in ours.items():
            assert env_id in gym.registry or env_id == "default", env_id
            assert section == zoo[env_id.replace("-v5", "-v4")], (algo, env_id)


def test_bundled_files_cover_the_required_envs():
    assert bundled_hyperparams_dir().is_dir()
    required = {
        "ppo": ["CartPole-v1", "Acrobot-v1", "MountainCar-v0", "LunarLander-v3", "Pendulum-v1", "HalfCheetah-v5"],
        "dqn": ["CartPole-v1", "Acrobot-v1", "MountainCar-v0", "LunarLander-v3"],
        "ppo_lstm": ["CartPoleNoVel-v1"],
        "trpo": ["CartPole-v1", "Pendulum-v1", "LunarLander-v3", "BipedalWalker-v3"],
        **{algo: ["Pendulum-v1", "LunarLanderContinuous-v3", "BipedalWalker-v3", "HalfCheetah-v5"] for algo in OFF_POLICY},
    }
    for algo, envs in required.items():
        data = load_yaml_file(default_hyperparams_file(algo))
        for env_id in envs:
            assert env_id in data, (algo, env_id)
            preprocess_hyperparams(read_hyperparams(algo, env_id))


def _zoo_hyperparams_files():
    folder = rl_zoo_hyperparams_dir()
    if folder is None:
        pytest.skip("rl_zoo3 is not installed")
    return sorted(folder.glob("*.yml"))


def test_rl_zoo_published_files_parse_for_installed_envs():
    """Every section of the RL Zoo's own files whose env is installed here preprocesses without error."""
    import sb3_speedups.envs  # noqa: F401

    checked = 0
    for path in _zoo_hyperparams_files():
        algo = path.stem
        for env_id in load_yaml_file(path):
            if env_id not in gym.registry:
                continue
            try:
                preprocess_hyperparams(read_hyperparams(algo, env_id, path))
            except UserError as exc:
                if "cannot import" in str(exc) and "No module named" in str(exc):
                    continue  # a wrapper from a package not installed here (minigrid, ae, ...)
                raise
            checked += 1
    assert checked >= 40
