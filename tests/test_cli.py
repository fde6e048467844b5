"""The command line end to end (real subprocesses) and in-process for every bad-input case."""

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import yaml
from stable_baselines3 import PPO as StockPPO

from sb3_speedups.cli import main
from sb3_speedups.registry import get_algo
from sb3_speedups.zoo.hyperparams import rl_zoo_hyperparams_dir
from sb3_speedups.zoo.validation import validate_model_kwargs
from tests.helpers import run_cli

FAST_PPO = ["-params", "n_envs:2", "n_steps:64", "batch_size:64", "n_epochs:2"]


def test_train_then_enjoy_end_to_end(log_folder: Path):
    proc = run_cli(
        "train",
        "--algo",
        "ppo",
        "--env",
        "CartPole-v1",
        "-n",
        "2000",
        "--seed",
        "3",
        "-f",
        str(log_folder),
        "--eval-freq",
        "1000",
        "--eval-episodes",
        "2",
        "--no-progress",
        *FAST_PPO,
    )
    assert proc.returncode == 0, proc.stderr
    run_dir = log_folder / "ppo" / "CartPole-v1_1"
    assert f"Saved {run_dir / 'CartPole-v1.zip'}" in proc.stdout
    assert "Final mean return over 2 episodes" in proc.stdout
    for name in ("CartPole-v1.zip", "best_model.zip", "config.yml", "args.yml", "evaluations.npz", "0.monitor.csv"):
        assert (run_dir / name).is_file(), name
    config = yaml.safe_load((run_dir / "config.yml").read_text())["CartPole-v1"]
    assert config["n_envs"] == 2 and config["n_steps"] == 64 and config["n_timesteps"] == 2000
    assert config["learning_rate"] == "lin_0.001" and config["gamma"] == 0.98  # the YAML's values, merged
    assert np.load(run_dir / "evaluations.npz")["results"].shape[0] >= 1
    assert StockPPO.load(run_dir / "CartPole-v1.zip").n_steps == 64  # a stock-SB3-loadable zip

    enjoy = run_cli("enjoy", "--algo", "ppo", "--env", "CartPole-v1", "-f", str(log_folder), "--n-episodes", "2")
    assert enjoy.returncode == 0, enjoy.stderr
    assert "mean return over 2 episodes" in enjoy.stdout and "CartPole-v1_1" in enjoy.stdout

    # config.yml is itself a hyperparameters file; -i continues training the saved model
    again = main(
        [
            "train",
            "--algo",
            "ppo",
            "--env",
            "CartPole-v1",
            "-n",
            "256",
            "-f",
            str(log_folder),
            "--no-progress",
            "--conf-file",
            str(run_dir / "config.yml"),
            "-i",
            str(run_dir / "CartPole-v1.zip"),
            "--eval-freq",
            "0",
            "--eval-episodes",
            "1",
            "--verbose",
            "0",
        ]
    )
    assert again == 0
    continued = StockPPO.load(log_folder / "ppo" / "CartPole-v1_2" / "CartPole-v1.zip")
    assert continued.num_timesteps > 2000


@pytest.mark.slow
def test_rl_zoo_published_ppo_file_runs_on_acrobot(log_folder: Path):
    zoo_dir = rl_zoo_hyperparams_dir()
    if zoo_dir is None:
        pytest.skip("rl_zoo3 is not installed")
    zoo_ppo = zoo_dir / "ppo.yml"
    code = main(
        [
            "train",
            "--algo",
            "ppo",
            "--env",
            "Acrobot-v1",
            "--conf-file",
            str(zoo_ppo),
            "-n",
            "4096",
            "-f",
            str(log_folder),
            "--eval-freq",
            "0",
            "--eval-episodes",
            "1",
            "--no-progress",
            "--verbose",
            "0",
        ]
    )
    assert code == 0
    run_dir = log_folder / "ppo" / "Acrobot-v1_1"
    assert (run_dir / "vecnormalize.pkl").is_file()  # normalize: true in the Zoo's Acrobot section
    assert yaml.safe_load((run_dir / "config.yml").read_text())["Acrobot-v1"]["n_envs"] == 16


