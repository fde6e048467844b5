"""AleVecEnv gives what make_atari_env + VecFrameStack give: stacks, clipped rewards, life losses, whole-game episodes."""

from __future__ import annotations

import io
import warnings

import gymnasium as gym
import numpy as np
import pytest
from stable_baselines3 import PPO as StockPPO
from stable_baselines3.common import atari_wrappers
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.monitor import Monitor, load_results
from stable_baselines3.common.vec_env import VecEnv, VecFrameStack, VecTransposeImage

from sb3_speedups import PPO
from sb3_speedups.cli import main
from sb3_speedups.common.env_util import make_atari_env, make_vec_env
from sb3_speedups.errors import UserError, UserValueError
from sb3_speedups.zoo.envs import make_env
from sb3_speedups.zoo.hyperparams import Hyperparams

gym.register_envs(pytest.importorskip("ale_py"))  # SB3's make_atari_env needs the ids registered
pytest.importorskip("cv2")

from sb3_speedups.common.vec_env.ale import AleVecEnv  # noqa: E402

BREAKOUT = "BreakoutNoFrameskip-v4"
MSPACMAN = "MsPacmanNoFrameskip-v4"  # no FIRE action: its resets are the same in ALE and in SB3's wrappers


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def stock_stack(env_id: str, n_envs: int, seed: int, **wrapper_kwargs) -> VecEnv:
    """SB3's Atari stack, channel-first as SB3's algorithms see it."""
    return VecTransposeImage(VecFrameStack(make_atari_env(env_id, n_envs, seed=seed, wrapper_kwargs=wrapper_kwargs), 4))


def test_spaces_and_one_step() -> None:
    env = AleVecEnv(BREAKOUT, 3, seed=0)
    try:
        assert env.observation_space.shape == (4, 84, 84) and env.observation_space.dtype == np.uint8
        assert env.action_space.n == 4
        obs = env.reset()
        assert obs.shape == (3, 4, 84, 84) and obs.dtype == np.uint8
        assert not obs[:, :3].any() and obs[:, 3].any(), "a new game's stack holds its first frame only"
        obs, rewards, dones, infos = env.step(np.zeros(3, dtype=np.int64))
        assert rewards.dtype == np.float32 and dones.dtype == bool and obs.shape == (3, 4, 84, 84)
        assert set(infos[0]) == {"lives", "episode_frame_number", "frame_number", "TimeLimit.truncated"}
    finally:
        env.close()


@pytest.mark.parametrize("frame_skip", [1, 4])
def test_same_as_stock_until_the_first_life_loss(frame_skip: int) -> None:
    """Without noops and FIRE, ALE and SB3's wrappers run the same emulator frames: same rewards, dones and lives."""
    n_envs = 2
    stock = stock_stack(MSPACMAN, n_envs, 0, noop_max=0, frame_skip=frame_skip)
    ours = AleVecEnv(MSPACMAN, n_envs, seed=0, noop_max=0, frame_skip=frame_skip)
    try:
        expected, obs = stock.reset(), ours.reset()
        rng = np.random.default_rng(0)
        for _ in range(1000):
            actions = rng.integers(0, ours.action_space.n, n_envs)
            expected, stock_rewards, stock_dones, stock_infos = stock.step(actions)
            obs, rewards, dones, infos = ours.step(actions)
            np.testing.assert_array_equal(rewards, stock_rewards)
            np.testing.assert_array_equal(dones, stock_dones)
            for info, stock_info in zip(infos, stock_infos, strict=True):
                for key in ("lives", "episode_frame_number", "TimeLimit.truncated"):
                    assert info[key] == stock_info[key]
            if dones.any():
                break
            if frame_skip == 1:
                np.testing.assert_array_equal(obs, expected)  # the same grey conversion and INTER_AREA resize
            else:
                # SB3 max-pools two RGB frames before the grey conversion, ALE two grey frames: where objects of
                # different colours overlap the pixels differ (measured: at most 1.2% of them on MsPacman)
                assert np.mean(obs != expected) < 0.03
        assert dones.any(), "a life is lost within the budget"
        done = int(np.flatnonzero(dones)[0])
        assert "episode" not in infos[done] and infos[done]["lives"] > 0
        assert not obs[done, :3].any(), "the stack starts again after a life loss, as VecFrameStack's does"
    finally:
        stock.close()
        ours.close()


