"""BatchedSubprocVecEnv returns exactly what DummyVecEnv returns, for every space type, split and API method."""

from __future__ import annotations

import json
from collections import OrderedDict

import gymnasium as gym
import numpy as np
import pytest
from stable_baselines3 import DQN, PPO
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv

from sb3_speedups import BatchedSubprocVecEnv, make_vec_env
from sb3_speedups.bench.vec_env import format_summary, run_vec_env_benchmark
from sb3_speedups.common.vec_env.startup import pick_split
from sb3_speedups.cli import main
from sb3_speedups.errors import UserError
from sb3_speedups.zoo.envs import make_env
from sb3_speedups.zoo.hyperparams import Hyperparams
from tests.vec_env_helpers import OBS_SPACES, SpacesEnv, assert_same, assert_same_step, env_fns, random_actions

N_ENVS = 5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_both(ours, ref, n_steps: int, seed: int = 3) -> None:
    ours.seed(seed)
    ref.seed(seed)
    assert_same(ours.reset(), ref.reset(), "reset")
    assert_same(ours.reset_infos, ref.reset_infos, "reset_infos")
    for t, actions in enumerate(random_actions(ref.action_space, ref.num_envs, n_steps, seed)):
        assert_same_step(ours.step(actions), ref.step(actions), f"step {t}")
        assert_same(ours.reset_infos, ref.reset_infos, f"step {t} reset_infos")


@pytest.mark.parametrize("obs", list(OBS_SPACES))
@pytest.mark.parametrize("n_local", [0, 2])
def test_same_as_dummy_for_each_space(obs: str, n_local: int) -> None:
    fns = env_fns(N_ENVS, obs=obs, action="discrete" if obs == "dict" else "box")
    ours = BatchedSubprocVecEnv(fns, n_workers=2, start_method="fork", n_local=n_local)
    try:
        assert ours.observation_space == OBS_SPACES[obs]
        run_both(ours, DummyVecEnv(fns), n_steps=40)
    finally:
        ours.close()


def test_auto_split_same_as_dummy() -> None:
    # A slow env: the split is rehearsed and the fastest one kept, ties to the workers (depends on the load).
    fns = env_fns(N_ENVS, delay=1e-4)
    ours = BatchedSubprocVecEnv(fns, start_method="fork")
    try:
        assert ours.step_cost is not None and ours.step_cost >= 1e-4
        assert set(ours.split_times) == set(range(N_ENVS + 1))
        assert ours.n_local == pick_split(ours.split_times)
        assert len(ours.worker_pids()) == (0 if ours.n_local == N_ENVS else 1)
        run_both(ours, DummyVecEnv(fns), n_steps=20)
    finally:
        ours.close()
    # A cheap env: no split could beat stepping in-process, so no worker is even started (unless the machine's
    # load inflated the measured step cost; then the rehearsal decides, as above).
    cheap = BatchedSubprocVecEnv(env_fns(N_ENVS), start_method="fork")
    try:
        assert cheap.step_cost is not None
        if not cheap.split_times:
            assert cheap.n_local == N_ENVS and cheap.worker_pids() == [] and cheap.split_times == {}
        else:
            assert cheap.n_local == pick_split(cheap.split_times)
        run_both(cheap, DummyVecEnv(env_fns(N_ENVS)), n_steps=20)
    finally:
        cheap.close()


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_start_methods(start_method: str) -> None:
    fns = env_fns(3, obs="dict", action="discrete")
    ours = BatchedSubprocVecEnv(fns, n_workers=1, start_method=start_method, n_local=1)
    try:
        assert len(ours.worker_pids()) == 1
        run_both(ours, DummyVecEnv(fns), n_steps=20)
    finally:
        ours.close()


def test_actions_in_other_dtypes_and_lists() -> None:
    fns = env_fns(4, action="discrete")
    ours = BatchedSubprocVecEnv(fns, n_workers=1, start_method="fork", n_local=1)
    ref = DummyVecEnv(fns)
    try:
        ours.seed(0)
        ref.seed(0)
        ours.reset()
        ref.reset()
        for actions in (np.array([0, 1, 2, 1], dtype=np.int32), np.array([2, 2, 0, 1], dtype=np.uint8), [1, 0, 2, 2]):
            assert_same_step(ours.step(actions), ref.step(actions), str(actions))
    finally:
        ours.close()


