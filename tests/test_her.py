"""SB3's HerReplayBuffer sampled many minibatches at a time: stock's samples and RNG draws, on real goal envs."""

import numpy as np
import pytest
import torch as th
from stable_baselines3 import HerReplayBuffer
from stable_baselines3.common.envs import BitFlippingEnv
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize
from stable_baselines3.common.type_aliases import DictReplayBufferSamples

from sb3_speedups.common.replay.her import her_sampling_supported, valid_transitions
from sb3_speedups.common.replay.sampling import batchable, sample_minibatches


def _filled_buffer(
    n_envs: int, buffer_size: int, steps: int, strategy: str = "future", normalize: bool = False, copy_info_dict=False
) -> tuple[HerReplayBuffer, VecNormalize | None]:
    """:return: a HER buffer holding ``steps`` real steps of BitFlipping envs (episodes of up to 8 steps), random actions"""
    env = DummyVecEnv([lambda: BitFlippingEnv(n_bits=8, continuous=True, max_steps=8) for _ in range(n_envs)])
    env.seed(0)
    vec_norm = VecNormalize(env, norm_obs=False, gamma=0.9) if normalize else None  # (MultiBinary entries)
    stepper = vec_norm if vec_norm is not None else env
    buffer = HerReplayBuffer(
        buffer_size,
        env.observation_space,
        env.action_space,
        env=stepper,
        n_envs=n_envs,
        goal_selection_strategy=strategy,
        copy_info_dict=copy_info_dict,
    )
    rng = np.random.default_rng(1)
    obs = stepper.reset()
    for _ in range(steps):
        actions = rng.uniform(-1, 1, (n_envs, 8)).astype(np.float32)
        new_obs, rewards, dones, infos = stepper.step(actions)
        stored_next = {k: v.copy() for k, v in new_obs.items()}
        for i, done in enumerate(dones):
            if done:
                for k in stored_next:
                    stored_next[k][i] = infos[i]["terminal_observation"][k]
        buffer.add(obs, stored_next, actions, rewards, dones, infos)
        obs = new_obs
    return buffer, vec_norm


def _assert_same(got: DictReplayBufferSamples, expected: list[DictReplayBufferSamples]) -> None:
    for field in DictReplayBufferSamples._fields:
        mine, theirs = getattr(got, field), [getattr(e, field) for e in expected]
        if theirs[0] is None:  # (n-step discounts: HER has none)
            assert mine is None, field
        elif isinstance(mine, dict):
            for key in mine:
                joined = th.cat([t[key] for t in theirs])
                assert mine[key].dtype == joined.dtype, (field, key)
                assert th.equal(mine[key], joined), (field, key)
        else:
            joined = th.cat(theirs)
            assert mine.dtype == joined.dtype, field
            assert th.equal(mine, joined), field


@pytest.mark.parametrize(
    "n_envs,buffer_size,steps,strategy,normalize,copy_info",
    [
        (1, 1000, 60, "future", False, False),
        (2, 1000, 60, "episode", True, False),
        (2, 1000, 60, "final", False, True),
        (3, 37, 120, "future", True, False),  # the buffer wrapped: old episodes overwritten
    ],
)
def test_her_minibatches_equal_stocks_samples_and_draws(n_envs, buffer_size, steps, strategy, normalize, copy_info):
    buffer, env = _filled_buffer(n_envs, buffer_size, steps, strategy, normalize, copy_info)
    assert her_sampling_supported(buffer) and batchable(buffer)
    for n_batches in (1, 4):
        np.random.seed(7)
        expected = [buffer.sample(16, env) for _ in range(n_batches)]
        after_stock = np.random.get_state()[1].copy()
        np.random.seed(7)
        got = sample_minibatches(buffer, 16, n_batches, env)
        np.testing.assert_array_equal(np.random.get_state()[1], after_stock)  # the same draws, no more
        _assert_same(got, expected)


def test_valid_transitions_follow_every_change_of_episode_lengths():
    """The kept valid transitions equal stock's scan after every add: episodes ending, a wrap, a truncation."""
    env = DummyVecEnv([lambda: BitFlippingEnv(n_bits=4, continuous=True, max_steps=5) for _ in range(2)])
    env.seed(0)
    buffer = HerReplayBuffer(23, env.observation_space, env.action_space, env=env, n_envs=2)
    obs = env.reset()
    rng = np.random.default_rng(2)
    for step in range(60):
        actions = rng.uniform(-1, 1, (2, 4)).astype(np.float32)
        new_obs, rewards, dones, infos = env.step(actions)
        buffer.add(obs, new_obs, actions, rewards, dones, infos)
        obs = new_obs
        np.testing.assert_array_equal(valid_transitions(buffer), np.flatnonzero(buffer.ep_length > 0), f"step {step}")
        if step == 30:
            buffer.truncate_last_trajectory()
            np.testing.assert_array_equal(valid_transitions(buffer), np.flatnonzero(buffer.ep_length > 0))