def test_life_loss_is_done_without_a_reset_and_episodes_are_whole_games() -> None:
    env = AleVecEnv(BREAKOUT, 2, seed=1)
    try:
        env.reset()
        rng = np.random.default_rng(1)
        lives, frames = np.full(2, 5), np.zeros(2, dtype=int)
        life_losses, games, ages = 0, 0, np.ones(2, dtype=int)  # frames in the stack since the last done
        for _ in range(1500):
            obs, _, dones, infos = env.step(rng.integers(0, 4, 2))
            ages += 1
            for i, info in enumerate(infos):
                empty = max(0, 4 - ages[i])
                assert not obs[i, :empty].any() and obs[i, empty:].any(), "VecFrameStack's zeros after a done"
                if dones[i] and "episode" not in info:
                    life_losses += 1
                    assert info["lives"] == lives[i] - 1 > 0
                    assert info["episode_frame_number"] > frames[i], "the game goes on"
                    assert info["terminal_observation"].shape == (4, 84, 84)
                elif dones[i]:
                    games += 1
                    assert info["lives"] == 0 and not info["TimeLimit.truncated"]
                    assert info["episode"]["l"] == info["episode_frame_number"], "Monitor counts frames of v4 ids"
                else:
                    assert "terminal_observation" not in info
                if dones[i]:
                    ages[i] = 1
                new_game = "episode" in info
                lives[i] = 5 if new_game else info["lives"]
                frames[i] = 0 if new_game else info["episode_frame_number"]
        assert games >= 2 and life_losses >= 4 * games
    finally:
        env.close()


def test_fire_after_a_life_loss_keeps_the_game_going() -> None:
    """Breakout waits for FIRE after a life loss: with NOOPs only, the game ends only if the env presses it."""
    env = AleVecEnv(BREAKOUT, 1, seed=0)
    try:
        env.reset()
        game_ends = ["episode" in env.step(np.zeros(1, dtype=np.int64))[3][0] for _ in range(300)]
        assert any(game_ends), "a game of NOOPs ends"
    finally:
        env.close()


def test_clipped_rewards_and_true_returns() -> None:
    env_kwargs = {"max_num_frames_per_episode": 1200}
    clipped = AleVecEnv(MSPACMAN, 2, seed=0, env_kwargs=env_kwargs)
    raw = AleVecEnv(MSPACMAN, 2, seed=0, env_kwargs=env_kwargs, clip_reward=False)
    try:
        clipped.reset()
        raw.reset()
        rng = np.random.default_rng(0)
        returns, clipped_returns, episodes = np.zeros(2), np.zeros(2), 0
        for _ in range(700):
            actions = rng.integers(0, 9, 2)
            _, rewards, dones, infos = clipped.step(actions)
            _, raw_rewards, _, raw_infos = raw.step(actions)
            np.testing.assert_array_equal(rewards, np.sign(raw_rewards))
            returns += raw_rewards
            clipped_returns += rewards
            for i in np.flatnonzero(dones):
                if "episode" in infos[i]:
                    # ALE counts the frame limit from the end of the noop start (at most noop_max frames)
                    assert infos[i]["TimeLimit.truncated"] and 1200 <= infos[i]["episode"]["l"] <= 1200 + 30
                    assert infos[i]["episode"]["r"] == returns[i] == raw_infos[i]["episode"]["r"]
                    assert returns[i] > clipped_returns[i] > 0, "MsPacman's pellets are worth 10"
                    episodes += 1
                    returns[i] = clipped_returns[i] = 0.0
        assert episodes >= 4
    finally:
        clipped.close()
        raw.close()


