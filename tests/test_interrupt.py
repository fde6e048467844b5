"""Ctrl-C (SIGINT) and SIGTERM during training save the model into the run folder (real subprocess)."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from stable_baselines3 import PPO as StockPPO
from stable_baselines3.common.callbacks import BaseCallback

from sb3_speedups import PPO
from sb3_speedups.zoo.callbacks import StopOnSignal

from tests.helpers import cli_command, subprocess_env


@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, signal.SIGTERM],
)
def test_signal_during_training_saves_the_model(log_folder: Path, sig):
    proc = subprocess.Popen(
        cli_command(
            "train",
            "--algo",
            "ppo",
            "--env",
            "CartPole-v1",
            "-n",
            "10000000",
            "--seed",
            "0",
            "-f",
            str(log_folder),
            "--no-progress",
            "--eval-freq",
            "0",
            "-params",
            "n_envs:2",
            "n_steps:32",
            "batch_size:64",
            "n_epochs:1",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    run_dir = log_folder / "ppo" / "CartPole-v1_1"
    deadline = time.monotonic() + 120
    while not (run_dir / "0.monitor.csv").is_file() or (run_dir / "0.monitor.csv").stat().st_size < 200:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)  # wait until training runs (a few episodes logged)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Interrupted: saving the model" in out
    model = StockPPO.load(run_dir / "CartPole-v1.zip")
    assert model.num_timesteps > 0
    assert not list(run_dir.glob(".*tmp*"))  # no temporary file left behind


class _SignalAt(BaseCallback):
    """Sends ``sig`` to this process ``times`` times at step ``at``."""

    def __init__(self, sig: signal.Signals, at: int, times: int = 1) -> None:
        super().__init__()
        self.sig, self.at, self.times = sig, at, times

    def _on_step(self) -> bool:
        if self.n_calls == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), self.sig)
        return True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stop_on_signal_ends_learn_at_the_next_step(sig):
    before = signal.getsignal(sig)
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=16, batch_size=16, n_epochs=1, seed=0)
    with StopOnSignal() as stop:
        model.learn(10_000, callback=[_SignalAt(sig, at=5), stop])
    assert stop.requested
    assert model.num_timesteps == 5  # the step that saw the signal is the last one
    assert signal.getsignal(sig) is before  # the previous handler is back


def test_second_signal_interrupts_at_once():
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=16, batch_size=16, n_epochs=1, seed=0)
    with StopOnSignal() as stop, pytest.raises(KeyboardInterrupt):
        model.learn(10_000, callback=[_SignalAt(signal.SIGINT, at=3, times=2), stop])
    assert stop.requested
