"""FrameStackReplayBuffer: each frame stored once, samples equal to stock ReplayBuffer's, draw for draw."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import NStepReplayBuffer, ReplayBuffer
from stable_baselines3.common.env_util import make_atari_env
from stable_baselines3.common.save_util import load_from_pkl, save_to_pkl
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.vec_env import VecFrameStack, VecTransposeImage

from sb3_speedups import DQN
from sb3_speedups.common.off_policy.transitions import copies_on_add
from sb3_speedups.common.replay.frames import ZERO, FrameStackReplayBuffer
from sb3_speedups.common.replay.sampling import batchable, batched_sampling_supported, sample_minibatches
from sb3_speedups.dqn.replay.buffers import PrioritizedReplayBuffer
from sb3_speedups.errors import UserTypeError, UserValueError

ATARI_SPACE = spaces.Box(0, 255, (4, 84, 84), np.uint8)
Transition = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[dict[str, Any]]]


def _atari_env(n_envs: int = 2, transposed: bool = True) -> Any:
    ale_py = pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    gym.register_envs(ale_py)
    # AtariWrapper ends an episode at every life lost: episode starts (zero-padded stacks) come often
    env = VecFrameStack(make_atari_env("BreakoutNoFrameskip-v4", n_envs=n_envs, seed=0), 4)
    return VecTransposeImage(env) if transposed else env


@pytest.fixture(scope="module")
def atari_transitions() -> list[Transition]:
    """300 steps of 2 Breakout envs with random actions, next observations as SB3 stores them (terminal ones)."""
    env = _atari_env()
    env.action_space.seed(0)
    obs = env.reset()
    steps = []
    for _ in range(300):
        actions = np.array([env.action_space.sample() for _ in range(env.num_envs)])
        new_obs, rewards, dones, infos = env.step(actions)
        next_obs = new_obs.copy()
        for i in np.flatnonzero(dones):
            next_obs[i] = infos[i]["terminal_observation"]
        steps.append((obs, next_obs, actions, rewards, dones, infos))
        obs = new_obs.copy()
    env.close()
    assert sum(int(d.sum()) for *_, d, _ in steps) >= 10  # episode ends, so zero-padded starts, happened
    return steps


def _fill(buffers: list[ReplayBuffer], transitions: list[Transition]) -> None:
    for obs, next_obs, actions, rewards, dones, infos in transitions:
        for buffer in buffers:
            buffer.add(obs, next_obs, actions, rewards, dones, infos)


def _assert_samples_equal(ours: ReplayBufferSamples, stock: ReplayBufferSamples) -> None:
    for name in ReplayBufferSamples._fields:
        a, b = getattr(ours, name), getattr(stock, name)
        assert (a is None) == (b is None), name
        if a is not None:  # the same bytes: th.equal, with NaNs equal to themselves and -0.0 not equal to 0.0
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert th.equal(a.reshape(-1).view(th.uint8), b.reshape(-1).view(th.uint8)), name


def _cat(samples: list[ReplayBufferSamples]) -> ReplayBufferSamples:
    return ReplayBufferSamples(*(None if f[0] is None else th.cat(f) for f in zip(*samples, strict=True)))  # type: ignore[arg-type]


def _assert_same_contents(ours: FrameStackReplayBuffer, stock: ReplayBuffer) -> None:
    """Every stored stack (all positions, all envs) is stock's, and the reference counts are the stored stacks'."""
    positions = np.arange(ours.buffer_size)
    np.testing.assert_array_equal(ours.observations[positions], stock.observations)
    np.testing.assert_array_equal(ours.next_observations[positions], stock.next_observations)
    ring = ours.frames
    expected = np.zeros_like(ring.refs)
    for records in (ours.observation_ids, ours.next_observation_ids):
        for env in range(ours.n_envs):
            ids = records[:, env][records[:, env] != ZERO]
            np.add.at(expected[env], ids % ring.capacity, 1)
    np.testing.assert_array_equal(ring.refs, expected)


def test_atari_samples_equal_stock_also_after_wraps(atari_transitions):
    ours = FrameStackReplayBuffer(100, ATARI_SPACE, spaces.Discrete(4), device="cpu", n_envs=2)
    stock = ReplayBuffer(100, ATARI_SPACE, spaces.Discrete(4), device="cpu", n_envs=2)
    capacity = ours.frames.capacity
    _fill([ours, stock], atari_transitions)
    assert stock.full and len(atari_transitions) > 5 * stock.buffer_size  # the ring wrapped several times
    assert ours.frames.capacity == capacity  # buffer_size * 17 / 16 slots held every frame in use
    _assert_same_contents(ours, stock)
    # about one frame per transition: one per step, one more per episode (its first frame)
    n_frames = ours.frames.next_ids.sum()
    n_episodes = sum(int(d.sum()) for *_, d, _ in atari_transitions)
    assert n_frames <= 2 * len(atari_transitions) + n_episodes + 2 * 4
    for seed in range(5):
        np.random.seed(seed)
        expected = stock.sample(32)
        after_stock = np.random.rand()
        np.random.seed(seed)
        _assert_samples_equal(ours.sample(32), expected)
        assert np.random.rand() == after_stock  # the same draws


@pytest.mark.parametrize("n_batches", [1, 4])
def test_atari_batched_sampling_equals_stock(atari_transitions, n_batches):
    ours = FrameStackReplayBuffer(100, ATARI_SPACE, spaces.Discrete(4), device="cpu", n_envs=2)
    stock = ReplayBuffer(100, ATARI_SPACE, spaces.Discrete(4), device="cpu", n_envs=2)
    _fill([ours, stock], atari_transitions[:130])  # full, wrapped, pos in the middle
    assert batched_sampling_supported(ours) and batchable(ours) and copies_on_add(ours)
    for seed in range(3):
        np.random.seed(seed)
        expected = [stock.sample(16) for _ in range(n_batches)]
        np.random.seed(seed)
        batched = sample_minibatches(ours, 16, n_batches)
        _assert_samples_equal(batched, _cat(expected))
    for combined in (False, True):
        np.random.seed(7)
        expected_combined = sample_minibatches(stock, 8, 3, combined=combined)
        np.random.seed(7)
        _assert_samples_equal(sample_minibatches(ours, 8, 3, combined=combined), expected_combined)


def test_atari_n_step_samples_equal_sb3_n_step_buffer(atari_transitions):
    kwargs = dict(device="cpu", n_envs=2, n_steps=3, gamma=0.9)
    ours = FrameStackReplayBuffer(100, ATARI_SPACE, spaces.Discrete(4), **kwargs)
    stock = NStepReplayBuffer(100, ATARI_SPACE, spaces.Discrete(4), **kwargs)
    _fill([ours, stock], atari_transitions[:170])
    assert not batched_sampling_supported(ours) and batchable(ours)
    for seed in range(3):
        np.random.seed(seed)
        expected = stock.sample(32)
        np.random.seed(seed)
        _assert_samples_equal(ours.sample(32), expected)
        np.random.seed(seed)
        expected_batches = [stock.sample(8) for _ in range(2)]
        np.random.seed(seed)
        batches = sample_minibatches(ours, 8, 2)
        _assert_samples_equal(batches, _cat(expected_batches))


def _synthetic_transitions(n_steps: int, n_envs: int, shape: tuple[int, ...], dtype: Any, seed: int) -> list[Transition]:
    """
    Transitions of every kind a buffer can be given: stacks that continue the previous ones, episode starts (zero
    padding), terminal observations, stacks that do not continue (random, or a frame changed in the middle),
    observations that are not the previous next observations, unchanged stacks, all-zero stacks; some truncations.
    """
    rng = np.random.default_rng(seed)

    def frame() -> np.ndarray:
        values = rng.integers(0, 4, shape[1:]) if dtype == np.uint8 else rng.choice([0.0, -0.0, 1.5, np.nan], shape[1:])
        return values.astype(dtype)

    def random_stack() -> np.ndarray:
        return np.stack([frame() for _ in range(shape[0])])

    current = np.stack([random_stack() for _ in range(n_envs)])
    transitions = []
    for _ in range(n_steps):
        obs, next_obs = current.copy(), np.empty_like(current)
        dones = np.zeros(n_envs, dtype=np.float32)
        infos: list[dict[str, Any]] = [{} for _ in range(n_envs)]
        for env in range(n_envs):
            kind = rng.integers(0, 8)
            if kind == 0:  # not the previous next observation (an arbitrary writer)
                obs[env] = random_stack()
            if kind == 1:  # a stack that does not continue
                next_obs[env] = random_stack()
            elif kind == 2:  # a frame in the middle differs from the shifted observation
                next_obs[env] = np.concatenate((obs[env, 1:], frame()[None]))
                next_obs[env, 1] = frame()
            elif kind == 3:  # unchanged, or all zeros
                next_obs[env] = obs[env] if rng.random() < 0.5 else 0
            else:
                next_obs[env] = np.concatenate((obs[env, 1:], frame()[None]))
            current[env] = next_obs[env]
            if kind >= 6:  # the episode ends at next_obs (its terminal observation); the next one starts zero-padded
                dones[env] = 1.0
                infos[env]["TimeLimit.truncated"] = bool(rng.random() < 0.3)
                current[env] = 0
                current[env, -1] = frame()
        actions = rng.integers(0, 3, (n_envs, 1))
        transitions.append((obs, next_obs, actions, rng.standard_normal(n_envs).astype(np.float32), dones, infos))
    return transitions


@pytest.mark.parametrize(
    ("n_envs", "shape", "dtype", "timeouts"),
    [(2, (4, 3, 5), np.uint8, True), (1, (4, 6), np.uint8, False), (3, (3, 4), np.float32, True)],
)
def test_any_observations_are_stored_exactly_and_live_frames_are_never_overwritten(n_envs, shape, dtype, timeouts):
    """A tiny buffer wrapping many times over transitions of every kind: each step, every stored stack is stock's."""
    space = spaces.Box(-10, 10, shape, dtype) if dtype != np.uint8 else spaces.Box(0, 255, shape, dtype)
    kwargs = dict(device="cpu", n_envs=n_envs, handle_timeout_termination=timeouts)
    ours = FrameStackReplayBuffer(3 * n_envs, space, spaces.Discrete(3), **kwargs)
    stock = ReplayBuffer(3 * n_envs, space, spaces.Discrete(3), **kwargs)
    capacity = ours.frames.capacity
    for transition in _synthetic_transitions(200, n_envs, shape, dtype, seed=n_envs):
        _fill([ours, stock], [transition])
        _assert_same_contents(ours, stock)
    assert ours.frames.capacity > capacity  # frames that do not continue made the ring grow (and move its frames)
    for seed in range(3):
        np.random.seed(seed)
        expected = stock.sample(16)
        np.random.seed(seed)
        _assert_samples_equal(ours.sample(16), expected)
        np.random.seed(seed)
        _assert_samples_equal(sample_minibatches(ours, 16, 1), expected)