def test_seeds() -> None:
    """Env i of a VecEnv seeded s plays as a single env seeded s + i; seed() applies at the next reset()."""
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 4, (150, 2))

    def trajectory(env: AleVecEnv, columns: slice) -> np.ndarray:
        frames = [env.reset()]
        frames += [env.step(actions[t, columns])[0] for t in range(len(actions))]
        env.close()
        return np.stack(frames)

    pair = trajectory(AleVecEnv(BREAKOUT, 2, seed=7), slice(0, 2))
    np.testing.assert_array_equal(pair, trajectory(AleVecEnv(BREAKOUT, 2, seed=7), slice(0, 2)))
    np.testing.assert_array_equal(pair[:, 1:], trajectory(AleVecEnv(BREAKOUT, 1, seed=8), slice(1, 2)))
    reseeded = AleVecEnv(BREAKOUT, 2, seed=0)
    reseeded.seed(7)
    np.testing.assert_array_equal(pair, trajectory(reseeded, slice(0, 2)))
    assert not np.array_equal(pair[:, 0], pair[:, 1])


def test_vec_env_methods() -> None:
    env = AleVecEnv(BREAKOUT, 2, seed=0, terminal_on_life_loss=False)
    try:
        assert env.env_is_wrapped(Monitor) == [True, True]
        assert env.env_is_wrapped(atari_wrappers.AtariWrapper) == [True, True]
        assert env.env_is_wrapped(atari_wrappers.FireResetEnv, indices=[1]) == [True]
        assert env.env_is_wrapped(atari_wrappers.EpisodicLifeEnv) == [False, False]
        assert env.get_attr("render_mode") == [None, None]
        assert env.env_method("get_action_meanings", indices=0) == [["NOOP", "FIRE", "RIGHT", "LEFT"]]
        assert not env.has_attr("ale")
        with pytest.raises(AttributeError, match="no attribute 'ale'"):
            env.get_attr("ale")
        with pytest.raises(UserError, match="AleVecEnv"):
            env.set_attr("noop_max", 0)
    finally:
        env.close()


@pytest.mark.parametrize(
    ("env_id", "env_kwargs", "match"),
    [
        ("CartPole-v1", None, "ALE cannot run 'CartPole-v1'"),
        ("NoSuchGameNoFrameskip-v4", None, "ALE cannot run"),
        ("Breakout-v4", None, "NoFrameskip-v4 or v5"),
        (BREAKOUT, {"obs_type": "ram"}, "drop obs_type"),
        (BREAKOUT, {"mode": 1}, "does not take env_kwargs"),
    ],
)
def test_bad_ids_and_settings(env_id: str, env_kwargs: dict | None, match: str) -> None:
    with pytest.raises(UserError, match=match) as error:
        AleVecEnv(env_id, 1, env_kwargs=env_kwargs)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("env_kwargs", "frames"), [(None, 16), ({"frameskip": 1}, 4)])
def test_v5_steps_skip_frames_as_make_atari_env(env_kwargs: dict | None, frames: int) -> None:
    """A v5 id skips 4 frames itself and AtariWrapper 4 more per step, unless env_kwargs sets frameskip 1."""
    env = AleVecEnv("ALE/Breakout-v5", 1, seed=0, env_kwargs=env_kwargs)
    try:
        env.reset()
        counts = [env.step(np.zeros(1, dtype=np.int64))[3][0]["episode_frame_number"] for _ in range(3)]
        assert np.diff(counts).tolist() == [frames, frames]
    finally:
        env.close()