@pytest.mark.parametrize(
    ("algo", "conf"), [("sac", "zoo"), ("td3", "zoo"), ("ddpg", "bundled")], ids=["sac-zoo", "td3-zoo", "ddpg-bundled"]
)
def test_off_policy_continuous_control_trains_from_an_rl_zoo_file(log_folder: Path, algo: str, conf: str):
    """The RL Zoo's own (or our bundled) sac/td3/ddpg.yml run through --conf-file: noise keys, Pendulum section."""
    conf_args: list[str] = []
    if conf == "zoo":
        zoo_dir = rl_zoo_hyperparams_dir()
        if zoo_dir is None:
            pytest.skip("rl_zoo3 is not installed")
        conf_args = ["--conf-file", str(zoo_dir / f"{algo}.yml")]
    run = ["--algo", algo, "--env", "Pendulum-v1", "-n", "300", "--seed", "0", "-f", str(log_folder)]
    quiet = ["--eval-freq", "0", "--eval-episodes", "1", "--no-progress", "--verbose", "0"]
    small = ["-params", "learning_starts:100", "batch_size:32", "policy_kwargs:dict(net_arch=[16])"]
    code = main(["train", *run, *quiet, *conf_args, *small])
    assert code == 0
    run_dir = log_folder / algo / "Pendulum-v1_1"
    config = yaml.safe_load((run_dir / "config.yml").read_text())["Pendulum-v1"]
    assert config["n_timesteps"] == 300 and config["learning_rate"] == 1e-3  # the file's value, merged
    if algo != "sac":
        assert (config["noise_type"], config["noise_std"]) == ("normal", 0.1)
    model = get_algo(algo).cls().load(run_dir / "Pendulum-v1.zip")
    assert model.num_timesteps == 300 and model._n_updates > 0