def test_frame_stacks_use_a_quarter_of_optimize_memory_usage_storage():
    """Atari's stacks (4 x 84 x 84 bytes): one frame per transition plus 1/16 slack and 64 bytes of frame ids."""
    buffer_size, frame = 16_000, 84 * 84
    ours = FrameStackReplayBuffer(buffer_size, ATARI_SPACE, spaces.Discrete(4), device="cpu")
    stock = ReplayBuffer(buffer_size, ATARI_SPACE, spaces.Discrete(4), device="cpu")
    compact_kwargs = dict(optimize_memory_usage=True, handle_timeout_termination=False)
    compact = ReplayBuffer(buffer_size, ATARI_SPACE, spaces.Discrete(4), device="cpu", **compact_kwargs)
    others = 8 + 3 * 4  # int64 action, float32 reward, done, timeout
    capacity = buffer_size + buffer_size // 16 + 2 * 4
    assert ours.nbytes == (capacity + 1) * frame + 4 * capacity + 8 + buffer_size * (2 * 4 * 8 + others)
    stock_bytes = sum(a.nbytes for a in (stock.observations, stock.next_observations, stock.actions, stock.rewards))
    stock_bytes += stock.dones.nbytes + stock.timeouts.nbytes
    compact_bytes = sum(a.nbytes for a in (compact.observations, compact.actions, compact.rewards))
    compact_bytes += compact.dones.nbytes + compact.timeouts.nbytes
    assert stock_bytes == buffer_size * (8 * frame + others)
    assert compact_bytes / ours.nbytes > 3.5 and stock_bytes / ours.nbytes > 7.0