def test_make_atari_env_stacks_alike(tmp_path) -> None:
    ours = make_atari_env(BREAKOUT, 2, seed=0, vec_env_cls=AleVecEnv, monitor_dir=str(tmp_path))
    stacked = make_atari_env(BREAKOUT, 2, seed=0, vec_env_cls=AleVecEnv, n_stack=4)
    stock = make_atari_env(BREAKOUT, 2, seed=0, n_stack=4)
    try:
        assert ours.observation_space.shape == (1, 84, 84), "as SB3's make_atari_env: no stack unless asked"
        assert VecFrameStack(ours, 4).observation_space.shape == (4, 84, 84)
        assert stacked.observation_space.shape == (4, 84, 84) and stock.observation_space.shape == (84, 84, 4)
        assert isinstance(make_vec_env(BREAKOUT, 1, vec_env_cls=AleVecEnv), AleVecEnv)
        ours.reset()
        rng = np.random.default_rng(0)
        for _ in range(400):
            ours.step(rng.integers(0, 4, 2))
        assert len(load_results(str(tmp_path))) >= 1, "whole games in the Monitor file"
    finally:
        for env in (ours, stacked, stock):
            env.close()


def test_models_move_between_stock_stack_and_ale() -> None:
    """A model trained on either env loads with the other (same spaces) and evaluates whole games there."""
    kwargs = {"n_steps": 16, "batch_size": 32, "n_epochs": 1, "seed": 0, "device": "cpu"}
    ale_env = make_atari_env(BREAKOUT, 2, seed=0, vec_env_cls=AleVecEnv, n_stack=4)
    stock_env = stock_stack(BREAKOUT, 2, 0)
    try:
        for train_env, eval_env in ((ale_env, stock_env), (stock_env, ale_env)):
            model = PPO("CnnPolicy", train_env, **kwargs).learn(32)
            loaded = StockPPO.load(_saved(model), env=eval_env, device="cpu")  # checks the spaces
            assert loaded.predict(eval_env.reset(), deterministic=True)[0].shape == (2,)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                returns, lengths = evaluate_policy(loaded, eval_env, n_eval_episodes=1, return_episode_rewards=True)
            assert not [warning for warning in caught if "Monitor" in str(warning.message)]
            # Monitor's length of a whole game (5 lives, frames); a life alone would count some 30 steps
            assert len(returns) == 1 and lengths[0] > 200
    finally:
        ale_env.close()
        stock_env.close()


def _saved(model: PPO) -> io.BytesIO:
    buffer = io.BytesIO()
    model.save(buffer)
    buffer.seek(0)
    return buffer


def test_zoo_settings() -> None:
    wrapper = (atari_wrappers.AtariWrapper, {"terminal_on_life_loss": False})
    atari = Hyperparams(n_timesteps=1, env_wrappers=[wrapper], frame_stack=4)
    env = make_env(BREAKOUT, atari, 2, seed=0, vec_env="ale")
    try:
        assert isinstance(env, AleVecEnv) and env.observation_space.shape == (4, 84, 84)
        assert env.env_is_wrapped(atari_wrappers.EpisodicLifeEnv) == [False, False]
    finally:
        env.close()
    with pytest.raises(UserValueError, match=r"frame_stack 4 .* n_stack 2"):
        make_env(BREAKOUT, atari, 1, vec_env="ale", vec_env_kwargs={"n_stack": 2})
    with pytest.raises(UserValueError, match="add env_wrapper AtariWrapper"):
        make_env(BREAKOUT, Hyperparams(n_timesteps=1), 1, vec_env="ale")


def test_cli_trains_with_vec_env_ale(tmp_path) -> None:
    code = main(
        ["train", "--algo", "ppo", "--env", BREAKOUT, "--vec-env", "ale", "-n", "64", "--seed", "0", "-f", str(tmp_path),
         "--eval-freq", "0", "--eval-episodes", "1", "--no-progress", "--quiet",
         "-params", "n_envs:2", "n_steps:32", "batch_size:32", "n_epochs:1"]
    )  # fmt: skip
    assert code == 0
    (model_file,) = tmp_path.glob("ppo/*/BreakoutNoFrameskip-v4.zip")
    assert StockPPO.load(model_file, device="cpu").observation_space.shape == (4, 84, 84)
    assert list(tmp_path.glob("ppo/*/vec.monitor.csv"))
