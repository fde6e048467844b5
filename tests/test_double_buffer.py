"""Double-buffered collection (``PPO(double_buffer=True)``): same rollouts as plain collection, real workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch as th
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecNormalize

from sb3_speedups import PPO, BatchedSubprocVecEnv, make_vec_env
from sb3_speedups.errors import UserError

PPO_KWARGS = dict(n_steps=16, batch_size=32, n_epochs=2, seed=0)


def _batched(env_id: str, n_envs: int = 4, **kwargs) -> BatchedSubprocVecEnv:
    options = dict(n_workers=2, n_local=0) | kwargs
    return make_vec_env(
        env_id, n_envs=n_envs, seed=0, vec_env_cls=BatchedSubprocVecEnv, start_method="fork", vec_env_kwargs=options
    )


class _Record(BaseCallback):
    """Keeps the actions and rewards of every step, and stops after ``stop_at`` steps when given."""

    def __init__(self, stop_at: int | None = None) -> None:
        super().__init__()
        self.stop_at = stop_at
        self.actions: list[np.ndarray] = []
        self.rewards: list[np.ndarray] = []

    def _on_step(self) -> bool:
        self.actions.append(np.array(self.locals["actions"]))
        self.rewards.append(np.array(self.locals["rewards"]))
        return self.stop_at is None or self.n_calls < self.stop_at


def _learn(env, double_buffer: bool, steps: int, callback: BaseCallback | None = None) -> PPO:
    model = PPO("MlpPolicy", env, double_buffer=double_buffer, **PPO_KWARGS)
    model.learn(steps, callback=callback)
    return model


@pytest.mark.parametrize("split", [dict(n_workers=2, n_local=0), dict(n_workers=1, n_local=2)])
def test_discrete_actions_give_the_same_training_as_plain_collection(split) -> None:
    plain_env, double_env = _batched("CartPole-v1", **split), _batched("CartPole-v1", **split)
    try:
        plain_rec, double_rec = _Record(), _Record()
        plain = _learn(plain_env, False, 3 * 16 * 4, plain_rec)
        double = _learn(double_env, True, 3 * 16 * 4, double_rec)
        assert len(double_rec.actions) == len(plain_rec.actions) == 3 * 16  # on_step once per vectorised step
        np.testing.assert_array_equal(np.stack(double_rec.actions), np.stack(plain_rec.actions))
        np.testing.assert_array_equal(np.stack(double_rec.rewards), np.stack(plain_rec.rewards))
        for p, q in zip(plain.policy.parameters(), double.policy.parameters(), strict=True):
            assert th.allclose(p, q, rtol=0, atol=1e-6)
        assert double.num_timesteps == plain.num_timesteps
    finally:
        plain_env.close()
        double_env.close()


def test_box_actions_train() -> None:
    env = _batched("Pendulum-v1")
    try:
        model = _learn(env, True, 2 * 16 * 4)
        assert model.num_timesteps == 2 * 16 * 4
        assert all(th.isfinite(p).all() for p in model.policy.parameters())
    finally:
        env.close()


def test_callback_stop_leaves_the_envs_usable() -> None:
    env = _batched("CartPole-v1")
    try:
        model = PPO("MlpPolicy", env, double_buffer=True, **PPO_KWARGS)
        model.learn(10_000, callback=_Record(stop_at=5))
        assert model.num_timesteps == 5 * 4
        assert np.asarray(model._last_obs).shape == (4, 4)
        model.learn(2 * 16 * 4, reset_num_timesteps=False)  # nothing left pending in the VecEnv
        assert model.num_timesteps == 5 * 4 + 2 * 16 * 4
        env.step(np.zeros(4, dtype=np.int64))
    finally:
        env.close()


def test_unsupported_envs_are_refused_with_the_fix() -> None:
    with pytest.raises(UserError, match="BatchedSubprocVecEnv"):
        _learn(make_vec_env("CartPole-v1", n_envs=2), True, 64)
    env = _batched("CartPole-v1")
    try:
        with pytest.raises(UserError, match="VecNormalize"):
            _learn(VecNormalize(env), True, 64)
    finally:
        env.close()
    single = _batched("CartPole-v1", n_envs=2, n_workers=1, n_local=0)
    try:
        with pytest.raises(UserError, match="two groups"):
            _learn(single, True, 64)
    finally:
        single.close()