BAD_INPUTS = [
    (["train", "--algo", "ppo", "--env", "CartPole-v9"], "unknown environment id 'CartPole-v9'; did you mean CartPole-v1"),
    (["train", "--algo", "ppo2", "--env", "CartPole-v1"], "unknown algorithm 'ppo2'; choose one of: ppo,"),
    (
        ["train", "--algo", "ppo", "--env", "CartPole-v1", "-params", "learning_rat:0.1"],
        "unknown hyperparameter 'learning_rat' for ppo (PPO); did you mean learning_rate",
    ),
    (
        ["train", "--algo", "ppo", "--env", "CartPole-v1", "-params", "gamma:1.5"],
        "invalid hyperparameter gamma=1.5 for ppo: expected a number >= 0 and <= 1",
    ),
    (
        ["train", "--algo", "ppo", "--env", "CartPole-v1", "-params", "n_steps:abc"],
        "invalid hyperparameter n_steps='abc' for ppo: expected an integer >= 1",
    ),
    (
        ["train", "--algo", "sac", "--env", "Pendulum-v1", "-params", "ent_coef:'auto_x'"],
        "invalid hyperparameter ent_coef='auto_x' for sac: expected a number >= 0, 'auto' or 'auto_<initial value > 0>'",
    ),
    (
        ["train", "--algo", "ppo", "--env", "CartPole-v1", "-params", "ent_coef:'auto'"],
        "invalid hyperparameter ent_coef='auto' for ppo: expected a number >= 0 (PPO learns no entropy coefficient)",
    ),
    (
        ["train", "--algo", "ppo", "--env", "CartPole-v1", "-params", "learning_rate:exp_0.1"],
        "invalid learning_rate 'exp_0.1': use a number or a linear schedule",
    ),
    (
        ["train", "--algo", "ppo", "--env", "CartPole-v1", "-params", "policy_kwargs:dict(x=__import__('os'))"],
        "function call in kwargs string",
    ),
    (
        ["train", "--algo", "ppo", "--env", "CartPole-v1", "-i", "/nonexistent/model.zip"],
        "cannot read model /nonexistent/model.zip: not an existing SB3 .zip file",
    ),
    (
        ["train", "--algo", "ppo", "--env", "CartPole-v1", "--conf-file", "/nonexistent.yml"],
        "cannot read hyperparameters file /nonexistent.yml",
    ),
    (["enjoy", "--algo", "ppo", "--env", "CartPole-v1", "-f", "/nonexistent-logs"], "/nonexistent-logs does not exist"),
    (["enjoy", "--algo", "ppo", "--env", "CartPole-v1", "-f", "/"], "no runs of ppo on CartPole-v1 under /ppo"),
    (["train", "--algo", "ppo", "--env", "CartPole-v1", "-params", "batch_size:1"], "invalid hyperparameters for ppo"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS)
def test_bad_input_gives_one_clean_line(argv, message, capsys, log_folder):
    extra = ["-f", str(log_folder), "--no-progress"] if argv[0] == "train" else []
    code = main([*argv, *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_yaml_files(tmp_path, capsys):
    malformed = tmp_path / "malformed.yml"
    malformed.write_text("CartPole-v1:\n  n_envs: 8\n  policy: 'MlpPolicy\n")
    assert main(["train", "--algo", "ppo", "--env", "CartPole-v1", "--conf-file", str(malformed)]) == 2
    assert f"malformed YAML in {malformed}:" in capsys.readouterr().err
    other = tmp_path / "other.yml"
    other.write_text("Pendulum-v1:\n  policy: MlpPolicy\n")
    assert main(["train", "--algo", "ppo", "--env", "CartPole-v1", "--conf-file", str(other)]) == 2
    assert "no hyperparameters for CartPole-v1 in" in capsys.readouterr().err


def test_unknown_flag_and_vec_env_are_argparse_errors(capsys):
    assert main(["train", "--algo", "ppo", "--env", "CartPole-v1", "--vec-env", "nope"]) == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_console_entry_point_and_module_exit_code():
    proc = run_cli("train", "--algo", "nope", "--env", "CartPole-v1")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "unknown algorithm" in proc.stderr


@pytest.mark.parametrize(
    "algo, env_id, params",
    [
        ("trpo", "CartPole-v1", ["n_steps:128", "batch_size:128"]),
        ("td3", "Pendulum-v1", ["learning_starts:100", "train_freq:1", "gradient_steps:1"]),  # RL Zoo: noise_type normal
        ("qrdqn", "CartPole-v1", ["learning_starts:100"]),
    ],
)
def test_stock_algorithms_with_rl_zoo_files(algo, env_id, params, log_folder):
    if rl_zoo_hyperparams_dir() is None:
        pytest.skip("rl_zoo3 is not installed")
    argv = ["train", "--algo", algo, "--env", env_id, "-n", "300", "-f", str(log_folder), "--eval-freq", "0",
            "--eval-episodes", "1", "--no-progress", "--verbose", "0"]  # fmt: skip
    assert main(argv + (["-params", *params] if params else [])) == 0
    assert (log_folder / algo / f"{env_id}_1" / f"{env_id}.zip").is_file()


NUMERIC_FLAGS = [
    ["train", "--algo", "ppo", "--env", "CartPole-v1", "-n", "-5"],
    ["train", "--algo", "ppo", "--env", "CartPole-v1", "-n", "0"],
    ["train", "--algo", "ppo", "--env", "CartPole-v1", "-n", "abc"],
    ["train", "--algo", "ppo", "--env", "CartPole-v1", "--eval-freq", "-1"],
    ["train", "--algo", "ppo", "--env", "CartPole-v1", "--n-eval-envs", "0"],
    ["train", "--algo", "ppo", "--env", "CartPole-v1", "--save-freq", "-3"],
    ["train", "--algo", "ppo", "--env", "CartPole-v1", "--seed", "-1"],
    ["train", "--algo", "ppo", "--env", "CartPole-v1", "--verbose", "5"],
    ["train", "--algo", "ppo", "--env", "CartPole-v1", "--num-threads", "0"],
    ["enjoy", "--algo", "ppo", "--env", "CartPole-v1", "--n-episodes", "0"],
    ["tune", "--algo", "ppo", "--env", "CartPole-v1", "--n-trials", "0"],
    ["tune", "--algo", "ppo", "--env", "CartPole-v1", "--n-jobs", "-2"],
    ["tune", "--algo", "ppo", "--env", "CartPole-v1", "--timeout", "-1"],
    ["tune", "--algo", "ppo", "--env", "CartPole-v1", "--trial-seeds", "1.5"],
    ["bench", "--algo", "ppo", "--env", "CartPole-v1", "--seeds", "1", "-2"],
    ["bench-vec-env", "--n-envs", "0"],
]


@pytest.mark.parametrize("argv", NUMERIC_FLAGS, ids=lambda argv: " ".join(argv[:1] + argv[-2:]))
def test_out_of_range_numbers_give_one_line_and_exit_2(argv, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert captured.err.startswith(f"sb3-speedups {argv[0]}: error: argument ") and "expected " in captured.err


def test_version_and_help_show_every_default(capsys):
    import sb3_speedups

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"sb3-speedups {sb3_speedups.__version__}"
    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 25000)", "(default: dummy)", "(default: logs)", "(default: 1)", "(default: True)"):
        assert default in text


def _train_argv(log_folder: Path, *extra: str) -> list[str]:
    return ["train", "--algo", "ppo", "--env", "CartPole-v1", "-n", "2000", "--seed", "0", "-f", str(log_folder),
            "--eval-freq", "500", "--eval-episodes", "1", *FAST_PPO[:1], "n_envs:2", "n_steps:64", "batch_size:64",
            "n_epochs:1", *extra]  # fmt: skip


def test_default_run_fits_on_a_screen(log_folder: Path):
    proc = run_cli(*_train_argv(log_folder))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    # header, 4 evaluations, the progress bar, where it saved, the final return
    assert len(lines) <= 8, proc.stdout
    assert sum(line.startswith("Evaluation at ") for line in lines) == 4
    assert lines[-2].startswith("Saved ") and lines[-1].startswith("Final mean return over 1 episodes")
    assert proc.stderr == ""


@pytest.mark.parametrize("flags, tables, lines", [(["--verbose", "2"], True, None), (["--verbose", "0"], False, 2),
                                                  (["--quiet", "--verbose", "2"], False, 0)])  # fmt: skip
def test_verbosity_levels(flags, tables, lines, log_folder: Path, capsys):
    assert main(_train_argv(log_folder, "--no-progress", *flags)) == 0
    out = capsys.readouterr().out
    assert ("| rollout/" in out) == tables
    if lines is not None:
        assert len(out.splitlines()) == lines, out
    if lines == 2:
        assert out.startswith("Saved ") and "Final mean return" in out


class _NeedsOpenCV(gym.Env):
    def __init__(self) -> None:
        raise gym.error.DependencyNotInstalled('opencv-python is not installed, run `pip install "gymnasium[other]"`')


class _NeedsRobotics(gym.Env):
    def __init__(self) -> None:
        raise ImportError("Reacher-v2 moved to gymnasium-robotics:\npip install gymnasium-robotics")


@pytest.mark.parametrize(
    ("entry_point", "message"),
    [(_NeedsOpenCV, 'opencv-python is not installed, run `pip install "gymnasium[other]"`'),
     (_NeedsRobotics, "Reacher-v2 moved to gymnasium-robotics: pip install gymnasium-robotics")],
)  # fmt: skip
def test_an_env_with_a_missing_dependency_gives_the_library_message_in_one_line(entry_point, message, tmp_path, capsys):
    env_id = f"UxMissing{entry_point.__name__}-v0"
    gym.register(env_id, entry_point=entry_point)
    try:
        conf = tmp_path / "conf.yml"
        conf.write_text(f"{env_id}:\n  policy: MlpPolicy\n  n_envs: 1\n  n_timesteps: 100\n")
        assert main(["train", "--algo", "ppo", "--env", env_id, "-conf", str(conf), "-f", str(tmp_path)]) == 2
    finally:
        del gym.registry[env_id]
    err = capsys.readouterr().err
    assert err == f"sb3-speedups train: error: cannot make {env_id}: {message}\n"


@pytest.mark.parametrize("value", ["auto", "auto_0.1", 0.05])
def test_learned_entropy_coefficients_are_valid_hyperparameters(value):
    """The RL Zoo's SAC and TQC files set ``ent_coef: 'auto'`` (learned from 1.0) or ``'auto_0.1'`` (from 0.1)."""
    for algo in ("sac", "tqc"):
        validate_model_kwargs(get_algo(algo).cls(), {"ent_coef": value}, algo)