def _dqn(replay_buffer_class: type[ReplayBuffer], **kwargs: Any) -> DQN:
    model = DQN(
        "CnnPolicy",
        _atari_env(transposed=False),  # SB3 wraps VecTransposeImage
        buffer_size=120,
        learning_starts=100,
        batch_size=16,
        train_freq=4,
        target_update_interval=40,
        replay_buffer_class=replay_buffer_class,
        policy_kwargs=dict(net_arch=[32], features_extractor_kwargs=dict(features_dim=32)),
        device="cpu",
        seed=0,
        **kwargs,
    )
    model.learn(300)
    return model


def test_dqn_on_atari_learns_the_same_with_frame_stacks(tmp_path):
    """Same samples, same operations on the same shapes: the same parameters, bit for bit."""
    ours, stock = _dqn(FrameStackReplayBuffer), _dqn(ReplayBuffer)
    assert isinstance(ours.replay_buffer, FrameStackReplayBuffer) and ours._n_updates == stock._n_updates > 0
    _assert_same_contents(ours.replay_buffer, stock.replay_buffer)
    for (name, a), b in zip(ours.policy.state_dict().items(), stock.policy.state_dict().values(), strict=True):
        assert th.equal(a, b), name
    ours.save_replay_buffer(tmp_path / "buffer.pkl")
    other = DQN("CnnPolicy", _atari_env(transposed=False), buffer_size=120, device="cpu")
    other.load_replay_buffer(tmp_path / "buffer.pkl")
    loaded = other.replay_buffer
    assert isinstance(loaded, FrameStackReplayBuffer) and loaded is not ours.replay_buffer
    _assert_same_contents(loaded, stock.replay_buffer)
    np.random.seed(3)
    expected = stock.replay_buffer.sample(32)
    np.random.seed(3)
    _assert_samples_equal(loaded.sample(32), expected)


