"""
Checks of :class:`RayVecEnv` on a real two-node Ray cluster. Not collected by a plain ``pytest`` run (no ``test_``
prefix): ``tests/test_ray_vec_env.py`` runs this file inside ``scripts/ray_local_cluster.sh``, which starts the
cluster in a network namespace with loopback only and sets ``RAY_ADDRESS``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv

from sb3_speedups import PPO, make_vec_env
from sb3_speedups.cli import main
from sb3_speedups.common.vec_env import RemoteTraceback, WorkerDiedError
from sb3_speedups.common.vec_env.ray_vec_env import RayVecEnv
from sb3_speedups.errors import UserError
from tests.vec_env_helpers import SpacesEnv, assert_same, assert_same_step, env_fns, random_actions

ray = pytest.importorskip("ray")

ADDRESS = os.environ.get("RAY_ADDRESS", "")
WAIT_S = 60.0  # generous bound on anything that must happen "within seconds"
ACTIONS = np.zeros((4, 2), dtype=np.float32)


class WaitForFileEnv(SpacesEnv):
    """Its steps block until the file ``path`` exists (at most ``WAIT_S``): proves the caller was not blocked."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(self.path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path} never appeared: step_async did not return before the step finished")
            time.sleep(0.01)
        return super().step(action)


@pytest.fixture(scope="module", autouse=True)
def cluster():
    if not ADDRESS.startswith("127.0.0.1:"):
        pytest.skip("run by tests/test_ray_vec_env.py inside scripts/ray_local_cluster.sh (RAY_ADDRESS=127.0.0.1:PORT)")
    ray.init(address=ADDRESS, log_to_driver=False)
    try:
        nodes = [node for node in ray.nodes() if node["Alive"]]
        # Loopback only: no node may have registered with another address.
        assert [node["NodeManagerAddress"] for node in nodes] == ["127.0.0.1"] * 2, nodes
        yield
    finally:
        ray.shutdown()


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


def run_both(ours: RayVecEnv, ref: DummyVecEnv, n_steps: int, seed: int = 3) -> None:
    ours.seed(seed)
    ref.seed(seed)
    assert_same(ours.reset(), ref.reset(), "reset")
    assert_same(ours.reset_infos, ref.reset_infos, "reset_infos")
    for t, actions in enumerate(random_actions(ref.action_space, ref.num_envs, n_steps, seed)):
        assert_same_step(ours.step(actions), ref.step(actions), f"step {t}")
        assert_same(ours.reset_infos, ref.reset_infos, f"step {t} reset_infos")


@pytest.mark.parametrize("obs", ["box", "dict", "image"])
def test_same_as_dummy_with_actors_on_both_nodes(obs: str) -> None:
    fns = env_fns(5, obs=obs, action="discrete" if obs == "dict" else "box")
    ours = RayVecEnv(fns, n_workers=2, address=ADDRESS)
    try:
        assert len(set(ours.actor_node_ids())) == 2, "the actors should be spread over both nodes"
        run_both(ours, DummyVecEnv(fns), n_steps=30)
    finally:
        ours.close()


def test_envs_per_worker_seeds_options_attributes_and_images() -> None:
    fns = [lambda: Monitor(SpacesEnv(render_mode="rgb_array")), lambda: SpacesEnv(render_mode="rgb_array")] * 2
    ours = RayVecEnv(fns, envs_per_worker=1, address=ADDRESS, num_cpus=0.5)
    ref = DummyVecEnv(fns)
    try:
        assert len(ours.actor_pids()) == 4
        assert ours.metadata == ref.metadata and ours.render_mode == "rgb_array"
        for venv in (ours, ref):
            venv.seed(11)
            venv.set_options([{"offset": float(i)} for i in range(4)])
        assert_same(ours.reset(), ref.reset())
        assert_same(ours.reset_infos, ref.reset_infos)
        assert [info["offset"] for info in ours.reset_infos] == [0.0, 1.0, 2.0, 3.0]
        for venv in (ours, ref):
            venv.step(ACTIONS)
            venv.set_attr("marker", "odd", indices=[1, 3])
            venv.set_attr("marker", "first", indices=0)
        for indices in (None, 2, [3, 0], range(1, 3)):
            assert ours.get_attr("marker", indices) == ref.get_attr("marker", indices)
            assert ours.env_method("add", 2, b=3, indices=indices) == ref.env_method("add", 2, b=3, indices=indices)
            assert ours.env_is_wrapped(Monitor, indices) == ref.env_is_wrapped(Monitor, indices)
        assert ours.env_is_wrapped(Monitor) == [True, False, True, False]
        assert_same(list(ours.get_images()), list(ref.get_images()))
        with pytest.raises(AttributeError):
            ours.get_attr("no_such_attribute", indices=[3])
    finally:
        ours.close()


def test_make_vec_env_ppo_and_the_cli(tmp_path: Path) -> None:
    ours = make_vec_env("CartPole-v1", n_envs=3, seed=0, vec_env_cls=RayVecEnv, vec_env_kwargs={"address": ADDRESS})
    ref = make_vec_env("CartPole-v1", n_envs=3, seed=0)
    try:
        assert_same(ours.reset(), ref.reset())
        PPO("MlpPolicy", ours, n_steps=16, batch_size=16, n_epochs=1, seed=0).learn(48)
    finally:
        ours.close()
    args = ["train", "--algo", "ppo", "--env", "CartPole-v1", "-n", "64", "--seed", "0", "-f", str(tmp_path), "--vec-env",
            "ray", "--ray-address", ADDRESS, "--eval-freq", "0", "--eval-episodes", "1", "--no-progress", "--verbose", "0",
            "-params", "n_envs:2", "n_steps:32", "batch_size:32", "n_epochs:1"]  # fmt: skip
    assert main(args) == 0
    assert list(tmp_path.rglob("*.zip"))


