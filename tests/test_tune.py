"""Tuning runs: pruning, reports, round trip into train, failures, reproducibility, seeds, interrupt and resume."""

from __future__ import annotations

import csv
import multiprocessing
import os
import shlex
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from sb3_speedups.cli import main
from sb3_speedups.errors import UserError
from sb3_speedups.tune.storage import open_storage, storage_url, study_folder

ROOT = Path(__file__).resolve().parents[1]
# tiny trials: 8 CartPole envs (the YAML's), 32 steps each per rollout, 2 evaluations of 2 episodes
FAST = ["--algo", "ppo", "--env", "CartPole-v1", "-n", "2048", "--n-eval-episodes", "2", "--n-evaluations", "2"]


def write_space(path: Path, params: dict[str, Any]) -> str:
    base = {"n_steps": [32], "batch_size": [128], "n_epochs": [2]}
    path.write_text(yaml.safe_dump({"replace": True, "params": {**base, **params}}))
    return str(path)


def load(log_folder: Path, name: str, storage: str | None = None) -> optuna.Study:
    url = storage_url(storage, study_folder(log_folder, name))
    return optuna.load_study(study_name=name, storage=open_storage(url))


def states(study: optuna.Study) -> list[str]:
    return [t.state.name for t in study.trials]


def test_sqlite_study_prunes_writes_reports_and_best_config_trains(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    space = write_space(tmp_path / "space.yml", {"learning_rate": [3e-3, 1e-7]})
    args = [*FAST, "-n", "3072", "--n-evaluations", "3", "--n-trials", "6", "--seed", "0", "--sampler", "random"]
    args += ["--n-startup-trials", "2", "--search-space", space, "-f", str(tmp_path)]
    assert main(["tune", *args]) == 0
    out = capsys.readouterr().out
    study = load(tmp_path, "ppo_CartPole-v1")
    assert (study_folder(tmp_path, "ppo_CartPole-v1") / "study.db").is_file()
    assert len(study.trials) == 6 and "PRUNED" in states(study) and "COMPLETE" in states(study)
    pruned = next(t for t in study.trials if t.state.name == "PRUNED")
    assert len(pruned.intermediate_values) < 3  # stopped before its last evaluation
    assert "trial   5" in out and "Best " in out  # progress lines and summary table

    folder = study_folder(tmp_path, "ppo_CartPole-v1")
    rows = list(csv.DictReader((folder / "trials.csv").open()))
    assert [r["state"] for r in rows] == states(study) and "learning_rate" in rows[0]
    assert (folder / "history.png").stat().st_size > 0 and (folder / "importances.png").stat().st_size > 0
    best = yaml.safe_load((folder / "best_hyperparams.yml").read_text())["CartPole-v1"]
    assert best["learning_rate"] == study.best_trial.params["learning_rate"]
    assert best["n_timesteps"] == 3072 and best["n_envs"] == 8 and best["policy"] == "MlpPolicy"

    # the best hyperparameters are a hyperparameters file that train uses as is
    train_args = ["--algo", "ppo", "--env", "CartPole-v1", "--conf-file", str(folder / "best_hyperparams.yml"), "--seed", "0"]
    train_args += [
        "-f",
        str(tmp_path / "runs"),
        "--eval-freq",
        "0",
        "--eval-episodes",
        "1",
        "--no-progress",
        "--verbose",
        "0",
    ]
    assert main(["train", *train_args]) == 0
    used = yaml.safe_load((tmp_path / "runs" / "ppo" / "CartPole-v1_1" / "config.yml").read_text())["CartPole-v1"]
    assert used == best

    # a study is one experiment: resuming it with another budget is refused
    assert main(["tune", *args, "-n", "1024"]) == 2
    assert "was run with n_timesteps=3072" in capsys.readouterr().err


def test_failed_trials_are_recorded_and_the_study_goes_on(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # a huge learning rate makes the policy NaN; batch_size 1 is rejected by SB3 when the model is built
    space = write_space(tmp_path / "space.yml", {"learning_rate": [1e30], "batch_size": [1, 128]})
    args = [*FAST, "--n-trials", "3", "--seed", "1", "--sampler", "random", "--search-space", space, "-f", str(tmp_path)]
    assert main(["tune", *args]) == 1  # no trial completed
    study = load(tmp_path, "ppo_CartPole-v1")
    assert states(study) == ["FAIL"] * 3
    errors = [t.user_attrs["error"] for t in study.trials]
    assert any("batch_size" in e for e in errors) and any("ValueError" in e and "invalid values" in e for e in errors)
    assert "error: " in capsys.readouterr().out
    rows = list(csv.DictReader((study_folder(tmp_path, "ppo_CartPole-v1") / "trials.csv").open()))
    assert [r["error"] for r in rows] == errors
    # failures count toward --n-trials: running again has nothing left to do
    assert main(["tune", *args]) == 1
    assert len(load(tmp_path, "ppo_CartPole-v1").trials) == 3


def test_same_seed_repeats_the_sequence_on_sqlite_and_journal(tmp_path: Path) -> None:
    space = write_space(tmp_path / "space.yml", {"learning_rate": {"low": 1e-4, "high": 3e-3, "log": True}})
    args = [*FAST, "--n-trials", "3", "--seed", "7", "--n-startup-trials", "1", "--search-space", space, "--no-plots"]
    args += ["-f", str(tmp_path), "--verbose", "0"]
    journal = str(tmp_path / "journal.log")
    assert main(["tune", *args, "--study-name", "a"]) == 0
    assert main(["tune", *args, "--study-name", "b", "--storage", journal]) == 0
    a, b = load(tmp_path, "a"), load(tmp_path, "b", journal)
    assert [t.params for t in a.trials] == [t.params for t in b.trials]
    assert len({t.params["learning_rate"] for t in a.trials}) == 3
    assert [t.value for t in a.trials] == [t.value for t in b.trials]  # training is seeded too
    assert [t.user_attrs["seeds"] for t in a.trials] == [[7], [1007], [2007]]


def test_trial_seeds_objective_is_the_mean_and_a_failing_seed_fails_the_trial(tmp_path: Path) -> None:
    # with this seed the random sampler draws the NaN-making learning rate twice, then the good one: the seed
    # helper process fails, is drained, and serves the next trial
    space = write_space(tmp_path / "space.yml", {"learning_rate": [1e30, 1e-3]})
    args = [*FAST, "--n-trials", "3", "--seed", "6", "--sampler", "random", "--trial-seeds", "2", "--search-space", space]
    assert main(["tune", *args, "--no-plots", "-f", str(tmp_path)]) == 0
    study = load(tmp_path, "ppo_CartPole-v1")
    assert states(study) == ["FAIL", "FAIL", "COMPLETE"]
    assert all("ValueError" in t.user_attrs["error"] for t in study.trials[:2])
    trial = study.trials[2]
    returns = trial.user_attrs["seed_returns"]
    assert len(returns) == 2 and trial.value == pytest.approx(sum(returns) / 2)
    assert trial.user_attrs["seeds"] == [2006, 2007] and len(trial.intermediate_values) == 2
    assert trial.user_attrs["return_std"] == pytest.approx(abs(returns[0] - returns[1]) / 2)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--storage", "notes.txt"], "cannot use --storage"),
        (["--storage", "nosuchdb://host/db"], "cannot open storage"),
        (["--n-trials", "0"], "argument --n-trials: expected an integer >= 1, got 0"),
        (["-n", "100"], "less than the smallest rollout (n_steps 16 x 8 envs)"),
    ],
)
def test_bad_settings_fail_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, extra: list, message: str) -> None:
    assert main(["tune", *FAST, "-f", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def _spawn_tune(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "sb3_speedups", "tune", *args]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_running(log_folder: Path, count: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    db = study_folder(log_folder, "ppo_CartPole-v1") / "study.db"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if db.is_file():
            try:
                if states(load(log_folder, "ppo_CartPole-v1")).count("RUNNING") >= count:
                    time.sleep(1.0)  # let the trials get into training
                    return
            except (KeyError, UserError, optuna.exceptions.OptunaError):
                pass
        time.sleep(0.3)
    raise AssertionError(f"no {count} running trials: {proc.communicate()[0].decode()[-2000:]}")


# long enough trials that the interrupt lands while they train (the tests signal ~1 s after a trial starts)
SLOW = ["-n", "200000", "--n-evaluations", "2", "--seed", "4", "--verbose", "1"]


def _claim_queued_trials(url: str, barrier: Any, results: Any) -> None:
    study = optuna.load_study(study_name="queue", storage=open_storage(url))
    barrier.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # heartbeats are meant for optimize(); ask() is what optimize() calls
        results.put([study.ask().number for _ in range(10)])


def test_two_processes_never_claim_the_same_queued_sqlite_trial(tmp_path: Path) -> None:
    # retried (queued) trials are claimed by read-then-write; on SQLite both processes used to get the same one
    url = storage_url(None, tmp_path)
    study = optuna.create_study(study_name="queue", storage=open_storage(url))
    for i in range(20):
        study.enqueue_trial({"x": i})
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(2), context.Queue()
    procs = [context.Process(target=_claim_queued_trials, args=(url, barrier, results)) for _ in range(2)]
    for proc in procs:
        proc.start()
    claimed = results.get(timeout=120) + results.get(timeout=120)
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert sorted(claimed) == list(range(20))


@pytest.mark.slow
def test_ctrl_c_fails_running_trials_and_the_same_command_resumes(tmp_path: Path) -> None:
    space = write_space(tmp_path / "space.yml", {"learning_rate": {"low": 1e-4, "high": 3e-3, "log": True}})
    args = [*FAST, *SLOW, "--n-trials", "2", "--n-jobs", "2", "--search-space", space, "-f", str(tmp_path), "--no-plots"]
    proc = _spawn_tune(args, tmp_path)
    _wait_for_running(tmp_path, 2, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 130, out
    assert "Traceback" not in out, out
    study = load(tmp_path, "ppo_CartPole-v1")
    assert states(study) == ["FAIL", "FAIL"]
    assert all(t.user_attrs.get("interrupted") for t in study.trials)
    interrupted = {t.number: t.params for t in study.trials}

    # the same command again: the interrupted trials are retried with their parameters, and the study is finished
    proc = _spawn_tune(args, tmp_path)
    out = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 0, out
    study = load(tmp_path, "ppo_CartPole-v1")
    assert states(study)[:2] == ["FAIL", "FAIL"] and len(study.trials) == 4
    failed = {t.number: t.user_attrs for t in study.trials[2:] if t.state.name not in ("COMPLETE", "PRUNED")}
    assert not failed, (states(study), failed, out[-3000:])
    retries = {t.user_attrs["retry_of"]: t.params for t in study.trials[2:]}
    assert retries == interrupted
    assert len({t.user_attrs["worker"] for t in study.trials[2:]}) == 2  # two worker processes


@pytest.mark.slow
def test_a_killed_worker_process_makes_the_run_fail_with_one_line(tmp_path: Path) -> None:
    space = write_space(tmp_path / "space.yml", {"learning_rate": [1e-3, 3e-4]})
    args = [*FAST, *SLOW, "--n-trials", "2", "--n-jobs", "2", "--search-space", space, "-f", str(tmp_path), "--no-plots"]
    proc = _spawn_tune(args, tmp_path)
    _wait_for_running(tmp_path, 2, proc)
    running = [t for t in load(tmp_path, "ppo_CartPole-v1").trials if t.state.name == "RUNNING"]
    pid = int(running[0].user_attrs["worker"].split(":")[1])
    os.kill(pid, signal.SIGKILL)  # what the kernel's OOM killer does
    out = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 1, out
    assert "was killed by SIGKILL" in out and "run the same command" in out, out
    assert "Traceback" not in out, out
    assert sorted(states(load(tmp_path, "ppo_CartPole-v1"))) in (["COMPLETE", "RUNNING"], ["PRUNED", "RUNNING"])


@pytest.mark.slow
def test_sigterm_fails_the_running_trial_of_a_single_process_run(tmp_path: Path) -> None:
    space = write_space(tmp_path / "space.yml", {"learning_rate": [1e-3]})
    proc = _spawn_tune([*FAST, *SLOW, "--n-trials", "3", "--search-space", space, "-f", str(tmp_path)], tmp_path)
    _wait_for_running(tmp_path, 1, proc)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 130, out
    (trial,) = load(tmp_path, "ppo_CartPole-v1").trials
    assert trial.state.name == "FAIL" and trial.user_attrs["interrupted"] is True
    assert "Interrupted" in out and (study_folder(tmp_path, "ppo_CartPole-v1") / "trials.csv").is_file()


def test_a_search_space_whose_rollouts_cannot_fit_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    space = write_space(tmp_path / "space.yml", {"n_steps": [32, 1024]})
    assert main(["tune", *FAST, "-f", str(tmp_path), "--search-space", space]) == 2
    err = capsys.readouterr().err
    assert "n_steps up to 1024 x 8 envs = 8192 env steps per rollout, more than the 1024 between" in err
    assert len(err.strip().splitlines()) == 1


def test_trials_fit_their_budget_and_the_best_retrains_to_its_return_with_its_seed(tmp_path: Path, capsys) -> None:
    # 3,000 steps and 2 evaluations: the built-in space may only offer rollouts of at most 1,500 steps (n_steps <= 128
    # with the YAML's 8 envs), and each trial trains the whole rollouts that fit in 3,000 steps
    args = ["--algo", "ppo", "--env", "CartPole-v1", "-n", "3000", "--n-evaluations", "2", "--n-eval-episodes", "3"]
    args += ["--n-trials", "3", "--seed", "5", "--sampler", "random", "--no-plots", "--verbose", "0", "-f", str(tmp_path)]
    assert main(["tune", *args]) == 0
    study = load(tmp_path, "ppo_CartPole-v1")
    for trial in study.trials:
        hp = trial.user_attrs["hyperparams"]
        rollout = hp["n_steps"] * hp["n_envs"]
        assert rollout <= 1500 and hp["n_timesteps"] == 3000 // rollout * rollout
    best = study.best_trial
    path = study_folder(tmp_path, "ppo_CartPole-v1") / "best_hyperparams.yml"
    text = path.read_text()
    assert yaml.safe_load(text)["CartPole-v1"] == best.user_attrs["hyperparams"]
    (seed,) = best.user_attrs["seeds"]
    command = next(line for line in text.splitlines() if line.startswith(f"# Seed {seed} "))
    argv = shlex.split(command.partition(": ")[2])
    assert argv[:2] == ["sb3-speedups", "train"] and f"--seed {seed}" in command
    capsys.readouterr()
    assert main([*argv[1:], "-f", str(tmp_path / "runs"), "--no-progress", "--verbose", "0"]) == 0
    final = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Final mean return"))
    assert f"over 3 episodes: {best.value:.2f} +/- " in final


def test_an_interrupt_that_python_swallowed_still_stops_the_trial_at_its_next_step() -> None:
    # A signal can land in a weakref callback or __del__, where Python prints "Exception ignored" and drops the
    # KeyboardInterrupt; the recorded interrupt must still stop training (the CI saw a trial run to completion).
    from stable_baselines3 import PPO as StockPPO

    from sb3_speedups.tune.interrupts import clear_interrupt, interrupt_handler
    from sb3_speedups.tune.training import EvalReportCallback

    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    model = StockPPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=64, n_epochs=1, device="cpu")
    callback = EvalReportCallback(model.get_env(), [10_000, 20_000], 1, True, lambda i, v: True, eval_seed=0)
    clear_interrupt()
    try:
        try:
            interrupt_handler(signal.SIGINT, None)
        except KeyboardInterrupt:
            pass  # swallowed, as Python does inside a weakref callback
        with pytest.raises(KeyboardInterrupt):
            model.learn(256, callback=callback)
        assert model.num_timesteps == model.n_envs  # stopped at the first env step
    finally:
        clear_interrupt()
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


def test_a_space_without_parameters_fails_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # every registered algorithm has a built-in space: a file replacing it with fixed values only leaves nothing
    space = tmp_path / "fixed.yml"
    space.write_text("replace: true\nparams:\n  learning_rate: 0.001\n")
    assert main(["tune", *FAST, "-f", str(tmp_path), "--search-space", str(space)]) == 2
    err = capsys.readouterr().err
    assert "nothing to tune" in err and len(err.strip().splitlines()) == 1
