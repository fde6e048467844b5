"""A failing or dying worker never hangs the run, errors name the env, and nothing is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
from stable_baselines3.common.vec_env import DummyVecEnv

from sb3_speedups import BatchedSubprocVecEnv
from sb3_speedups.common.vec_env import RemoteTraceback, WorkerDiedError
from sb3_speedups.errors import UserError
from tests.helpers import REPO_ROOT, subprocess_env
from tests.vec_env_helpers import KillSelfEnv, UnpicklableErrorEnv, assert_same_step, env_fns

ACTIONS = np.zeros((4, 2), dtype=np.float32)


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


def gone(pid: int) -> bool:
    """The process has exited and was reaped (or is a zombie of a parent that is not us)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" in status.read_text()


def wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(gone(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def assert_nothing_left(venv: BatchedSubprocVecEnv, pids: list[int], sem_names: list[str]) -> None:
    assert venv.worker_pids() == []
    assert all(gone(pid) for pid in pids), "a worker process is still there"
    assert not sem_files(sem_names)
    assert not [link for link in open_fd_targets() if "sb3_speedups" in link], "the shared block is still open"


def open_fd_targets() -> list[str]:
    fds = [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")]
    return [os.readlink(fd) for fd in fds if os.path.exists(fd)]


def sem_files(names: list[str]) -> list[str]:
    return [name for name in names if os.path.exists(f"/dev/shm/sem.{name.lstrip('/')}")]


def semaphore_names(venv: BatchedSubprocVecEnv) -> list[str]:
    return [sem._semlock.name for w in venv._pool.workers for sem in (w.go, w.done) if sem._semlock.name]


def test_step_error_in_worker_names_the_env_and_keeps_the_traceback() -> None:
    fns = env_fns(4, per_env={"fail_at": [None, None, None, 2]})
    venv = BatchedSubprocVecEnv(fns, n_workers=1, start_method="fork", n_local=1)
    try:
        venv.reset()
        venv.step(ACTIONS)
        with pytest.raises(ValueError, match="step 2 failed on purpose") as info:
            venv.step(ACTIONS)
        exc = info.value
        assert exc.sb3_env_index == 3
        assert "raised by env 3 during step in the worker 0 (pid" in notes(exc)
        assert isinstance(exc.__cause__, RemoteTraceback)
        assert "vec_env_helpers.py" in str(exc.__cause__) and "in step" in str(exc.__cause__)
        assert "RemoteTraceback" in "".join(traceback.format_exception(exc))
        # The protocol is still in step: the VecEnv goes on (env 3 continues its episode).
        venv.reset()
        venv.step(ACTIONS)
    finally:
        venv.close()


def test_step_error_in_main_process_env() -> None:
    fns = env_fns(4, per_env={"fail_at": [2, None, None, None]})
    venv = BatchedSubprocVecEnv(fns, n_workers=1, start_method="fork", n_local=2)
    try:
        venv.reset()
        venv.step(ACTIONS)
        with pytest.raises(ValueError, match="step 2") as info:
            venv.step(ACTIONS)
        assert "raised by env 0 during step in the main process" in notes(info.value)
        # As in DummyVecEnv the envs after the failing one were not stepped; the worker's step was waited for, so
        # the next command gets its own answer.
        assert venv.get_attr("t")[:2] == [2, 1]
    finally:
        venv.close()


def test_reset_and_creation_errors() -> None:
    fns = env_fns(3, per_env={"fail_reset": [False, False, True]})
    venv = BatchedSubprocVecEnv(fns, n_workers=1, start_method="fork", n_local=1)
    try:
        with pytest.raises(ValueError, match="reset failed") as info:
            venv.reset()
        assert "raised by env 2 during reset" in notes(info.value)
    finally:
        venv.close()

    def broken() -> None:
        raise KeyError("no such asset")

    with pytest.raises(KeyError, match="no such asset") as creation:
        BatchedSubprocVecEnv([*env_fns(2), broken], n_workers=1, start_method="fork", n_local=1)
    assert "raised by env 2 during creation in the worker 0" in notes(creation.value)
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name.startswith("vecenv-worker")]


def test_unpicklable_exception_becomes_runtime_error() -> None:
    venv = BatchedSubprocVecEnv(env_fns(2, cls=UnpicklableErrorEnv), n_workers=1, start_method="fork", n_local=0)
    try:
        venv.reset()
        with pytest.raises(RuntimeError, match="UnpicklableError: 1/2") as info:
            venv.step(ACTIONS[:2])
        assert "raised by env 0 during step" in str(info.value.__cause__)
    finally:
        venv.close()


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_killed_worker_is_detected_and_close_cleans_up(start_method: str) -> None:
    venv = BatchedSubprocVecEnv(env_fns(4), n_workers=1, start_method=start_method, n_local=2)
    pids, sems = venv.worker_pids(), semaphore_names(venv)
    venv.reset()
    os.kill(pids[0], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"worker 0 \(envs 2-3, pid \d+\) was killed by SIGKILL during step"):
        venv.step(ACTIONS)
    assert time.monotonic() - start < 5.0
    with pytest.raises(WorkerDiedError):
        venv.get_attr("t")
    venv.close()
    venv.close()
    assert_nothing_left(venv, pids, sems)


def test_worker_dying_inside_a_step_or_while_idle() -> None:
    fns = env_fns(4, cls=KillSelfEnv, per_env={"fail_at": [None, None, None, 3]})
    venv = BatchedSubprocVecEnv(fns, n_workers=2, start_method="fork", n_local=0)
    pids = venv.worker_pids()
    try:
        venv.reset()
        venv.step(ACTIONS)
        venv.step(ACTIONS)
        with pytest.raises(WorkerDiedError, match=r"worker 1 .* killed by SIGKILL"):
            venv.step(ACTIONS)
    finally:
        venv.close()
    assert wait_gone(pids)
    idle = BatchedSubprocVecEnv(env_fns(4), n_workers=1, start_method="fork", n_local=1)
    try:
        os.kill(idle.worker_pids()[0], signal.SIGTERM)
        with pytest.raises(WorkerDiedError, match="killed by SIGTERM during a command"):
            idle.env_method("add", 1, indices=[3])
    finally:
        idle.close()


def test_close_leaves_nothing_after_errors() -> None:
    fns = env_fns(4, per_env={"fail_at": [None, 1, None, 1]})
    venv = BatchedSubprocVecEnv(fns, n_workers=2, start_method="forkserver", n_local=0)
    pids, sems = venv.worker_pids(), semaphore_names(venv)
    # Named for the start-up only: once both workers run, the names are gone from /dev/shm.
    assert len(sems) == 4 and not sem_files(sems)
    assert [link for link in open_fd_targets() if "sb3_speedups" in link]
    venv.reset()
    with pytest.raises(ValueError):
        venv.step(ACTIONS)
    venv.step_async(ACTIONS)  # a pending step is finished by close
    venv.close()
    assert_nothing_left(venv, pids, sems)


def test_interrupted_step_keeps_the_protocol_in_step() -> None:
    fns = env_fns(2, per_env={"delay": [0.0, 0.5]})
    venv = BatchedSubprocVecEnv(fns, n_workers=1, start_method="fork", n_local=1)
    ref = DummyVecEnv(fns)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        venv.seed(1)
        ref.seed(1)
        venv.reset()
        ref.reset()
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            venv.step(ACTIONS[:2])  # interrupted while the worker's env sleeps in its step
        ref.step(ACTIONS[:2])
        # The late answer of the interrupted step is taken first, not mistaken for the next step's.
        assert_same_step(venv.step(ACTIONS[:2]), ref.step(ACTIONS[:2]))
        assert venv.get_attr("t") == ref.get_attr("t")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        venv.close()


def test_same_env_object_twice_is_refused() -> None:
    from tests.vec_env_helpers import SpacesEnv

    env = SpacesEnv()
    with pytest.raises(UserError, match="same env object"):
        BatchedSubprocVecEnv([lambda: env, lambda: env, SpacesEnv], n_workers=1, start_method="fork", n_local=2)


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_workers_exit_when_the_main_process_is_killed(start_method: str) -> None:
    script = (
        "import sys, time\n"
        "from sb3_speedups import BatchedSubprocVecEnv\n"
        "from tests.vec_env_helpers import env_fns\n"
        "if __name__ == '__main__':\n"
        "    venv = BatchedSubprocVecEnv(env_fns(2), n_workers=1, start_method=sys.argv[1], n_local=0)\n"
        "    venv.reset()\n"
        "    print('PIDS', *venv.worker_pids(), flush=True)\n"
        "    time.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, start_method], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=subprocess_env()
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), line
        pids = [int(pid) for pid in line.split()[1:]]
        proc.kill()
        proc.wait(10)
        assert wait_gone(pids, timeout=10.0), "workers outlived their main process"
    finally:
        proc.kill()