def test_pickled_buffer_keeps_storing_exactly(atari_transitions, tmp_path):
    ours = FrameStackReplayBuffer(60, ATARI_SPACE, spaces.Discrete(4), device="cpu", n_envs=2)
    stock = ReplayBuffer(60, ATARI_SPACE, spaces.Discrete(4), device="cpu", n_envs=2)
    _fill([ours, stock], atari_transitions[:50])
    save_to_pkl(tmp_path / "buffer", ours)
    loaded = load_from_pkl(tmp_path / "buffer")
    assert loaded.observations.buffer is loaded  # its stacks are its own, not the original's
    _fill([loaded, stock], atari_transitions[50:120])
    _assert_same_contents(loaded, stock)


def test_dqn_combined_replay_and_n_steps_with_frame_stacks():
    combined = _dqn(FrameStackReplayBuffer, combined_replay=True)
    assert combined._n_updates > 0
    n_step = _dqn(FrameStackReplayBuffer, replay_buffer_kwargs=dict(n_steps=3, gamma=0.99))
    assert n_step.replay_buffer.n_steps == 3 and n_step._n_updates > 0
    as_dqn_argument = _dqn(FrameStackReplayBuffer, n_steps=3, gamma=0.9)  # DQN's own n_steps reaches the buffer
    assert (as_dqn_argument.replay_buffer.n_steps, as_dqn_argument.replay_buffer.gamma) == (3, 0.9)
    with pytest.raises(UserValueError, match="combined_replay=True needs one-step transitions"):
        _dqn(FrameStackReplayBuffer, n_steps=3, combined_replay=True)