def test_step_async_returns_before_the_actors_finish(tmp_path: Path) -> None:
    flag = tmp_path / "go"
    ours = RayVecEnv([lambda: WaitForFileEnv(str(flag))] * 2, n_workers=2, address=ADDRESS)
    try:
        ours.reset()
        ours.step_async(np.zeros((2, 2), dtype=np.float32))
        with pytest.raises(UserError, match="pending"):
            ours.get_attr("t")
        flag.touch()  # only now can the actors' steps finish
        ours.step_wait()
        assert ours.get_attr("t") == [1, 1]
        ours.step_async(np.zeros((2, 2), dtype=np.float32))
        assert_same(ours.reset(), ours._obs())  # reset cancels the pending step
    finally:
        ours.close()


def test_env_exception_names_the_env_and_keeps_the_remote_traceback() -> None:
    ours = RayVecEnv(env_fns(4, per_env={"fail_at": [None, None, None, 2]}), n_workers=2, address=ADDRESS)
    try:
        ours.reset()
        ours.step(ACTIONS)
        with pytest.raises(ValueError, match="step 2 failed on purpose") as info:
            ours.step(ACTIONS)
        exc = info.value
        assert exc.sb3_env_index == 3
        assert "raised by env 3 during step in the Ray actor 1 (host" in notes(exc)
        assert isinstance(exc.__cause__, RemoteTraceback)
        assert "vec_env_helpers.py" in str(exc.__cause__) and "in step" in str(exc.__cause__)
        assert "RemoteTraceback" in "".join(traceback.format_exception(exc))
        ours.reset()  # the VecEnv goes on
        ours.step(ACTIONS)
    finally:
        ours.close()
    ours = RayVecEnv(env_fns(3, per_env={"fail_reset": [False, False, True]}), n_workers=2, address=ADDRESS)
    try:
        with pytest.raises(ValueError, match="reset failed") as info:
            ours.reset()
        assert "raised by env 2 during reset" in notes(info.value)
    finally:
        ours.close()


def test_timeouts_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"1 actors of 64 CPUs each did not start within 1 s; the cluster has 2 CPUs"):
        RayVecEnv(env_fns(2), n_workers=1, address=ADDRESS, num_cpus=64, startup_timeout_s=1.0)
    never = tmp_path / "never"
    ours = RayVecEnv([lambda: WaitForFileEnv(str(never))], address=ADDRESS, num_cpus=0.5, step_timeout_s=1.0)
    try:
        ours.reset()
        with pytest.raises(ray.exceptions.GetTimeoutError, match="step did not finish within 1 s; close this VecEnv"):
            ours.step(np.zeros((1, 2), dtype=np.float32))
        with pytest.raises(WorkerDiedError, match="step did not finish"):
            ours.reset()
    finally:
        ours.close()


def wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_killed_actor_raises_a_clear_error_and_close_kills_the_rest() -> None:
    ours = RayVecEnv(env_fns(4), n_workers=2, address=ADDRESS, step_timeout_s=WAIT_S)
    actors = [handle.actor for handle in ours._actors]
    try:
        ours.reset()
        ours.step(ACTIONS)
        pids = ours.actor_pids()
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=r"RayVecEnv actor 1 \(envs 2-3, .*\) .* during step; close this VecEnv"):
            for _ in range(1000):  # the step in flight when the kill lands may still be answered
                ours.step(ACTIONS)
        with pytest.raises(WorkerDiedError):
            ours.reset()
    finally:
        ours.close()
    ours.close()  # idempotent
    assert wait_gone(pids[0]), "close() must kill the surviving actor"
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actors[0].pid.remote(), timeout=WAIT_S)


def raylet_pid(node_id: str) -> int:
    """The raylet of ``node_id`` (this runs in the cluster's own PID namespace: only its processes are seen)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                args = Path(f"/proc/{entry}/cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue
            if args[0].endswith("raylet") and f"--node_id={node_id}" in args:
                return int(entry)
    raise AssertionError(f"no raylet process for node {node_id}")


def test_node_stopped_mid_run_raises_a_clear_error() -> None:
    # A third node, joined as the second was and used only here, so the cluster stays whole for the other checks.
    ray_cli = str(Path(sys.executable).with_name("ray"))
    before = {node["NodeID"] for node in ray.nodes()}
    subprocess.run(
        [ray_cli, "start", f"--address={ADDRESS}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
         "--object-store-memory=80000000", '--resources={"doomed": 2}', "--disable-usage-stats"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    node_id = next(node["NodeID"] for node in ray.nodes() if node["NodeID"] not in before and node["Alive"])
    assert next(node for node in ray.nodes() if node["NodeID"] == node_id)["NodeManagerAddress"] == "127.0.0.1"
    ours = RayVecEnv(
        env_fns(4), n_workers=2, address=ADDRESS, actor_options={"resources": {"doomed": 1}}, step_timeout_s=WAIT_S
    )
    try:
        assert ours.actor_node_ids() == [node_id, node_id]
        ours.reset()
        ours.step(ACTIONS)
        os.kill(raylet_pid(node_id), signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=r"RayVecEnv actor \d .* during step; close this VecEnv"):
            for _ in range(100_000):
                ours.step(ACTIONS)
    finally:
        ours.close()