def test_reset_seeds_options_and_seed() -> None:
    fns = env_fns(4)
    ours = BatchedSubprocVecEnv(fns, n_workers=1, start_method="fork", n_local=2)
    ref = DummyVecEnv(fns)
    try:
        for venv in (ours, ref):
            venv.seed(11)
            venv.set_options([{"offset": float(i)} for i in range(4)])
        assert_same(ours.reset(), ref.reset())
        assert [info["offset"] for info in ours.reset_infos] == [0.0, 1.0, 2.0, 3.0]
        actions = np.zeros((4, 2), dtype=np.float32)
        assert_same_step(ours.step(actions), ref.step(actions))
        # Seeds and options are used once: the next reset draws new states and has no offset.
        first = ours.reset()
        ref.reset()
        assert all(info["offset"] == 0.0 for info in ours.reset_infos)
        ours.seed(11)
        ref.seed(11)
        assert_same(ours.reset(), ref.reset())
        assert not np.array_equal(first, ours.reset())
    finally:
        ours.close()


def test_attributes_methods_and_wrappers() -> None:
    fns = [lambda: Monitor(SpacesEnv()), lambda: SpacesEnv(), lambda: Monitor(SpacesEnv()), lambda: SpacesEnv()]
    ours = BatchedSubprocVecEnv(fns, n_workers=1, start_method="fork", n_local=1)
    ref = DummyVecEnv(fns)
    try:
        for venv in (ours, ref):
            venv.reset()
            venv.step(np.zeros((4, 2), dtype=np.float32))
            venv.set_attr("marker", "odd", indices=[1, 3])
            venv.set_attr("marker", "first", indices=0)
        for indices in (None, 2, [3, 0], range(1, 3)):
            assert ours.get_attr("marker", indices) == ref.get_attr("marker", indices)
            assert ours.get_attr("t", indices) == ref.get_attr("t", indices)
            assert ours.env_method("add", 2, b=3, indices=indices) == ref.env_method("add", 2, b=3, indices=indices)
            assert ours.env_is_wrapped(Monitor, indices) == ref.env_is_wrapped(Monitor, indices)
        assert ours.env_is_wrapped(Monitor) == [True, False, True, False]
        assert ours.has_attr("marker") and not ours.has_attr("no_such_attribute")
        with pytest.raises(AttributeError):
            ours.get_attr("no_such_attribute", indices=[3])
    finally:
        ours.close()


def test_render_and_images() -> None:
    fns = env_fns(4, render_mode="rgb_array")
    ours = BatchedSubprocVecEnv(fns, n_workers=1, start_method="fork", n_local=2)
    ref = DummyVecEnv(fns)
    try:
        assert ours.render_mode == "rgb_array"
        assert ours.metadata == ref.metadata == SpacesEnv.metadata
        for venv in (ours, ref):
            venv.reset()
            venv.step(np.zeros((4, 2), dtype=np.float32))
        assert_same(list(ours.get_images()), list(ref.get_images()))
        assert_same(ours.render(), ref.render())
    finally:
        ours.close()
    plain = BatchedSubprocVecEnv(env_fns(2), n_workers=1, start_method="fork", n_local=1)
    try:
        with pytest.warns(UserWarning, match="render mode"):
            assert plain.get_images() == [None, None]
    finally:
        plain.close()


