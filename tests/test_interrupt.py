"""Ctrl-C (SIGINT) and SIGTERM during training save the model into the run folder (real subprocess)."""

import signal
import subprocess
import time
from pathlib import Path

import pytest
from stable_baselines3 import PPO as StockPPO

from tests.helpers import cli_command, subprocess_env


@pytest.mark.parametrize(
    "sig",
    [
        # Known intermittent bug: SIGINT (KeyboardInterrupt) sometimes leaves the training process running
        # (2 of the last 3 CI runs); see the stop note of 2026-12-02.
        pytest.param(signal.SIGINT, marks=pytest.mark.xfail(reason="SIGINT sometimes does not stop training", strict=False)),
        signal.SIGTERM,
    ],
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