def test_bad_arguments_name_the_problem_and_the_fix():
    actions = spaces.Discrete(2)
    with pytest.raises(UserValueError, match=r"channels-last.*VecTransposeImage"):
        FrameStackReplayBuffer(10, spaces.Box(0, 255, (84, 84, 4), np.uint8), actions)
    with pytest.raises(UserTypeError, match="Box observation space"):
        FrameStackReplayBuffer(10, spaces.Discrete(5), actions)
    with pytest.raises(UserValueError, match="optimize_memory_usage"):
        FrameStackReplayBuffer(10, ATARI_SPACE, actions, optimize_memory_usage=True, handle_timeout_termination=False)
    with pytest.raises(UserValueError, match="n_stack=3"):
        FrameStackReplayBuffer(10, ATARI_SPACE, actions, n_stack=3)
    with pytest.raises(UserValueError, match="n_steps=0"):
        FrameStackReplayBuffer(10, ATARI_SPACE, actions, n_steps=0)

    class Both(PrioritizedReplayBuffer, FrameStackReplayBuffer):
        pass

    with pytest.raises(UserTypeError, match="prioritised"):
        Both(10, ATARI_SPACE, actions)
    buffer = FrameStackReplayBuffer(10, ATARI_SPACE, actions)
    with pytest.raises(IndexError, match="whole positions"):
        buffer.observations[0, 0] = np.zeros((4, 84, 84), np.uint8)


def test_colour_frames_stack_several_channels():
    """RGB frames stacked by 4 on the first axis (12 channels): one frame is 3 channels."""
    space = spaces.Box(0, 255, (12, 5, 5), np.uint8)
    ours = FrameStackReplayBuffer(8, space, spaces.Discrete(2), device="cpu", n_stack=4)
    stock = ReplayBuffer(8, space, spaces.Discrete(2), device="cpu")
    rng = np.random.default_rng(0)
    frames = rng.integers(1, 255, (20, 3, 5, 5), dtype=np.uint8)
    for t in range(15):
        obs, next_obs = frames[t : t + 4].reshape(1, 12, 5, 5), frames[t + 1 : t + 5].reshape(1, 12, 5, 5)
        _fill([ours, stock], [(obs, next_obs, np.zeros((1, 1)), np.zeros(1), np.zeros(1), [{}])])
    _assert_same_contents(ours, stock)
    assert ours.frames.next_ids[0] == 4 + 15  # one frame per transition after the first stack


@pytest.mark.parametrize(
    ("algo", "env_id", "params", "stock", "frames_once"),
    [
        ("qrdqn", "BreakoutNoFrameskip-v4", {}, False, True),
        ("dqn", "BreakoutNoFrameskip-v4", {}, False, True),
        ("qrdqn", "BreakoutNoFrameskip-v4", {}, True, False),
        ("dqn", "BreakoutNoFrameskip-v4", {"optimize_memory_usage": True}, False, False),
        ("dqn", "CartPole-v1", {}, False, False),
    ],
)
def test_zoo_runs_store_atari_frames_once(algo: str, env_id: str, params: dict, stock: bool, frames_once: bool) -> None:
    """
    The CLI's (and the benchmark's) DQN and QR-DQN on the Zoo's frame-stacked ``atari`` sections store each frame once:
    the Zoo's 1M-transition QR-DQN buffer needs 56 GB in SB3's default buffer. Stock runs, other buffers asked for and
    non-image observations keep SB3's buffer.
    """
    if "Breakout" in env_id:
        pytest.importorskip("ale_py")
    from sb3_speedups.zoo.envs import make_env
    from sb3_speedups.zoo.train import TrainConfig, create_model, prepare_experiment

    hyperparams = {"buffer_size": 500, "learning_starts": 50, **params}
    if params.get("optimize_memory_usage"):
        hyperparams["replay_buffer_kwargs"] = {"handle_timeout_termination": False}
    config = TrainConfig(algo=algo, env_id=env_id, n_timesteps=80, seed=0, hyperparams=hyperparams, stock=stock)
    experiment = prepare_experiment(config)
    env = make_env(env_id, experiment.hyperparams, experiment.hyperparams.n_envs, 0, vec_env="dummy")
    try:
        model = create_model(experiment, env)
        assert isinstance(model.replay_buffer, FrameStackReplayBuffer) is frames_once
        model.learn(80)
        assert model.replay_buffer.pos * env.num_envs == model.num_timesteps >= 80
    finally:
        env.close()