def test_reset_cancels_a_pending_step_and_misuse_is_refused() -> None:
    fns = env_fns(4)
    ours = BatchedSubprocVecEnv(fns, n_workers=1, start_method="fork", n_local=1)
    try:
        ours.reset()
        ours.step_async(np.zeros((4, 2), dtype=np.float32))
        with pytest.raises(UserError, match="pending"):
            ours.step_async(np.zeros((4, 2), dtype=np.float32))
        with pytest.raises(UserError, match="pending"):
            ours.get_attr("t")
        ours.seed(5)
        obs = ours.reset()
        ref = DummyVecEnv(fns)
        ref.seed(5)
        assert_same(obs, ref.reset())
        assert ours.get_attr("t") == [0, 0, 0, 0]
    finally:
        ours.close()
    with pytest.raises(UserError, match="closed"):
        ours.reset()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_workers": 0}, "n_workers"),
        ({"n_local": 9}, "n_local"),
        ({"n_local": "some"}, "n_local"),
        ({"start_method": "teleport"}, "^cannot find context for 'teleport': .*start_method"),  # as SB3's test expects
        ({"spin_us": -1.0}, "spin_us"),
        ({"n_local": 4, "n_workers": 1}, "keeps every env"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(UserError, match=message) as info:
        BatchedSubprocVecEnv(env_fns(4), **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("n_local, n_workers", [(0, 2), (1, 1), (2, 1), (3, None)])
def test_indices_select_the_envs_dummy_vec_env_selects(n_local: int, n_workers: int | None) -> None:
    """Negative (SB3's test_vecenv_custom_calls uses [0, -1]), unsorted and repeated indices, for envs anywhere."""
    fns = env_fns(3)
    ours = BatchedSubprocVecEnv(fns, n_workers=n_workers, start_method="fork", n_local=n_local)
    ref = DummyVecEnv(fns)
    try:
        for venv in (ours, ref):
            venv.seed(4)
            venv.reset()
            assert venv.env_method("set_wrapper_attr", "t", 12, indices=[0, -1]) == [True, True]
            for i, marker in ((0, "first"), (1, "middle"), (-1, "last")):
                venv.set_attr("marker", marker, indices=i)
        assert ours.get_attr("t") == ref.get_attr("t") == [12, 0, 12]
        for indices in (None, [0, -1], -2, [2, 0], [-1, 1, -3], [1, 1], np.array([-2, 0])):
            assert ours.get_attr("marker", indices) == ref.get_attr("marker", indices), indices
        # A repeated index calls the env again, in order: each call's own result comes back
        assert_same(ours.env_method("reset", indices=[0, -1, 0, 2]), ref.env_method("reset", indices=[0, -1, 0, 2]))
        for venv, bad in ((ours, [3]), (ref, [3]), (ours, [0, -4]), (ref, [0, -4])):
            with pytest.raises(IndexError):
                venv.get_attr("t", bad)
    finally:
        ours.close()


def calls_until_error(venv) -> tuple[int, type | None]:
    """:return: the steps made after the reset until an error, and its type"""
    venv.seed(0)
    calls = 0
    try:
        venv.reset()
        for actions in random_actions(venv.action_space, venv.num_envs, 500):
            calls += 1
            venv.step(actions)
    except Exception as exc:
        return calls, type(exc)
    return calls, None


@pytest.mark.parametrize("case", ["fail_at", "fail_reset", "record_episode_statistics"])
def test_start_up_timing_leaves_env_errors_to_their_first_use(case: str) -> None:
    """n_local="auto" steps a throw-away env at start-up: an env's error must come where stock's comes, not there."""
    if case == "record_episode_statistics":
        # SB3's make_vec_env puts a Monitor under the wrapper, so both write info["episode"] and the wrapper asserts
        # at the first episode end, for stock as for ours.
        kwargs = {"n_envs": 2, "seed": 0, "wrapper_class": gym.wrappers.RecordEpisodeStatistics}
        ours = make_vec_env("CartPole-v1", vec_env_cls=BatchedSubprocVecEnv, vec_env_kwargs={"start_method": "fork"}, **kwargs)
        ref = make_vec_env("CartPole-v1", **kwargs)
    else:
        fns = env_fns(2, **{case: 1 if case == "fail_at" else True})
        ours, ref = BatchedSubprocVecEnv(fns, start_method="fork"), DummyVecEnv(fns)
    try:
        assert calls_until_error(ours) == calls_until_error(ref) != (500, None)
    finally:
        ours.close()


def test_halves_step_while_the_other_half_waits() -> None:
    fns = env_fns(6, obs="dict", action="discrete")
    ours = BatchedSubprocVecEnv(fns, n_workers=2, start_method="fork", n_local=0)
    refs = [DummyVecEnv(fns[:3]), DummyVecEnv(fns[3:])]
    try:
        half_a, half_b = ours.halves()
        assert half_a.tolist() == [0, 1, 2] and half_b.tolist() == [3, 4, 5]
        ours.seed(2)
        refs[0].seed(2)
        refs[1].seed(5)
        obs = ours.reset()
        for ref, half in zip(refs, (half_a, half_b), strict=True):
            assert_same(OrderedDict((key, value[half]) for key, value in obs.items()), ref.reset())
        actions = random_actions(ours.action_space, 6, 30)
        ours.step_async_indices(actions[0][half_a], half_a)
        ours.step_async_indices(actions[0][half_b], half_b)
        with pytest.raises(UserError, match="pending"):
            ours.step_async_indices(actions[0][half_a], half_a)
        with pytest.raises(UserError, match="pending"):
            ours.step_async(actions[0])
        for t in range(30):
            for ref, half in zip(refs, (half_a, half_b), strict=True):
                assert_same_step(ours.step_wait_indices(half), ref.step(actions[t][half]), f"step {t} half {half[0]}")
                if t + 1 < 30:
                    ours.step_async_indices(actions[t + 1][half], half)
        # Back to whole steps: all envs move together again.
        ours.step(actions[0])
    finally:
        ours.close()


def test_subsets_with_local_envs_and_bad_subsets() -> None:
    fns = env_fns(4)
    ours = BatchedSubprocVecEnv(fns, n_workers=1, start_method="fork", n_local=2)
    ref = DummyVecEnv(fns)
    try:
        local, remote = ours.halves()
        assert local.tolist() == [0, 1] and remote.tolist() == [2, 3]
        ours.seed(0)
        ref.seed(0)
        ours.reset()
        ref.reset()
        actions = np.ones((4, 2), dtype=np.float32)
        ours.step_async_indices(actions[remote], remote)
        ours.step_async_indices(actions[local], local)
        obs_l, rew_l, done_l, infos_l = ours.step_wait_indices(local)
        obs_r, rew_r, done_r, infos_r = ours.step_wait_indices(remote)
        ref_obs, ref_rew, ref_done, ref_infos = ref.step(actions)
        assert_same(np.concatenate([obs_l, obs_r]), ref_obs)
        assert_same(np.concatenate([rew_l, rew_r]), ref_rew)
        assert_same(np.concatenate([done_l, done_r]), ref_done)
        assert_same(infos_l + infos_r, list(ref_infos))
        for bad in ([2, 1], [], [4]):
            with pytest.raises(UserError, match="indices"):
                ours.step_async_indices(actions[:1], bad)
        with pytest.raises(UserError, match="no pending"):
            ours.step_wait_indices([0])
    finally:
        ours.close()
    single = BatchedSubprocVecEnv(fns, n_workers=1, start_method="fork", n_local=0)
    try:
        with pytest.raises(UserError, match="halves"):
            single.halves()
    finally:
        single.close()


@pytest.mark.parametrize("algo", [PPO, DQN])
def test_sb3_learns_the_same_with_it(algo: type) -> None:
    kwargs = {"n_steps": 16, "batch_size": 32, "n_epochs": 2} if algo is PPO else {"learning_starts": 32, "train_freq": 4}
    params = []
    for vec_env_cls, vec_env_kwargs in ((DummyVecEnv, {}), (BatchedSubprocVecEnv, {"start_method": "fork", "n_local": 1})):
        env = make_vec_env("CartPole-v1", n_envs=4, seed=0, vec_env_cls=vec_env_cls, vec_env_kwargs=vec_env_kwargs)
        model = algo("MlpPolicy", env, seed=0, device="cpu", **kwargs)
        model.learn(160)
        params.append([p.detach().clone() for p in model.policy.parameters()])
        env.close()
    for ours, ref in zip(*params, strict=True):
        np.testing.assert_array_equal(ours.numpy(), ref.numpy())


def test_make_vec_env_and_zoo_kind() -> None:
    env = make_vec_env("CartPole-v1", n_envs=3, seed=1, vec_env_cls=BatchedSubprocVecEnv, n_workers=1, start_method="fork")
    try:
        assert isinstance(env, BatchedSubprocVecEnv) and len(env.worker_pids()) <= 1
        assert env.env_is_wrapped(Monitor) == [True, True, True]
    finally:
        env.close()
    with pytest.raises(UserError, match="n_workers"):
        make_vec_env("CartPole-v1", n_envs=2, n_workers=2)
    zoo_env = make_env("CartPole-v1", Hyperparams(n_timesteps=100), 2, seed=0, vec_env="batched")
    try:
        assert isinstance(zoo_env.unwrapped, BatchedSubprocVecEnv)
        zoo_env.reset()
        _, _, _, infos = zoo_env.step(np.array([0, 1]))
        assert infos[0]["TimeLimit.truncated"] is False
    finally:
        zoo_env.close()


def test_cli_trains_with_batched_vec_env(tmp_path) -> None:
    argv = ["train", "--algo", "ppo", "--env", "CartPole-v1", "-n", "128", "--seed", "0", "-f", str(tmp_path)]
    params = ["-params", "n_envs:4", "n_steps:32", "batch_size:64", "n_epochs:1"]
    assert main([*argv, "--vec-env", "batched", "--eval-freq", "0", "--no-progress", "--verbose", "0", *params]) == 0
    assert (tmp_path / "ppo" / "CartPole-v1_1" / "CartPole-v1.zip").exists()


def test_vec_env_benchmark_reports_ratios(tmp_path) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench-vec-env", "--env", "CartPole-v1", "--kinds", "batched:n_local=1", "gym_vector", "--n-envs", "4"]
    assert main([*argv, "--rounds", "2", "--block-steps", "5", "--start-method", "fork", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["throughput"]
    assert list(results) == ["dummy", "subproc", "batched:n_local=1", "gym_vector"]
    assert results["dummy"]["vs_dummy"] == 1.0 and results["subproc"]["vs_subproc"] == 1.0
    assert all(len(row["block_rates"]) == 2 and row["env_steps_per_s"] > 0 for row in results.values())
    assert results["batched:n_local=1"]["n_local"] == 1 and results["batched:n_local=1"]["n_workers"] == 1
    assert "batched:n_local=1" in format_summary("CartPole-v1", results, None)
    with pytest.raises(UserError, match="VecEnv option"):
        run_vec_env_benchmark("CartPole-v1", ["batched:n_local"])


def test_gym_registered_env_by_id_with_workers() -> None:
    fns = [lambda: gym.make("CartPole-v1") for _ in range(4)]
    ours = BatchedSubprocVecEnv(fns, n_workers=1, start_method="fork", n_local=2)
    try:
        run_both(ours, DummyVecEnv(fns), n_steps=200)
    finally:
        ours.close()
